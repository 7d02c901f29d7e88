"""Pools whose workers can be added and retired while the epoch runs (``num_workers="auto"``).

NOTE [ Resizing the pool ]
--------------------------
Worker ids stay ``0 .. n-1`` for the ``n`` workers in force: growth starts the lowest free id,
a shrink retires the highest. ``AutoIter`` (``_host/auto_iter.py``) keeps the bookkeeping:

- **Retire.** A retiring worker gets no new task (the dispatch turn covers ids below ``n``) and
  finishes those it holds, delivered in order as any other: nothing is lost, repeated or
  reordered. Only once nothing is outstanding for it (tasks sent less answers received, of any
  epoch, and no large message still being written) does ``retire`` stop watching its
  descriptors and hang up its pipe (NOTE [ Shutdown ] in ``_host/pool.py``): its exit is then
  no error. A thread worker gets its stop message. Growing again before a retiring worker was
  retired takes it back at no cost.
- **Add.** A new worker starts from the pool's ``WorkerSpec`` with the count in force as its
  ``num_workers`` and a seed of its own: the ``k``-th worker started has ``base_seed + k``
  (the first ``n`` are torch's), so a worker started again at a retired id never replays a
  random stream. It is sent the epoch's plan and per-sample seed when the pool's differ. A
  retired process at that id is joined first (killed if stuck after ``GRACE_S``).
- **Failures.** A new worker that fails to start or dies is reported like any other
  (``StartFailed``, its sentinel); ``close()`` stops every worker ever started, retired ones
  included; the started process is in ``procs`` before anything else can be interrupted. A
  process worker started with ``spawn`` or ``forkserver`` needs the ring's descriptor, so an
  elastic process pool keeps it open until the ring closes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from .._base.interrupts import ctrl_c_held
from .failures import warn_if_unpicklable
from .frozen_heap import heap_frozen
from .messages import Done, Tasks, ThreadChannel, ToMain, ToWorker, WorkerSpec
from .pool import GRACE_S, ProcessPool, ThreadPool, _hang_up, _stop_processes, _thread_entry, _Watch
from .worker import in_thread_worker, worker_loop


class _Counting:
    """What both elastic pools share: ``send`` and ``poll`` count the tasks outstanding per
    worker (sent less answers received, of any epoch); the ids retired, and the seeds given."""

    n: int

    def _start_counting(self, spec: WorkerSpec) -> None:
        self._spec = spec
        self.outstanding = [0] * self.n
        self.started = self.n  # workers started so far: the next one's seed offset
        self.retired: set[int] = set()

    def send(self, w: int, msg: ToWorker) -> None:
        if isinstance(msg, Tasks):
            self.outstanding[w] += len(msg.tasks)
        super().send(w, msg)  # type: ignore[misc]

    def poll(self, timeout: float | None) -> tuple[list[tuple[int, ToMain]], list[int]]:
        msgs, dead = super().poll(timeout)  # type: ignore[misc]
        self._received(msgs)
        return msgs, [w for w in dead if w not in self.retired]

    def _received(self, msgs: list[tuple[int, ToMain]]) -> None:
        for w, msg in msgs:
            if isinstance(msg, Done):
                self.outstanding[w] -= len(msg.results)

    def _spec_for(self, w: int, num_workers: int) -> WorkerSpec:
        """The spec of the next worker started, at id ``w`` (see NOTE [ Resizing the pool ])."""
        offset = self.started - w
        self.started += 1
        return dataclasses.replace(self._spec, num_workers=num_workers,
                                   base_seed=self._spec.base_seed + offset)

    def _placed(self, w: int) -> None:
        """Worker ``w`` was started: nothing outstanding, not retired, counted in ``n``."""
        if w == len(self.outstanding):
            self.outstanding.append(0)
        self.outstanding[w] = 0
        self.retired.discard(w)
        self.n = max(self.n, w + 1)


class ElasticProcessPool(_Counting, ProcessPool):
    """A ProcessPool with :meth:`add` and :meth:`retire` (NOTE [ Resizing the pool ])."""

    def __init__(self, spec: WorkerSpec, ctx: Any) -> None:
        super().__init__(spec, ctx)
        self._ctx = ctx
        self._start_counting(spec)

    def last_messages(self, w: int) -> list[ToMain]:
        msgs = super().last_messages(w)
        self._received([(w, m) for m in msgs])
        return msgs

    def idle(self, w: int) -> bool:
        """Nothing outstanding for worker ``w``: it may be retired."""
        return self.outstanding[w] <= 0 and not (self._sender is not None and self._sender.busy(w))

    def processes(self) -> list[Any]:
        """The process objects of the workers in force (retiring ones included)."""
        return [p for w, p in enumerate(self.procs) if w not in self.retired]

    def pids(self) -> list[int]:
        """The pids of the workers in force (retiring ones included)."""
        return [p.pid for p in self.processes() if p.pid]

    def tids(self) -> list[int]:
        return []

    def retire(self, w: int) -> None:
        """Stop watching worker ``w`` and hang up its pipe: it exits, and that is no error."""
        if w in self.retired:
            return
        self.retired.add(w)
        for fd in (self.conns[w].fileno(), self.procs[w].sentinel):
            if self._fd_owner.pop(fd, None) is not None:
                self._poller.unregister(fd)
        _hang_up(self.conns[w], may_write=not (self._sender and self._sender.busy(w)))

    def add(self, w: int, num_workers: int) -> None:
        """Start a worker at id ``w`` (the next id, or a retired one)."""
        if w < len(self.procs):
            self.retire(w)
            self._join(w)
        spec = self._spec_for(w, num_workers)
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        close_fds: tuple[int, ...] = ()
        if fork := self._ctx.get_start_method() == "fork":  # the child closes every main end
            close_fds = (*(c.fileno() for c in self.conns if not c.closed), parent_end.fileno())
        proc = self._ctx.Process(target=worker_loop, args=(spec,), daemon=True, kwargs=dict(
            worker_id=w, kind="process", chan=child_end, close_fds=close_fds))
        with ctrl_c_held(hold=fork):  # NOTE [ Ctrl-C that Python drops ]: raised once watched
            placed = False
            try:
                # NOTE [ Frozen heap at fork ]; spawn and forkserver pickle the spec again: a
                # dataset that stopped pickling since the first start fails as it would there
                with heap_frozen(fork=fork), warn_if_unpicklable():
                    proc.start()
                if w == len(self.procs):
                    self.procs.append(proc)
                    self.conns.append(parent_end)
                else:
                    self.procs[w], self.conns[w] = proc, parent_end
                placed = True
            finally:
                child_end.close()
                if not placed:
                    parent_end.close()  # a started child reads EOF and exits
            self._placed(w)
            if self._sender is not None and w == len(self._sender.pending):
                self._sender.pending.append(0)
            self._watch(parent_end.fileno(), _Watch.CONN, w)
            self._watch(proc.sentinel, _Watch.EXIT, w)

    def _join(self, w: int) -> None:
        """Reap the retired process at ``w`` and close its pipe (NOTE [ Resizing the pool ])."""
        _stop_processes([self.procs[w]], GRACE_S)
        self.conns[w].close()


class ElasticThreadPool(_Counting, ThreadPool):
    """A ThreadPool with :meth:`add` and :meth:`retire` (NOTE [ Resizing the pool ])."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)
        self._start_counting(spec)
        self._gone: list[threading.Thread] = []  # retired threads replaced at their id

    def idle(self, w: int) -> bool:
        return self.outstanding[w] <= 0

    def pids(self) -> list[int]:
        return []

    def tids(self) -> list[int]:
        """The native thread ids of the workers in force (retiring ones included)."""
        return [t.native_id for w, t in enumerate(self.threads)
                if w not in self.retired and t.native_id is not None]

    def retire(self, w: int) -> None:
        if w not in self.retired:
            self.retired.add(w)
            self.chans[w].tasks.put(None)

    def add(self, w: int, num_workers: int) -> None:
        if w < len(self.threads):
            self.retire(w)
            self._gone.append(self.threads[w])
        spec = self._spec_for(w, num_workers)
        chan = ThreadChannel(w, self.results)
        t = threading.Thread(target=_thread_entry, args=(spec, w, chan),
                             name=f"gpufeed-worker-{w}", daemon=True)
        if w == len(self.threads):
            self.chans.append(chan)
            self.threads.append(t)
        else:
            self.chans[w], self.threads[w] = chan, t
        self._placed(w)
        t.start()

    def close(self, grace_s: float = GRACE_S) -> None:
        if self.closed:
            return
        super().close(grace_s)
        if in_thread_worker() or grace_s <= 0:  # never joins there (NOTE [ Shutdown ])
            return
        deadline = time.monotonic() + grace_s
        for t in self._gone:
            t.join(max(deadline - time.monotonic(), 0))
        self.stopped = self.stopped and not any(t.is_alive() for t in self._gone)
