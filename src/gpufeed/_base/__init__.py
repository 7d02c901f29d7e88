"""Floor 0: what every stage uses (errors, nested-batch walking, CUDA seams, stats)."""
