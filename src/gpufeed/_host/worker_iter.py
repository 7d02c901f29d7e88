"""WorkerIter: ``gpufeed.DataLoader``'s batches from a worker pool through the slot ring. How
batches are numbered, dispatched, answered and delivered, and what an epoch's generation is:
NOTE [ Messages ] in ``_host/messages.py``.

Names of torch's multiprocessing iterator that programs written for the stock loader reach for
(not public API) are kept on ``WorkerIter``:

- ``loader._iterator._workers``: the process workers in force (for their pids or liveness);
  empty for thread workers and once the workers have stopped.
- ``loader._iterator._shutdown_workers()``: stop the workers now (persistent ones, before a
  loader is replaced). It is ``close()``: the loader's next ``iter()`` starts a new iterator.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import torch

from .._base import timeline as _timeline
from .._base.errors import RemoteError, WorkerError
from .._base.interrupts import ctrl_c_held
from .._memory.keeper import end_ring, ring_for
from .._memory.ring import SlotRing
from .._order.plan import IndexPlan, follow_stock, make_plan, plannable
from .._sources.packed import check_copy_on_write
from . import failures
from .collate import unpack
from .config import IterConfig
from .iterator import BaseIter
from .late_slots import LateSlots
from .messages import (
    LATE,
    Dropped,
    Exhausted,
    Failed,
    Fetched,
    NeedSlot,
    Reseed,
    ResetStream,
    Result,
    Slot,
    StartFailed,
    Task,
    Tasks,
    ToMain,
    UsePlan,
    WorkerSpec,
    WorkerState,
)
from .pool import GRACE_S, Pool, ProcessPool, ThreadPool, live
from .priority import WorkerPriority
from .workahead import WorkAhead

# An iterable dataset's worker ran dry.
_STOP = object()
# How often a waiting main process re-checks worker health.
WAIT_SLICE_S = 1.0


class WorkerIter(BaseIter):
    """Batches from ``num_workers`` process or thread workers through the slot ring."""

    # the pools it starts; ``AutoIter`` (``_host/auto_iter.py``) starts pools that can resize,
    # whose later process workers need the ring's descriptor (NOTE [ Resizing the pool ])
    process_pool: type[ProcessPool] = ProcessPool
    thread_pool: type[ThreadPool] = ThreadPool
    keeps_region_fd = False

    def __init__(self, config: IterConfig) -> None:
        # First: close() below must work on a half-built iterator.
        self._closed = False
        # A forked child inherits this object: it must not close it.
        self._pid = os.getpid()
        try:
            super().__init__(config)
            nw = self._num_workers = config.num_workers
            self._in_order, self._persistent = config.in_order, config.persistent
            self._timeout = config.timeout
            self._timeout_text = config.timeout_text
            self._shared = shared = config.worker_type == "process"
            self._work_ahead = WorkAhead(
                num_workers=nw, prefetch_factor=config.prefetch_factor, pin=self._pin,
                adaptive=self._timeout <= 0 and not config.prefetch_explicit,
                device_depth=config.device_depth,
                balanced=not shared and not self._is_iterable)
            # NOTE [ Slot lifetime ] (e)
            self._keeper = config.keeper if self._pin else None
            self._ring = ring_for(self._keeper, budget=config.ring_bytes, shared=shared,
                                  pin=self._pin, device=self._pin_device,
                                  slots_hint=self._work_ahead.slots_hint)
            # Counted in stats so far.
            self._seen = (self._ring.grows, self._ring.fallbacks)
            # thread workers' draws from the global generators (process workers seed theirs)
            self._watch = None if shared else config.random_watch
            spec = WorkerSpec(
                num_workers=nw, dataset=self._dataset, is_iterable=self._is_iterable,
                auto_collation=self._auto_collation, collate_fn=self._collate_fn,
                drop_last=config.drop_last,
                region=self._ring.region if shared else self._ring.region_tensor,
                base_seed=self._base_seed, init_fn=config.worker_init_fn,
                sample_seed=self._sample_seed, rank=config.rank, world_size=config.world_size,
                random_watch=self._watch, datapipe=self._pipe_seeds.setup())
            self._pool: Pool
            if shared:
                # NOTE [ Copy-on-write and Python objects ]
                check_copy_on_write(self._dataset)
                ctx = config.multiprocessing_context or torch.multiprocessing
                self._pool = self.process_pool(spec, ctx)
                # Without a keeper, no later worker needs the region's descriptor.
                if self._keeper is None and not self.keeps_region_fd:
                    self._ring.region.close_fd()
            else:
                self._pool = self.thread_pool(spec)
            live.add(self)
            # NOTE [ Worker priority ] in _host/priority.py: the loop's thread first
            self._priority = WorkerPriority(config.worker_nice, num_workers=nw, process=shared,
                                            send=self._pool.send, recorder=self._recorder)
            self._late = LateSlots(self._pool.send, self._ring.acquire, self._ring.release,
                                   config.late_verdict)
            self._late.decide(self._work_ahead.late_bind)
            # The epoch's generation (NOTE [ Messages ]).
            self._gen = 0
            self._restart(config.sample_seed, first_iter=True)
        except BaseException:
            # A failed start leaves no worker, thread or descriptor behind.
            self.close()
            raise

    # -- epoch bookkeeping ------------------------------------------------------------------
    def _restart(self, sample_seed: int | None, first_iter: bool = False) -> None:
        if self._closed:
            raise RuntimeError("this gpufeed iterator was closed; iterate the DataLoader again")
        failures.check_not_forked(self._pid)
        self._gen += 1
        if not first_iter:
            self._begin_epoch()
        self._num_yielded = 0
        # Next batch number to dispatch, to deliver.
        self._send_idx, self._rcvd_idx = 0, 0
        # Dispatched, not answered: batch -> worker.
        self._tasks: dict[int, int] = {}
        # Answered, not delivered.
        self._ready: dict[int, Any] = {}
        # Answered batches in pinned slots: batch -> slot.
        self._slot_of: dict[int, int] = {}
        # Iterable datasets, per batch.
        self._dataset_states: dict[int, WorkerState] = {}
        self._active = [True] * self._num_workers
        # Workers that could not start (their errors deferred).
        self._exits_expected: set[int] = set()
        self._sampler_done = False
        # NOTE [ Iterable resume ] in _order/delivery.py: states and turns as last delivered
        resumed = self._position.take_dataset_states() if self._is_iterable else None
        first = resumed.next_worker if resumed is not None else 0
        self._cycle = itertools.cycle([*range(first, self._num_workers), *range(first)])
        # NOTE [ DataPipes ] (1): drawn at every start, as torch; workers started with the first
        pipe_seed = self._pipe_seeds.draw()
        if self._is_iterable and (resumed is not None or not first_iter):
            for w in range(self._num_workers):
                state = resumed.states[w] if resumed is not None else None
                self._pool.send(w, ResetStream(self._gen, state, None if first_iter else pipe_seed))
        # load_state_dict brought another seed: re-seed the workers.
        if sample_seed != self._sample_seed:
            self._sample_seed = sample_seed
            for w in range(self._num_workers):
                self._pool.send(w, Reseed(self._gen, sample_seed))
        self._plan: IndexPlan | None = None
        point = self._tracker.point
        if not self._is_iterable and not point.ahead and plannable(self._index_sampler):
            skip = 0 if point.seeked else point.done
            self._plan = make_plan(self._index_sampler, shared=self._shared, skip=skip,
                                   epoch_seed=self._tracker.epoch_seed)
            for w in range(self._num_workers):
                self._pool.send(w, UsePlan(self._gen, self._plan))
            follow_stock(self._plan, self._index_sampler, self._work_ahead.stock_in_flight,
                         self._tracker)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand out tasks while fewer than the bound are in flight: batch k goes to the next
        active worker in turn, as with torch's loader (so iterable datasets and per-worker
        random state give the same batches), in windows of ``chunk * num_workers`` batches,
        each worker's share in one message; or one by one, to the worker holding the fewest
        (NOTE [ Balanced dispatch ] in ``_host/workahead.py``)."""
        acquire, new, plan, late = self._ring.acquire, tuple.__new__, self._plan, self._late
        balance = self._work_ahead.share == 1 and self._work_ahead.balanced
        # Slots bound when the tasks start (NOTE [ Slots bound when a task starts ]): all LATE.
        if late.on:
            acquire = itertools.repeat(LATE).__next__
        while not self._sampler_done:
            first = self._send_idx < self._num_workers
            window = self._work_ahead.window(first, len(self._tasks) + len(self._ready))
            if not window:
                break
            per_worker: dict[int, list[Task]] = {}
            for _ in range(window):
                for _ in range(self._num_workers):
                    w = next(self._cycle)
                    if self._active[w]:
                        break
                else:
                    # Every iterable worker ran dry.
                    self._sampler_done = True
                    break
                # With a plan, the worker slices it (indices None).
                try:
                    indices = self._next_indices() if plan is None else None
                except StopIteration:
                    self._sampler_done = True
                    break
                if plan is not None and self._send_idx >= plan.n_batches:
                    self._sampler_done = True
                    break
                if balance:
                    w = self._least_held(w)
                idx, self._send_idx = self._send_idx, self._send_idx + 1
                self._tasks[idx] = w
                slot = acquire()
                per_worker.setdefault(w, []).append(new(Task, (
                    idx, plan is not None, indices, slot if slot is None else new(Slot, slot))))
            for w, tasks in per_worker.items():
                self._pool.send(w, Tasks(self._gen, tasks, self._tracker.epoch))
        if (self._ring.grows, self._ring.fallbacks) != self._seen:
            self._count_ring()

    def _least_held(self, turn: int) -> int:
        """The active worker holding the fewest tasks, ``turn`` first among equals."""
        n = self._num_workers
        held = [0] * n
        for holder in self._tasks.values():
            # (a retiring worker's, past n, gets no more)
            if holder < n:
                held[holder] += 1
        best = turn
        for w in range(n):
            if self._active[w] and held[w] < held[best]:
                best = w
        return best

    # -- receiving ----------------------------------------------------------------------------
    def _handle(self, w: int, msg: ToMain) -> None:
        if isinstance(msg, StartFailed):
            # worker_init_fn raised: in order, the error comes at the worker's first batch, as
            # with the stock loader (_defer_lost), and its exit, which follows, is expected.
            held = [i for i, holder in self._tasks.items() if holder == w]
            if self._in_order and self._defer_lost(w, held, msg.error):
                self._exits_expected.add(w)
                return
            self.close()
            msg.error.reraise()
        if isinstance(msg, NeedSlot):
            self._late.answer(w, msg, msg.gen == self._gen, self._work_ahead.batch_s)
            # The ring may have grown for the answer, as in _dispatch.
            if (self._ring.grows, self._ring.fallbacks) != self._seen:
                self._count_ring()
            return
        fetched = [r for r in msg.results if type(r) is Fetched]
        # Results of an abandoned epoch are recorded under epoch -1.
        if fetched:
            busy_s = self._record_fetched(w, self._tracker.epoch if msg.gen == self._gen else -1,
                                          fetched)
            self._worked(len(fetched), busy_s)
        for result in msg.results:
            self._result(w, msg.gen, result)
        # The batches' cost, which decides the chunk and the slots' binding.
        if fetched:
            if self._work_ahead.adapt(busy_s / len(fetched), self._ring.slot_bytes):
                self._ring.set_slots_hint(self._work_ahead.slots_hint)
            self._late.decide(self._work_ahead.late_bind)
            self._priority.observe(self._num_yielded, len(fetched), busy_s)

    def _worked(self, batches: int, busy_s: float) -> None:
        """``batches`` answered in ``busy_s`` s of fetch + collate (``AutoIter``'s windows)."""

    def _result(self, w: int, gen: int, result: Result) -> None:
        batch, slot_id = result.batch, result.slot_id
        if self._late.sent:
            self._late.settle(gen, batch, slot_id)
        # An answer to an abandoned epoch.
        if gen != self._gen:
            if slot_id >= 0:
                self._ring.release(slot_id)
            return
        self._tasks.pop(batch, None)
        if type(result) is Fetched:
            if result.dataset_state is not None:
                self._dataset_states[batch] = WorkerState(w, result.dataset_state)
            if result.unsupported:
                self._recorder.count("ring_unsupported")
            if result.need > self._ring.slot_bytes:
                self._ring.learn(result.need)
            base = self._ring.lease(slot_id, result.used) if slot_id >= 0 else None
            spill: torch.Tensor | None = result.spill  # type: ignore[assignment]  # mapped
            self._ready[batch] = unpack(result.packed, base, spill)
            if base is not None and self._pin:
                self._slot_of[batch] = slot_id
            return
        if slot_id >= 0:
            self._ring.release(slot_id)
        match result:
            case Exhausted():
                self._active[w] = False
                self._ready[batch] = _STOP
            case Failed():
                self._ready[batch] = result.error
            case Dropped():
                # The slot went back above; nothing is stored.
                # Workers drop the current epoch's tasks only when the pool is closing (a stop
                # waiting on their channel): anything else would lose a batch silently.
                if not self._closed:
                    raise RuntimeError(f"gpufeed internal error: a worker dropped batch {batch} "
                                       "of the current epoch; please report it")

    def _wait(self) -> None:
        """Wait for a task's answer, or raise (dead worker, timeout: NeedSlots do not stop it)."""
        # The loop draws nothing until the batch is popped.
        if self._watch is not None:
            self._watch.wait_begins()
        failures.check_not_forked(self._pid)
        start = time.monotonic()
        while True:
            slice_s = WAIT_SLICE_S
            if self._timeout > 0:
                left = self._timeout - (time.monotonic() - start)
                if left <= 0:
                    error = failures.timed_out(self._timeout_text, self._tasks)
                    # As stock: raised at the timeout, not after a grace period.
                    self.close(grace_s=0.0)
                    raise error
                slice_s = min(slice_s, left)
            try:
                msgs, dead = self._pool.poll(slice_s)
            except WorkerError:
                # Out of file descriptors: nothing more can arrive.
                self.close()
                raise
            for w, msg in msgs:
                self._handle(w, msg)
            for w in dead:
                for msg in self._pool.last_messages(w):
                    self._handle(w, msg)
                if w in self._exits_expected:
                    continue
                held = [i for i, holder in self._tasks.items() if holder == w]
                if not held and not self._tasks and self._sampler_done:
                    # It had nothing left to do.
                    continue
                error = failures.lost_worker(self._pool.exit_description(w), held)
                if self._in_order and self._defer_lost(w, held, error):
                    # The batches before the dead worker's first come first.
                    return
                self.close()
                raise error
            if any(type(msg) is not NeedSlot for _, msg in msgs):
                return

    def _next(self) -> Any:
        if (watch := self._watch) is None:
            return self._next_batch()
        # Reported here, before a batch is taken: a warning turned error loses no batch.
        watch.report(stacklevel=3)
        try:
            return self._next_batch()
        finally:
            watch.wait_ends()

    def _next_batch(self) -> Any:
        if self._pin:
            self._check_capture()
        self._begin_again_if_set_late()
        asked_at = time.perf_counter()
        # The loop's step counts for late slots' rule (e).
        if self._late.on and self._returned_at:
            self._late.away(self._returned_at, asked_at)
        while True:
            if self._closed:
                raise StopIteration
            if self._in_order:
                idx = self._rcvd_idx
                while idx not in self._ready:
                    # Nothing dispatched at idx: the epoch is over.
                    if idx not in self._tasks:
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
            # The sampler, asked for more below, may draw.
            if self._watch is not None:
                self._watch.wait_ends()
            ahead = self._work_ahead
            in_flight = len(self._ready) + len(self._tasks)
            if not self._sampler_done and (in_flight <= ahead.refill_at or in_flight == 0
                                           or self._send_idx < self._num_workers):
                # Else no window would open (WorkAhead.refill_at).
                self._dispatch()
                in_flight = len(self._ready) + len(self._tasks)
            if data is _STOP:
                continue
            # A dead worker's first batch: the epoch stops here.
            if type(data) is failures.Lost:
                self.close()
                data.raise_it()
            if isinstance(data, RemoteError):
                # Else the device stage's Delivered counts it.
                if self._direct:
                    self._tracker.fetch_failed()
                data.reraise()
            occupancy, gauges = (ring := self._ring).levels()
            occupancy.append(("prefetch", in_flight, ahead.in_flight_bound))
            span = None
            # Batches in pinned slots: a device stage orders their copies.
            if self._slot_of:
                sid = self._slot_of.pop(idx, None)
                span = ring.hand_out(sid, streams=self._direct) if sid is not None else None
            states = self._dataset_states
            return self._finish(data, asked_at, idx, states.pop(idx, None) if states else None,
                                span, occupancy, gauges)

    # -- a worker lost ------------------------------------------------------------------------
    def _defer_lost(self, w: int, held: list[int], error: WorkerError | RemoteError) -> bool:
        """Worker ``w`` died holding batches ``held``: if the first is still ahead of the loop,
        put ``error`` in its place (a ``failures.Lost``), forget the tasks and send no more,
        so that the batches before it come first, and return True. False: raise it now."""
        if not held or min(held) <= self._rcvd_idx:
            return False
        self._ready[min(held)] = failures.Lost(error)
        for batch in held:
            del self._tasks[batch]
        self._active[w] = False
        self._sampler_done = True
        return True

    # -- stats and trace (NOTE [ Timeline ] in _base/timeline.py: what, on which clock) -------
    def _record_fetched(self, w: int, epoch: int, fetched: list[Any]) -> float:
        """Record the fetch and collate times of one message's ``Fetched`` results, one recorder
        call per stage and message (not per batch), and worker ``w``'s spans for them, of
        ``epoch`` (-1: an abandoned one's), while a trace records (NOTE [ Timeline ] (4)); their
        worker seconds in all."""
        fetch_s, collate_s = [r.fetch_s for r in fetched], [r.collate_s for r in fetched]
        self._recorder.add_many("fetch", fetch_s)
        self._recorder.add_many("collate", collate_s)
        tl = _timeline.active
        if tl is not None:
            for r in fetched:
                tl.worker_batch(self._recorder, w, r.batch, epoch, r.started, r.fetch_s,
                                r.collate_s, r.need, r.spill is not None)
        return sum(fetch_s) + sum(collate_s)

    def _count_ring(self) -> None:
        """Count the slots the ring carved and the batches that fell back to a fresh allocation
        since ``_seen`` (its grows and fallbacks counted so far), in the stats and, while a
        trace records, as instants."""
        ring = self._ring
        grown, fell_back = ring.grows - self._seen[0], ring.fallbacks - self._seen[1]
        self._seen = (ring.grows, ring.fallbacks)
        self._recorder.count("ring_grow", grown)
        self._recorder.count("ring_fallback", fell_back)
        tl = _timeline.active
        if tl is not None and grown > 0:
            tl.instant(self._recorder, "ring grew",
                       args={"slots": grown, "slot_bytes": ring.slot_bytes})
        if tl is not None and fell_back > 0:
            tl.instant(self._recorder, "ring fallback: fresh allocation",
                       args={"batches": fell_back, "ring_slots_in_use": ring.in_use})

    def _label(self, tl: _timeline.Timeline) -> None:
        """Name the loader and its worker tracks: "worker 0 (pid 4242)", "worker 0 (thread)"."""
        kind = "process" if self._shared else "thread"
        n, procs = self._pool.n, getattr(self._pool, "procs", [])
        tl.label(self._recorder, None, f"gpufeed.DataLoader ({n} {kind} workers)")
        for w in range(n):
            pid = procs[w].pid if w < len(procs) else None
            tl.label(self._recorder, ("worker", w),
                     f"worker {w}" + (f" (pid {pid})" if pid else f" ({kind})"))

    def _sample_counters(self, tl: _timeline.Timeline) -> None:
        """Ring slots in use, fenced (released, waiting for their copy's event) and free (the
        ring may still hold), batches in flight (dispatched, not handed out), workers."""
        ring = self._ring
        in_use, fenced = ring.in_use, ring.fenced
        free = max(ring.capacity_slots - in_use - fenced, 0)
        tl.sample(self._recorder, self._returned_at, in_use, fenced, free,
                  len(self._tasks) + len(self._ready), self._num_workers)

    def _end_epoch(self) -> None:
        self._tracker.host_exhausted()
        if not self._persistent:
            self.close()
        raise StopIteration

    # -- lifecycle ----------------------------------------------------------------------------
    def ring_info(self) -> dict[str, int]:
        """The ring's counters (for tests)."""
        return self._ring.info()

    def close(self, grace_s: float = GRACE_S) -> None:
        """Stop workers and release memory; idempotent. A failed ``__init__`` calls it too, so
        any attribute but ``_closed`` and ``_pid`` may be missing. ``grace_s``: NOTE
        [ Shutdown ]."""
        if getattr(self, "_closed", True) or os.getpid() != self._pid:
            return
        self._closed = True
        live.discard(self)
        for pending in ("_ready", "_tasks", "_slot_of"):
            getattr(self, pending, {}).clear()
        pool: Pool | None = getattr(self, "_pool", None)
        ring: SlotRing | None = getattr(self, "_ring", None)
        try:
            if pool is not None:
                pool.close(grace_s)
        finally:
            if ring is not None:
                end_ring(getattr(self, "_keeper", None), ring,
                         workers_stopped=getattr(pool, "stopped", False))

    def __del__(self) -> None:
        # NOTE [ Ctrl-C that Python drops ]
        with ctrl_c_held(in_finalizer=True):
            # close() is idempotent, and a no-op in a forked child.
            self.close()

    # -- torch's names: _workers, _shutdown_workers (the module's docstring) ------------------
    @property
    def _workers(self) -> list[Any]:
        pool: Pool | None = getattr(self, "_pool", None)  # (missing on a half-built iterator)
        return pool.processes() if pool is not None else []

    def _shutdown_workers(self) -> None:
        self.close()
