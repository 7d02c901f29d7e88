"""Starting, talking to, watching and stopping workers (processes or threads).

NOTE [ Shutdown ]
-----------------
``close()`` is idempotent and bounded in time. Process workers: the main process shuts down its
end of each worker's socket (``_hang_up``); a worker waiting for a task sees EOF, one busy in
user code finds the socket broken when it answers, and either way it exits. shutdown() acts on
the socket, not on one descriptor: copies of our end inherited by workers forked later do not
keep it open, and the ``_Sender`` thread, if blocked writing a large task to a busy worker,
wakes with an error at once. Only once that thread has exited are the connections closed
(closing a descriptor under a thread still writing to it would make it write to whatever file
reuses the number). Workers still alive after ``GRACE_S`` get SIGTERM, then SIGKILL; each also
exits when its parent process changes (the main process died). The ring's memory is an
anonymous memory file (``Region``, _memory/region.py): nothing is left in /dev/shm even after
SIGKILL; the mapping goes with the last tensor viewing it. Thread workers get a stop message;
threads are daemons, so one stuck in user code cannot keep the interpreter alive. A close run
on a thread worker (the iterator's finalizer, when a collection happens to run there) only
sends the stop messages: it never joins. After ``close()``, ``stopped`` says whether every
worker has ended.

Dropping the last reference closes at once, without waiting for the cyclic garbage collector:
an iterator knows its loader only through an ``IterConfig`` (``_host/config.py``), which holds
no reference to it, so a persistent loader (which keeps its iterator) and its iterator form no
cycle; torch's per-epoch ``_reset(loader)`` only asks the loader for a fresh config. Nothing
else the iterator owns (pool, ring, sender thread) refers back to it. Keep it so: a cycle
through the iterator keeps its workers alive until a collection runs.

A pool that fails while starting (its arguments cannot be pickled for spawn, fork fails) stops
the workers it started and closes every pipe before the error leaves ``__init__``. A process
that exits while the iterator runs is reported by its sentinel (``poll``), with its exit code
or signal, also when a send found its pipe broken; never a hang.

NOTE [ Plans without a sharing thread ]
---------------------------------------
A shuffled epoch's order (``IndexPlan.perm``, ``_order/plan.py``) is drawn into shared memory
and sent to every process worker in ``UsePlan``. Pickled as torch pickles a shared tensor (the
``file_descriptor`` strategy), its descriptor would go through
``multiprocessing.resource_sharer``, a main-process thread that, once started, runs until the
program exits: every later fork would fork a multi-threaded process, which Python 3.12+ warns
of (a ``DeprecationWarning``: an error in suites that turn warnings into errors). The stock
loader leaves no such thread (torch's intra-op threads, once started, warn in both).

So the pool sends the plan's storage descriptor itself, right after the message, over the
worker's own Unix socket pair (``SCM_RIGHTS``); the message carries a ``SharedPerm``
(``messages.py``) instead of the tensor, and the worker's ``ProcessChannel`` takes the
descriptor first and rebuilds the tensor on the same shared memory. Only with the
``file_descriptor`` strategy (torch's default on Linux) and a plan already in shared memory;
otherwise the plan pickles as torch pickles it. Tested in ``tests/host/test_pool.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import os
import queue
import select
import socket
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler, sendfds
from typing import Any

import torch

from .._base.errors import capture
from .._base.interrupts import ctrl_c_held
from .._order.plan import IndexPlan
from .descriptors import receive
from .failures import describe_exit, warn_if_unpicklable
from .frozen_heap import heap_frozen
from .messages import SharedPerm, StartFailed, ThreadChannel, ToMain, ToWorker, UsePlan, WorkerSpec
from .worker import in_thread_worker, install_thread_worker_info, worker_label, worker_loop

log = logging.getLogger("gpufeed")
GRACE_S = 2.0
#: Iterators with workers: closed at the interpreter's exit (``close_all``; NOTE [ Shutdown ]).
live: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def close_all() -> None:
    # A second Ctrl-C while exiting: the rest stop at once, with no traceback.
    grace = GRACE_S
    for it in list(live):
        try:
            it.close(grace)
        except KeyboardInterrupt:
            grace = 0.0


_STOP_MSG = bytes(ForkingPickler.dumps(None))
# Task messages up to this size are written inline (which never blocks).
INLINE_BYTES = 4096


class _Watch(enum.Enum):
    """What a polled descriptor reports: a worker's message (or EOF), or its process's exit."""
    CONN = enum.auto()
    EXIT = enum.auto()


def detach_plan(msg: UsePlan) -> tuple[UsePlan, int]:
    """An epoch's plan as pickled, and the descriptor to send right after it (-1: none), which
    the plan's storage owns: the caller neither closes nor keeps it (NOTE [ Plans without a
    sharing thread ])."""
    plan = msg.plan
    perm = plan.perm
    if (not isinstance(perm, torch.Tensor) or not perm.is_shared()
            or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"):
        return msg, -1
    try:
        fd, nbytes = perm.untyped_storage()._share_fd_cpu_()
    except (AttributeError, RuntimeError):  # a torch without it, or a storage shared by name
        return msg, -1
    stub = IndexPlan(None, plan.n, plan.batch_size, plan.drop_last, plan.single)
    stub.perm = SharedPerm(  # type: ignore[assignment]
        nbytes, perm.dtype, int(perm.storage_offset()), perm.numel(), perm.stride(0))
    return UsePlan(msg.gen, stub), fd


def send_descriptor(conn: Any, fd: int) -> None:
    """Pass ``fd`` over ``conn``, a Unix socket pair's end, after its message."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sendfds(sock, [fd])


class ProcessPool:
    def __init__(self, spec: WorkerSpec, ctx: Any) -> None:
        n = self.n = spec.num_workers
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self._sender: _Sender | None = None
        self.closed = False
        try:
            self._start(ctx, spec)
        except BaseException:
            # See NOTE [ Shutdown ]: nothing outlives a failed start.
            self.close()
            raise
        self._poller = select.poll()
        # Descriptor -> (what it is, its worker).
        self._fd_owner: dict[int, tuple[_Watch, int]] = {}
        # Workers poll() has reported: each once, though its pipe's end and its sentinel may
        # fire in different polls.
        self._exited: set[int] = set()
        for w in range(n):
            self._watch(self.conns[w].fileno(), _Watch.CONN, w)
            self._watch(self.procs[w].sentinel, _Watch.EXIT, w)

    def _start(self, ctx: Any, spec: WorkerSpec) -> None:
        fork = ctx.get_start_method() == "fork"
        pipes: list[tuple[Any, Any]] = []
        try:
            for _ in range(self.n):
                pipes.append(ctx.Pipe(duplex=True))
                self.conns.append(pipes[-1][0])
            # Each child closes every end but its own.
            close_fds = tuple(c.fileno() for p in pipes for c in p) if fork else ()
            # One freeze for all: NOTE [ Frozen heap at fork ].
            with heap_frozen(fork=fork):
                for w, (_, worker_end) in enumerate(pipes):
                    own = worker_end.fileno()
                    kwargs = dict(worker_id=w, kind="process", chan=worker_end,
                                  close_fds=tuple(fd for fd in close_fds if fd != own))
                    proc = ctx.Process(target=worker_loop, args=(spec,), kwargs=kwargs,
                                       daemon=True)
                    # a Ctrl-C held in the start is raised once the process is kept (NOTE
                    # [ Ctrl-C that Python drops ])
                    with ctrl_c_held(hold=fork), warn_if_unpicklable():
                        proc.start()
                        self.procs.append(proc)
        finally:
            # The workers have theirs (a failed start: before close() stops them).
            for _, worker_end in pipes:
                worker_end.close()

    def _watch(self, fd: int, what: _Watch, w: int) -> None:
        self._poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        self._fd_owner[fd] = (what, w)
        # A worker (re)started at id w (a resized pool reuses ids).
        self._exited.discard(w)

    def send(self, w: int, msg: ToWorker) -> None:
        fd = -1
        # Once an epoch: NOTE [ Plans without a sharing thread ].
        if type(msg) is UsePlan:
            msg, fd = detach_plan(msg)
        payload = ForkingPickler.dumps(msg)
        if len(payload) <= INLINE_BYTES and (self._sender is None or not self._sender.busy(w)):
            try:
                self.conns[w].send_bytes(payload)
                if fd >= 0:
                    send_descriptor(self.conns[w], fd)
            except (BrokenPipeError, ConnectionResetError):
                # The worker died: poll() reports it, with its signal or exit code.
                pass
        else:
            # A large task could fill the pipe while the worker is busy answering.
            if self._sender is None:
                self._sender = _Sender(self.conns)
            self._sender.put(w, payload, os.dup(fd) if fd >= 0 else -1)

    def poll(self, timeout: float | None) -> tuple[list[tuple[int, ToMain]], list[int]]:
        """Messages that arrived (worker, msg) and workers that exited, waiting up to timeout."""
        ms = -1 if timeout is None else max(int(timeout * 1000), 0)
        msgs: list[tuple[int, ToMain]] = []
        dead: list[int] = []
        for fd, _ in self._poller.poll(ms):
            what, w = self._fd_owner[fd]
            if what is _Watch.CONN:
                try:
                    msgs.append((w, receive(self.conns[w], self.procs[w], w)))
                except (EOFError, OSError):
                    self._poller.unregister(fd)
                    dead.append(w)
            else:
                self._poller.unregister(fd)
                dead.append(w)
        dead = [w for w in dict.fromkeys(dead) if w not in self._exited]
        self._exited.update(dead)
        return msgs, dead

    def processes(self) -> list[Any]:
        """The workers' ``multiprocessing`` process objects in force; none once closed."""
        return list(self.procs)

    def last_messages(self, w: int) -> list[ToMain]:
        """Whatever worker ``w`` sent before it died."""
        out = []
        conn = self.conns[w]
        with contextlib.suppress(EOFError, OSError):
            while conn.poll(0):
                out.append(conn.recv())
        return out

    def exit_description(self, w: int) -> str:
        if self.closed:
            return f"gpufeed worker {w}"
        proc = self.procs[w]
        proc.join(0.5)
        return describe_exit(proc.pid, w, proc.exitcode)

    def close(self, grace_s: float = GRACE_S) -> None:
        """Stop the workers (NOTE [ Shutdown ]). ``grace_s``: how long they get to exit by
        themselves before SIGTERM (0 after a timeout: they are stuck)."""
        if self.closed:
            return
        self.closed = True
        sender = self._sender
        for w, conn in enumerate(self.conns):
            _hang_up(conn, may_write=sender is None or not sender.busy(w))
        if sender is not None and not sender.stop():
            log.warning("gpufeed sender thread did not stop: its connections are left open")
        else:
            for conn in self.conns:
                conn.close()
        _stop_processes(self.procs, grace_s)
        # Stopped workers: none can write a slot now.
        self.stopped = not any(p.is_alive() for p in self.procs)
        for p in self.procs:
            if p.is_alive():
                log.warning("gpufeed worker pid %s did not stop", p.pid)
        # Not Process.close(): a program may hold them (``_workers``, _host/worker_iter.py) and
        # join them or ask is_alive(), as with stock's. Dropped, they free their descriptors.
        # Their arguments hold the ring: let it go with the last user view.
        self.procs = []


def _stop_processes(procs: list[Any], grace_s: float) -> None:
    """Give ``procs`` ``grace_s`` in all to exit by themselves, then SIGTERM those still alive,
    then SIGKILL, each time a second to take effect (NOTE [ Shutdown ])."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0))
    for stop in ("terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        for p in alive:
            getattr(p, stop)()
        for p in alive:
            p.join(1.0)


def _hang_up(conn: Any, *, may_write: bool) -> None:
    """End the conversation on ``conn`` for good: the worker reads EOF, and every write, the
    worker's and ours, fails at once from now on (NOTE [ Shutdown ])."""
    # fromfd works on a duplicate descriptor, which the with block closes.
    try:
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        # Not a socket (or the worker is gone): an explicit stop message instead (EOF alone is
        # not enough when a later fork inherited our end), never from this thread while the
        # sender may be writing to it.
        if may_write:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(_STOP_MSG)


class _Sender:
    """Writes large task messages from a thread, so the main thread never blocks on a pipe;
    it owns writing to a connection while ``busy`` for it (NOTE [ Shutdown ])."""

    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns
        self.q: queue.SimpleQueue[tuple[int, Any, int] | None] = queue.SimpleQueue()
        self.pending = [0] * len(conns)
        self.lock = threading.Lock()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="gpufeed-sender", daemon=True)
        self.thread.start()

    def busy(self, w: int) -> bool:
        return self.pending[w] > 0

    def put(self, w: int, payload: Any, fd: int = -1) -> None:
        """Queue ``payload`` for worker ``w``, then ``fd`` (a descriptor of the sender's own,
        closed once sent or dropped; -1: none)."""
        with self.lock:
            self.pending[w] += 1
        self.q.put((w, payload, fd))

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            w, payload, fd = item
            try:
                if not self.stopping:
                    self.conns[w].send_bytes(payload)
                    if fd >= 0:
                        send_descriptor(self.conns[w], fd)
            except (OSError, ValueError):
                # The pool is closing, or the worker died: the iterator reports it.
                pass
            finally:
                if fd >= 0:
                    os.close(fd)
            with self.lock:
                self.pending[w] -= 1

    def stop(self) -> bool:
        """Drop what is still queued and end the thread; True once it has ended."""
        self.stopping = True
        self.q.put(None)
        self.thread.join(GRACE_S)
        return not self.thread.is_alive()


class ThreadPool:
    """Threads do not survive fork(): WorkerIter checks its process (``check_not_forked``)."""

    def __init__(self, spec: WorkerSpec) -> None:
        install_thread_worker_info()
        n = self.n = spec.num_workers
        self.results: queue.SimpleQueue[tuple[int, ToMain]] = queue.SimpleQueue()
        self.chans = [ThreadChannel(w, self.results) for w in range(n)]
        self.threads: list[threading.Thread] = []
        self.closed = False
        try:
            for w in range(n):
                t = threading.Thread(target=_thread_entry, args=(spec, w, self.chans[w]),
                                     name=f"gpufeed-worker-{w}", daemon=True)
                t.start()
                self.threads.append(t)
        except BaseException:
            # E.g. "can't start new thread": stop those that started.
            self.close()
            raise

    def send(self, w: int, msg: ToWorker) -> None:
        self.chans[w].tasks.put(msg)

    def poll(self, timeout: float | None) -> tuple[list[tuple[int, ToMain]], list[int]]:
        msgs = []
        try:
            msgs.append(self.results.get(timeout=timeout))
            while True:
                msgs.append(self.results.get_nowait())
        except queue.Empty:
            pass
        dead = [] if msgs else [w for w, t in enumerate(self.threads) if not t.is_alive()]
        return msgs, dead

    def processes(self) -> list[Any]:
        """None: thread workers have no process."""
        return []

    def last_messages(self, w: int) -> list[ToMain]:
        return []

    def exit_description(self, w: int) -> str:
        return f"DataLoader worker (thread {w}) exited unexpectedly: gpufeed thread worker {w}"

    def close(self, grace_s: float = GRACE_S) -> None:
        """Tell every thread to stop; wait ``grace_s`` for them (0 after a timeout: threads
        cannot be killed), except on a worker thread (NOTE [ Shutdown ]), where joining could
        mean joining itself, or a worker blocked on a lock this thread holds (an import lock,
        say)."""
        if self.closed:
            return
        self.closed = True
        for chan in self.chans:
            chan.tasks.put(None)
        if in_thread_worker() or grace_s <= 0:
            return
        deadline = time.monotonic() + grace_s
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0))
            if t.is_alive():
                log.warning("gpufeed worker %s is still in user code: left as daemon", t.name)
        self.stopped = not any(t.is_alive() for t in self.threads)


def _thread_entry(spec: WorkerSpec, worker_id: int, chan: ThreadChannel) -> None:
    """Run a thread worker; an error that escapes the loop (a dataset's ``state_dict()``,
    say) is sent to the main process to re-raise, not left to kill the thread unexplained."""
    try:
        worker_loop(spec, worker_id=worker_id, kind="thread", chan=chan)
    except BaseException:
        chan.send(StartFailed(capture(f"in {worker_label(worker_id, False)} (gpufeed)")))


Pool = ProcessPool | ThreadPool
