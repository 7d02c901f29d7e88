"""gpufeed's benchmarks: ``python -m gpufeed.benchmarks [cpu|gpu] --help``.

Files:

- ``workloads.py``: the workloads (tabular, image-array, jpeg, python-list, synthetic), built
  deterministically once in a cache directory and warmed into the page cache before timing;
- ``cpu.py``: the CPU comparison, gpufeed against the stock DataLoader (and torchdata.nodes)
  at the same settings, alternating, medians of repeats, ratios and targets;
- ``__main__.py``: the command line; writes ``cpu.json`` and a Markdown table ``cpu.md``;
- ``gpu.py``: the GPU comparison (host-to-device path), where CUDA is available.

Measurement itself (rates, first-batch latency, process-tree PSS) is ``gpufeed._tools.measure``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cpu import LOADERS, TARGETS, Settings, environment, run_cpu
from .workloads import WORKLOADS, Workload, WorkloadUnavailable, build

__all__ = [
    "LOADERS",
    "TARGETS",
    "WORKLOADS",
    "Settings",
    "Workload",
    "WorkloadUnavailable",
    "build",
    "environment",
    "main",
    "run_cpu",
]


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of ``python -m gpufeed.benchmarks`` (for ``gpufeed bench``)."""
    from .__main__ import main as cli_main

    return cli_main(argv)
