"""Every message between the main process and its workers, and what a worker starts from.

Messages are ``NamedTuple``s, read by field name. ``None`` stays the stop message (the pool
pre-pickles it, and EOF on a worker's pipe means the same). ``Tasks`` and ``Done``, which carry
a message's batches, pickle their items as plain tuples (``__reduce__``), rebuilt by C calls
on the other side: a ``NamedTuple`` item costs the pickler a Python call on each side, some
4-7 us per batch in each process on cheap batches. The worker's side is ``_host/worker.py``,
the main process's ``WorkerIter`` (``_host/worker_iter.py``).

    main -> worker   Tasks, SlotFor, UsePlan, ResetStream, Reseed, Nice, None (stop)
    worker -> main   Done (with one Result per task), NeedSlot, StartFailed

NOTE [ Messages ]
-----------------
Batches are numbered 0, 1, 2 ... in sampler order. The main process keeps at most
``prefetch_factor * num_workers`` batches dispatched and not yet delivered (with
``prefetch_factor`` unset and cheap batches, up to ``2 * chunk * num_workers``: see
``WorkAhead.adapt`` in ``_host/workahead.py``; never more than ``CHUNK_BYTES`` of extra slots),
hands each task to the next active worker in turn with a free slot of the ring (or none: see
NOTE [ Slot lifetime ] in ``_memory/ring.py``; a task queued behind another on an expensive
batch gets its slot when it starts: NOTE [ Slots bound when a task starts ] in
``_host/late_slots.py``), and delivers in order (``in_order=True``) or as they come.
Each epoch of a persistent iterator is a new *generation*; answers from an older one are
dropped and their slots released. A worker that sees a newer generation (or a stop) waiting
on its channel answers ``Dropped`` to the older tasks it still holds, between tasks, without
running them: restarting an epoch does not wait for the abandoned work-ahead. Only small
messages cross: indices out; slot offsets, dtypes and shapes back.
"""

from __future__ import annotations

import os
import queue
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import recvfds
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from .._base.errors import RemoteError
    from .._memory.spill import SpillFile
    from .._order.datapipes import PipeSetup
    from .._order.plan import IndexPlan


# -- main -> worker ----------------------------------------------------------------------------
class Slot(NamedTuple):
    """Where in the ring a batch goes (``SlotRing.acquire``)."""

    id: int
    offset: int
    size: int


class Task(NamedTuple):
    """Batch number ``batch`` of the epoch, to fetch. ``planned``: its indices are the epoch's
    ``IndexPlan``'s (``indices`` is None); else ``indices`` (a count of samples for iterable
    datasets). ``slot``: None for ordinary allocation; ``LATE``: a ``SlotFor`` names it when
    the task starts (NOTE [ Slots bound when a task starts ] in ``_host/late_slots.py``)."""

    batch: int
    planned: bool
    indices: Any
    slot: Slot | None


class Tasks(NamedTuple):
    """A worker's share of a dispatch window, in order; ``epoch`` seeds per-sample random
    state (``_order/seeding.py``)."""

    gen: int
    tasks: list[Task]
    epoch: int

    def __reduce__(self) -> tuple[Any, ...]:
        rows = [(b, p, i, s if s is None else (*s,)) for b, p, i, s in self.tasks]
        return (_tasks, (self.gen, rows, *self[2:]))


LATE = Slot(-1, 0, 0)  # a Task's slot that a SlotFor message will name


class SlotFor(NamedTuple):
    """The slot of task ``batch``, sent ``LATE`` (None: ordinary allocation)."""

    gen: int
    batch: int
    slot: Slot | None


def _tasks(gen: int, rows: list[tuple[Any, ...]], *rest: Any) -> Tasks:
    new = tuple.__new__
    return Tasks(gen, [new(Task, (b, p, i, s if s is None else new(Slot, s)))
                       for b, p, i, s in rows], *rest)


class UsePlan(NamedTuple):
    """This epoch's index plan (map-style datasets)."""

    gen: int
    plan: IndexPlan


class SharedPerm(NamedTuple):
    """A plan's ``perm`` in transit to a process worker, whose storage's descriptor follows
    the message (NOTE [ Plans without a sharing thread ] in ``_host/pool.py``)."""

    nbytes: int
    dtype: Any
    offset: int
    numel: int
    stride: int


class ResetStream(NamedTuple):
    """Iterable datasets: restart the stream, from ``state`` on resume (else None);
    ``pipe_seed``: a datapipe graph's shared seed for the epoch (NOTE [ DataPipes ] in
    ``_order/datapipes.py``), None to keep its seed."""

    gen: int
    state: Any
    pipe_seed: int | None = None


class Reseed(NamedTuple):
    """Per-sample seeding's base seed from now on (None: off); a persistent pool after
    ``load_state_dict``."""

    gen: int
    seed: int | None


class Nice(NamedTuple):
    """Process workers: lower your priority by ``step`` (NOTE [ Worker priority ] in
    ``_host/priority.py``)."""

    gen: int
    step: int


ToWorker = Tasks | SlotFor | UsePlan | ResetStream | Reseed | Nice | None


# -- worker -> main: one result per task -------------------------------------------------------
class Fetched(NamedTuple):
    """A batch, written into slot ``slot_id`` (-1: none) and described by ``packed``.
    ``spill`` is the batch's spill file (NOTE [ Spill ] in ``_memory/spill.py``): a
    ``SpillFile`` when the worker sends it, the mapped uint8 tensor once it arrives (its pickle
    carries the descriptor), None when the batch spilled nothing."""

    batch: int
    slot_id: int
    used: int  # bytes of the slot the leaves span
    need: int  # bytes the whole batch would take in a slot (the ring learns slot sizes)
    packed: Any  # (tree, leaves): the batch, its ringable leaves in ``collate.Leaf`` tuples
    fetch_s: float
    collate_s: float
    dataset_state: Any  # iterable datasets' ``state_dict()``, else None
    spill: SpillFile | torch.Tensor | None
    unsupported: bool  # a leaf went torch's way (``_host/collate.py``)
    started: float = 0.0  # the worker's perf_counter() at the task's start (NOTE [ Timeline ])


class Dropped(NamedTuple):
    """Not run, or stopped waiting for its slot: its epoch was abandoned (or the pool is
    closing)."""

    batch: int
    slot_id: int


class Exhausted(NamedTuple):
    """The worker's iterable dataset ran dry."""

    batch: int
    slot_id: int


class Failed(NamedTuple):
    """Fetching or collating the batch raised ``error``."""

    batch: int
    slot_id: int
    error: RemoteError


Result = Fetched | Dropped | Exhausted | Failed


class Done(NamedTuple):
    """The results of one ``Tasks`` message, in its order."""

    gen: int
    results: list[Result]

    def __reduce__(self) -> tuple[Any, ...]:
        kind = _KIND.get  # a result type not listed in _RESULTS pickles as itself (-1)
        rows = [(k, (*r,)) if (k := kind(type(r), -1)) >= 0 else (k, r) for r in self.results]
        return (_done, (self.gen, rows, *self[2:]))


_RESULTS: tuple[type[Any], ...] = (Fetched, Dropped, Exhausted, Failed)
_KIND = {cls: k for k, cls in enumerate(_RESULTS)}


def _done(gen: int, rows: list[tuple[int, Any]], *rest: Any) -> Done:
    new, results = tuple.__new__, _RESULTS
    return Done(gen, [new(results[k], r) if k >= 0 else r for k, r in rows], *rest)


class NeedSlot(NamedTuple):
    """A ``LATE`` task's first request for slot memory (NOTE [ Slots bound when a task
    starts ])."""

    gen: int
    batch: int
    asked_at: float  # the worker's perf_counter() (a system-wide clock on Linux)


class StartFailed(NamedTuple):
    """``worker_init_fn`` or the worker's set-up failed (thread workers: or the loop itself)."""

    error: RemoteError


ToMain = Done | NeedSlot | StartFailed


class WorkerState(NamedTuple):
    """An iterable dataset's ``state_dict()`` after a batch, and the worker whose it is."""

    worker: int
    state: Any


# -- what a worker starts from -----------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker is started with, the same for every worker of a pool. ``region``:
    the ring's memory, a ``Region`` for process workers (pickled as its descriptor) or its
    tensor for thread workers; None without a ring. ``base_seed``: each worker seeds from
    ``base_seed + worker_id``. ``sample_seed``: per-sample seeding's base seed at start (None:
    off; ``Reseed`` changes it). ``random_watch``: thread workers' ``GlobalDrawWatch``
    (``_host/random_watch.py``). ``datapipe``: what each worker applies to its copy of a
    datapipe graph before ``init_fn`` (``_order/datapipes.py``)."""

    num_workers: int
    dataset: Any
    is_iterable: bool
    auto_collation: bool
    collate_fn: Callable[[Any], Any] | None
    drop_last: bool
    region: Any
    base_seed: int
    init_fn: Callable[[int], None] | None
    sample_seed: int | None
    rank: int
    world_size: int
    random_watch: Any = None
    datapipe: PipeSetup | None = None


# -- the channels they travel on ---------------------------------------------------------------
class ThreadChannel:
    """A thread worker's end: its own task queue, and the results queue all workers share."""

    def __init__(self, worker_id: int, results: queue.SimpleQueue[tuple[int, ToMain]]) -> None:
        self.worker_id = worker_id
        self.tasks: queue.SimpleQueue[ToWorker] = queue.SimpleQueue()
        self.results = results

    def recv(self, timeout: float) -> ToWorker:
        return self.tasks.get(timeout=timeout) if timeout > 0 else self.tasks.get_nowait()

    def waiting(self) -> bool:
        return not self.tasks.empty()

    def send(self, msg: ToMain) -> None:
        self.results.put((self.worker_id, msg))


class ProcessChannel:
    """A process worker's end of its duplex pipe."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.poller = select.poll()  # made once: Connection.poll builds a selector per call
        self.poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)

    def recv(self, timeout: float) -> ToWorker:
        if not self.poller.poll(int(timeout * 1000)):
            raise TimeoutError
        msg = self.conn.recv()
        if type(msg) is UsePlan and isinstance(msg.plan.perm, SharedPerm):
            msg.plan.perm = self._shared_perm(msg.plan.perm)
        return msg

    def _shared_perm(self, shared: SharedPerm) -> Any:
        """A plan's ``perm`` rebuilt on the shared memory whose descriptor follows its message
        on this connection (NOTE [ Plans without a sharing thread ] in ``pool.py``)."""
        with socket.fromfd(self.conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            fd = recvfds(sock, 1)[0]
        try:
            storage = torch.UntypedStorage._new_shared_fd_cpu(  # type: ignore[attr-defined]
                fd, shared.nbytes)
        finally:
            os.close(fd)  # the storage keeps its own
        return torch.empty(0, dtype=shared.dtype).set_(
            storage, shared.offset, (shared.numel,), (shared.stride,))

    def waiting(self) -> bool:
        """Something (a message, or EOF) can be read now."""
        return bool(self.poller.poll(0))

    def send(self, msg: ToMain) -> None:
        self.conn.send(msg)
