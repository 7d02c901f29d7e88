"""The ``gpufeed`` command: ``gpufeed bench | tune | profile | doctor`` (``--help`` on each).

Exit codes: 0 done; 1 the work failed (the user's code raised, no trial worked) or ``doctor``
found a problem that will break a loader; 2 bad usage (options, a bad ``MODULE:FACTORY``);
130 interrupted. Tables go to stdout, progress bars and errors to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["TargetError", "UsageError", "load_target", "main"]


class UsageError(ValueError):
    """A command-line value gpufeed cannot use (exit code 2)."""


class TargetError(UsageError):
    """A ``MODULE:NAME`` argument that does not name what the command needs."""


def load_target(spec: str, *, what: str = "FACTORY") -> Callable[..., Any]:
    """Import ``MODULE:NAME`` (or ``path/to/file.py:NAME``) and return the callable it names."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"expected MODULE:{what} (e.g. mypkg.data:{what.lower()}), got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise TargetError(f"no file {module_name!r} (from {spec!r}); give an existing .py "
                              f"file or an importable module: MODULE:{what}")
        loc = importlib.util.spec_from_file_location(path.stem, path)
        if loc is None or loc.loader is None:
            raise TargetError(f"cannot load {module_name!r} as a Python module (from {spec!r})")
        module = importlib.util.module_from_spec(loc)
        sys.modules.setdefault(path.stem, module)  # so workers can unpickle what it defines
        loc.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: the current directory imports
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise TargetError(f"cannot import module {module_name!r} (from {spec!r}): {exc}; "
                                  "check the spelling and that it is importable from the current "
                                  "directory or PYTHONPATH") from None
            raise
    if not hasattr(module, attr):
        names = ", ".join(n for n in dir(module) if not n.startswith("_"))[:300]
        raise TargetError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r}); "
                          f"it defines: {names or 'nothing public'}")
    target = getattr(module, attr)
    if not callable(target):
        raise TargetError(f"{spec!r} is a {type(target).__name__}, not a callable; {what} must "
                          "be a function (or class) to call")
    return target


def load_dataset(spec: str) -> Any:
    """Call the ``MODULE:FACTORY`` with no arguments and check it returned a dataset."""
    dataset = load_target(spec)()
    is_map = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if not (is_map or isinstance(dataset, torch.utils.data.IterableDataset)):
        raise TargetError(f"{spec!r} returned a {type(dataset).__name__}, not a dataset; FACTORY "
                          "must return a map-style dataset (__getitem__ and __len__) or a "
                          "torch.utils.data.IterableDataset")
    return dataset


class _Progress:
    """A tqdm bar on stderr when tqdm is installed and enabled, else nothing."""

    def __init__(self, enabled: bool, total: int | None, desc: str, unit: str = "run") -> None:
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, disable=None)

    def step(self, text: str = "") -> None:
        if self.bar is not None:
            if text:
                self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_on(args: argparse.Namespace) -> bool:
    """A bar unless --no-progress or --json (the bar itself stays off when stderr is no
    terminal: tqdm's ``disable=None``)."""
    return not (args.no_progress or args.json)


def _write_json(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"wrote {path}")


def _cmd_bench(args: argparse.Namespace) -> int:
    from gpufeed._tools import bench as _bench

    if args.plot:
        from gpufeed._tools.tuner import require_matplotlib

        require_matplotlib()  # fail before the runs, not after
    if args.target:
        dataset, batch_size, title = load_dataset(args.target), args.batch_size or 32, args.target
        variants: dict[str, tuple[Any, Any]] = {"yours": (dataset, None)}
    else:
        from gpufeed.benchmarks.workloads import build

        work = build("synthetic", quick=args.quick)
        batch_size = args.batch_size or work.batch_size
        title = f"built-in synthetic workload: {work.description}"
        variants = {v.name: (v.dataset, v.collate_fn) for v in work.variants}
    rows = _bench.configs(variants, args.workers, batch_size, args.worker_type)
    bar = _Progress(_progress_on(args), len(rows) * args.runs, "gpufeed bench")
    try:
        load = _bench.run_bench(rows, seconds=args.seconds, runs=args.runs,
                                target_spread=args.target_spread, step=bar.step)
    finally:
        bar.close()
    comparisons = _bench.compare(rows)
    print(_bench.render(f"{title}, batch_size={batch_size}", rows, comparisons, load,
                        args.seconds))
    from gpufeed.benchmarks.cpu import environment

    doc: dict[str, Any] = {"workload": title, "batch_size": batch_size,
                           "rows": [r.to_dict() for r in rows],
                           "comparisons": [c.to_dict() for c in comparisons],
                           "machine": load.to_dict(), "seconds_per_run": args.seconds,
                           "runs": args.runs, "environment": environment()}
    if torch.cuda.is_available():
        from gpufeed.benchmarks import gpu

        doc["gpu"] = gpu.run_gpu_benchmark(batches=16, repeats=1)
        if "skipped" not in doc["gpu"]:
            print(gpu.render_markdown(doc["gpu"]))
    _write_json(args.json, doc)
    if args.plot:
        _bench.plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


class _SleepStep:
    """``--step-ms N``: a training step that takes N ms and leaves the CPUs free, as a step
    waiting on the GPU does (picklable, like a step of the user's)."""

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1e3

    def __call__(self, batch: Any) -> None:
        time.sleep(self.seconds)


def _cmd_tune(args: argparse.Namespace) -> int:
    from gpufeed._tools.tuner import Budget, require_matplotlib, tune

    if args.plot:
        require_matplotlib()  # fail before minutes of trials, not after
    dataset = load_dataset(args.target)
    collate = load_target(args.collate, what="FUNCTION") if args.collate else None
    step = (load_target(args.step, what="FUNCTION") if args.step
            else _SleepStep(args.step_ms) if args.step_ms else None)
    default = Budget.default()
    budget = Budget(memory_bytes=args.budget_memory or default.memory_bytes,
                    shm_bytes=args.budget_shm or default.shm_bytes,
                    pinned_bytes=args.budget_pinned)
    bar = _Progress(_progress_on(args), None, "gpufeed tune")
    try:
        result = tune(dataset, batch_size=args.batch_size, budget=budget, collate_fn=collate,
                      step=step, worker_types=args.worker_types, runs=args.runs,
                      trial_seconds=args.trial_seconds, time_budget_s=args.time_budget,
                      progress=lambda t: bar.step(
                          f"{t.num_workers} {t.worker_type or ''}: {t.samples_per_s:,.0f}/s"))
    except ValueError as exc:  # trials catch the dataset's errors: this is a bad option
        raise UsageError(str(exc)) from exc
    except RuntimeError as exc:  # no trial worked: the message says why and the fix
        print(f"gpufeed tune: {exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    print(result)
    _write_json(args.json, result.to_dict())
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from gpufeed._tools.profiler import Profiler, profile

    fn = load_target(args.target, what="FUNCTION")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if params:  # fn(profiler): the user's loop wraps its loader with profiler.wrap(...)
        with Profiler(warmup_steps=args.warmup, max_steps=args.steps) as prof:
            fn(prof)
        report = prof.report()
    else:  # fn() -> (iterable, step)
        pair = fn()
        if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[1])):
            raise TargetError(f"{args.target!r} returned a {type(pair).__name__}; FUNCTION must "
                              "either take the profiler (and loop over profiler.wrap(loader)) or "
                              "take no argument and return (iterable, step)")
        iterable, user_step = pair
        bar = _Progress(_progress_on(args), args.steps, "gpufeed profile", unit="step")

        def step(batch: Any) -> None:
            user_step(batch)
            bar.step()  # a microsecond or so, counted in compute

        try:
            report = profile(iterable, step if bar.bar is not None else user_step,
                             max_steps=args.steps, warmup_steps=args.warmup)
        finally:
            bar.close()
    print(report)
    _write_json(args.json, report.to_dict())
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from gpufeed._tools.doctor import Workload, diagnose

    report = diagnose(workload=Workload(
        num_workers=args.workers, prefetch_factor=args.prefetch_factor,
        pin_memory=args.pin_memory, batch_bytes=args.batch_bytes, worker_type=args.worker_type))
    print(report)
    _write_json(args.json, report.to_dict())
    return report.exit_code


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") \
                from None
    return parse


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value
    return parse


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _size(text: str) -> int:
    from gpufeed._tools.tuner import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufeed", description="Measure and tune data loading.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    common.add_argument("--no-progress", action="store_true", help="no progress bar")

    b = sub.add_parser("bench", parents=[common], help="stock DataLoader vs gpufeed, side by side",
                       description="Compare the stock torch DataLoader with gpufeed.DataLoader "
                       "on a built-in synthetic workload (no files, no GPU) or on MODULE:FACTORY.")
    b.add_argument("target", nargs="?", metavar="MODULE:FACTORY",
                   help="a function returning your dataset (default: built-in synthetic data)")
    b.add_argument("--batch-size", type=_positive(int),
                   help="samples per batch (default: 256 built-in, 32 yours)")
    b.add_argument("--workers", type=_csv(int), default=[0, 2], help="num_workers values (0,2)")
    b.add_argument("--seconds", type=_positive(float), default=0.5,
                   help="timed seconds per run (0.5)")
    b.add_argument("--runs", type=_positive(int), default=5,
                   help="runs per row (5); a row stops after 3 when its spread is small")
    b.add_argument("--target-spread", type=_positive(float), default=0.05,
                   help="spread (fastest-slowest)/median that counts as small (0.05)")
    b.add_argument("--worker-type", choices=("process", "thread"), default="process",
                   help="gpufeed's worker kind (process)")
    b.add_argument("--quick", action="store_true", help="a smaller synthetic data set")
    b.add_argument("--plot", metavar="FILE", help="bar chart of samples/s (needs matplotlib)")
    b.set_defaults(func=_cmd_bench)

    t = sub.add_parser("tune", parents=[common], help="find the smallest fast loader settings",
                       description="Short trials over num_workers, worker_type, prefetch_factor "
                       "and pin_memory on your dataset; recommends DataLoader keyword arguments.")
    t.add_argument("target", metavar="MODULE:FACTORY", help="a function returning your dataset")
    t.add_argument("--batch-size", type=_positive(int), default=32, help="samples per batch (32)")
    t.add_argument("--collate", metavar="MODULE:FUNCTION",
                   help="your collate_fn (e.g. padding variable-length samples)")
    step = t.add_mutually_exclusive_group()
    step.add_argument("--step", metavar="MODULE:FUNCTION",
                      help="your training step, called with each batch: tune for the share of "
                      "the loop spent waiting for data, not raw loader speed")
    step.add_argument("--step-ms", type=_positive(float), metavar="MS",
                      help="a training step of MS milliseconds that leaves the CPUs free "
                      "(a GPU step)")
    t.add_argument("--budget-memory", "--budget", dest="budget_memory", type=_size,
                   help="peak PSS limit of the process tree, e.g. 8GiB (default: 80%% of "
                   "available RAM)")
    t.add_argument("--budget-shm", type=_size,
                   help="limit on /dev/shm growth (default: 80%% of its free space)")
    t.add_argument("--budget-pinned", type=_size, help="pinned host memory limit (CUDA)")
    t.add_argument("--runs", type=_positive(int), default=5,
                   help="runs per trial (5); a trial stops after 3 when they agree")
    t.add_argument("--worker-types", type=_csv(str), default=["process", "thread"],
                   help="worker kinds to try (process,thread)")
    t.add_argument("--trial-seconds", type=_positive(float), default=0.5,
                   help="timed seconds per run of a trial (0.5)")
    t.add_argument("--time-budget", type=_positive(float), default=120.0,
                   help="no trial starts after this many seconds (120)")
    t.add_argument("--plot", metavar="FILE", help="samples/s by num_workers (needs matplotlib)")
    t.set_defaults(func=_cmd_tune)

    pr = sub.add_parser("profile", parents=[common], help="is your training loop input-bound?",
                        description="Run MODULE:FUNCTION under the profiler. FUNCTION(profiler) "
                        "loops over profiler.wrap(loader); or FUNCTION() returns (iterable, step).")
    pr.add_argument("target", metavar="MODULE:FUNCTION")
    pr.add_argument("--steps", type=_positive(int), help="stop after N steps (default: all)")
    pr.add_argument("--warmup", type=_positive(int), default=1, help="first steps left out (1)")
    pr.set_defaults(func=_cmd_profile)

    d = sub.add_parser("doctor", parents=[common], help="check this machine's limits",
                       description="Check /dev/shm, ulimit -n, RLIMIT_MEMLOCK, CPUs, memory and "
                       "GPUs against the loader you will run; exit 1 when something will "
                       "break it.")
    d.add_argument("--workers", type=_nonnegative, help="num_workers (default: usable CPUs)")
    d.add_argument("--prefetch-factor", type=_positive(int), default=2,
                   help="batches in flight per worker (2)")
    d.add_argument("--worker-type", choices=("process", "thread"), default="process",
                   help="worker kind (process)")
    d.add_argument("--pin-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="whether batches are pinned (default: where CUDA is available)")
    d.add_argument("--batch-bytes", type=_size, metavar="SIZE",
                   help="bytes of one batch, e.g. 48MiB: judge /dev/shm and memory against "
                   "the batches in flight")
    d.set_defaults(func=_cmd_doctor)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpufeed`` and ``python -m gpufeed``; returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
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
