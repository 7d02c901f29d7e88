"""WorkerIter: ``gpufeed.DataLoader``'s batches from a worker pool through the slot ring.

NOTE [ Messages ]
-----------------
Batches are numbered 0, 1, 2 ... in sampler order. The main process keeps at most
``prefetch_factor * num_workers`` batches dispatched and not yet delivered (with
``prefetch_factor`` unset and cheap batches, up to ``2 * chunk * num_workers``: see ``_adapt``;
never more than ``CHUNK_BYTES`` of extra slots), hands each task to
the next active worker in turn with a free slot of the ring (or none: see NOTE [ Slot
lifetime ] in ``_memory/ring.py``), and delivers in order (``in_order=True``) or as they come.
Each epoch of a persistent iterator is a new *generation*; answers from an older one are
dropped and their slots released. A worker that sees a newer generation (or a stop) waiting
on its channel answers "drop" to the older tasks it still holds, between tasks, without
running them: restarting an epoch does not wait for the abandoned work-ahead. Only small
messages cross: indices out; slot offsets,
dtypes and shapes back. The message format is in ``_host/worker.py``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
import weakref
from typing import Any

import torch

from .._base.errors import RemoteError, WorkerError
from .._memory.ring import SlotRing, reserve_for
from .._order.plan import IndexPlan, finish_plan, make_plan, plannable
from .._sources.packed import check_copy_on_write
from .collate import unpack
from .config import IterConfig
from .iterator import BaseIter
from .pool import Pool, ProcessPool, ThreadPool, forked_message

_live: weakref.WeakSet[WorkerIter] = weakref.WeakSet()
_STOP = object()  # an iterable dataset's worker ran dry
WAIT_SLICE_S = 1.0  # how often a waiting main process re-checks worker health
CHUNK_TARGET_S = 0.01  # worker seconds of work per task message (see _host/worker.py)
CHUNK_MAX = 64
CHUNK_BYTES = 64 << 20  # never prefetch more than this in extra chunked batches
FENCE_SLACK = 2  # slots of a pinned ring waiting for the user's copies (a GPU 2 steps behind)


@atexit.register
def _close_all() -> None:
    for it in list(_live):
        it.close()


class WorkerIter(BaseIter):
    """Batches from ``num_workers`` process or thread workers through the slot ring."""

    def __init__(self, config: IterConfig) -> None:
        self._closed = False  # first: close() below must work on a half-built iterator
        self._pid = os.getpid()  # a forked child inherits this object: it must not close it
        try:
            super().__init__(config)
            nw = config.num_workers
            self._nw = nw
            self._in_order = config.in_order
            self._timeout = config.timeout
            self._timeout_text = config.timeout_text  # as given: torch's message prints it so
            self._persistent = config.persistent
            self._shared = config.worker_type == "process"
            # batches the consumer holds besides those in flight (see _slots_for)
            if config.device_depth is not None:
                self._held = 2 + config.device_depth + 1
            else:
                self._held = 2 + (FENCE_SLACK if self._pin else 0)
            self._pf_out = (config.prefetch_factor or 2) * nw
            self._max_out = self._pf_out
            self._chunk = 1
            self._seen_grows = self._seen_fallbacks = 0
            self._batch_s = 0.0  # moving average of worker seconds per batch
            # Chunking only when prefetch_factor was left unset and without timeout= (_adapt).
            self._adaptive = self._timeout <= 0 and not config.prefetch_explicit
            shared = self._shared
            budget = config.ring_bytes
            self._ring = SlotRing(
                reserve=reserve_for(budget), budget=budget, shared=shared, pin=self._pin,
                slots_hint=self._slots_for(self._max_out),
                device=self._pin_device,
            )
            kwargs = dict(
                num_workers=nw, dataset=self._dataset, is_iterable=self._is_iterable,
                auto_collation=self._auto_collation, collate_fn=self._collate_fn,
                drop_last=self._drop_last, region=self._ring.mem if shared else self._ring.region,
                base_seed=self._base_seed,
                init_fn=config.worker_init_fn, sample_seed=self._sample_seed, rank=config.rank,
                world_size=config.world_size,
            )
            self._pool: Pool
            if shared:
                check_copy_on_write(self._dataset)  # NOTE [ Copy-on-write and Python objects ]
                ctx = config.multiprocessing_context or torch.multiprocessing
                self._pool = ProcessPool(nw, ctx, kwargs)
                self._ring.mem.close_fd()
            else:
                self._pool = ThreadPool(nw, kwargs)
            _live.add(self)
            self._gen = 0
            self._restart(config, first_iter=True)
        except BaseException:
            self.close()  # a failed start leaves no worker, thread or descriptor behind
            raise

    # -- epoch bookkeeping ------------------------------------------------------------------
    def _restart(self, config: IterConfig, first_iter: bool = False) -> None:
        if self._closed:
            raise RuntimeError("this gpufeed iterator was closed; iterate the DataLoader again")
        self._check_pid()
        self._gen += 1
        if not first_iter:
            self._begin_epoch()
        self._num_yielded = 0
        self._send_idx = 0  # next batch number to dispatch
        self._rcvd_idx = 0  # next batch number to deliver (in order)
        self._tasks: dict[int, int] = {}  # dispatched, not answered: batch -> worker
        self._ready: dict[int, Any] = {}  # answered, not delivered
        self._wstates: dict[int, tuple[int, Any]] = {}  # iterable datasets: (worker, state)
        self._active = [True] * self._nw
        self._sampler_done = False
        # NOTE [ Iterable resume ] in _order/delivery.py: each worker restarts from its state as of
        # its last delivered batch, and the turn starts with the worker that was next.
        resumed = self._position.take_dataset_states() if self._is_iterable else None
        first = resumed.next_worker if resumed is not None else 0
        self._cycle = itertools.cycle([*range(first, self._nw), *range(first)])
        if self._is_iterable and (resumed is not None or not first_iter):
            for w in range(self._nw):
                state = resumed.states[w] if resumed is not None else None
                self._pool.send(w, ("reset", self._gen, state))
        seed = config.sample_seed
        if seed != self._sample_seed:  # load_state_dict brought another seed: re-seed workers
            self._sample_seed = seed
            for w in range(self._nw):
                self._pool.send(w, ("seed", self._gen, seed))
        self._plan: IndexPlan | None = None
        point = self._tracker.point
        if not self._is_iterable and not point.ahead and plannable(self._index_sampler):
            skip = 0 if point.seeked else point.done
            self._plan = make_plan(self._index_sampler, shared=self._shared, skip=skip,
                                   epoch_seed=self._tracker.epoch_seed)
            for w in range(self._nw):
                self._pool.send(w, ("plan", self._gen, self._plan))
            self._stock_pulls(0)
        self._dispatch()

    def _next_task(self) -> tuple[bool, Any]:
        """(planned, indices) for the next batch; StopIteration at the end of the epoch."""
        if self._plan is None:
            return False, self._next_indices()
        if self._send_idx >= self._plan.n_batches:
            raise StopIteration
        return True, None

    def _stock_pulls(self, delivered: int) -> None:
        """Advance the user's generator as the stock loader would by now.

        Stock pulls ``prefetch_factor * num_workers`` batches of indices from the sampler at
        ``iter()`` and one more per delivered batch; the pull that exhausts the sampler makes
        ``RandomSampler`` draw a closing permutation (``IndexPlan.closing_pull``). gpufeed
        dispatches further ahead, so it makes that draw when stock would: breaking out early
        leaves the generator as stock does.
        """
        plan = self._plan
        if plan is not None and not plan.finished and self._pf_out + delivered >= plan.closing_pull:
            plan.finished = True
            finish_plan(self._index_sampler)

    def _dispatch(self) -> None:
        """Hand out tasks while fewer than the bound are in flight.

        Batch k goes to the next active worker in turn, as with torch's loader (so iterable
        datasets and per-worker random state give the same batches). When batches are cheap,
        a window of ``chunk * num_workers`` batches is handed out at once, each worker's share
        in one message.
        """
        while not self._sampler_done:
            # An epoch's first window is one batch per worker: its first batch then waits for
            # one batch of work, not for a whole chunk (a persistent iterator restarted).
            chunk = self._chunk if self._send_idx >= self._nw else 1
            room = self._max_out - len(self._tasks) - len(self._ready)
            window = min(chunk * self._nw, room)
            if window <= 0 or (window < chunk * self._nw and (self._tasks or self._ready)):
                return
            per_worker: dict[int, list[Any]] = {}
            for _ in range(window):
                for _ in range(self._nw):
                    w = next(self._cycle)
                    if self._active[w]:
                        break
                else:
                    self._sampler_done = True  # every iterable worker ran dry
                    break
                try:
                    planned, indices = self._next_task()
                except StopIteration:
                    self._sampler_done = True
                    break
                idx = self._send_idx
                self._send_idx += 1
                self._tasks[idx] = w
                per_worker.setdefault(w, []).append(
                    (idx, planned, indices, self._ring.acquire())
                )
            for w, items in per_worker.items():
                self._pool.send(w, ("tasks", self._gen, items, self._tracker.epoch))
        ring = self._ring
        if ring.grows != self._seen_grows or ring.fallbacks != self._seen_fallbacks:
            self._rec.count("ring_grow", ring.grows - self._seen_grows)
            self._rec.count("ring_fallback", ring.fallbacks - self._seen_fallbacks)
            self._seen_grows, self._seen_fallbacks = ring.grows, ring.fallbacks

    def _adapt(self, batch_s: float) -> None:
        """Size task messages so each carries about CHUNK_TARGET_S of worker time.

        Only when ``prefetch_factor`` was left unset (an explicit one is a strict bound, as in
        torch), and not with ``timeout=``: a worker answers once per message, and the timeout
        is per batch.
        """
        if not self._adaptive:
            return
        self._batch_s = batch_s if not self._batch_s else 0.8 * self._batch_s + 0.2 * batch_s
        chunk = min(int(CHUNK_TARGET_S / max(self._batch_s, 1e-6)), CHUNK_MAX)
        if self._ring.slot_bytes:
            chunk = min(chunk, CHUNK_BYTES // (self._ring.slot_bytes * 2 * self._nw))
        chunk = max(chunk, 1)
        if chunk != self._chunk:
            self._chunk = chunk
            self._max_out = max(self._pf_out, 2 * chunk * self._nw)
            self._ring.set_slots_hint(self._slots_for(self._max_out))

    def _slots_for(self, in_flight: int) -> int:
        """Default ring size: in-flight batches plus those the consumer holds (the loop's
        current and previous batch, and a device stage's depth + 1; pinned without a device
        stage, FENCE_SLACK more whose release fence waits for the user's copies: NOTE [ Slot
        lifetime ]). More would only raise peak memory; a consumer that keeps more batches,
        or a GPU further behind, gets ordinary allocations."""
        return in_flight + self._held

    # -- receiving ----------------------------------------------------------------------------
    def _handle(self, w: int, msg: Any) -> None:
        if msg[0] == "init_err":
            self.close()
            msg[1].reraise()
        gen = msg[1]
        cost = 0.0
        n = 0
        rec = self._rec
        for res in msg[2]:
            if res[0] == "ok":
                cost += res[6] + res[7]
                n += 1
                rec.add("fetch", busy_s=res[6])
                rec.add("collate", busy_s=res[7])
            self._result(w, gen, res)
        if n:
            self._adapt(cost / n)

    def _result(self, w: int, gen: int, res: Any) -> None:
        kind, idx, sid = res[0], res[1], res[2]
        if gen != self._gen:  # an answer to an abandoned epoch
            if sid >= 0:
                self._ring.release(sid)
            return
        self._tasks.pop(idx, None)
        if kind == "ok":
            used, need, packed, spill = res[3], res[4], res[5], res[9]
            if res[8] is not None:
                self._wstates[idx] = (w, res[8])
            if res[10]:
                self._rec.count("ring_unsupported")
            self._ring.learn(need)
            self._ready[idx] = unpack(
                packed, self._ring.lease(sid, used) if sid >= 0 else None, spill
            )
            return
        if sid >= 0:
            self._ring.release(sid)
        if kind == "drop":  # workers drop only an abandoned epoch's tasks (answered above)
            raise RuntimeError(
                f"gpufeed internal error: a worker dropped batch {idx} of the current epoch; "
                "please report it"
            )
        if kind == "stop":
            self._active[w] = False
            self._ready[idx] = _STOP
        else:
            self._ready[idx] = res[3]

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # a persistent loader (or an iterator) inherited by fork
            raise RuntimeError(forked_message(self._pid))

    def _wait(self) -> None:
        """Receive at least one message, or raise for a dead worker or a timeout."""
        self._check_pid()
        start = time.monotonic()
        while True:
            slice_s = WAIT_SLICE_S
            if self._timeout > 0:
                left = self._timeout - (time.monotonic() - start)
                if left <= 0:
                    waiting = [f"batch {i} on worker {w}" for i, w in sorted(self._tasks.items())]
                    self.close()
                    raise WorkerError(  # torch's phrase first: programs match on it
                        f"DataLoader timed out after {self._timeout_text} seconds (gpufeed: "
                        f"waiting for {', '.join(waiting[:4]) or 'a batch'}); raise timeout= "
                        "or find what blocks the dataset"
                    )
                slice_s = min(slice_s, left)
            try:
                msgs, dead = self._pool.poll(slice_s)
            except WorkerError:  # out of file descriptors: nothing more can arrive
                self.close()
                raise
            for w, msg in msgs:
                self._handle(w, msg)
            for w in dead:
                for msg in self._pool.drain(w):
                    self._handle(w, msg)
                held = [i for i, ww in self._tasks.items() if ww == w]
                if not held and not self._tasks and self._sampler_done:
                    continue  # it had nothing left to do
                desc = self._pool.exit_description(w)
                self.close()
                # It works through its batches in order, but a result it already sent can be
                # lost with it (a fallback batch's memory is handed over by the dead process),
                # so the culprit is one of these, not necessarily the first.
                held.sort()
                named = ", ".join(map(str, held[:6])) + (", ..." if len(held) > 6 else "")
                plural = "es" if len(held) > 1 else ""
                detail = f" while it held batch{plural} {named}" if held else ""
                raise WorkerError(
                    f"{desc}{detail}. No batch was lost silently: the epoch stops here. "
                    "Rerun with num_workers=0 to see the error in the main process."
                )
            if msgs:
                return

    def __next__(self) -> Any:
        self._check_capture()
        asked_at = time.perf_counter()
        while True:
            if self._closed:
                raise StopIteration
            if self._in_order:
                idx = self._rcvd_idx
                while idx not in self._ready:
                    if idx not in self._tasks:  # nothing dispatched at idx: the epoch is over
                        self._end_epoch()
                    self._wait()
                self._rcvd_idx += 1
            else:
                if not self._ready:
                    if not self._tasks:
                        self._end_epoch()
                    self._wait()
                    continue
                idx = next(iter(self._ready))
            data = self._ready.pop(idx)
            self._stock_pulls(self._num_yielded + 1)
            self._dispatch()
            if data is _STOP:
                continue
            if isinstance(data, RemoteError):
                data.reraise()
            ring = self._ring
            self._rec.occupancy("ring", ring.in_use, ring.capacity_slots)
            self._rec.occupancy("prefetch", len(self._ready) + len(self._tasks), self._max_out)
            return self._finish(data, asked_at, idx, self._wstates.pop(idx, None))

    def _end_epoch(self) -> None:
        self._tracker.host_exhausted()
        if not self._persistent:
            self.close()
        raise StopIteration

    # -- lifecycle ----------------------------------------------------------------------------
    def ring_info(self) -> dict[str, int]:
        r = self._ring
        return {
            "slot_bytes": r.slot_bytes, "live_bytes": r.live_bytes, "in_use": r.in_use,
            "grows": r.grows, "fallbacks": r.fallbacks, "budget": r.budget or 0,
        }

    def close(self) -> None:
        """Stop workers and release memory; idempotent. Also called by a failed ``__init__``,
        so every attribute past ``_closed`` and ``_pid`` may be missing."""
        if getattr(self, "_closed", True) or os.getpid() != self._pid:
            return
        self._closed = True
        _live.discard(self)
        for pending in (getattr(self, "_ready", None), getattr(self, "_tasks", None)):
            if pending is not None:
                pending.clear()
        pool: Pool | None = getattr(self, "_pool", None)
        ring: SlotRing | None = getattr(self, "_ring", None)
        try:
            if pool is not None:
                pool.close()
        finally:
            if ring is not None:
                ring.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
