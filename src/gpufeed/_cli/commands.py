"""The ``gpufeed`` subcommands, one function each (``cmd_bench``, ``cmd_tune``, ``cmd_profile``,
``cmd_doctor``: an ``argparse`` namespace in, the exit code out), and their progress bar; the
user's ``MODULE:NAME`` (or ``path/to/file.py:NAME``) targets they load, and the errors those
raise (exit code 2).

``gpufeed profile ... --trace FILE --timeline FILE.png``: :func:`cmd_profile_traced` runs
``cmd_profile`` inside ``gpufeed.trace`` when either is given, then writes the trace and draws
the picture (``_tools/gantt.py``).

Each command imports the tools it uses when it runs (``gpu`` only with CUDA).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._tools.output import require_matplotlib


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


def load_collate(spec: str | None) -> Callable[[list[Any]], Any] | None:
    """``--collate MODULE:FUNCTION`` (``gpufeed bench`` and ``tune``): the ``collate_fn`` every
    loader measured gets; None (no option) leaves the loaders' default."""
    return load_target(spec, what="FUNCTION") if spec else None



class _ProgressBar:
    """A tqdm bar on stderr, unless --no-progress or --json or tqdm is not installed (and off
    too when stderr is no terminal: tqdm's ``disable=None``)."""

    def __init__(self, args: argparse.Namespace, total: int | None, unit: str = "run") -> None:
        self.bar: Any = None
        if not (args.no_progress or args.json):
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc=f"gpufeed {args.command}", unit=unit, leave=False,
                            disable=None)

    def step(self, text: str = "") -> None:
        if self.bar is not None:
            if text:
                self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_bench(args: argparse.Namespace) -> int:
    from .._tools import bench as _bench
    from .._tools.trial import COLLATE_FIX, ragged

    if args.plot:
        require_matplotlib()  # fail before the runs, not after
    if args.target:
        dataset, batch_size, title = load_dataset(args.target), args.batch_size or 32, args.target
        variants: dict[str, tuple[Any, Any]] = {"yours": (dataset, load_collate(args.collate))}
    else:
        if args.collate:
            raise UsageError("--collate applies to your dataset: give MODULE:FACTORY too (the "
                             "built-in workload has its own collate functions)")
        from .._tools.workloads import builtin

        work = builtin(quick=args.quick)
        batch_size = args.batch_size or work.batch_size
        title = f"built-in synthetic workload: {work.description}"
        variants = {v.name: (v.dataset, v.collate_fn) for v in work.variants}
    rows = _bench.configs(variants, args.workers, batch_size, args.worker_type)
    bar = _ProgressBar(args, len(rows) * args.runs)
    try:
        load = _bench.run_bench(rows, seconds=args.seconds, runs=args.runs,
                                target_spread=args.target_spread, step=bar.step)
    except Exception as exc:
        if not (args.target and not args.collate and ragged(str(exc))):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]  # not the worker's traceback
        print(f"gpufeed bench: {type(exc).__name__}: {first}; {COLLATE_FIX}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    comparisons = _bench.compare(rows)
    print(_bench.render(f"{title}, batch_size={batch_size}", rows, comparisons, load,
                        args.seconds))
    from .._tools.environment import environment

    doc: dict[str, Any] = {"workload": title, "batch_size": batch_size,
                           "rows": [r.to_dict() for r in rows],
                           "comparisons": [c.to_dict() for c in comparisons],
                           "machine": load.to_dict(), "seconds_per_run": args.seconds,
                           "runs": args.runs, "environment": environment()}
    if torch.cuda.is_available():
        from .._tools import bench_gpu as gpu

        doc["gpu"] = gpu.run_gpu_benchmark(batches=16, repeats=1)
        if "skipped" not in doc["gpu"]:
            print(gpu.render_markdown(doc["gpu"]))
    args.emit_json(doc)
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


def cmd_tune(args: argparse.Namespace) -> int:
    from .._tools.tuner import Budget, tune

    if args.plot:
        require_matplotlib()  # fail before minutes of trials, not after
    dataset = load_dataset(args.target)
    collate = load_collate(args.collate)
    step = (load_target(args.step, what="FUNCTION") if args.step
            else _SleepStep(args.step_ms) if args.step_ms else None)
    default = Budget.default()
    budget = Budget(memory_bytes=args.budget_memory or default.memory_bytes,
                    shm_bytes=args.budget_shm or default.shm_bytes,
                    pinned_bytes=args.budget_pinned)
    bar = _ProgressBar(args, None)
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
    args.emit_json(result.to_dict())
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .._tools.profiler import Profiler, profile

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
        bar = _ProgressBar(args, args.steps, unit="step")

        def step(batch: Any) -> None:
            user_step(batch)
            bar.step()  # a microsecond or so, counted in compute

        try:
            report = profile(iterable, step if bar.bar is not None else user_step,
                             max_steps=args.steps, warmup_steps=args.warmup)
        finally:
            bar.close()
    print(report)
    args.emit_json(report.to_dict())
    if report.steps == 0:  # no verdict: a script reading the exit code must not take it as one
        print(f"gpufeed profile: error: no steps measured: the loop ended within the first "
              f"{args.warmup} step(s) that --warmup leaves out, or never iterated "
              "profiler.wrap(loader); give it more batches"
              + (" or a lower --warmup" if args.warmup > 1 else ""),
              file=sys.stderr)
        return 1
    return 0


#: The picture's options (None: not given) and their defaults; each needs ``--timeline``.
_PICTURE = {"timeline_seconds": 1.0, "timeline_start": 0.0, "stall_ms": 1.0}


def _check_trace_options(args: argparse.Namespace) -> None:
    """An option that shapes a recording nobody asked for is a usage error, not ignored."""
    given = [name for name in _PICTURE if getattr(args, name) is not None]
    if given and not args.timeline:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags} shape{'s' if len(given) == 1 else ''} the picture: add "
                         "--timeline FILE.png, or leave "
                         f"{'it' if len(given) == 1 else 'them'} out")
    if args.trace_last is not None and not (args.trace or args.timeline):
        raise UsageError("--trace-last bounds a recording: add --trace FILE (or --timeline "
                         "FILE.png), or leave it out")
    for name, default in _PICTURE.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def cmd_profile_traced(args: argparse.Namespace) -> int:
    """``cmd_profile``, recorded when ``--trace`` or ``--timeline`` is given."""
    _check_trace_options(args)
    if not (args.trace or args.timeline):
        return cmd_profile(args)
    from .._tools.trace import trace

    if args.timeline:  # fail before the run, not after
        require_matplotlib("timeline pictures", "--timeline")
    with trace(args.trace, last_batches=args.trace_last) as recording:
        code = cmd_profile(args)
    if args.trace:
        print(f"wrote {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.timeline:
        try:
            recording.plot(args.timeline, seconds=args.timeline_seconds,
                           start_s=args.timeline_start, stall_ms=args.stall_ms)
        except ValueError as exc:  # a window past the run's end: the trace is written already
            raise UsageError(f"--timeline-start {args.timeline_start:g}: {exc}") from None
        print(f"wrote {args.timeline}")
    return code


def cmd_doctor(args: argparse.Namespace) -> int:
    from .._tools.doctor import Workload, diagnose

    if args.workers == 0 and args.prefetch_factor is not None:
        raise UsageError("--prefetch-factor counts batches in flight per worker process: with "
                         "--workers 0 there are none (DataLoader(num_workers=0) refuses a "
                         "prefetch_factor too); leave it out")
    report = diagnose(workload=Workload(
        num_workers=args.workers, prefetch_factor=2 if args.prefetch_factor is None
        else args.prefetch_factor,
        pin_memory=args.pin_memory, batch_bytes=args.batch_bytes, worker_type=args.worker_type))
    print(report)
    args.emit_json(report.to_dict())
    return report.exit_code
