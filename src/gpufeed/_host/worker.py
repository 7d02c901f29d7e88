"""The worker loop, shared by process and thread workers.

A worker receives small task messages, fetches and collates each batch into the slot the
task names, and answers with small messages, one result per task in order: the messages, and
who sends which, are in ``_host/messages.py`` (NOTE [ Messages ]).

Several tasks travel in one message when batches are cheap (``WorkAhead.adapt``: about 30 ms
of work per message): waking a sleeping process costs more than gathering a small batch, and a
main process that sleeps between messages pays CPU for every message.
Measurements: docs/how-it-works/measurements/engine.md#several-tasks-per-message.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import _utils
from torch.utils.data._utils.worker import WorkerInfo, _generate_state

from .._base.errors import capture, out_of_descriptors
from .._memory.heap import HeapFollower
from .._memory.spill import SharedMemoryError, Spill
from .._order.datapipes import reseed_in_worker, set_up_in_worker
from .._order.shards import ShardInfo, set_shard_info
from .._order.state import capture_state
from .collate import pack
from .descriptors import worker_out_of_descriptors
from .fetch import IterFetcher, MapFetcher, make_fetcher, thread_copy
from .lane import GatherLane
from .late_slots import Abandoned, wait_for_slot
from .messages import (
    Done,
    Dropped,
    Exhausted,
    Failed,
    Fetched,
    Nice,
    ProcessChannel,
    Reseed,
    ResetStream,
    Result,
    SlotFor,
    StartFailed,
    Task,
    ToMain,
    ToWorker,
    UsePlan,
    WorkerSpec,
)
from .priority import lower_priority
from .random_watch import GlobalDrawWatch
from .writer import SlotWriter

# How often an idle worker checks that the main process is alive.
POLL_S = 0.5
# How often a busy worker looks for a newer generation or a stop.
NEWER_CHECK_S = 0.001


_thread_local = threading.local()
_patch_lock = threading.Lock()


def install_thread_worker_info() -> None:
    """Make ``torch.utils.data.get_worker_info()`` answer per thread inside thread workers.

    torch keeps the worker info in one module global, which threads share. The function's
    code is swapped once for one that looks at a thread-local first, so that references the
    user took before (``from torch.utils.data import get_worker_info``) see it too. Outside
    gpufeed's thread workers it returns exactly what it returned before.
    """
    mod = _utils.worker
    with _patch_lock:
        if getattr(mod, "_gpufeed_thread_info", None) is not None:
            return
        mod._gpufeed_thread_info = _thread_local  # type: ignore[attr-defined]
        scope: dict[str, Any] = {}
        exec(  # compiled against torch's module globals so _worker_info resolves there
            "def get_worker_info():\n"
            "    info = getattr(_gpufeed_thread_info, 'info', None)\n"
            "    return info if info is not None else _worker_info\n",
            mod.__dict__,
            scope,
        )
        mod.get_worker_info.__code__ = scope["get_worker_info"].__code__


def in_thread_worker() -> bool:
    """Whether the calling thread is one of gpufeed's thread workers (any loader's)."""
    return getattr(_thread_local, "info", None) is not None


def worker_label(worker_id: int, is_process: bool) -> str:
    """How an error caught in a worker names it: torch's words (``Caught KeyError in
    DataLoader worker process 0.``: what people and tools search logs for), or "thread"."""
    return f"DataLoader worker {'process' if is_process else 'thread'} {worker_id}"


def worker_loop(
    spec: WorkerSpec, *, worker_id: int, kind: str, chan: Any, close_fds: tuple[int, ...] = (),
) -> None:
    """Run one worker until told to stop, the main process goes away, or the pipe closes.

    ``chan``: a process worker's end of its pipe, or a thread worker's ``ThreadChannel``;
    ``close_fds``: descriptors a forked process worker inherited and closes at once.
    """
    is_process = kind == "process"
    label = worker_label(worker_id, is_process)
    seed = spec.base_seed + worker_id
    dataset = spec.dataset
    # NOTE [ Iterable datasets in thread workers ] in _host/fetch.py: each its own copy
    if spec.is_iterable and not is_process:
        dataset = thread_copy(dataset)
    info = WorkerInfo(id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset)
    region = spec.region
    parent = -1
    if is_process:
        chan = ProcessChannel(chan)
        # A _memory Region, mapped here.
        region = region.tensor_here() if region is not None else None
        # The main's ends of other workers' pipes, inherited by fork.
        for fd in close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        # Ctrl-C is the main process's to handle.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        torch.set_num_threads(1)
        random.seed(seed)
        torch.manual_seed(seed)
        import numpy as np

        np.random.seed(_generate_state(spec.base_seed, worker_id))
        _utils.worker._worker_info = info
        parent = os.getppid()
    else:
        _thread_local.info = info
    set_shard_info(ShardInfo(spec.rank, spec.world_size, worker_id, spec.num_workers))
    try:
        # torch's seed and sharding of DataPipes, before worker_init_fn.
        if spec.datapipe is not None:
            set_up_in_worker(dataset, spec.datapipe, spec.num_workers, worker_id)
        if spec.init_fn is not None:
            spec.init_fn(worker_id)
        fetcher = make_fetcher(
            dataset, is_iterable=spec.is_iterable, auto_collation=spec.auto_collation,
            collate_fn=spec.collate_fn, drop_last=spec.drop_last, sample_seed=spec.sample_seed,
            base_seed=spec.base_seed, worker_id=worker_id, seed_globals=is_process,
        )
        writer = (
            SlotWriter(region, shared_fallback=is_process) if region is not None else None
        )
    except Exception:
        _say(chan, StartFailed(capture(f"in {label} (gpufeed: during start-up)")))
        return
    # NOTE [ Worker heap ] in _memory/heap.py
    heap = HeapFollower() if is_process else None
    # NOTE [ Gather lane ]
    lane = GatherLane.of(fetcher) if writer is not None else None
    _serve(worker_id, label, chan, fetcher, writer, parent,
           None if is_process else spec.random_watch,
           heap if heap is not None and heap.active else None, lane)


def _serve(
    worker_id: int, label: str, chan: Any, fetcher: MapFetcher | IterFetcher,
    writer: SlotWriter | None,
    parent: int, watch: GlobalDrawWatch | None, heap: HeapFollower | None,
    lane: GatherLane | None,
) -> None:
    # Messages read ahead by _newer.
    inbox: collections.deque[ToWorker] = collections.deque()
    # How LATE tasks get their slots.
    late = functools.partial(wait_for_slot, chan, inbox, parent, POLL_S)
    # The newest generation seen: tasks of older ones are dropped, not run.
    latest = 0
    while True:
        msg: ToWorker
        if inbox:
            msg = inbox.popleft()
        else:
            try:
                msg = chan.recv(POLL_S)
            except (queue.Empty, TimeoutError):
                if parent != -1 and os.getppid() != parent:
                    # The main process died without closing us.
                    return
                continue
            except Exception as exc:
                # A message with a descriptor (the epoch's plan) found no free descriptor.
                if out_of_descriptors(exc):
                    _say(chan, StartFailed(worker_out_of_descriptors(
                        worker_id, "receiving a message from the main process")))
                    return
                if isinstance(exc, (EOFError, OSError)):
                    return
                raise
        if msg is None:
            return
        if isinstance(msg, SlotFor):
            # Its task ended without asking (NOTE [ Slots bound when a task starts ]).
            continue
        gen = msg.gen
        latest = max(latest, gen)
        if isinstance(msg, ResetStream):
            if isinstance(fetcher, IterFetcher):
                # NOTE [ DataPipes ]
                reseed_in_worker(fetcher.dataset, msg.pipe_seed)
                fetcher.reset(msg.state)
            continue
        if isinstance(msg, UsePlan):
            if isinstance(fetcher, MapFetcher):
                fetcher.plan = msg.plan
            continue
        if isinstance(msg, Reseed):
            fetcher.seed = msg.seed
            continue
        # Sent to process workers only.
        if isinstance(msg, Nice):
            lower_priority(msg.step)
            continue
        spills: list[Spill] = []
        results: list[Result] = []
        # Look for a newer generation (a poll) before the first task, then every
        # NEWER_CHECK_S: a poll per task cost more than cheap tasks.
        look_at = 0.0
        for task in msg.tasks:
            now = time.perf_counter()
            if gen < latest or (now >= look_at and _newer(chan, inbox, gen)):
                # NOTE [ Messages ] in _host/messages.py: the epoch was abandoned (a restarted
                # persistent iterator) or the pool is closing; the slot goes back unused
                latest = max(latest, gen + 1)
                results.append(Dropped(task.batch, task.slot.id if task.slot is not None else -1))
                continue
            look_at = now + NEWER_CHECK_S
            # A thread worker's task may be checked for draws from the global generators
            # (NOTE [ Seeding and threads ] in _order/seeding.py).
            if watch is not None:
                fetcher.probe = watch.task_probe()
            result: Result | None = None
            # A lane comes with a writer.
            if lane is not None and lane.on:
                result = lane.take(fetcher, task, writer, heap)  # type: ignore[arg-type]
            if result is None:
                result = _run_task(worker_id, label, fetcher, writer, task, gen, msg.epoch,
                                   spills, heap, late)
            if watch is not None:
                fetcher.probe = None
            # It stopped waiting for its slot: the rest go unrun.
            if type(result) is Dropped:
                latest = max(latest, gen + 1)
            results.append(result)
        try:
            _send_results(worker_id, label, chan, gen, results)
        except (BrokenPipeError, EOFError, OSError):
            return
        finally:
            # The main process has the descriptors now (or never will).
            for spill in spills:
                spill.release()
        del results


def _say(chan: Any, msg: ToMain) -> None:
    # The main process may be gone or closing (another worker's error, or close()).
    with contextlib.suppress(BrokenPipeError, EOFError, OSError):
        chan.send(msg)


def _newer(chan: Any, inbox: collections.deque[ToWorker], gen: int) -> bool:
    """Read what is waiting into ``inbox``; True if it holds a stop or a newer generation."""
    while chan.waiting():
        try:
            inbox.append(chan.recv(0))
        except (queue.Empty, TimeoutError):
            break
        except (EOFError, OSError):
            inbox.append(None)
            break
    return any(m is None or m.gen > gen for m in inbox)


def _send_results(worker_id: int, label: str, chan: Any, gen: int, results: list[Result]
                  ) -> None:
    """Send a message's results; if pickling them fails (torch's own shared memory, used by
    the leaves the ring cannot hold, is full), each becomes that error."""
    try:
        chan.send(Done(gen, results))
    except Exception as exc:
        # Out of descriptors while passing a batch's: the pipe is still whole.
        if out_of_descriptors(exc):
            err = worker_out_of_descriptors(worker_id, f"sending batch {results[0].batch}")
        elif isinstance(exc, (BrokenPipeError, EOFError, OSError)):
            raise
        else:
            err = capture(
                f"in {label} (gpufeed: sending a batch with tensors the ring cannot hold, "
                "nested, sparse, quantized or subclasses, which torch shares through /dev/shm; "
                "a larger /dev/shm, e.g. docker --shm-size, or worker_type='thread' avoids it)"
            )
        chan.send(Done(gen, [Failed(r.batch, r.slot_id, err) for r in results]))


def _run_task(
    worker_id: int, label: str, fetcher: MapFetcher | IterFetcher, writer: SlotWriter | None,
    task: Task,
    gen: int, epoch: int, spills: list[Spill], heap: HeapFollower | None,
    late: Callable[[int, int], Any],
) -> Result:
    batch, indices, slot = task.batch, task.indices, task.slot
    if writer is not None:
        if slot is None:
            writer.begin(0, 0)
        elif slot.id < 0:
            # LATE: NOTE [ Slots bound when a task starts ] in late_slots.py
            writer.begin_late(functools.partial(late, gen, batch))
        else:
            writer.begin(slot.offset, slot.size, slot.id)
    t0 = time.perf_counter()
    try:
        if task.planned:
            indices = fetcher.planned(batch)  # type: ignore[union-attr]
        data = fetcher.fetch(indices, writer, epoch=epoch)
        t1 = time.perf_counter()
        packed = pack(data, writer)
        # Before the samples are freed, so that glibc keeps their memory for the next batch.
        if heap is not None:
            heap.follow_batch(packed.need)
        del data
        spill = writer.take_spill() if writer is not None else None
        sealed = None
        if spill is not None:
            spills.append(spill)
            sealed = spill.seal()
    except Abandoned:
        # A stop or a newer generation while waiting for its slot.
        return Dropped(batch, -1)
    except StopIteration:
        return Exhausted(batch, -1 if writer is None else writer.sid)
    except BaseException as exc:
        if not isinstance(exc, Exception) and not in_thread_worker():
            # SystemExit and the like end a process worker, as stock's (its exit is reported);
            # in a thread worker the batch raises it, in order, as with num_workers=0.
            raise
        # A LATE task's slot, if it came.
        sid = -1 if writer is None else writer.sid
        # Out of descriptors anywhere: the spill's memory file, or the user's open().
        if out_of_descriptors(exc):
            return Failed(batch, sid, worker_out_of_descriptors(
                worker_id, f"{fetcher.describe(indices)} (batch {batch})"))
        # gpufeed's own allocation failed, not the user's code: no indices named.
        what = "" if isinstance(exc, SharedMemoryError) else f"{fetcher.describe(indices)}, "
        return Failed(batch, sid, capture(f"in {label} (gpufeed: {what}batch {batch})"))
    t2 = time.perf_counter()
    collate_s = fetcher.collate_s + (t2 - t1)
    fetch_s, sid = t2 - t0 - collate_s, -1
    if writer is not None:
        sid, waited = writer.sid, writer.waited_s
        # A LATE task's wait for its slot is neither fetch nor collate (collation asked for
        # its slot, else batch_empty did).
        if waited:
            if collate_s >= waited:
                collate_s -= waited
            else:
                fetch_s = max(fetch_s - waited, 0.0)
    state = None
    try:
        # Map-style datasets have no stream state.
        if type(fetcher) is IterFetcher:
            state = capture_state(fetcher.dataset)
    except Exception:
        where = f"in {label} (gpufeed: saving the dataset's state after batch {batch})"
        return Failed(batch, sid, capture(where))
    return tuple.__new__(Fetched, (  # in C: a NamedTuple's __new__ is Python code
        batch, sid, packed.used, packed.need, (packed.batch, packed.leaves), fetch_s, collate_s,
        state, sealed, packed.unsupported, t0,
    ))
