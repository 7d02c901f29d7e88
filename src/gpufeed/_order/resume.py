"""Exact mid-epoch resume: :class:`LoaderPosition`, the loader's bookkeeping, and where a
loaded state resumes (:func:`prepare_resume`, the sampler set up as NOTE [ Rewinding samplers ]
in ``_order/rewind.py`` says; :func:`after_set_epoch`, after a later ``set_epoch``).

The ``state_dict()`` format and its checks (``_order/state.py``) and the delivered batches
(``_order/delivery.py``) are re-exported here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset, RandomSampler

from .delivery import Delivered, DeliveryTracker, ResumePoint, WorkerStates, numbered
from .plan import advance_as_randperm, finish_plan, plannable
from .rewind import (
    EPOCH_SEED,
    UNREWINDABLE,
    EpochSeed,
    draws_epoch_seed,
    inner_sampler,
    is_ours,
    order_of,
    restore_sampler,
    sampler_state_of,
    state_after_base_seed,
)
from .sample_rng import RandomStateWarning
from .state import (
    STATE_VERSION,
    LoaderState,
    capture_state,
    check_state,
    make_state,
    unresumable,
)

__all__ = [
    "STATE_VERSION",
    "Delivered",
    "DeliveryTracker",
    "LoaderPosition",
    "LoaderState",
    "LoaderView",
    "ResumePoint",
    "WorkerStates",
    "capture_state",
    "check_state",
    "inner_sampler",
    "make_state",
    "numbered",
    "prepare_resume",
    "sampler_state_of",
    "unresumable",
]

log = logging.getLogger("gpufeed")


class LoaderView(Protocol):
    """What :class:`LoaderPosition` reads of its ``gpufeed.DataLoader``, handed in per call:
    it keeps no reference and writes nothing back (a loaded seed is returned)."""

    dataset: Any
    batch_size: int | None
    num_workers: int
    seed: int | None
    deterministic: bool  # per-sample random state (with seed)

    @property
    def _index_sampler(self) -> Any: ...  # its batch sampler, or its sampler without batching
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    # the generator the next iter()'s new iterator draws its base seed from (None: no draw)
    def _next_base_seed_generator(self) -> torch.Generator | None: ...


class LoaderPosition:
    """Where one loader stands: the epoch, a loaded state waiting for the next ``__iter__``, and
    the delivered batches of the epoch in progress. The loader's ``state_dict``,
    ``load_state_dict`` and ``set_epoch`` and each epoch's start delegate here."""

    def __init__(self) -> None:
        self.epoch = 0  # next epoch, for samplers that do not count their own
        self.pending: ResumePoint | None = None  # a loaded state, for the next __iter__
        self.pending_dataset: WorkerStates | None = None
        self.tracker: DeliveryTracker | None = None
        self.sampler_state: Any = None  # sampler_state of the epoch in progress
        self.warned = False  # the "cannot be rewound" warning was given
        self.warned_random = False  # the "random transforms are not replayed" one
        # the epoch in progress began from a loaded state: that point, its sampler's
        # set_epoch_mark then, and the epoch it runs (see set_epoch_came_late)
        self.loaded: tuple[ResumePoint, int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """A copied loader starts its next epoch afresh: the epoch in progress stays here."""
        state = dict(self.__dict__)
        state["tracker"] = None
        return state

    def next_epoch(self, index_sampler: Any) -> int:
        sampler = inner_sampler(index_sampler)
        return int(sampler.epoch) if is_ours(sampler) else self.epoch

    def set_epoch(self, loader: LoaderView, epoch: int) -> None:
        """The epoch of the next ``__iter__``; a loaded state is kept for its own epoch only
        (:func:`after_set_epoch`)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        sampler = inner_sampler(loader._index_sampler)
        if is_ours(sampler):
            sampler.set_epoch(epoch)
        if self.pending is not None:
            self.pending = after_set_epoch(self.pending, epoch, loader._index_sampler)
        if self.pending is None:
            self.pending_dataset = None
        self.epoch = epoch

    def begin_epoch(
        self, index_sampler: Any, *, iterable: bool, direct: bool,
        base_seed_of: Callable[[], Any] | None = None,
    ) -> DeliveryTracker:
        """Called once per epoch by the iterator, after its base seed; indices come from
        ``tracker.indices``. ``direct``: no device stage follows; ``base_seed_of``: draws a
        new iterator's base seed after a replayed epoch (no persistent workers)."""
        point, self.pending = self.pending, None
        sampler = inner_sampler(index_sampler)
        chosen = chosen_epoch(sampler)  # the sampler's set_epoch() after the load
        loaded, mark = point, set_epoch_mark(sampler)
        if point is not None and chosen is not None:
            point = after_set_epoch(point, chosen, index_sampler)
        if point is not None and point.sampler_state is not None:
            restore_sampler(sampler, point.sampler_state)
            if point.replay:
                replay_epoch(index_sampler, point.epoch - 1)
                if base_seed_of is not None:  # the run that saved it began a new iterator
                    base_seed_of()
        if point is None:
            point, self.pending_dataset = ResumePoint(self.next_epoch(index_sampler)), None
        self.loaded = None if loaded is None or mark is None else (loaded, mark, point.epoch)
        self.epoch = point.epoch + 1
        self.sampler_state = None if iterable else sampler_state_of(sampler)
        plan, epoch_seed = index_sampler, None
        if draws_epoch_seed(sampler):  # NOTE [ Rewinding samplers ], case 4
            epoch_seed = EpochSeed(point.epoch_seed, self._record_epoch_seed)
            plan = epoch_seed.plan(plan, sampler)
        self.tracker = DeliveryTracker(
            point, plan, direct=direct, iterable=iterable, resumed=self.pending_dataset,
        )
        self.tracker.epoch_seed = epoch_seed
        return self.tracker

    def set_epoch_came_late(self, index_sampler: Any) -> bool:
        """Whether this epoch began from a loaded state and its sampler's ``set_epoch`` ran
        since, to another epoch (where ``set_epoch_mark`` tells), as in Lightning's fit loop:
        ``load_state_dict``, ``iter()``, ``set_epoch`` (the next epoch after one cut short by
        ``limit_train_batches``). An iterator that delivered nothing then starts again
        (:meth:`reload`), as one made after the call would."""
        if self.loaded is None:
            return False
        sampler = inner_sampler(index_sampler)
        _, mark, running = self.loaded
        return set_epoch_mark(sampler) != mark and chosen_epoch(sampler) != running

    def reload(self) -> None:
        """Put the loaded state back for the next :meth:`begin_epoch`."""
        if self.loaded is not None:
            self.pending, self.loaded = self.loaded[0], None

    def _record_epoch_seed(self, seed: int) -> None:
        self.sampler_state = {EPOCH_SEED: seed}

    def current(self) -> DeliveryTracker:
        """The tracker of the epoch in progress (after the iterator began it)."""
        if self.tracker is None:
            raise RuntimeError("no epoch has started: iterate the loader first")
        return self.tracker

    def take_dataset_states(self) -> WorkerStates | None:
        """Where an iterable dataset's workers resume this epoch (once, after begin_epoch)."""
        states, self.pending_dataset = self.pending_dataset, None
        return states

    def state_dict(self, loader: LoaderView) -> LoaderState:
        pending, tracker, sampler_state = self.pending, self.tracker, self.sampler_state
        iterable = isinstance(loader.dataset, IterableDataset)
        if pending is not None:
            epoch, done, ahead = pending.epoch, pending.done, list(pending.ahead)
        elif tracker is not None and not tracker.finished:
            epoch, done, ahead = tracker.position()
            # The epoch's seed, drawn now if no batch was asked yet (a loaded one: kept).
            if tracker.epoch_seed is not None:
                tracker.epoch_seed.seed()
                sampler_state = self.sampler_state
        else:  # at the start of an epoch: the sampler as it stands now starts it
            epoch, done, ahead = tracker.position() if tracker else (
                self.next_epoch(loader._index_sampler), 0, []
            )
            sampler_state = None if iterable else self._next_start(loader)
        if loader.seed is None or not loader.deterministic:
            self._random_not_replayed(loader, "loader.state_dict() was taken", "resuming from it")
        dataset_state, stream_lost = None, unresumable(loader.dataset)
        if stream_lost is not None:  # as an unrewindable sampler: the epoch restarts
            sampler_state = {UNREWINDABLE: stream_lost}
        lost = isinstance(sampler_state, dict) and UNREWINDABLE in sampler_state
        if lost and (done or ahead) and not self.warned:  # once per loader
            self.warned = True
            warnings.warn(
                f"loader.state_dict() at batch {done} of epoch {epoch} cannot be resumed "
                f"exactly: {sampler_state[UNREWINDABLE]}. Loading this state restarts the "
                "epoch from its first batch",
                stacklevel=3,
            )
        if iterable and stream_lost is None:
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
            dataset_len=None if iterable else length_or_none(loader.dataset),
            world_size=loader.world_size, rank=loader.rank, num_workers=loader.num_workers,
            sampler_state=sampler_state, dataset_state=dataset_state,
            order=None if iterable else order_of(loader._index_sampler),
        )

    @staticmethod
    def _next_start(loader: LoaderView) -> Any:
        """The sampler's state at the next epoch's first draw: one sharing the loader's
        generator gets there after the next iterator's base seed (NOTE [ Rewinding samplers ])."""
        sampler = inner_sampler(loader._index_sampler)
        state = sampler_state_of(sampler)
        generator = loader._next_base_seed_generator()
        shared = getattr(sampler, "generator", None) is generator
        if shared and isinstance(generator, torch.Generator) and isinstance(state, dict) and (
                "generator_state" in state):
            return {"generator_state": state_after_base_seed(generator)}
        return state

    def _random_not_replayed(self, loader: LoaderView, what: str, resume: str) -> None:
        """Say once per loader (map-style data: seed= does not cover iterable datasets) that a
        resume without per-sample seeds replays the order, not the random transforms. Where
        warnings are errors (pytest's ``filterwarnings = error``), a log record: frameworks
        checkpoint inside their loops, which must not fail for advice."""
        if self.warned_random or isinstance(loader.dataset, IterableDataset):
            return
        self.warned_random = True
        message = (
            f"{what} without seed= (or with deterministic=False): {resume} replays the order "
            "of the batches exactly, but not the random transforms drawn while fetching them "
            "(from torch's, numpy's or Python's generators, or gpufeed.random.sample_generator()), "
            "which come from the random state of the run that fetches them. Pass seed= to "
            "gpufeed.DataLoader for per-sample random state that a resume replays too"
        )
        try:
            warnings.warn(message, RandomStateWarning, stacklevel=4)
        except RandomStateWarning:
            log.warning("%s", message)

    def load_state_dict(self, loader: LoaderView, state: Mapping[str, Any]) -> int | None:
        """Check ``state`` against ``loader`` and set the sampler up for the next
        :meth:`begin_epoch`. Returns the state's seed (or ``None``) for the loader to take."""
        iterable = isinstance(loader.dataset, IterableDataset)
        checked = check_state(
            state, dataset_len=None if iterable else length_or_none(loader.dataset),
            world_size=loader.world_size, rank=loader.rank, batch_size=loader.batch_size,
            num_workers=loader.num_workers,
            order=None if iterable else order_of(loader._index_sampler),
        )
        seed = checked["seed"]
        if seed is None or not loader.deterministic:
            self._random_not_replayed(loader, "loader.load_state_dict() got a state saved",
                                      "this resume")
        point = prepare_resume(
            checked, index_sampler=loader._index_sampler, iterable=iterable,
            num_batches=None if iterable else length_or_none(loader._index_sampler),
        )
        sampler = inner_sampler(loader._index_sampler)
        if seed is not None and is_ours(sampler):
            # its order comes from (seed, epoch); set once the state proved resumable
            sampler.seed = seed
        self.pending, self.epoch, self.tracker = point, point.epoch, None
        self.sampler_state = checked["sampler_state"]
        if isinstance(self.sampler_state, dict) and EPOCH_SEED in self.sampler_state and (
            point.epoch_seed is None  # rolled over: the next epoch draws its own
        ):
            self.sampler_state = None
        dataset_state = checked["dataset_state"]
        self.pending_dataset = None
        if dataset_state is not None and point.epoch == checked["epoch"]:
            self.pending_dataset = WorkerStates(
                list(dataset_state["workers"]), dataset_state.get("next_worker", 0)
            )
        return seed


def prepare_resume(
    state: LoaderState, *, index_sampler: Any, num_batches: int | None, iterable: bool = False
) -> ResumePoint:
    """Set the loader's ``_index_sampler`` up for ``state``; where the next ``__iter__`` starts.

    gpufeed's own samplers seek (the permutation is regenerated, nothing is fetched). Others
    get their epoch-start state back when the epoch starts and ``set_epoch`` if they have it;
    the iterator draws and drops ``done`` batches of indices (``delivery.numbered``). Iterable
    datasets resume through their own state. A state taken after the epoch's last batch
    (``num_batches`` known and reached) rolls over to the start of the next epoch.
    """
    epoch, done, ahead = state["epoch"], state["batches_delivered"], state["delivered_ahead"]
    if num_batches is not None and done > num_batches:
        raise ValueError(
            f"loader state says {done} batches of epoch {epoch} were delivered but this "
            f"loader's epoch has only {num_batches}; resume with the same batch_size, "
            "drop_last and sampler"
        )
    rolled = done == num_batches
    if rolled:
        epoch, done, ahead = epoch + 1, 0, []
    sampler_state, epoch_seed = state["sampler_state"], None
    if isinstance(sampler_state, dict) and UNREWINDABLE in sampler_state:
        # An unrewindable sampler, or an iterable dataset without a state of its own.
        if done or ahead:
            warnings.warn(
                f"cannot resume epoch {epoch} at batch {done}: {sampler_state[UNREWINDABLE]}. "
                "The epoch restarts from its first batch, so the batches already delivered "
                f"({done + len(ahead)}) come again",
                stacklevel=4,
            )
            done, ahead = 0, []
        sampler_state = None
    if iterable:  # batches are counted, not numbered (NOTE [ Iterable resume ])
        return ResumePoint(epoch, done, (), seeked=True)
    sampler = inner_sampler(index_sampler)
    if isinstance(sampler_state, dict) and EPOCH_SEED in sampler_state:
        if epoch == state["epoch"]:  # a rolled-over state's next epoch draws its own seed
            if not draws_epoch_seed(sampler):
                raise ValueError(
                    "cannot resume: the state was saved by a loader that shuffled from torch's "
                    f"global random generator (shuffle=True without seed=), but this one orders "
                    f"its epochs with {type(sampler).__name__}; resume with the same shuffle, "
                    "sampler, generator and seed arguments"
                )
            epoch_seed = int(sampler_state[EPOCH_SEED])
        sampler_state = None
    # The sampler is put back, and a saved epoch delivered whole replayed (else the next epoch
    # would repeat its order), when the epoch starts: NOTE [ Rewinding samplers ].
    point = ResumePoint(epoch, done, tuple(ahead), epoch_seed=epoch_seed,
                        sampler_state=sampler_state,
                        replay=rolled and sampler_state is not None and not is_ours(sampler),
                        rolled=rolled)
    if is_ours(sampler) and (index_sampler is sampler or type(index_sampler) is BatchSampler):
        per_batch = 1 if index_sampler is sampler else index_sampler.batch_size
        sampler.seek(epoch, done * per_batch)
        return point._replace(seeked=True)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return point


def replay_epoch(index_sampler: Any, epoch: int) -> None:
    """Draw epoch ``epoch`` of ``index_sampler`` whole and drop it, as the run that saved it did
    (torch's ``RandomSampler``: the epoch's permutation and the closing one, unshuffled)."""
    sampler = inner_sampler(index_sampler)
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    if plannable(index_sampler) and type(sampler) is RandomSampler and (
            sampler.generator is not None):
        advance_as_randperm(sampler.generator, len(sampler.data_source))  # the epoch's order
        finish_plan(index_sampler)  # the draw that finds it exhausted
    else:
        for _ in index_sampler:
            pass
    if callable(set_epoch):
        set_epoch(epoch + 1)


def length_or_none(obj: Any) -> int | None:
    """``len(obj)``, or None where it has none."""
    try:
        return len(obj)
    except TypeError:
        return None


def chosen_epoch(sampler: Any) -> int | None:
    """The epoch a sampler with ``set_epoch`` was set to (gpufeed's, ``DistributedSampler``'s
    ``epoch``), or None where it does not say."""
    epoch = getattr(sampler, "epoch", None)
    if type(epoch) is int and callable(getattr(sampler, "set_epoch", None)):
        return epoch
    return None


def set_epoch_mark(sampler: Any) -> int | None:
    """What changes when ``sampler.set_epoch`` runs, where that can be told from the sampler
    advancing by itself: gpufeed's samplers count the calls (they also advance when iterated);
    ``DistributedSampler`` changes its ``epoch`` only there. None for others."""
    if is_ours(sampler):
        return int(sampler.set_epoch_calls)
    kind = type(sampler)
    if isinstance(sampler, DistributedSampler) and kind.__iter__ is DistributedSampler.__iter__ \
            and kind.set_epoch is DistributedSampler.set_epoch:
        return int(sampler.epoch)
    return None


def after_set_epoch(point: ResumePoint, chosen: int, index_sampler: Any) -> ResumePoint | None:
    """A loaded ``point`` after ``set_epoch(chosen)``: kept for its own epoch; for the epoch
    it rolled over from (a resume loop restarts at the epoch it saved), that epoch's empty
    rest; for any other, None (that epoch starts afresh)."""
    if chosen == point.epoch:
        return point
    if not (point.rolled and chosen == point.epoch - 1):
        return None
    sampler = inner_sampler(index_sampler)
    if is_ours(sampler):  # gpufeed's samplers slice their order themselves
        sampler.seek(chosen, len(sampler))
    return ResumePoint(chosen, len(index_sampler), seeked=is_ours(sampler))
