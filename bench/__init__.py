"""gpufeed's benchmark lab: ``python -m bench [cpu|gpu|sources|shards|autotune] --help``.

The lab lives in the repository, outside the installed package: run it from a checkout's root
(``python -m bench cpu``, ``python -m bench.seeding``, ...). Its current figures are in
``bench/results`` (one Markdown + JSON pair per benchmark; earlier rounds are in git's history),
its tests in ``bench/tests``. What ``gpufeed bench`` itself needs stays in the package:
``gpufeed._tools.workloads`` (the in-memory synthetic workload and the types every workload is
made of), ``gpufeed._tools.environment`` (date, machine,
versions and commit, recorded with every result) and ``gpufeed._tools.bench_gpu`` (the
host-to-device benchmark).

The rooms:

- ``__main__.py``: the command; ``cpu`` (the default) writes ``cpu.json`` and ``cpu.md``;
- ``workloads.py``: the file-backed workloads (tabular, image-array, jpeg, python-list), built
  deterministically once in a cache directory and warmed into the page cache before timing;
- ``cpu.py``: stock DataLoader vs gpufeed (and torchdata.nodes) on the CPU path, at the same
  settings, alternating, medians of repeats;
- ``ceiling.py``: the no-loader ceiling (NOTE [ No-loader ceiling ]);
- ``summary.py``: a CPU run's verdict: ratios, shares of the ceiling round by round, the
  main-process bound (NOTE [ Main-process bound ]);
- ``gpu.py``: ``python -m bench gpu``, the command line of ``gpufeed._tools.bench_gpu``;
- ``sources.py``: the data-source benchmarks (images, Arrow, HDF5, PackedList);
  ``photos.py``: photo-like JPEG sets and Pillow's per-sample crop, as users write it;
  ``shards.py``: JPEGs in tar shards, ImageShards against webdataset;
- ``persample.py``: the per-sample path, and where its time goes;
- ``seeding.py``: the cost of per-sample seeding (``python -m bench.seeding``);
- ``release.py``: what a pinned slot's release fence costs per batch, 1 and 8 devices;
- ``mainproc.py``: the main process's CPU per batch, by stage (``--py-spy``);
- ``handoff.py``: an idealised hand-off next to the ceiling and gpufeed (NOTE [ Hand-off
  bound ]);
- ``lane.py``: a worker's cost per gathered batch: bare gather, the general way, the lane;
- ``workers.py``: where each worker's epoch goes (trace), against the no-loader ceiling;
- ``repeatability.py``: would two ``gpufeed bench`` invocations agree, replayed from long ones;
- ``timeline.py``: what ``gpufeed.trace`` costs on the cheapest batches (trace on vs off);
- ``autotune.py``, ``autotune_report.py``: ``num_workers="auto"`` against the static grid, and
  its verdicts.

Measurement itself (rates, first-batch latency, process-tree PSS) is ``gpufeed._tools.measure``.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpufeed._tools.environment import environment

from .cpu import LOADERS, Settings, run_cpu
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
    """The command line of ``python -m bench``."""
    from .__main__ import main as cli_main

    return cli_main(argv)
