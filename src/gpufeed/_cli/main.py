"""The ``gpufeed`` command: ``gpufeed bench | tune | profile | doctor`` (``--help`` on each),
``gpufeed --version``.

Exit codes: 0 done; 1 the work failed (the user's code raised, no trial worked) or ``doctor``
found a problem that will break a loader; 2 bad usage (options, a bad ``MODULE:FACTORY``);
130 interrupted. Tables go to stdout, progress bars and errors to stderr; ``--json -`` puts the
JSON alone on stdout and the tables on stderr (``_tools/output.py``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .._tools.output import file_path, json_output, output_path
from .commands import UsageError, cmd_bench, cmd_doctor, cmd_profile_traced, cmd_tune


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") \
                from None
    return parse


def _number(kind: Callable[[str], Any], *, zero: bool = False) -> Callable[[str], Any]:
    """An ``argparse`` type: a finite number > 0, or with ``zero`` any number >= 0 (never nan)."""
    what = f"{'an int' if kind is int else 'a number'} >= 0" if zero else "a positive number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = float("nan")
        if not (value >= 0 if zero else 0 < value < float("inf")):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def _worker_counts(text: str) -> list[int]:
    """``--workers 0,2,4``: at least one count, each an int >= 0."""
    counts = _csv(int)(text)
    if not counts or any(n < 0 for n in counts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated worker counts >= 0, e.g. 0,2,4; got {text!r}")
    return counts


def _size(text: str) -> int:
    from .._host.cost import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def version_text() -> str:
    """``gpufeed --version``: gpufeed's version and the torch build it runs on."""
    import torch

    from .. import __version__

    build = (f"CUDA {torch.version.cuda}" if torch.version.cuda
             else f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None)
             else "CPU-only build")
    return (f"gpufeed {__version__} (torch {torch.__version__}, {build}; "
            f"Python {platform.python_version()})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufeed", description="Measure and tune data loading.")
    p.add_argument("--version", action="version", version=version_text(),
                   help="gpufeed's version, torch's version and build, and Python's")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="FILE", type=output_path,
                        help="also write the results as JSON to FILE (-: to stdout, and the "
                        "tables to stderr)")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")
    collate = argparse.ArgumentParser(add_help=False)  # bench and tune: one meaning
    collate.add_argument("--collate", metavar="MODULE:FUNCTION",
                         help="your collate_fn, given to every loader measured (e.g. one that "
                         "pads samples of different sizes)")

    b = sub.add_parser("bench", parents=[common, collate],
                       help="stock DataLoader vs gpufeed, side by side",
                       description="Compare the stock torch DataLoader with gpufeed.DataLoader "
                       "on a built-in synthetic workload (no files, no GPU) or on MODULE:FACTORY.")
    b.add_argument("target", nargs="?", metavar="MODULE:FACTORY",
                   help="a function returning your dataset (default: built-in synthetic data)")
    b.add_argument("--batch-size", type=_number(int),
                   help="samples per batch (default: 256 built-in, 32 yours)")
    b.add_argument("--workers", type=_worker_counts, default=[0, 2],
                   help="num_workers values (0,2)")
    b.add_argument("--seconds", type=_number(float), default=0.5,
                   help="timed seconds per run (0.5)")
    b.add_argument("--runs", type=_number(int), default=21,
                   help="runs per row (21, about 1.5 min for the built-in workload; fewer "
                        "is quicker and noisier); a row stops early once a third of its runs "
                        "(at least 3) agree within --target-spread")
    b.add_argument("--target-spread", type=_number(float), default=0.05,
                   help="spread (fastest-slowest)/median that counts as small (0.05)")
    b.add_argument("--worker-type", choices=("process", "thread"), default="process",
                   help="gpufeed's worker kind (process)")
    b.add_argument("--quick", action="store_true", help="a smaller synthetic data set")
    b.add_argument("--plot", metavar="FILE", type=file_path,
                   help="bar chart of samples/s (needs matplotlib)")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("tune", parents=[common, collate],
                       help="find the smallest fast loader settings",
                       description="Short trials over num_workers, worker_type, prefetch_factor "
                       "and pin_memory on your dataset; recommends DataLoader keyword arguments.")
    t.add_argument("target", metavar="MODULE:FACTORY", help="a function returning your dataset")
    t.add_argument("--batch-size", type=_number(int), default=32, help="samples per batch (32)")
    step = t.add_mutually_exclusive_group()
    step.add_argument("--step", metavar="MODULE:FUNCTION",
                      help="your training step, called with each batch: tune for the share of "
                      "the loop spent waiting for data, not raw loader speed")
    step.add_argument("--step-ms", type=_number(float), metavar="MS",
                      help="a training step of MS milliseconds that leaves the CPUs free "
                      "(a GPU step)")
    t.add_argument("--budget-memory", "--budget", dest="budget_memory", type=_size,
                   help="peak PSS limit of the process tree, e.g. 8GiB (default: 80%% of "
                   "available RAM)")
    t.add_argument("--budget-shm", type=_size,
                   help="limit on /dev/shm growth (default: 80%% of its free space)")
    t.add_argument("--budget-pinned", type=_size, help="pinned host memory limit (CUDA)")
    t.add_argument("--runs", type=_number(int), default=5,
                   help="runs per trial (5); a trial stops after 3 when they agree")
    t.add_argument("--worker-types", type=_csv(str), default=["process", "thread"],
                   help="worker kinds to try (process,thread)")
    t.add_argument("--trial-seconds", type=_number(float), default=0.5,
                   help="timed seconds per run of a trial (0.5)")
    t.add_argument("--time-budget", type=_number(float), default=120.0,
                   help="no trial starts after this many seconds (120)")
    t.add_argument("--plot", metavar="FILE", type=file_path,
                   help="samples/s by num_workers (needs matplotlib)")
    t.set_defaults(func=cmd_tune)

    pr = sub.add_parser("profile", parents=[common], help="is your training loop input-bound?",
                        description="Run MODULE:FUNCTION under the profiler. FUNCTION(profiler) "
                        "loops over profiler.wrap(loader); or FUNCTION() returns (iterable, step).")
    pr.add_argument("target", metavar="MODULE:FUNCTION")
    pr.add_argument("--steps", type=_number(int), help="stop after N steps (default: all)")
    pr.add_argument("--warmup", type=_number(int), default=1, help="first steps left out (1)")
    # --trace, --timeline and their bounds: the run recorded (cmd_profile_traced)
    g = pr.add_argument_group("timeline")
    g.add_argument("--trace", metavar="FILE", type=file_path,
                   help="write a timeline of every batch through every stage as Chrome Trace "
                   "Event JSON (FILE.json.gz: compressed); open it in ui.perfetto.dev or "
                   "chrome://tracing")
    g.add_argument("--timeline", metavar="PNG", type=file_path,
                   help="draw the first seconds of the timeline as a Gantt chart per track, "
                   "stalls marked (needs matplotlib)")
    g.add_argument("--timeline-seconds", type=_number(float), metavar="S",
                   help="seconds of the run the picture shows (1.0)")
    g.add_argument("--timeline-start", type=_number(float, zero=True), metavar="S",
                   help="where the picture starts, in seconds from the start (0: worker "
                   "start-up included)")
    g.add_argument("--stall-ms", type=_number(float, zero=True), metavar="MS",
                   help="a wait of the loop this long or longer is a stall in the picture (1)")
    g.add_argument("--trace-last", type=_number(int), metavar="N",
                   help="keep only the last N batches in the trace (a long run)")
    pr.set_defaults(func=cmd_profile_traced)

    d = sub.add_parser("doctor", parents=[common], help="check this machine's limits",
                       description="Check /dev/shm, ulimit -n, RLIMIT_MEMLOCK, CPUs, memory and "
                       "GPUs against the loader you will run; exit 1 when something will "
                       "break it.")
    d.add_argument("--workers", type=_number(int, zero=True),
                   help="num_workers (default: usable CPUs)")
    d.add_argument("--prefetch-factor", type=_number(int),
                   help="batches in flight per worker (2)")
    d.add_argument("--worker-type", choices=("process", "thread"), default="process",
                   help="worker kind (process)")
    d.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="whether batches are pinned (default: where CUDA is available)")
    d.add_argument("--batch-bytes", type=_size, metavar="SIZE",
                   help="bytes of one batch, e.g. 48MiB: judge /dev/shm and memory against "
                   "the batches in flight")
    d.set_defaults(func=cmd_doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpufeed`` and ``python -m gpufeed``; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        with json_output(args.json) as emit:
            args.emit_json = emit  # the commands write their JSON through it
            return int(args.func(args))
    except (UsageError, ImportError) as exc:
        print(f"gpufeed {args.command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print(f"gpufeed {args.command}: failed (see the traceback above)", file=sys.stderr)
        return 1
