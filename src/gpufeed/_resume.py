"""Loader state for exact mid-epoch resume: the format, its checks, and how to skip.

The state counts batches *delivered to the user*, never those fetched or prefetched, so a resume
continues with exactly the next batch the user would have seen, whatever ``num_workers``,
``worker_type`` or prefetch depth either run used. It is a dict of plain Python values, so
``torch.save`` / ``torch.load(weights_only=True)`` round-trip it::

    {"version": 1,
     "epoch": 3,                 # epoch in progress (the next one if the last was exhausted)
     "batches_delivered": 17,    # batches 0..16 of that epoch's plan were handed to the user
     "delivered_ahead": [19],    # later batch numbers already handed out (in_order=False only)
     "batch_size": 8,            # None without automatic batching
     "seed": 1234,               # base seed of shuffles and per-sample random state
     "dataset_len": 1000,        # None for iterable datasets
     "world_size": 2, "rank": 0,
     "num_workers": 2,           # only binding for iterable datasets (their shards depend on it)
     "sampler_state": None,      # a user sampler's own state_dict() at the start of the epoch
     "dataset_state": None}      # iterable datasets: {"num_workers": W, "workers": [state|None]}

NOTE [ Delivery tracking ]: the host iterator numbers the batches of an epoch by their position in
the batch plan and calls :meth:`DeliveryTracker.produced` as it hands each one on; whatever is
outermost (the host iterator itself, or the device stage wrapped in :class:`Delivered`) calls
:meth:`DeliveryTracker.delivered` when the user receives one. Stages between the two are FIFO, so
the oldest produced batch is the one delivered.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, TypedDict, TypeVar

import torch
from torch.utils.data import (
    BatchSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from ._sampler import SeededRandomSampler, ShardedSampler

__all__ = [
    "GLOBAL_RNG",
    "STATE_VERSION",
    "Delivered",
    "DeliveryTracker",
    "LoaderState",
    "Progress",
    "ResumePoint",
    "capture_state",
    "check_state",
    "inner_sampler",
    "make_state",
    "numbered",
    "prepare_resume",
    "require_resumable",
    "sampler_state_of",
]

STATE_VERSION = 1
T = TypeVar("T")


class LoaderState(TypedDict):
    """The loader's ``state_dict()`` (see the module docstring for each field)."""

    version: int
    epoch: int
    batches_delivered: int
    delivered_ahead: list[int]
    batch_size: int | None
    seed: int | None
    dataset_len: int | None
    world_size: int
    rank: int
    num_workers: int
    sampler_state: Any
    dataset_state: Any


def make_state(
    *,
    epoch: int,
    batches_delivered: int,
    delivered_ahead: Iterable[int] = (),
    batch_size: int | None,
    seed: int | None,
    dataset_len: int | None,
    world_size: int,
    rank: int,
    num_workers: int,
    sampler_state: Any = None,
    dataset_state: Any = None,
) -> LoaderState:
    """Build a state dict of plain Python values."""
    return {
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "batches_delivered": int(batches_delivered),
        "delivered_ahead": sorted(int(n) for n in delivered_ahead),
        "batch_size": batch_size,
        "seed": seed,
        "dataset_len": dataset_len,
        "world_size": int(world_size),
        "rank": int(rank),
        "num_workers": int(num_workers),
        "sampler_state": sampler_state,
        "dataset_state": dataset_state,
    }


def _mismatch(key: str, saved: Any, now: Any, fix: str) -> ValueError:
    return ValueError(
        f"cannot resume: the state was saved with {key}={saved!r} but this loader has "
        f"{key}={now!r}; {fix}"
    )


def check_state(
    state: Mapping[str, Any],
    *,
    dataset_len: int | None,
    world_size: int,
    rank: int,
    batch_size: int | None,
    num_workers: int,
) -> LoaderState:
    """Validate a state against the loader that loads it; return it as a :class:`LoaderState`.

    Raises ``ValueError`` naming the saved and the current value when the version, dataset
    length, world size, rank or batch size differ (and ``num_workers`` for iterable datasets,
    whose shards depend on it): resuming across those would silently mix up samples.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict from loader.state_dict(), got {type(state)!r}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"unsupported loader state version {state.get('version')!r} (this gpufeed reads "
            f"version {STATE_VERSION}); pass a dict made by gpufeed's loader.state_dict()"
        )
    missing = sorted(set(LoaderState.__annotations__) - set(state))
    if missing:
        raise ValueError(f"loader state is missing keys {missing}; was it edited or truncated?")
    for key in ("epoch", "batches_delivered"):
        if not isinstance(state[key], int) or state[key] < 0:
            raise ValueError(f"loader state {key} must be an int >= 0, got {state[key]!r}")
    fix = "resume with the same dataset and loader settings, or start without the state"
    if state["dataset_len"] != dataset_len:
        raise _mismatch("dataset_len", state["dataset_len"], dataset_len, fix)
    if state["world_size"] != world_size:
        raise _mismatch(
            "world_size", state["world_size"], world_size,
            "launch the same number of ranks (each rank loads the state it saved)",
        )
    if state["rank"] != rank:
        raise _mismatch("rank", state["rank"], rank, "load the state file this rank saved")
    if state["batch_size"] != batch_size:
        raise _mismatch("batch_size", state["batch_size"], batch_size, fix)
    if state["dataset_state"] is not None and state["num_workers"] != num_workers:
        raise _mismatch(
            "num_workers", state["num_workers"], num_workers,
            "an iterable dataset is sharded per worker, so resume it with the same num_workers",
        )
    return dict(state)  # type: ignore[return-value]


class ResumePoint(NamedTuple):
    """Where the next ``__iter__`` starts: :func:`prepare_resume`, or ``ResumePoint(epoch)``.

    Attributes:
        epoch: the epoch to run (seeds per-sample random state; the loader's epoch counter).
        done: batches ``0 .. done-1`` of its plan were delivered already.
        ahead: later batch numbers delivered already (``in_order=False`` only).
        seeked: the sampler itself starts at batch ``done`` (nothing to drop from the plan).
    """

    epoch: int
    done: int = 0
    ahead: tuple[int, ...] = ()
    seeked: bool = False


def prepare_resume(
    state: LoaderState, *, index_sampler: Any, num_batches: int | None, iterable: bool = False
) -> ResumePoint:
    """Set the sampler up for ``state`` and say where the next ``__iter__`` starts.

    ``index_sampler`` is the loader's ``_index_sampler`` (its batch sampler, or its sampler
    without automatic batching). gpufeed's own samplers seek directly (the permutation is
    regenerated, nothing is fetched). Other samplers get their epoch-start state back
    (:func:`sampler_state_of`) and ``set_epoch`` if they have it, and the iterator draws and
    drops ``done`` batches of indices (:func:`numbered`). Iterable datasets resume through
    their own state (``iterable=True``). A state taken after the epoch's last batch
    (``num_batches`` known and reached) rolls over to the start of the next epoch.
    """
    epoch, done, ahead = state["epoch"], state["batches_delivered"], state["delivered_ahead"]
    if num_batches is not None:
        if done > num_batches:
            raise ValueError(
                f"loader state says {done} batches of epoch {epoch} were delivered but this "
                f"loader's epoch has only {num_batches}; resume with the same batch_size, "
                "drop_last and sampler"
            )
        if done == num_batches:
            epoch, done, ahead = epoch + 1, 0, []
    point = ResumePoint(epoch, done, tuple(ahead))
    if iterable:
        return point._replace(seeked=True)
    sampler = inner_sampler(index_sampler)
    _restore_sampler(sampler, state["sampler_state"])
    if _ours(sampler):
        if index_sampler is sampler:
            sampler.seek(epoch, done)
            return point._replace(seeked=True)
        if type(index_sampler) is BatchSampler:
            sampler.seek(epoch, done * index_sampler.batch_size)
            return point._replace(seeked=True)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return point


def inner_sampler(index_sampler: Any) -> Any:
    """The sampler that orders an epoch: a ``BatchSampler``'s sampler, else the object itself."""
    return index_sampler.sampler if isinstance(index_sampler, BatchSampler) else index_sampler


_STOCK_RANDOM = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
GLOBAL_RNG: Any = "<drawn from torch's global RNG>"  # sampler state that cannot be saved


def sampler_state_of(sampler: Any) -> Any:
    """What restores ``sampler`` to the start of an epoch; take it when the epoch starts.

    A sampler's own ``state_dict()``; for torch's random samplers, their generator's state (as a
    list of ints), or :data:`GLOBAL_RNG` when they draw from torch's global RNG, which cannot
    be restored; ``None`` for gpufeed's samplers (they seek) and deterministic samplers.
    """
    if _ours(sampler):
        return None
    state_dict = getattr(sampler, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    if isinstance(sampler, _STOCK_RANDOM):
        if sampler.generator is None:
            return GLOBAL_RNG
        return {"generator_state": sampler.generator.get_state().tolist()}
    return None


def _restore_sampler(sampler: Any, state: Any) -> None:
    if state is None:
        return
    if isinstance(sampler, _STOCK_RANDOM) and isinstance(state, dict) and (
        sampler.generator is not None and "generator_state" in state
    ):
        sampler.generator.set_state(torch.tensor(state["generator_state"], dtype=torch.uint8))
    elif hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(state)


def numbered(plan: Iterable[T], point: ResumePoint) -> Iterator[tuple[int, T]]:
    """``(batch_number, indices)`` of the batches still to deliver in ``point.epoch``.

    Unless the sampler seeked, the first ``point.done`` items of ``plan`` are drawn and dropped
    (indices only: no data is fetched); numbers in ``point.ahead`` are dropped too. Numbers are
    positions in the whole epoch. Raises ``ValueError`` when the plan is too short (the state
    belongs to a different configuration).
    """
    iterator = iter(plan)
    skip = 0 if point.seeked else point.done
    for dropped in range(skip):
        if next(iterator, _END) is _END:
            raise ValueError(
                f"cannot skip {skip} batches: the batch plan ended after {dropped}; the state "
                "belongs to a loader with another dataset, batch_size or sampler"
            )
    excluded = set(point.ahead)
    for number, item in enumerate(iterator, start=point.done):
        if number not in excluded:
            yield number, item


_END: Any = object()


def require_resumable(dataset: Any) -> None:
    """Raise ``TypeError`` naming the class when an iterable dataset has no ``state_dict`` and
    ``load_state_dict``: gpufeed cannot know where such a stream stood."""
    if isinstance(dataset, IterableDataset) and not (
        hasattr(dataset, "state_dict") and hasattr(dataset, "load_state_dict")
    ):
        raise TypeError(
            f"cannot save the position of {type(dataset).__name__}: an IterableDataset is resumed "
            "through its own state_dict() and load_state_dict(state) methods, which it lacks; "
            "add them (returning plain Python values), or use a map-style Dataset"
        )


def capture_state(dataset: Any) -> Any:
    """Worker side, after each batch: the iterable dataset's ``state_dict()``, else ``None``.

    It runs once per batch, so a dataset's ``state_dict`` must be cheap (a few counters). Thread
    workers share one dataset object: its state must then be kept per worker (keyed by
    ``get_worker_info().id``); process workers each have their own copy.
    """
    if isinstance(dataset, IterableDataset) and hasattr(dataset, "state_dict"):
        return dataset.state_dict()
    return None


class DeliveryTracker:
    """Which batches of one epoch the user has received (NOTE [ Delivery tracking ]).

    Args:
        point: where the epoch starts.
        plan: the loader's index sampler; :attr:`indices` draws from it what is still to fetch
            (see :func:`numbered`). Loaders that slice an order themselves start at
            ``point.done`` and skip ``point.ahead``.
        direct: the host iterator is outermost, so a produced batch is delivered at once;
            ``False`` when a device stage wrapped in :class:`Delivered` sits in between.

    Every call is O(1) amortised; out-of-order numbers (``in_order=False``) wait in a set until
    the contiguous prefix reaches them.
    """

    def __init__(
        self, point: ResumePoint, plan: Iterable[Any] = (), *, direct: bool = True
    ) -> None:
        self.point = point
        self.epoch = point.epoch
        self.prefix = point.done
        self.ahead = {n for n in point.ahead if n >= point.done}
        self.direct = direct
        self.finished = False
        self.worker_states: dict[int, Any] = {}
        self._in_flight: deque[tuple[int, Any]] = deque()
        self._numbers: list[int] = []
        self.indices: Iterator[Any] = self._draw(numbered(plan, point))
        self._advance()

    def _draw(self, plan: Iterator[tuple[int, Any]]) -> Iterator[Any]:
        for number, item in plan:
            self._numbers.append(number)
            yield item

    def produced_nth(self, k: int, worker_state: tuple[int, Any] | None = None) -> None:
        """:meth:`produced` for the iterator's ``k``-th batch of the epoch (0-based): the
        ``k``-th drawn from :attr:`indices`, or, for a loader that slices an order itself
        without drawing, batch ``point.done + k``."""
        number = self._numbers[k] if k < len(self._numbers) else self.point.done + k
        self.produced(number, worker_state)

    def produced(self, batch_number: int, worker_state: tuple[int, Any] | None = None) -> None:
        """Host side: batch ``batch_number`` (its position in the epoch's plan) leaves the host
        iterator, with ``(worker_id, dataset.state_dict())`` for iterable datasets."""
        self._in_flight.append((batch_number, worker_state))
        if self.direct:
            self.delivered()

    def delivered(self) -> None:
        """User side: the oldest produced batch has reached the user."""
        number, worker_state = self._in_flight.popleft()
        if worker_state is not None:
            self.worker_states[worker_state[0]] = worker_state[1]
        if number == self.prefix:
            self.prefix += 1
            self._advance()
        else:
            self.ahead.add(number)

    def host_exhausted(self) -> None:
        """The host iterator raised ``StopIteration`` (ends the epoch only when ``direct``)."""
        if self.direct:
            self.finished = True

    def user_exhausted(self) -> None:
        """The user saw ``StopIteration``: the epoch is over."""
        self.finished = True

    def _advance(self) -> None:
        while self.prefix in self.ahead:
            self.ahead.discard(self.prefix)
            self.prefix += 1

    def position(self) -> tuple[int, int, list[int]]:
        """``(epoch, batches_delivered, delivered_ahead)`` for the state; a finished epoch
        reads as the start of the next one."""
        if self.finished:
            return self.epoch + 1, 0, []
        return self.epoch, self.prefix, sorted(self.ahead)

    def dataset_states(self, workers: int) -> list[Any]:
        """Per-worker states of an iterable dataset, as of each worker's last delivered batch
        (all ``None`` once the epoch is over: the next one starts afresh)."""
        if self.finished:
            return [None] * workers
        return [self.worker_states.get(w) for w in range(workers)]


class Delivered(Iterator[T]):
    """Wrap the outermost iterator (e.g. the device stage) to report deliveries to a tracker.

    Forwards ``len()``, ``close()`` and any other attribute to the wrapped iterator.
    """

    def __init__(self, inner: Iterator[T], tracker: DeliveryTracker) -> None:
        self.inner = inner
        self.tracker = tracker

    def __next__(self) -> T:
        try:
            item = next(self.inner)
        except StopIteration:
            self.tracker.user_exhausted()
            raise
        self.tracker.delivered()
        return item

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _ours(sampler: Any) -> bool:
    return isinstance(sampler, (ShardedSampler, SeededRandomSampler))


def _len(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


class Progress:
    """One loader's resume bookkeeping; the loader's ``state_dict``/``load_state_dict`` and each
    epoch's start delegate here.

    ``loader`` arguments need: ``dataset``, ``sampler``, ``batch_sampler``, ``_index_sampler``,
    ``batch_size``, ``num_workers``, ``seed``, ``rank`` and ``world_size``.
    """

    def __init__(self) -> None:
        self.epoch = 0  # next epoch, for samplers that do not count their own
        self.pending: ResumePoint | None = None  # a loaded state, for the next __iter__
        self.pending_dataset: list[Any] | None = None
        self.tracker: DeliveryTracker | None = None
        self.sampler_state: Any = None

    def next_epoch(self, loader: Any) -> int:
        sampler = inner_sampler(loader._index_sampler)
        return int(sampler.epoch) if _ours(sampler) else self.epoch

    def set_epoch(self, loader: Any, epoch: int) -> None:
        """``loader.set_epoch``: the epoch of the next ``__iter__`` (drops a loaded state)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.pending = self.pending_dataset = None
        sampler = inner_sampler(loader._index_sampler)
        if _ours(sampler):
            sampler.set_epoch(epoch)
        self.epoch = epoch

    def begin_epoch(self, loader: Any, *, direct: bool) -> DeliveryTracker:
        """Called once per epoch by the iterator; draw indices from ``tracker.indices``."""
        point, self.pending = self.pending, None
        sampler = inner_sampler(loader._index_sampler)
        if point is not None and _ours(sampler) and sampler.epoch != point.epoch:
            point = None  # sampler.set_epoch() chose another epoch after the load: start it
        point = point or ResumePoint(self.next_epoch(loader))
        self.epoch = point.epoch + 1
        self.sampler_state = sampler_state_of(sampler)
        self.tracker = DeliveryTracker(point, loader._index_sampler, direct=direct)
        return self.tracker

    def current(self) -> DeliveryTracker:
        """The tracker of the epoch in progress (after the iterator began it)."""
        if self.tracker is None:
            raise RuntimeError("no epoch has started: iterate the loader first")
        return self.tracker

    def take_dataset_states(self) -> list[Any] | None:
        """Per-worker states to load into an iterable dataset before this epoch (once)."""
        states, self.pending_dataset = self.pending_dataset, None
        return states

    def state_dict(self, loader: Any) -> LoaderState:
        if self.sampler_state is GLOBAL_RNG:
            raise ValueError(
                "cannot save the loader's position: its shuffle is drawn from torch's global "
                "random generator, which a resumed run cannot replay; construct the DataLoader "
                "with seed=<int> (or generator=torch.Generator().manual_seed(<int>))"
            )
        pending, tracker = self.pending, self.tracker
        if pending is not None:
            epoch, done, ahead = pending.epoch, pending.done, list(pending.ahead)
        elif tracker is not None:
            epoch, done, ahead = tracker.position()
        else:
            epoch, done, ahead = self.next_epoch(loader), 0, []
        dataset_state = None
        if isinstance(loader.dataset, IterableDataset):
            require_resumable(loader.dataset)
            workers = max(loader.num_workers, 1)
            states = [None] * workers
            if pending is not None and self.pending_dataset is not None:
                states = list(self.pending_dataset)
            elif pending is None and tracker is not None:
                states = tracker.dataset_states(workers)
            dataset_state = {"num_workers": workers, "workers": states}
        return make_state(
            epoch=epoch, batches_delivered=done, delivered_ahead=ahead,
            batch_size=loader.batch_size, seed=loader.seed,
            dataset_len=None if isinstance(loader.dataset, IterableDataset)
            else _len(loader.dataset),
            world_size=loader.world_size, rank=loader.rank, num_workers=loader.num_workers,
            sampler_state=self.sampler_state, dataset_state=dataset_state,
        )

    def load_state_dict(self, loader: Any, state: Mapping[str, Any]) -> None:
        iterable = isinstance(loader.dataset, IterableDataset)
        checked = check_state(
            state, dataset_len=None if iterable else _len(loader.dataset),
            world_size=loader.world_size, rank=loader.rank, batch_size=loader.batch_size,
            num_workers=loader.num_workers,
        )
        sampler = inner_sampler(loader._index_sampler)
        if checked["seed"] is not None:
            loader.seed = checked["seed"]
            if _ours(sampler):
                sampler.seed = checked["seed"]
        point = prepare_resume(
            checked, index_sampler=loader._index_sampler,
            num_batches=None if iterable else _len(loader._index_sampler), iterable=iterable,
        )
        self.pending, self.epoch, self.tracker = point, point.epoch, None
        self.sampler_state = checked["sampler_state"]
        dataset_state = checked["dataset_state"]
        self.pending_dataset = None
        if dataset_state is not None and point.epoch == checked["epoch"]:
            self.pending_dataset = list(dataset_state["workers"])
