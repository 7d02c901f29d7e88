"""Exact mid-epoch resume: the loader's bookkeeping, and setting its sampler up for a state.

The pieces (each module's docstring has the details):

- ``_state.py``: the ``state_dict()`` format, its checks, and what an iterable dataset provides;
- ``_delivery.py``: where an epoch starts and which batches reached the user
  (NOTE [ Delivery tracking ], NOTE [ Iterable resume ]);
- this module: :class:`Progress` (the loader's ``state_dict``/``load_state_dict``/``set_epoch``
  and each epoch's start delegate to it) and :func:`prepare_resume` (seek or replay the sampler).

The names of the other two are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from ._delivery import Delivered, DeliveryTracker, ResumePoint, WorkerStates, numbered
from ._sampler import SeededRandomSampler, ShardedSampler
from ._state import (
    STATE_VERSION,
    LoaderState,
    capture_state,
    check_state,
    make_state,
    require_resumable,
)

__all__ = [
    "GLOBAL_RNG",
    "STATE_VERSION",
    "Delivered",
    "DeliveryTracker",
    "LoaderState",
    "Progress",
    "ResumePoint",
    "WorkerStates",
    "capture_state",
    "check_state",
    "inner_sampler",
    "make_state",
    "numbered",
    "prepare_resume",
    "require_resumable",
    "sampler_state_of",
]


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
    if iterable:  # batches are counted, not numbered (NOTE [ Iterable resume ])
        return ResumePoint(epoch, done, (), seeked=True)
    point = ResumePoint(epoch, done, tuple(ahead))
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
        self.pending_dataset: WorkerStates | None = None
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
        if point is None:
            point, self.pending_dataset = ResumePoint(self.next_epoch(loader)), None
        self.epoch = point.epoch + 1
        self.sampler_state = sampler_state_of(sampler)
        self.tracker = DeliveryTracker(
            point, loader._index_sampler, direct=direct,
            iterable=isinstance(loader.dataset, IterableDataset), resumed=self.pending_dataset,
        )
        return self.tracker

    def current(self) -> DeliveryTracker:
        """The tracker of the epoch in progress (after the iterator began it)."""
        if self.tracker is None:
            raise RuntimeError("no epoch has started: iterate the loader first")
        return self.tracker

    def take_dataset_states(self) -> WorkerStates | None:
        """Where an iterable dataset's workers resume this epoch (once; after
        :meth:`begin_epoch`): each worker's state to load, and whose turn is first."""
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
            position = WorkerStates([None] * workers)
            if pending is not None and self.pending_dataset is not None:
                position = self.pending_dataset
            elif pending is None and tracker is not None:
                position = tracker.dataset_states(workers)
            dataset_state = {
                "num_workers": workers, "workers": list(position.states),
                "next_worker": position.next_worker,
            }
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
            self.pending_dataset = WorkerStates(
                list(dataset_state["workers"]), dataset_state.get("next_worker", 0)
            )
