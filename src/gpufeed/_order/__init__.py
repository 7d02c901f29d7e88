"""Floor 1: which sample indices, in which order, and how to resume mid-epoch."""
