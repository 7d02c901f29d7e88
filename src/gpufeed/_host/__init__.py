"""Floor 4: the main process's iterators, the worker pool and the worker loop."""
