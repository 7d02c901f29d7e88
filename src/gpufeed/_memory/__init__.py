"""Floor 3: the host memory batches are written into (slot ring, spill, pinning)."""
