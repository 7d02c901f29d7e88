"""gpufeed's benchmarks: ``python -m gpufeed.benchmarks [cpu|gpu] --help``.

Files:

- ``workloads.py``: the workloads (tabular, image-array, jpeg, python-list, synthetic), built
  deterministically once in a cache directory and warmed into the page cache before timing;
- ``cpu.py``: the CPU comparison, gpufeed against the stock DataLoader (and torchdata.nodes)
  at the same settings, alternating, medians of repeats;
- ``summary.py``: each workload's verdict: ratios against the targets, peak PSS, the ceiling;
- ``environment.py``: date, machine and versions, recorded with every result file;
- ``ceiling.py``: the no-loader ceiling (plain processes fetching the same batches);
- ``__main__.py``: the command line; writes ``cpu.json`` and a Markdown table ``cpu.md``;
- ``gpu.py``: the GPU comparison (host-to-device path), where CUDA is available;
- ``sources.py``, ``persample.py``: the source readers, and one worker's cost per sample;
- ``seeding.py``: the cost of per-sample random state: global seeding, the per-sample
  generators, thread workers with and without ``seed=`` (``python -m gpufeed.benchmarks.seeding``);
- ``autotune.py``, ``autotune_report.py``: ``num_workers="auto"`` against the static grid
  (``python -m gpufeed.benchmarks autotune``), and its verdicts;
- ``mainproc.py``: the main process's CPU per batch, by stage
  (``python -m gpufeed.benchmarks.mainproc --py-spy``);
- ``slots.py``: ring slots bound when a task starts against at dispatch
  (``python -m gpufeed.benchmarks.slots``).

Measurement itself (rates, first-batch latency, process-tree PSS) is ``gpufeed._tools.measure``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cpu import LOADERS, Settings, run_cpu
from .environment import environment
from .summary import TARGETS
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
