"""``python -m bench gpu [--out DIR]``: the GPU benchmark's command line.

The benchmark itself (what it measures, its targets) is ``gpufeed._tools.bench_gpu``, inside the
package because ``gpufeed bench`` runs it too where CUDA is available.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gpufeed._memory import pinning as _pinning
from gpufeed._tools.bench_gpu import SKIPPED, render_markdown, run_gpu_benchmark

from .cpu import directory
from .summary import write_documents

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench gpu``: run, write gpu.json and gpu.md, print a summary."""
    p = argparse.ArgumentParser(prog="python -m bench gpu",
                                description="Host-to-device bandwidth and overlap (needs CUDA).")
    p.add_argument("--out", type=directory, default=Path("bench/results"),
                   help="folder for gpu.json and gpu.md (default bench/results)")
    p.add_argument("--batch-size", type=int, default=256, help="uint8 3x224x224 images per batch")
    p.add_argument("--batches", type=int, default=48, help="timed batches per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (medians)")
    p.add_argument("--num-workers", type=int, default=4, help="workers of loaders (c) and (d)")
    p.add_argument("--step-ms", type=float, default=4.0, help="synthetic step duration T, ms")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not _pinning.cuda_usable():
        sys.stdout.write(SKIPPED + "\n")
        return 0
    doc = run_gpu_benchmark(batch_size=args.batch_size, batches=args.batches,
                            repeats=args.repeats, num_workers=args.num_workers,
                            step_ms=args.step_ms)
    report = render_markdown(doc)
    json_path, md_path = write_documents(doc, args.out, "gpu", report)
    sys.stdout.write(report + f"\nwrote {json_path} and {md_path}\n")
    return 0

