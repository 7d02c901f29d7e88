"""Support code for the tests (not tests): fakes, comparisons, leak checks, subprocesses,
the simulated CUDA backend, the resume checker and the scripts run under torchrun."""
