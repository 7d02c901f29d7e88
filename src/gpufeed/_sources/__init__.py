"""Floor 2: datasets that read a whole batch per call."""
