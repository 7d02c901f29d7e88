"""An epoch's batches as slices of one index tensor, for torch's stock samplers.

With ``BatchSampler(SequentialSampler | RandomSampler)`` (what ``batch_size``/``shuffle``
build), the main process draws the epoch's permutation once, exactly as torch's
``RandomSampler`` would (same generator, calls and order), and workers slice it: no list of
indices is built per batch in the main process, and none crosses a pipe. Without batching the
sampler is planned alike, one index per "batch" (its closing draw comes when stock's would).
gpufeed's samplers hand over their order through ``take_epoch()``. Any other sampler takes the
generic path, one list of indices per batch.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from .rewind import EpochSeed, inner_sampler, is_ours

#: From this many samples a plan the workers share holds its permutation as int32: half
#: the shared memory (4 bytes a sample), each batch's slice widened to int64 when taken.
COMPACT_FROM = 1 << 20


class IndexPlan:
    """Batch ``k`` is ``perm[k*batch_size : (k+1)*batch_size]`` (``perm`` None: arange);
    ``single`` (no batching): item ``k`` is the one index ``perm[k]`` (:meth:`index`)."""

    def __init__(self, perm: torch.Tensor | None, n: int, batch_size: int, drop_last: bool,
                 single: bool = False):
        self.perm, self.n, self.batch_size, self.drop_last = perm, n, batch_size, drop_last
        self.single = single
        self.n_batches = n // batch_size if drop_last else -(-n // batch_size)
        self.finished = False  # the sampler's closing draw was made (main process only)
        # Which ``next()`` on torch's ``BatchSampler`` exhausts its sampler: the last batch's
        # when it is partial and kept (``islice`` runs into the end), else the one after it.
        partial = not drop_last and n % batch_size
        self.closing_pull = self.n_batches if partial else self.n_batches + 1
        self._flat: np.ndarray | None = None  # perm as numpy, made once (batch_array)

    def batch(self, k: int) -> torch.Tensor:
        lo = k * self.batch_size
        hi = min(lo + self.batch_size, self.n)
        if self.perm is None:
            return torch.arange(lo, hi)
        return self.perm[lo:hi].long()  # (a no-op on int64; int32 plans: COMPACT_FROM)

    def index(self, k: int) -> int:
        """Item ``k`` of an unbatched plan: a Python int, as torch's samplers yield it."""
        if self.perm is None:
            return k
        return int(self._numpy()[k])

    def _numpy(self) -> np.ndarray:
        flat = self._flat
        if flat is None:
            flat = self._flat = self.perm.numpy()  # type: ignore[union-attr]
        return flat

    def batch_array(self, k: int) -> np.ndarray:
        """Batch ``k`` as numpy, for the vectorised gather: the same indices as :meth:`batch`,
        a slice of a numpy view of ``perm`` made once, cheaper than converting each batch's
        tensor. Measurements: docs/how-it-works/measurements/order.md#index-plans."""
        lo = k * self.batch_size
        hi = min(lo + self.batch_size, self.n)
        if self.perm is None:
            return np.arange(lo, hi, dtype=np.int64)
        return self._numpy()[lo:hi].astype(np.int64, copy=False)

    def __reduce__(self) -> tuple[Any, ...]:
        return (IndexPlan, (self.perm, self.n, self.batch_size, self.drop_last, self.single))


def plannable(index_sampler: Any) -> bool:
    """Whether the epoch's order can be drawn at once: torch's ``BatchSampler`` over one of
    the samplers below, or (no batching) one of them alone."""
    s = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    if type(s) is SequentialSampler or is_ours(s):
        return True
    return type(s) is RandomSampler and not s.replacement and s._num_samples is None


def make_plan(
    index_sampler: Any, *, shared: bool, skip: int = 0, epoch_seed: EpochSeed | None = None,
) -> IndexPlan:
    """Draw the epoch's order as the stock sampler would at its first ``next()``.

    ``skip``: batches to leave out at the start (a resume; gpufeed's samplers know it from
    their ``seek``). ``epoch_seed``: the tracker's ``rewind.EpochSeed``, which draws (and
    records) or replays the epoch's seed of a ``RandomSampler`` on the global generator
    (NOTE [ Rewinding samplers ], case 4)."""
    batched = type(index_sampler) is BatchSampler
    s = inner_sampler(index_sampler)
    bs = index_sampler.batch_size if batched else 1
    perm: torch.Tensor | None = None
    if is_ours(s):
        _, perm, start = s.take_epoch()
        n = len(perm)
    else:
        n = len(s.data_source)
        start = skip * bs
        if type(s) is RandomSampler:
            generator = epoch_seed.generator() if epoch_seed is not None else _generator(s)
            # Drawn straight into shared memory when the workers will read it: a private
            # draw copied there would leave its pages (8 bytes a sample) in the main process.
            out = torch.empty(n, dtype=torch.int32 if COMPACT_FROM <= n < 2**31 else torch.int64
                              ).share_memory_() if shared and not start else None
            # The same draws and values in either dtype (tested).
            perm = torch.randperm(n, generator=generator, out=out)
        if start:
            perm = torch.arange(n) if perm is None else perm
    if perm is not None:
        if start:
            perm, n = perm[start:].clone(), n - start
        if shared and not perm.is_shared():
            perm.share_memory_()
    return IndexPlan(perm, n, batch_size=bs, drop_last=batched and index_sampler.drop_last,
                     single=not batched)


def pull_as_stock(plan: IndexPlan, index_sampler: Any, pulled: int) -> None:
    """Advance the user's generator as the stock loader would have once it ``pulled`` batches
    of indices from its sampler: ``prefetch_factor * num_workers`` at ``iter()``, one more per
    delivered batch; the pull that exhausts the sampler makes ``RandomSampler`` draw a closing
    permutation (``IndexPlan.closing_pull``). gpufeed dispatches further ahead, so it makes
    that draw when stock would: breaking out early leaves the generator as stock does."""
    if not plan.finished and pulled >= plan.closing_pull:
        plan.finished = True
        finish_plan(index_sampler)


def follow_stock(plan: IndexPlan, index_sampler: Any, pulled: int, tracker: Any) -> None:
    """At an epoch's start: the stock loader's ``pulled`` pulls at ``iter()``, then one per
    batch that reaches the user, as ``tracker`` counts them (``DeliveryTracker.follow_stock``)."""
    pull_as_stock(plan, index_sampler, pulled)
    tracker.follow_stock(plan.closing_pull - pulled, functools.partial(
        pull_as_stock, plan, index_sampler, plan.closing_pull))


def finish_plan(index_sampler: Any) -> None:
    """Consume what the stock sampler consumes when it runs out (a second ``randperm``)."""
    s = inner_sampler(index_sampler)
    if type(s) is RandomSampler and s.generator is not None:
        advance_as_randperm(s.generator, len(s.data_source))


# torch's CPU randperm draws one 32-bit number per element but the last below this size
# (aten randperm_cpu), one 64-bit number above it
_RANDPERM_32BIT_BELOW = (2**32 - 1) // 20
_CHUNK = 1 << 20
_same_draws: bool | None = None  # does _draw_32bit leave the state randperm leaves? (once)


def advance_as_randperm(generator: torch.Generator, n: int) -> None:
    """Leave ``generator`` as ``torch.randperm(n, generator=generator)`` leaves it, without the
    permutation (the stock sampler's closing draw is thrown away), by drawing ``n - 1`` numbers:
    several times cheaper (docs/how-it-works/measurements/order.md#index-plans). Checked once
    per process against ``randperm``; where they differ (another torch), or for a CUDA
    generator, it is ``randperm``."""
    global _same_draws
    if _same_draws is None:
        a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        torch.randperm(1000, generator=a)
        _draw_32bit(b, 999)
        _same_draws = torch.equal(a.get_state(), b.get_state())
    if _same_draws and n < _RANDPERM_32BIT_BELOW and generator.device.type == "cpu":
        _draw_32bit(generator, n - 1)
    else:
        torch.randperm(n, generator=generator)


def _draw_32bit(generator: torch.Generator, count: int) -> None:
    """Draw ``count`` 32-bit numbers (a range below 2**32 takes one draw each), through a
    buffer of at most ``_CHUNK`` elements."""
    buf = torch.empty(min(max(count, 0), _CHUNK), dtype=torch.int32)
    while count > 0:
        part = buf if count >= len(buf) else buf[:count]
        part.random_(0, 2, generator=generator)
        count -= len(part)


def _generator(s: RandomSampler) -> torch.Generator:
    """The user's generator of a ``RandomSampler``; one on the global generator comes with the
    tracker's ``EpochSeed`` (``LoaderPosition.begin_epoch``), so none reaches here."""
    if s.generator is None:
        raise RuntimeError(
            "gpufeed internal error: an epoch plan of a RandomSampler on torch's global "
            "generator was drawn without its EpochSeed; please report it"
        )
    return s.generator
