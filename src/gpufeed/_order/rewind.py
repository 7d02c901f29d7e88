"""Bringing a sampler back to a point of its epoch: what is recorded as the epoch starts, and
how a resume replays it.

NOTE [ Rewinding samplers ]: a resume must give the rest of the epoch exactly, so the state
holds what reproduces the epoch's order (``sampler_state``), taken as the epoch starts:

1. gpufeed's samplers: nothing; their order is a function of ``(seed, epoch)`` and they seek.
2. A sampler with ``state_dict()``/``load_state_dict()``: its own state.
3. torch's random samplers with a ``generator``: the generator's state (a list of ints).
4. torch's ``RandomSampler`` on torch's global generator (``shuffle=True`` without ``seed=``)
   draws one seed per epoch from it, at its first index, and shuffles with a generator seeded
   by it. gpufeed makes that draw itself, with the same call at the same moment (the order
   stays the stock one, bit for bit), hands the sampler a generator seeded by it, and records
   ``{"epoch_seed": seed}``, which a resume shuffles from again (:class:`EpochSeed`). Later
   epochs draw afresh from the resumed run's generator, as in torch.
5. Samplers whose order is fixed or a function of the epoch (``SequentialSampler``, a list or
   range of indices, ``DistributedSampler``, anything with ``set_epoch``): nothing; the resume
   calls ``set_epoch`` and draws and drops the delivered batches' indices.
6. Anything else cannot be rewound (a user sampler of unknown order, ``SubsetRandomSampler`` or
   ``WeightedRandomSampler`` on the global generator). ``state_dict()`` still succeeds (a loader
   that iterates can always be checkpointed), with ``{"unrewindable": reason}``, and warns
   once; loading such a mid-epoch state restarts that epoch, with a warning saying why.

Where the state stands (cases 2 and 3): right before the epoch's first draw, after the base
seed a new iterator draws for its workers (torch's order: base seed, then the sampler; with
``shuffle=True, generator=g`` both come from ``g``). A resume puts it back there when the
resumed epoch starts (``LoaderPosition.begin_epoch``), not at ``load_state_dict``: the new
iterator's base seed comes first, whether or not the saved epoch had one (a persistent
iterator's later epochs draw none). Taken between epochs, it holds where the next epoch's first
draw will find the generator (past the next base seed, drawn from a copy). Taken after an
epoch's last batch, its iterator not run out, it rolls over to the next epoch: the restored
sampler draws the saved epoch whole once more (``RandomSampler``: its permutation and the
closing one) and, where each epoch gets a new iterator, one base seed, as the saving run did.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from .sampler import SeededRandomSampler, ShardedSampler

EPOCH_SEED = "epoch_seed"
UNREWINDABLE = "unrewindable"
_STOCK_RANDOM = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
_FIXED_ORDER = (SequentialSampler, DistributedSampler, range, Sequence)


def inner_sampler(index_sampler: Any) -> Any:
    """The sampler that orders an epoch: a ``BatchSampler``'s sampler, else the object itself
    (also a ``BatchSampler`` subclass without one, as Accelerate's ``SkipBatchSampler``)."""
    if isinstance(index_sampler, BatchSampler):
        return getattr(index_sampler, "sampler", index_sampler)
    return index_sampler


def is_ours(sampler: Any) -> bool:
    return isinstance(sampler, (ShardedSampler, SeededRandomSampler))


def order_of(index_sampler: Any) -> str:
    """What orders a map-style loader's epochs, in a few words a state keeps (loaded under
    another order, its delivered batches would name other samples); not the seeds it holds
    otherwise (``seed=``, a generator's)."""
    sampler = inner_sampler(index_sampler)
    # a plain iterable of indices (a list, an iterator) says nothing of its order
    name = type(sampler).__name__ if isinstance(sampler, Sampler) else "indices"
    if isinstance(sampler, DistributedSampler):  # gpufeed's sharded sampler is one
        name += (f"(num_replicas={sampler.num_replicas}, shuffle={sampler.shuffle}, "
                 f"drop_last={sampler.drop_last}"
                 + ("" if is_ours(sampler) else f", seed={sampler.seed}") + ")")
    elif isinstance(sampler, RandomSampler):
        name += (f"(replacement={sampler.replacement}, generator="
                 + ("global" if sampler.generator is None and not is_ours(sampler) else "own")
                 + ")")
    if index_sampler is not sampler and type(index_sampler) is not BatchSampler:
        kind = type(index_sampler).__name__ if isinstance(index_sampler, Sampler) else "batches"
        name = f"{kind} of {name}"  # a batch_sampler of the user's
    return name


def draws_epoch_seed(sampler: Any) -> bool:
    """Case 4 of NOTE [ Rewinding samplers ]: torch's own ``RandomSampler.__iter__`` on the
    global generator."""
    return (
        isinstance(sampler, RandomSampler)
        and not is_ours(sampler)
        and type(sampler).__iter__ is RandomSampler.__iter__
        and sampler.generator is None
    )


def sampler_state_of(sampler: Any) -> Any:
    """What restores ``sampler`` to the start of an epoch, taken when the epoch starts: ``None``
    for cases 1, 4 (its seed is recorded at its first draw) and 5 of NOTE [ Rewinding samplers ];
    its own state (2); ``{"generator_state": [...]}`` (3); ``{"unrewindable": reason}`` (6)."""
    if is_ours(sampler):
        return None
    state_dict = getattr(sampler, "state_dict", None)
    if callable(state_dict):
        return state_dict()
    name = type(sampler).__name__
    if isinstance(sampler, _STOCK_RANDOM):
        if sampler.generator is not None:
            return {"generator_state": sampler.generator.get_state().tolist()}
        if draws_epoch_seed(sampler):
            return None
        return {UNREWINDABLE: (
            f"its {name} draws its order from torch's global random generator, whose state at "
            "the epoch's start was not saved; pass the DataLoader seed=<int> (or a sampler "
            "with generator=torch.Generator().manual_seed(<int>))"
        )}
    if isinstance(sampler, _FIXED_ORDER) or callable(getattr(sampler, "set_epoch", None)):
        return None
    return {UNREWINDABLE: (
        f"its sampler {name} has no state_dict()/load_state_dict() (nor set_epoch), so gpufeed "
        "cannot know that it repeats its order; give it those methods, or use shuffle=True "
        "with seed=<int>"
    )}


def draw_base_seed(generator: torch.Generator | None) -> int:
    """A new iterator's base seed, drawn as torch's iterators draw it before the epoch's first
    index (from the loader's ``generator``, else torch's global one)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def state_after_base_seed(generator: torch.Generator) -> list[int]:
    """``generator``'s state after the next iterator's base seed (drawn from a copy)."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    draw_base_seed(copy)
    return copy.get_state().tolist()


def restore_sampler(sampler: Any, state: Any) -> None:
    """Put ``sampler`` back where :func:`sampler_state_of` found it (cases 2 and 3; the markers
    of cases 4 and 6 never reach here: ``resume.prepare_resume`` drops them)."""
    if isinstance(sampler, _STOCK_RANDOM) and isinstance(state, dict) and (
        sampler.generator is not None and "generator_state" in state
    ):
        sampler.generator.set_state(torch.tensor(state["generator_state"], dtype=torch.uint8))
    elif hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(state)


def rank_bound(state: Any) -> str | None:
    """Why a state saved on one rank cannot be loaded on another, or ``None``: a map-style
    loader ordered by ``(seed, epoch)`` (gpufeed's samplers, ``DistributedSampler``) is at the
    same batch count on every rank, so one state serves all (frameworks save rank 0's only)."""
    if state.get("dataset_state") is not None:
        return "it holds an iterable dataset's per-worker stream positions, which differ per rank"
    if state.get("delivered_ahead"):
        return "it lists batches delivered out of order (in_order=False), which differ per rank"
    sampler_state = state.get("sampler_state")
    if isinstance(sampler_state, dict) and EPOCH_SEED in sampler_state:
        return (
            "it holds the shuffle seed this rank drew from torch's global random generator "
            "(shuffle=True without seed=); pass seed=<int>, the same on every rank"
        )
    if sampler_state is not None and not (
        isinstance(sampler_state, dict) and UNREWINDABLE in sampler_state
    ):
        return "it holds the sampler's own state (or its generator's), which may differ per rank"
    return None


class EpochSeed:
    """The seed of one epoch of a ``RandomSampler`` on the global generator (case 4).

    Args:
        replay: the seed to shuffle with (a resume), or ``None`` to draw it as torch would.
        record: a bound method, called with the seed when it is drawn or replayed. Held
            weakly: the epoch's draw holds this object and the recorder (a loader's position)
            the draw, a cycle that would keep the sampler and dataset alive until collected.
    """

    def __init__(self, replay: int | None, record: Callable[[int], None]) -> None:
        self.replay = replay
        self._record = weakref.WeakMethod(record)

    def seed(self) -> int:
        """The epoch's seed, drawn as torch draws it if not yet drawn (or replayed); recorded.
        A state taken before the epoch's first batch calls it to keep the seed: the epoch then
        shuffles with it (the same one draw, earlier; a replayed seed is recorded again)."""
        if self.replay is None:
            self.replay = draw_base_seed(None)
        if (record := self._record()) is not None:
            record(self.replay)
        return self.replay

    def generator(self) -> torch.Generator:
        """A generator seeded as ``RandomSampler.__iter__`` seeds its own: call it at the
        sampler's first index."""
        generator = torch.Generator()
        generator.manual_seed(self.seed())
        return generator

    def plan(self, index_sampler: Iterable[Any], sampler: RandomSampler) -> Iterator[Any]:
        """Iterate ``index_sampler`` with ``sampler`` shuffling from this epoch's seed."""
        iterator = iter(index_sampler)  # generators: nothing is drawn yet
        sampler.generator = self.generator()
        try:
            # RandomSampler.__iter__ reads .generator at its first index, once
            first = list(itertools.islice(iterator, 1))
        finally:
            sampler.generator = None
        yield from first
        yield from iterator
