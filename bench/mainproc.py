"""The main process's cost per batch, by stage: ``python -m bench.mainproc``.

On cheap batches a loader's main process competes with its own workers for the cores: what it
spends per batch (receiving, bookkeeping, unpacking, releasing) is taken from the workers'
gather. This tool runs one loader of the CPU benchmark (``bench/cpu.py``: same workloads,
variants and settings) for a few epochs and reports, per epoch after the warm-up batches:

- the **CPU time per batch** of the main thread (``time.thread_time``), of the whole main
  process and of the worker processes (``psutil``), with the rate. CPU time is steadier than
  wall time on a loaded machine, though it still grows with cache and CPU contention;
- **where each thread's wall time goes** (Linux, ``/proc/<pid>/task/<tid>/schedstat``): the
  main thread and each worker process's, per batch, on a CPU, runnable but waiting for one
  (more busy threads than cores), and asleep (waiting for work or a message). On cheap
  batches the loader's rate is set by how these three fit on the cores, not by CPU time alone;
- with ``--py-spy`` (``pip install py-spy``), **where the main thread's time goes**: the tool
  runs itself under ``py-spy record`` (raw stacks), keeps the samples taken inside the timed
  loop (``_timed_epoch``), leaves out those waiting for a worker (a poll or a queue get), sorts
  the rest into stages by the functions on the stack (:data:`STAGES`), and gives each stage its
  share of the main thread's CPU per batch. Samples are a sampling profiler's: shares are
  accurate to a few percent over thousands of samples, not to the microsecond.

``bench/results/main-process.md`` holds a before/after budget made with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from gpufeed._base.system import thread_sched

from .cpu import LOADERS, Settings, _factory, add_workload_options, workload_variant

__all__ = ["STAGES", "classify", "main", "measure_epochs", "stage_budget"]

#: Stages of the main thread's work, in the order they are matched: a sample belongs to the
#: first stage one of whose (function, file) patterns is on its stack. ``file`` is the
#: module's file name; a pattern's function may be a prefix (ending in ``*``).
STAGES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("waiting for a worker", ()),  # the innermost frame is a wait (see WAITS)
    ("stats recording", (("*", "stats.py"),)),
    ("release / collect", (("SlotRing._collect_released", "ring.py"), ("Releaser*", "release.py"),
                           ("SlotRing._unfence", "ring.py"))),
    ("dispatch: acquire slots", (("SlotRing.acquire*", "ring.py"),)),
    ("dispatch: pickle + send", (("ProcessPool.send", "pool.py"), ("ThreadPool.send", "pool.py"),
                                 ("*", "reduction.py"))),
    ("dispatch: tasks", (("WorkerIter._dispatch", "worker_iter.py"),
                         ("*", "workahead.py"))),
    ("lease + unpack", (("SlotRing.lease", "ring.py"), ("*", "collate.py"), ("*", "tree.py"))),
    ("receive: recv + decode", (("*", "connection.py"), ("*", "messages.py"))),
    ("receive: poll", (("ProcessPool.poll", "pool.py"), ("ThreadPool.poll", "pool.py"))),
    ("results bookkeeping", (("WorkerIter._handle", "worker_iter.py"),
                             ("WorkerIter._result", "worker_iter.py"),
                             ("WorkerIter._wait", "worker_iter.py"))),
    ("closing sampler draw", (("finish_plan", "plan.py"),)),
    ("__next__ + hand-out", (("*", "worker_iter.py"), ("*", "iterator.py"), ("*", "delivery.py"),
                             ("*", "ring.py"), ("*", "cuda.py"), ("*", "pinning.py"))),
    ("the loop itself", (("*", "mainproc.py"), ("*", "_tensor.py"))),  # its len() and clocks
    ("other loader code", (("*", "*"),)),
)
#: Innermost frames that wait rather than compute: a pool's poll, a queue get, a selector.
WAITS = (("ProcessPool.poll", "pool.py"), ("SimpleQueue.get", "*"), ("*", "selectors.py"),
         ("wait", "connection.py"), ("Condition.wait", "threading.py"), ("Queue.get", "queue.py"))
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*?)(?::(?P<line>\d+))?\)$")
_LOOP = "_timed_epoch"


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for frame in stack.split(";"):
        m = _FRAME.match(frame.strip())
        if m is not None:
            out.append((m["func"], os.path.basename(m["file"])))
    return out


def _matches(frame: tuple[str, str], pattern: tuple[str, str]) -> bool:
    func, file = pattern
    ok_file = file == "*" or frame[1] == file
    ok_func = func == "*" or frame[0] == func or (
        func.endswith("*") and frame[0].startswith(func[:-1]))
    return ok_file and ok_func


def classify(stack: str) -> str | None:
    """The stage of one raw py-spy stack (outermost frame first), or None when the sample was
    not taken inside the timed loop."""
    frames = _frames(stack)
    at = next((i for i, f in enumerate(frames) if f[0] == _LOOP), None)
    if at is None:
        return None
    inner = frames[at + 1:]
    if not inner:
        return "the loop itself"
    if any(_matches(inner[-1], w) for w in WAITS):
        return STAGES[0][0]
    for stage, patterns in STAGES[1:]:
        if any(_matches(f, p) for f in inner for p in patterns):
            return stage
    return "the loop itself"


def stage_budget(raw: Iterable[str], cpu_per_batch_s: float) -> list[dict[str, Any]]:
    """Rows (stage, samples, share of the non-waiting samples, CPU us per batch) of py-spy's
    raw output lines, the main thread's measured CPU per batch split by the shares."""
    counts: Counter[str] = Counter()
    for line in raw:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        stage = classify(stack) if n.isdigit() else None
        if stage is not None:
            counts[stage] += int(n)
    waiting = counts.pop(STAGES[0][0], 0)
    busy = sum(counts.values())
    order = list(dict.fromkeys(s for s, _ in STAGES[1:]))
    rows = [{"stage": s, "samples": counts[s], "share": counts[s] / busy if busy else 0.0,
             "us_per_batch": 1e6 * cpu_per_batch_s * counts[s] / busy if busy else 0.0}
            for s in order if counts[s]]
    rows.append({"stage": STAGES[0][0], "samples": waiting, "share": None,
                 "us_per_batch": None})
    return rows


def _workers_cpu(workers: Sequence[int]) -> float:
    """CPU seconds so far of the worker processes ``workers`` (pids)."""
    total = 0.0
    for pid in workers:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children()}


def _sched_now(workers: Sequence[int]) -> dict[str, tuple[float, float] | None]:
    """(on a CPU, waiting for one) seconds so far of the main thread and of each worker
    process's main thread (``thread_sched``; None off Linux)."""
    out = {"main thread": thread_sched(os.getpid(), threading.get_native_id())}
    for k, pid in enumerate(workers):
        out[f"worker {k}"] = thread_sched(pid)
    return out


def _sched_split(start: dict[str, Any], end: dict[str, Any], seconds: float,
                 batches: int) -> dict[str, dict[str, float]]:
    """Each thread's share of the epoch's wall time, in us per batch: on a CPU, runnable and
    waiting for one (the kernel's run-queue delay), and asleep (the rest: waiting for work,
    for a message, for a page)."""
    out = {}
    for name, a in start.items():
        b = end.get(name)
        if a is None or b is None:
            continue
        on, queued = b[0] - a[0], b[1] - a[1]
        out[name] = {"on_cpu": 1e6 * on / batches, "waiting_for_cpu": 1e6 * queued / batches,
                     "asleep": 1e6 * max(0.0, seconds - on - queued) / batches}
    return out


def _timed_epoch(it: Any, n_batches: int, workers: Sequence[int] = (), step_s: float = 0.0
                 ) -> tuple[int, int, float, float, float, float, dict[str, dict[str, float]],
                            float]:
    """Iterate the rest of the epoch, spending ``step_s`` of CPU in the loop per batch (a
    training step's stand-in); read the clocks at its last batch, while the workers live.
    (batches, samples, seconds, thread CPU, process CPU, workers' CPU, the wall time of the
    main thread and of the ``workers`` (pids) split by ``_sched_split``, the share of the
    machine's CPU time left idle)."""
    def clocks() -> tuple[tuple[float, float, float, float, float, float], dict[str, Any]]:
        return ((time.perf_counter(), time.thread_time(), time.process_time(),
                 _workers_cpu(workers), *_machine_idle()), _sched_now(workers))

    start, s0 = end, s1 = clocks()
    batches = samples = 0
    clock = time.thread_time
    for batch in it:
        batches += 1
        samples += len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
        if step_s:  # CPU time, not wall time: a step preempted still costs its CPU
            done = clock() + step_s
            while clock() < done:
                pass
        if batches == n_batches:
            end, s1 = clocks()
    sec, thread, proc, cpu, idle, total = (b - a for a, b in zip(start, end, strict=True))
    sched = _sched_split(s0, s1, sec, max(batches, 1))
    return batches, samples, sec, thread, proc, cpu, sched, idle / total if total > 0 else 0.0


def _machine_idle() -> tuple[float, float]:
    """(idle + iowait, all) jiffies of every CPU so far, from /proc/stat ((0, 0) elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    return float(sum(ticks[3:5])), float(sum(ticks))


def _counted_epoch(it: Any) -> tuple[int, Counter[str]]:
    """Iterate the rest of the epoch counting the main thread's function calls, Python
    (``name (file)``) and C (``[C] name``): (batches, counts)."""
    counts: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            counts[f"{code.co_qualname} ({os.path.basename(code.co_filename)})"] += 1
        elif event == "c_call":
            counts[f"[C] {getattr(arg, '__qualname__', arg)}"] += 1

    batches = 0
    sys.setprofile(profile)
    try:
        for _ in it:
            batches += 1
    finally:
        sys.setprofile(None)
    return batches, counts


def measure_epochs(workload: str, variant: str, loader: str, *, epochs: int = 3,
                   warmup: int = 5, num_workers: int = 2, quick: bool = False,
                   calls: bool = False, worker_nice: int | None = None,
                   same_loader: bool = False, step_us: float = 0.0) -> list[dict[str, Any]]:
    """One row per epoch: rate and CPU microseconds per batch of the main thread, the main
    process and the workers, over the batches after ``warmup``; with ``calls``, the main
    thread's function calls per batch instead (exact, whatever the machine's load: a
    profiling hook sees each), the most frequent first. ``worker_nice``: set on gpufeed's
    loader (None: its default; NOTE [ Worker priority ] in ``_host/priority.py``).
    ``same_loader``: one loader for every epoch (as a training loop has), not a new one each
    (as the CPU benchmark runs them). ``step_us``: CPU microseconds the loop spends per batch
    (in the main thread's figures), to see how the rate answers the main process's cost."""
    work, v = workload_variant(workload, variant, quick=quick)
    torch.set_num_threads(1)
    make = _factory(loader, v, work, Settings(num_workers=num_workers, quick=quick))
    rows = []
    one = make() if same_loader else None
    for _ in range(epochs):
        before = _children()
        made = one if one is not None else make()
        if worker_nice is not None:  # (else the loader's default)
            made.worker_nice = worker_nice  # type: ignore[attr-defined]
        it = iter(made)
        n = len(it)  # type: ignore[arg-type]
        for _ in range(warmup):
            next(it)
        workers = sorted(_children() - before)  # this loader's worker processes
        if calls:
            b, counts = _counted_epoch(it)
            del it
            rows.append({"batches": b, "calls_per_batch": {
                "python": sum(v for k, v in counts.items() if not k.startswith("[C]")) / b,
                "c": sum(v for k, v in counts.items() if k.startswith("[C]")) / b,
                "top": {k: v / b for k, v in counts.most_common(25)}}})
            continue
        b, s, sec, thread, proc, cpu, sched, idle = _timed_epoch(it, n - warmup, workers,
                                                                 step_us * 1e-6)
        del it
        stats = getattr(made, "stats", None)  # gpufeed's: NOTE [ Worker priority ]
        rows.append({"batches": b, "samples_per_s": s / sec, "us_per_batch": {
            "wall": 1e6 * sec / b, "main_thread": 1e6 * thread / b,
            "main_process": 1e6 * proc / b, "workers": 1e6 * cpu / b},
            "sched_us_per_batch": sched, "loadavg": os.getloadavg()[0], "machine_idle": idle,
            "worker_nice": stats().counters.get("worker_nice", 0) if stats else 0})
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.mainproc",
                                description=__doc__.split("\n\n")[0])
    add_workload_options(p, workload="tabular", variant="array")
    p.add_argument("--loader", default="gpufeed", choices=LOADERS[:3])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--py-spy", dest="pyspy", action="store_true",
                   help="also sample the main thread with py-spy and give the budget by stage")
    p.add_argument("--rate", type=int, default=100,
                   help="py-spy samples per second (py-spy pauses the process for each: more "
                        "samples, steadier shares, a slower and costlier main thread)")
    p.add_argument("--calls", action="store_true",
                   help="count the main thread's Python and C calls per batch instead")
    p.add_argument("--worker-nice", type=int, default=None,
                   help="gpufeed's worker_nice (default: the loader's, decided from costs)")
    p.add_argument("--same-loader", action="store_true",
                   help="iterate one loader for every epoch, not a new one per epoch")
    p.add_argument("--step-us", type=float, default=0.0,
                   help="CPU microseconds the loop spends per batch, a training step's stand-in "
                        "(it counts in the main thread's CPU): how the rate answers the main "
                        "process's cost per batch")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.pyspy:
        return _under_py_spy(args, list(sys.argv[1:] if argv is None else argv))
    rows = measure_epochs(args.workload, args.variant, args.loader, epochs=args.epochs,
                          num_workers=args.num_workers, quick=args.quick, calls=args.calls,
                          worker_nice=args.worker_nice, same_loader=args.same_loader,
                          step_us=args.step_us)
    for k, r in enumerate(rows):
        if args.calls:
            c = r["calls_per_batch"]
            print(f"epoch {k}: {r['batches']} batches; calls per batch in the main thread: "
                  f"{c['python']:.1f} Python, {c['c']:.1f} C; the most frequent:")
            for name, per in c["top"].items():
                print(f"  {per:7.2f}  {name}")
            continue
        us = r["us_per_batch"]
        print(f"epoch {k}: {r['batches']} batches, {r['samples_per_s']:,.0f} samples/s; CPU "
              f"us/batch: main thread {us['main_thread']:.1f}, main process "
              f"{us['main_process']:.1f}, workers {us['workers']:.1f} (wall {us['wall']:.1f}); "
              f"load {r['loadavg']:.1f}; the machine's CPUs {r['machine_idle']:.0%} idle, "
              f"workers at nice +{r['worker_nice']}", flush=True)
        for name, t in r["sched_us_per_batch"].items():
                print(f"  {name:11}  us/batch on a CPU {t['on_cpu']:6.1f}, waiting for a CPU "
                  f"{t['waiting_for_cpu']:6.1f}, asleep {t['asleep']:6.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "epochs": rows}, indent=1) + "\n")
    return 0


def _under_py_spy(args: argparse.Namespace, argv: list[str]) -> int:
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    child = [a for a in argv if a != "--py-spy"]
    with tempfile.TemporaryDirectory() as tmp:
        raw, figures = Path(tmp) / "raw.txt", Path(tmp) / "figures.json"
        cmd = [exe, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--",
               sys.executable, "-m", "bench.mainproc", *child, "--json",
               str(figures)]
        subprocess.run(cmd, check=True)
        if os.environ.get("GPUFEED_KEEP_RAW"):
            shutil.copy(raw, os.environ["GPUFEED_KEEP_RAW"])
        epochs = json.loads(figures.read_text())["epochs"]
        thread = sorted(e["us_per_batch"]["main_thread"] for e in epochs)[len(epochs) // 2]
        rows = stage_budget(raw.read_text().splitlines(), thread / 1e6)
    print(f"\nmain thread, median epoch: {thread:.1f} us CPU per batch, by stage:")
    for r in rows:
        if r["share"] is None:
            print(f"  {'':>8}  {'':>6}  {r['samples']:7d} samples  {r['stage']} (not CPU)")
        else:
            print(f"  {r['us_per_batch']:8.1f}  {100 * r['share']:5.1f}%  {r['samples']:7d} "
                  f"samples  {r['stage']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"epochs": epochs, "stages": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
