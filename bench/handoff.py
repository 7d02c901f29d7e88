"""What a loader's hand-off could cost at best: ``python -m bench.handoff``.

NOTE [ Hand-off bound ]
-----------------------
The CPU benchmark grades each loader against the no-loader ceiling (NOTE [ No-loader ceiling ]
in ``bench/ceiling.py``). On cheap batches (tabular) gpufeed reaches about half of it,
and the question is whether the rest is out of reach on two cores (a consuming main process
competes with two workers) or is the loader's own cost. This tool answers it by measuring
an idealised loader with the same workers, the same batches and the same gather, next to the
ceiling and ``gpufeed.DataLoader``, alternating, in one process:

- ``workers`` forked processes; worker ``w`` gathers batches ``w, w + workers, ...`` of one
  shuffled epoch with ``index_select(out=)`` (gpufeed's own gather for these arrays) straight
  into slot ``k % slots`` of a ring in shared memory;
- two flag arrays in the same memory say which batch a slot holds and which batch may use it
  next: no message, no pickle, no per-batch Python object but the two views the main process
  hands out, made once per slot;
- a waiting side spins on ``sched_yield`` (``--wait yield``) or sleeps 20 us at a time
  (``--wait sleep``); the main process releases a slot when it asks for the next batch.

It keeps none of a loader's duties (errors, resume, timeouts, late slots, statistics, any
dataset but plain arrays, a user holding a batch), so it bounds what a hand-off can cost from
below; it checks itself by summing every label it hands out against the epoch's labels.
``bench/results/main-process.md`` ("Round 14") holds its figures.

``--duties`` adds what a drop-in loader must still do per batch in its main process, whatever
its hand-off, each by name: ``views``, the batch as new tensors of their own (gpufeed's
``unpack`` over the slot's bytes, which a user may keep); ``lease``, the slot held until the
last of them is gone (a lease whose callback is ``deque.append``, as the ring's) rather than
released at the next ask; ``stats``, the per-batch statistics (``StatsRecorder.handout`` with
the ring's and the work-ahead's occupancy). With any of them both arrays share one slot, at
aligned offsets, as in gpufeed's ring, and the batch is new tensors (``lease`` and ``stats``
imply ``views``), whose leaf descriptions are made once per batch length. What it leaves out
is what a flag hand-off would remove: task and result messages, their pickling, the poll
("Round 19" in ``main-process.md``).
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler

from gpufeed._base.stats import StatsRecorder
from gpufeed._host.collate import Leaf, leaf_ref, unpack
from gpufeed._host.writer import dtype_name
from gpufeed._memory.region import align
from gpufeed._memory.ring import _Lease
from gpufeed._tools.environment import environment
from gpufeed._tools.measure import one_intra_op_thread

from .ceiling import measure_no_loader
from .cpu import _ceiling_fetch
from .workloads import build

__all__ = ["DUTIES", "ideal_pass", "main"]

DUTIES = ("views", "lease", "stats")  # a drop-in loader's per-batch duties (--duties)
SPIN = 10_000  # sched_yield calls before a waiting side sleeps
NAP_S = 20e-6


def _shared(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, 1))  # anonymous and shared: seen by forked children


def _wait_until(ready: Any, how: str, check: Any = None) -> None:
    """Wait until ``ready()``; ``check()`` (raising on a failed worker) now and then."""
    spins = 0
    while not ready():
        spins += 1
        if how == "yield" and spins < SPIN:
            os.sched_yield()
        else:
            time.sleep(NAP_S)
        if check is not None and spins % 1000 == 0:
            check()


def ideal_pass(arrays: Sequence[torch.Tensor], order: np.ndarray, batch_size: int, *,
               workers: int = 2, slots: int = 8, wait: str = "yield",
               duties: Sequence[str] = ()) -> dict[str, float]:
    """One epoch of ``order`` through the idealised hand-off (NOTE [ Hand-off bound ]).

    ``arrays``: tensors sharing their first dimension (the last one's values are summed as a
    check). ``duties``: which of a drop-in loader's per-batch duties its main process does too
    (``DUTIES``; ``lease`` and ``stats`` each imply ``views``). Returns
    ``samples_per_s``, ``seconds``, and ``checksum`` (the sum of the last array's rows handed
    out), which must equal ``arrays[-1][order].sum()``.
    """
    if wait not in ("yield", "sleep"):
        raise ValueError(f"wait={wait!r}: choose 'yield' or 'sleep'")
    unknown = set(duties) - set(DUTIES)
    if unknown:
        raise ValueError(f"duties={tuple(duties)!r}: {sorted(unknown)} unknown; choose from "
                         f"{DUTIES}")
    if workers < 1 or slots < workers:
        raise ValueError(f"workers={workers}, slots={slots}: need workers >= 1 and slots >= "
                         "workers")
    n = len(order)
    batches = -(-n // batch_size)
    perm_mem = _shared(n * 8)
    perm = np.frombuffer(perm_mem, np.int64)
    perm[:] = order
    outs: list[Any] = []  # per array: the slots' views (one tensor, or one per slot)
    mems = []
    if duties:  # one slot holds every array, each at an aligned offset, as gpufeed's ring
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += align(batch_size * a[0].numel() * a.element_size())
        slot_bytes = end
        region = _shared(slots * slot_bytes)
        mems.append(region)
        for a, off in zip(arrays, offsets, strict=True):
            row = a[0].numel()
            outs.append([torch.frombuffer(region, dtype=a.dtype, count=batch_size * row,
                                          offset=s * slot_bytes + off)
                         .view(batch_size, *a.shape[1:]) for s in range(slots)])
    else:
        for a in arrays:
            mem = _shared(slots * batch_size * a[0].numel() * a.element_size())
            mems.append(mem)
            outs.append(torch.frombuffer(mem, dtype=a.dtype).view(slots, batch_size,
                                                                  *a.shape[1:]))
    flags_mem = _shared(2 * slots * 8)
    flags = np.frombuffer(flags_mem, np.int64)
    holds, next_use = flags[:slots], flags[slots:]  # slot s: batch it holds, next batch allowed
    holds[:] = -1
    next_use[:] = np.arange(slots)
    pids, parent = [], os.getpid()

    def orphaned() -> None:  # (in a worker) the main process was killed: stop, not spin on
        if os.getppid() != parent:
            raise SystemExit(1)

    for w in range(workers):
        pid = os.fork()
        if pid == 0:  # pragma: no cover  (a child: coverage does not follow it)
            code = 0
            try:
                torch.set_num_threads(1)
                for k in range(w, batches, workers):
                    s = k % slots
                    _wait_until(lambda s=s, k=k: next_use[s] >= k, wait, orphaned)
                    idx = torch.from_numpy(perm[k * batch_size:(k + 1) * batch_size])
                    for a, out in zip(arrays, outs, strict=True):
                        torch.index_select(a, 0, idx, out=out[s][:len(idx)])
                    holds[s] = k
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    status: dict[int, int] = {}  # exited workers' wait statuses

    def check() -> None:  # a failed worker would leave the main process waiting for good
        for pid in pids:
            if pid not in status:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done == pid:
                    status[pid] = code
        failed = [pid for pid, code in status.items() if code != 0]
        if failed:
            raise RuntimeError(f"hand-off workers {failed} failed")

    # made once per slot (the plain bound's batches; with duties each batch is new tensors)
    views = [] if duties else [[out[s] for out in outs] for s in range(slots)]
    last = n - (batches - 1) * batch_size
    checksum = 0
    finished = False
    t0 = time.perf_counter()
    try:
        if duties:
            checksum = _duties_loop(arrays, offsets, slot_bytes, mems[0], holds, next_use,
                                    batches, batch_size, last, slots, wait, check, set(duties))
        else:
            for k in range(batches):
                s = k % slots
                _wait_until(lambda s=s, k=k: holds[s] == k, wait, check)
                batch = views[s] if k < batches - 1 else [v[:last] for v in views[s]]
                checksum += int(batch[-1].sum())  # what a training step would read, cheaply
                next_use[s] = k + slots  # released as the loop asks for the next batch
        seconds = time.perf_counter() - t0
        finished = True
    finally:
        for pid in pids:
            if pid not in status:
                if not finished:  # the others may wait for slots that are never released
                    os.kill(pid, signal.SIGKILL)
                status[pid] = os.waitpid(pid, 0)[1]
    check()
    return {"samples_per_s": n / seconds, "seconds": seconds, "checksum": float(checksum)}


def _duties_loop(arrays: Sequence[torch.Tensor], offsets: list[int], slot_bytes: int,
                 region: mmap.mmap, holds: np.ndarray, next_use: np.ndarray, batches: int,
                 batch_size: int, last: int, slots: int, wait: str, check: Any,
                 duties: set[str]) -> int:
    """The main process's side with some of a drop-in loader's per-batch duties
    (``--duties``)."""
    memory = np.frombuffer(region, np.uint8)
    tree = tuple(leaf_ref(i) for i in range(len(arrays)))

    def layout(rows: int) -> tuple[int, list[Leaf], int]:
        """``rows``, the leaf descriptions of a batch of that many rows and the bytes it spans:
        known per slot to a hand-off without messages, as the gather lane's are (made once,
        not per batch)."""
        leaves: list[Leaf] = [(off // a.element_size(), dtype_name(a.dtype),
                               (rows, *a.shape[1:]), None, False, False)
                              for a, off in zip(arrays, offsets, strict=True)]
        last_leaf = rows * arrays[-1][0].numel() * arrays[-1].element_size()
        return rows, leaves, align(offsets[-1] + last_leaf)

    full, short = layout(batch_size), layout(last)
    dropped: collections.deque[_Lease] = collections.deque()
    leases: dict[int, _Lease] = {}
    recorder = StatsRecorder()
    checksum, out, returned = 0, 0, None
    for k in range(batches):
        while dropped:  # batches the loop let go of: their slots may be written again
            sid = dropped.popleft().sid
            del leases[sid]
            next_use[sid] = int(holds[sid]) + slots
            out -= 1
        s = k % slots
        asked = time.perf_counter()
        _wait_until(lambda s=s, k=k: holds[s] == k, wait, check)
        rows, leaves, spans = full if k < batches - 1 else short
        base = memory[s * slot_bytes : s * slot_bytes + spans]
        if "lease" in duties:
            lease = leases[s] = _Lease(base, dropped.append)
            lease.sid = s
        out += 1
        batch = unpack((tree, leaves), base)
        del base
        if "stats" in duties:
            now = time.perf_counter()
            recorder.handout(None if returned is None else asked - returned, now - asked, rows,
                             (("ring", out, slots), ("prefetch", slots - out, slots)))
            returned = time.perf_counter()
        checksum += int(batch[-1].sum())  # what a training step would read, cheaply
        del batch  # the loop lets go of it: its lease's callback queues the slot
        if "lease" not in duties:  # released as the loop asks for the next batch
            next_use[s] = k + slots
            out -= 1
    return checksum


def _gpufeed_pass(dataset: Any, batch_size: int, workers: int, seed: int) -> float:
    """samples/s of ``gpufeed.DataLoader`` over one shuffled epoch, after one warm-up epoch
    with the same (persistent) workers."""
    import gpufeed

    loader = gpufeed.DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                num_workers=workers, persistent_workers=True,
                                worker_init_fn=one_intra_op_thread,
                                generator=torch.Generator().manual_seed(seed))
    for _ in loader:
        pass
    samples = 0
    t0 = time.perf_counter()
    for batch in loader:
        samples += len(batch[0])
    rate = samples / (time.perf_counter() - t0)
    del loader
    return rate


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.handoff",
                                description="The idealised hand-off next to the no-loader "
                                            "ceiling and gpufeed (NOTE [ Hand-off bound ]).")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--wait", choices=("yield", "sleep"), default="yield")
    p.add_argument("--duties", default="",
                   help="comma-separated per-batch duties of a drop-in loader's main process "
                        f"to do too, of {','.join(DUTIES)}, or 'all' (each implies views)")
    p.add_argument("--quick", action="store_true", help="tiny data (for tests)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    duties = DUTIES if args.duties == "all" else tuple(d for d in args.duties.split(",") if d)
    torch.set_num_threads(1)
    work = build("tabular", quick=args.quick)
    variant = next(v for v in work.variants if v.name == "array")
    dataset = variant.dataset
    arrays = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a
              for a in dataset.gather_arrays]
    _, fetch = _ceiling_fetch(variant)
    rounds = []
    for r in range(args.rounds):
        generator = torch.Generator().manual_seed(r)
        order = torch.randperm(len(dataset), generator=generator).numpy()
        batches = list(BatchSampler(RandomSampler(dataset, generator=torch.Generator()
                                                  .manual_seed(r)), work.batch_size, False))
        before = measure_no_loader(fetch, batches, processes=args.workers,
                                   init=one_intra_op_thread).samples_per_s
        ideal = ideal_pass(arrays, order, work.batch_size, workers=args.workers,
                           slots=args.slots, wait=args.wait, duties=duties)
        if ideal["checksum"] != float(arrays[-1][torch.from_numpy(order)].sum()):
            raise RuntimeError("the hand-off lost or repeated a batch (checksum differs)")
        loader = _gpufeed_pass(dataset, work.batch_size, args.workers, r)
        after = measure_no_loader(fetch, batches, processes=args.workers,
                                  init=one_intra_op_thread).samples_per_s
        ceiling = (before + after) / 2
        row = {"ceiling_samples_per_s": [before, after], "ideal_samples_per_s":
               ideal["samples_per_s"], "gpufeed_samples_per_s": loader,
               "ideal_share": ideal["samples_per_s"] / ceiling, "gpufeed_share": loader / ceiling,
               "load_average": os.getloadavg()[0]}
        rounds.append(row)
        print(f"round {r}: ceiling {before:,.0f} / {after:,.0f}; ideal hand-off ({args.wait}, "
              f"{args.slots} slots{', ' + '+'.join(duties) if duties else ''}) "
              f"{row['ideal_samples_per_s']:,.0f} "
              f"({row['ideal_share']:.0%}); gpufeed {loader:,.0f} ({row['gpufeed_share']:.0%}); "
              f"load {row['load_average']:.1f}", flush=True)
    result = {"environment": environment(), "workload": work.description,
              "settings": vars(args) | {"json": None}, "rounds": rounds}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
