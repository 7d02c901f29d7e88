"""The worker loop, shared by process and thread workers.

A worker receives small task messages, fetches and collates each batch into the slot the
task names, and answers with small messages (see NOTE [ Messages ] in ``_host/worker_iter.py``):

    main -> worker   ("tasks", gen, [(batch, planned, indices, slot), ...], epoch)
                        planned: take batch ``batch`` of the epoch's IndexPlan (indices unused)
                        slot: (id, offset, size), or None for ordinary allocation
                        epoch: seeds per-sample random state (``_order/seeding.py``)
                     ("plan", gen, IndexPlan)                this epoch's index plan
                     ("reset", gen, state)                   iterable datasets: restart (from
                                                             ``state`` on resume, else None)
                     ("seed", gen, seed)                     per-sample seeding's base seed from
                                                             now on (None: off); a persistent
                                                             pool after load_state_dict
                     None                                    stop (or EOF on the pipe)
    worker -> main   ("done", gen, [result, ...])            one result per task, in order:
                        ("ok", batch, slot_id, used, need, packed, fetch_s, collate_s,
                         dataset_state,                      iterable datasets' state_dict()
                         spill,                              a SpillFile or None (NOTE [ Spill ])
                         unsupported)                        a leaf went torch's way (_collate)
                        ("drop", batch, slot_id)             not run: its epoch was abandoned
                        ("stop", batch, slot_id)             iterable dataset exhausted
                        ("err", batch, slot_id, RemoteError)
                     ("init_err", RemoteError)               worker_init_fn or set-up failed
                                                             (threads: or the loop itself)

Several tasks travel in one message when batches are cheap: on these machines waking a
sleeping process costs 0.1-0.4 ms, more than gathering a small batch.
"""

from __future__ import annotations

import collections
import os
import queue
import random
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import _utils
from torch.utils.data._utils.worker import WorkerInfo, _generate_state

from .._base.errors import capture
from .._memory.spill import SharedMemoryError, Spill
from .._order.shards import ShardInfo, set_shard_info
from .._order.state import capture_state
from .collate import SlotWriter, pack
from .fetch import IterFetcher, MapFetcher, thread_copy

POLL_S = 0.5  # how often an idle worker checks that the main process is alive


class ThreadChannel:
    """A thread worker's end: its own task queue, and the results queue all workers share."""

    def __init__(self, worker_id: int, results: queue.SimpleQueue[Any]) -> None:
        self.worker_id = worker_id
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.results = results

    def recv(self, timeout: float) -> Any:
        return self.tasks.get(timeout=timeout) if timeout > 0 else self.tasks.get_nowait()

    def waiting(self) -> bool:
        return not self.tasks.empty()

    def send(self, msg: Any) -> None:
        self.results.put((self.worker_id, msg))


class ProcessChannel:
    """A process worker's end of its duplex pipe."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.poller = select.poll()  # made once: Connection.poll builds a selector per call
        self.poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)

    def recv(self, timeout: float) -> Any:
        if not self.poller.poll(int(timeout * 1000)):
            raise TimeoutError
        return self.conn.recv()

    def waiting(self) -> bool:
        """Something (a message, or EOF) can be read now."""
        return bool(self.poller.poll(0))

    def send(self, msg: Any) -> None:
        self.conn.send(msg)


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


def worker_loop(
    *, worker_id: int, num_workers: int, kind: str, chan: Any, dataset: Any, is_iterable: bool,
    auto_collation: bool, collate_fn: Callable[[Any], Any] | None, drop_last: bool,
    region: Any, base_seed: int, init_fn: Callable[[int], None] | None,
    close_fds: tuple[int, ...] = (), sample_seed: int | None = None, rank: int = 0,
    world_size: int = 1,
) -> None:
    """Run one worker until told to stop, the main process goes away, or the pipe closes."""
    is_process = kind == "process"
    seed = base_seed + worker_id
    if is_process:
        chan = ProcessChannel(chan)
        region = region.tensor if region is not None else None  # a _ring.Region
        for fd in close_fds:  # the main's ends of other workers' pipes, inherited by fork
            try:
                os.close(fd)
            except OSError:
                pass
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
        torch.set_num_threads(1)
        random.seed(seed)
        torch.manual_seed(seed)
        import numpy as np

        np.random.seed(_generate_state(base_seed, worker_id))
        _utils.worker._worker_info = WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
        )
        parent = os.getppid()
    else:
        dataset = thread_copy(dataset) if is_iterable else dataset  # NOTE in _host/fetch.py
        _thread_local.info = WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
        )
        parent = -1
    set_shard_info(ShardInfo(rank, world_size, worker_id, num_workers))
    try:
        if init_fn is not None:
            init_fn(worker_id)
        fetcher: MapFetcher | IterFetcher
        if is_iterable:
            fetcher = IterFetcher(
                dataset, auto_collation=auto_collation, collate_fn=collate_fn, drop_last=drop_last
            )
        else:
            fetcher = MapFetcher(
                dataset, auto_collation=auto_collation, collate_fn=collate_fn, seed=sample_seed
            )
        writer = (
            SlotWriter(region, shared_fallback=is_process) if region is not None else None
        )
    except Exception:
        try:
            chan.send(("init_err", capture(f"in gpufeed worker {worker_id} during start-up")))
        except (BrokenPipeError, EOFError, OSError):
            pass  # the main process already stopped (another worker's error, or close())
        return
    _serve(worker_id, chan, fetcher, writer, parent)


def _serve(
    worker_id: int, chan: Any, fetcher: MapFetcher | IterFetcher, writer: SlotWriter | None,
    parent: int,
) -> None:
    inbox: collections.deque[Any] = collections.deque()  # read ahead by _newer
    latest = 0  # the newest generation seen: tasks of older ones are dropped, not run
    while True:
        if inbox:
            msg = inbox.popleft()
        else:
            try:
                msg = chan.recv(POLL_S)
            except (queue.Empty, TimeoutError):
                if parent != -1 and os.getppid() != parent:
                    return  # the main process died without closing us
                continue
            except (EOFError, OSError):
                return
        if msg is None:
            return
        kind, gen = msg[0], msg[1]
        latest = max(latest, gen)
        if kind == "reset":
            if isinstance(fetcher, IterFetcher):
                fetcher.reset(msg[2] if len(msg) > 2 else None)
            continue
        if kind == "plan":
            if isinstance(fetcher, MapFetcher):
                fetcher.plan = msg[2]
            continue
        if kind == "seed":
            if isinstance(fetcher, MapFetcher):
                fetcher.seed = msg[2]
            continue
        if len(msg) > 3 and isinstance(fetcher, MapFetcher):
            fetcher.epoch = msg[3]
        spills: list[Spill] = []
        results = []
        for task in msg[2]:
            if gen < latest or _newer(chan, inbox, gen):
                # NOTE [ Messages ] in _host/worker_iter.py: the epoch was abandoned (a restarted
                # persistent iterator) or the pool is closing; the slot goes back unused
                latest = max(latest, gen + 1)
                results.append(("drop", task[0], task[3][0] if task[3] is not None else -1))
                continue
            results.append(_run_task(worker_id, fetcher, writer, task, spills))
        try:
            _send_results(worker_id, chan, gen, results)
        except (BrokenPipeError, EOFError, OSError):
            return
        finally:
            for spill in spills:  # the main process has the descriptors now (or never will)
                spill.release()
        del results


def _newer(chan: Any, inbox: collections.deque[Any], gen: int) -> bool:
    """Read what is waiting into ``inbox``; True if it holds a stop or a newer generation."""
    while chan.waiting():
        try:
            inbox.append(chan.recv(0))
        except (queue.Empty, TimeoutError):
            break
        except (EOFError, OSError):
            inbox.append(None)
            break
    return any(m is None or m[1] > gen for m in inbox)


def _send_results(worker_id: int, chan: Any, gen: int, results: list[Any]) -> None:
    """Send a message's results; if pickling them fails (torch's own shared memory, which
    the leaves the ring cannot hold still use, is full), each becomes that error."""
    try:
        chan.send(("done", gen, results))
    except (BrokenPipeError, EOFError, OSError):
        raise
    except Exception:
        where = (
            f"in gpufeed worker {worker_id} sending a batch with tensors the ring cannot hold "
            "(nested, sparse, quantized, subclasses: torch shares them through /dev/shm; a "
            "larger /dev/shm, e.g. docker --shm-size, or worker_type='thread' avoids it)"
        )
        err = capture(where)
        chan.send(("done", gen, [("err", r[1], r[2], err) for r in results]))


def _run_task(
    worker_id: int, fetcher: MapFetcher | IterFetcher, writer: SlotWriter | None, task: Any,
    spills: list[Spill],
) -> tuple[Any, ...]:
    batch, planned, indices, slot = task
    sid = -1
    if writer is not None:
        if slot is None:
            writer.begin(0, 0)
        else:
            sid, off, size = slot
            writer.begin(off, size)
    t0 = time.perf_counter()
    try:
        if planned:
            indices = fetcher.plan.batch(batch)  # type: ignore[union-attr]
            if fetcher.arrays is None:
                indices = indices.tolist()
        data = fetcher.fetch(indices, writer)
        t1 = time.perf_counter()
        packed, used, need, unsupported = pack(data, writer)
        del data
        spill = writer.take_spill() if writer is not None else None
        region = None
        if spill is not None:
            spills.append(spill)
            region = spill.seal()
    except StopIteration:
        return ("stop", batch, sid)
    except SharedMemoryError:  # gpufeed's own allocation, not the user's collate_fn
        return ("err", batch, sid, capture(f"in gpufeed worker {worker_id} (batch {batch})"))
    except Exception:
        where = f"in gpufeed worker {worker_id} {fetcher.describe(indices)} (batch {batch})"
        return ("err", batch, sid, capture(where))
    t2 = time.perf_counter()
    collate_s = fetcher.collate_s + (t2 - t1)
    try:
        state = capture_state(fetcher.dataset)
    except Exception:
        where = f"in gpufeed worker {worker_id} saving the dataset's state after batch {batch}"
        return ("err", batch, sid, capture(where))
    return (
        "ok", batch, sid, used, need, packed, t2 - t0 - collate_s, collate_s, state, region,
        unsupported,
    )
