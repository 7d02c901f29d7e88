"""Where a loaded state resumes, for ``_order/resume.py``'s ``LoaderPosition``: a
``ResumePoint`` for the next ``__iter__`` with the sampler set up for it (NOTE [ Rewinding
samplers ] in ``_order/rewind.py``), and what a later ``set_epoch`` makes of it.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from .delivery import ResumePoint
from .plan import advance_as_randperm, finish_plan, plannable
from .rewind import EPOCH_SEED, UNREWINDABLE, draws_epoch_seed, inner_sampler, is_ours
from .state import LoaderState


def prepare_resume(
    state: LoaderState, *, index_sampler: Any, num_batches: int | None, iterable: bool = False
) -> ResumePoint:
    """Set the loader's ``_index_sampler`` up for ``state`` and say where the next
    ``__iter__`` starts.

    gpufeed's own samplers seek (the permutation is regenerated, nothing is fetched). Others
    get their epoch-start state back when the epoch starts and ``set_epoch`` if they have it,
    and the iterator draws and drops ``done`` batches of indices (``delivery.numbered``).
    Iterable datasets resume through their own state. A state taken after the epoch's last
    batch (``num_batches`` known and reached) rolls over to the start of the next epoch.
    """
    epoch, done, ahead = state["epoch"], state["batches_delivered"], state["delivered_ahead"]
    rolled = False
    if num_batches is not None:
        if done > num_batches:
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
    advancing by itself: gpufeed's samplers count the calls (they also advance when
    iterated); torch's ``DistributedSampler`` changes its ``epoch`` only there. None for
    others."""
    if is_ours(sampler):
        return int(sampler.set_epoch_calls)
    kind = type(sampler)
    if isinstance(sampler, DistributedSampler) and kind.__iter__ is DistributedSampler.__iter__ \
            and kind.set_epoch is DistributedSampler.set_epoch:
        return int(sampler.epoch)
    return None


def after_set_epoch(point: ResumePoint, chosen: int, index_sampler: Any) -> ResumePoint | None:
    """A loaded ``point`` once ``set_epoch(chosen)`` ran after the load: kept for its own
    epoch; for the epoch it rolled over from (the usual resume loop restarts at the epoch it
    saved), that epoch's empty rest; for any other, None (that epoch starts afresh)."""
    if chosen == point.epoch:
        return point
    if not (point.rolled and chosen == point.epoch - 1):
        return None
    sampler = inner_sampler(index_sampler)
    if is_ours(sampler):  # gpufeed's samplers slice their order themselves
        sampler.seek(chosen, len(sampler))
    return ResumePoint(chosen, len(index_sampler), seeked=is_ours(sampler))
