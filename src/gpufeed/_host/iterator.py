"""Iterators shared by both paths, and the one without workers (``num_workers=0``).

``BaseIter`` holds what every iterator does per batch: sampler and epoch bookkeeping, pinning,
counting, the length warning of iterable datasets, stage timings. ``SingleIter`` fetches in the
calling thread; ``WorkerIter`` (``_host/worker_iter.py``) fetches through a worker pool and the
ring.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .._base import cuda as _cuda
from .._base import timeline as _timeline
from .._base.tree import batch_len
from .._memory import pinning as _pinning
from .._memory.pinning import pin_batch
from .._order.datapipes import PipeSeeds, shard_here
from .._order.plan import IndexPlan, follow_stock, make_plan, plannable
from .._order.resume import capture_state
from .._order.rewind import draw_base_seed
from .._order.shards import ShardInfo, set_shard_info
from .config import ConfigSource, IterConfig
from .fetch import IterFetcher, make_fetcher


class BaseIter:
    def __init__(self, config: IterConfig) -> None:
        # The config holds no reference to the loader: NOTE [ Shutdown ] in _host/pool.py.
        self._position = config.position
        # the iterator hands batches to the user itself (no device stage after it)
        self._direct = config.device_depth is None
        self._dataset = config.dataset
        self._is_iterable = config.is_iterable
        self._auto_collation = config.auto_collation
        self._count_rows = config.auto_collation or config.whole_batches
        self._index_sampler = config.index_sampler
        self._collate_fn = config.collate_fn
        if config.pin_memory and not (torch.accelerator.is_available() or _pinning.cuda_usable()):
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=3,
            )
        self._pin = config.pin  # asked for, or implied by a CUDA device stage
        self._pin_device = config.pin_device  # pinning, registration and release fences run under
        self._sample_seed = config.sample_seed
        # torch's draw order: a datapipe's shared seed (NOTE [ DataPipes ] in
        # _order/datapipes.py), the base seed, then the sampler's first draw; a loaded state
        # is put back in between (LoaderPosition.begin_epoch)
        self._pipe_seeds = PipeSeeds(config.dataset, config.generator)
        self._pipe_seeds.draw()
        self._base_seed = draw_base_seed(config.generator)
        # a replayed epoch's end is followed by the next iterator's draw, where epochs get
        # new iterators and that draw comes from the generator the sampler may share
        self._base_seed_of = None if config.generator is None or (
            config.persistent and config.num_workers > 0) else functools.partial(
                draw_base_seed, config.generator)
        self._begin_epoch()
        self._num_yielded = 0
        self._len_called = config.len_called
        self._recorder = config.recorder
        self._returned_at = 0.0  # when the last batch was handed over (for "step")
        self._traced_by = 0  # the serial of the trace last labelled for (no reference kept)
        self._sample_due = float("inf")  # when _sample_counters runs next (never: no counters)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran: the loader's next ``iter()`` then starts a new iterator,
        even with persistent workers."""
        return bool(getattr(self, "_closed", False))

    def __iter__(self) -> BaseIter:
        return self

    def __getstate__(self) -> Any:
        """Refused, as torch's iterators refuse it (``pickle``, ``copy.copy``): a copy would
        share, and on its deletion stop, this iterator's workers and pending batches."""
        raise NotImplementedError("{} cannot be pickled", type(self).__name__)

    def __next__(self) -> Any:
        if _timeline.torch_profiler._is_profiler_enabled:  # NOTE [ Timeline ] (1): a range
            with _timeline.torch_range(_timeline.WAIT_RANGE):
                data = self._next()
        else:
            data = self._next()
        if self._len_warning:  # here, so that it points at the loop, as torch's does
            text, self._len_warning = self._len_warning, ""
            warnings.warn(text, stacklevel=2)
        return data

    _len_warning = ""  # torch's "Length of IterableDataset ..." for the batch being returned

    def _next(self) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._index_sampler)

    def _begin_again_if_set_late(self) -> None:
        """Before an epoch's first batch: if it began from a loaded state and its sampler's
        ``set_epoch`` has since moved it to another epoch (Lightning resumes so:
        ``LoaderPosition.set_epoch_came_late``), begin it again, as an iterator made now
        would (the sampler's draw may have begun: a worker iterator dispatches at once)."""
        if not self._num_yielded and self._position.set_epoch_came_late(self._index_sampler):
            self._position.reload()
            self._restart(self._sample_seed)

    def _begin_epoch(self) -> None:
        """Start the epoch's index plan and delivery count (NOTE [ Delivery tracking ] in
        ``_order/delivery.py``); resumes where ``loader.load_state_dict`` said."""
        self._tracker = self._position.begin_epoch(
            self._index_sampler, iterable=self._is_iterable, direct=self._direct,
            base_seed_of=self._base_seed_of,
        )
        self._sampler_iter = self._tracker.indices
        self._drawn = 0  # batches drawn this epoch, failed fetches too (SingleIter numbers them)

    def _next_indices(self) -> Any:
        idx = next(self._sampler_iter)
        if self._is_iterable and self._auto_collation:
            return len(idx)  # iterable datasets take a count, not indices
        return idx

    def _finish(
        self, data: Any, asked_at: float, k: int, worker_state: tuple[int, Any] | None = None,
        registered: tuple[int, int] | None = None,
        occupancy: Sequence[tuple[str, int, int]] = (),
        gauges: Sequence[tuple[str, int]] = (),
    ) -> Any:
        """Hand batch ``k`` of this epoch to the user, or to the device stage in front of the
        user (which records the handover the loop sees); ``registered``: the page-locked slot
        it was written into, whose leaves need no pinning check; ``occupancy``, ``gauges``:
        (stage, used, capacity) samples and (counter, level) values to record with it."""
        now = time.perf_counter()
        last = self._returned_at
        if self._direct:
            self._recorder.handout(asked_at - last if last else None, now - asked_at,
                                   (batch_len(data) or 0) if self._count_rows else 1,
                                   occupancy, gauges)
        else:  # the device stage's Delivered records the loop's handover (_order/delivery.py)
            self._recorder.passed_on(occupancy, gauges)
        self._num_yielded += 1
        if (self._is_iterable and self._len_called is not None
                and self._num_yielded > self._len_called):
            self._len_warning = (  # torch's words, spacing included
                f"Length of IterableDataset {self._dataset} was reported to be {self._len_called}"
                f"(when accessing len(dataloader)), but {self._num_yielded} samples have been "
                "fetched. " + ("" if not getattr(self, "_num_workers", 0) else
                               "For multiprocessing data-loading, this could be caused by not "
                               "properly configuring the IterableDataset replica at each worker. "
                               "Please see https://pytorch.org/docs/stable/data.html"
                               "#torch.utils.data.IterableDataset for examples."))
        if self._pin:
            data = pin_batch(data, registered, device=self._pin_device)
        self._tracker.produced_nth(k, worker_state)
        self._returned_at = time.perf_counter()
        tl = _timeline.active
        if tl is not None:  # the same times as the stats (NOTE [ Timeline ] (3))
            end = self._returned_at
            if self._direct:
                tl.handout(self._recorder, k, self._tracker.epoch, last, asked_at, now, end)
            if end >= self._sample_due or self._traced_by != tl.serial:
                self._trace_now_and_then(tl, end)
        return data

    def _trace_now_and_then(self, tl: _timeline.Timeline, now: float) -> None:
        """Once per trace, name the tracks; at most every ``SAMPLE_EVERY_S``, sample the
        counters."""
        if self._traced_by != tl.serial:
            self._traced_by = tl.serial
            self._label(tl)
        self._sample_due = now + _timeline.SAMPLE_EVERY_S
        self._sample_counters(tl)

    def _label(self, tl: _timeline.Timeline) -> None:
        tl.label(self._recorder, None, "gpufeed.DataLoader (num_workers=0)")

    def _sample_counters(self, tl: _timeline.Timeline) -> None:
        """Record the iterator's counters (none without workers)."""

    def _fetched_here(self, asked_at: float, fetched: float, done: float) -> None:
        """Record a batch fetched in the calling thread: fetched from ``asked_at`` to
        ``fetched``, collated from then to ``done``."""
        self._recorder.add("fetch", busy_s=fetched - asked_at)
        self._recorder.add("collate", busy_s=done - fetched)
        tl = _timeline.active
        if tl is not None:  # in this thread, while the loop waits: a track of their own
            args = {"batch": self._num_yielded, "epoch": self._tracker.epoch}
            tl.span(self._recorder, "fetching", "fetch", asked_at, fetched, args)
            tl.span(self._recorder, "fetching", "collate", fetched, done, args)

    def _check_capture(self) -> None:
        """A batch cannot be fetched inside CUDA graph capture: pinning and the ring's
        release fences are CUDA calls that capture forbids or would record into the graph."""
        if self._pin and _cuda.capturing(self._pin_device):
            raise RuntimeError(
                "next() on a gpufeed DataLoader was called while the current CUDA stream is "
                "capturing a graph; fetch the batch before torch.cuda.graph(...) and copy it "
                "into the graph's static input tensors (static_x.copy_(batch)) inside or "
                "before replay, never iterate the loader during capture"
            )

    def _reset(self, loader: ConfigSource, first_iter: bool = False) -> None:
        """torch's persistent-worker hook: ``DataLoader.__iter__`` calls it to start the next
        epoch. The one place an iterator is handed its loader: it only asks it for the epoch's
        config (the length warning takes its ``len(loader)``, as torch's ``_reset`` does)."""
        config = loader._iter_config()
        self._len_called = config.len_called
        self._restart(config.sample_seed, first_iter=first_iter)

    def _restart(self, sample_seed: int | None, first_iter: bool = False) -> None:
        """Start the next epoch, with ``sample_seed`` (the epoch's config's: ``load_state_dict``
        may bring another); ``first_iter``: the one ``__init__`` started."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop workers and release memory; idempotent."""

    def __enter__(self) -> BaseIter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_UNDRAWN = IndexPlan(None, 0, 1, False)  # a plannable epoch whose order is not drawn yet


class SingleIter(BaseIter):
    """``num_workers=0``: fetch in the calling thread (batched gather where possible).

    NOTE [ Planned epochs without workers ]
    ---------------------------------------
    With torch's own samplers (``_order/plan.py``'s ``plannable``), the epoch's order is
    drawn as one plan at its first pull, when the stock sampler draws it, and batches are
    sliced from it, as the workers slice theirs. The sampler itself is never run, so its
    closing draw (a second permutation when it runs out) is made by the delivery tracker
    when the user's batches say the stock loader's pulls ran out (``follow_stock``): a device
    stage taking the epoch's last batches ahead of a loop that breaks out does not make it.
    Any other sampler is pulled one batch at a time, as stock pulls it.
    """

    _plan: IndexPlan | None  # the epoch's plan, _UNDRAWN before its first pull; None: unplanned

    def __init__(self, config: IterConfig) -> None:
        super().__init__(config)
        shard_here(self._dataset)  # a datapipe graph, by the process group's rank
        self._fetcher = make_fetcher(
            self._dataset, is_iterable=self._is_iterable, auto_collation=self._auto_collation,
            collate_fn=self._collate_fn, drop_last=config.drop_last, sample_seed=self._sample_seed,
            base_seed=self._base_seed,
        )
        set_shard_info(ShardInfo(config.rank, config.world_size, 0, 1))
        self._load_dataset_state()

    def _load_dataset_state(self) -> None:
        resumed = self._position.take_dataset_states()
        if resumed is not None and isinstance(self._fetcher, IterFetcher):
            self._fetcher.reset(resumed.states[0])

    def _next(self) -> Any:
        self._check_capture()
        self._begin_again_if_set_late()
        asked_at = time.perf_counter()
        try:
            indices = self._planned_indices() if self._plan is not None else self._next_indices()
            k, self._drawn = self._drawn, self._drawn + 1  # a failed fetch drew its batch too
            try:
                data = self._fetcher.fetch(indices, None, epoch=self._tracker.epoch)
            except Exception:
                if self._direct:  # (else the device stage's Delivered counts it)
                    self._tracker.fetch_failed()
                raise
        except StopIteration:
            self._tracker.host_exhausted()
            raise
        done = time.perf_counter()
        self._fetched_here(asked_at, done - self._fetcher.collate_s, done)
        state = (0, capture_state(self._dataset)) if self._is_iterable else None
        # the loop waited from asked_at: the fetch is its wait, not its step
        return self._finish(data, asked_at, k, state)

    def _planned_indices(self) -> Any:
        """Batch ``_drawn`` of the epoch's plan (NOTE [ Planned epochs without workers ]);
        StopIteration past the end."""
        plan = self._plan
        assert plan is not None  # (called only for a planned epoch)
        if plan is _UNDRAWN:
            point = self._tracker.point
            plan = self._plan = self._fetcher.plan = make_plan(  # type: ignore[union-attr]
                self._index_sampler, shared=False, skip=0 if point.seeked else point.done,
                epoch_seed=self._tracker.epoch_seed)
            follow_stock(plan, self._index_sampler, 0, self._tracker)
        if self._drawn >= plan.n_batches:
            raise StopIteration
        return self._fetcher.planned(self._drawn)  # type: ignore[union-attr]

    def _begin_epoch(self) -> None:
        super()._begin_epoch()
        point = self._tracker.point
        self._plan = _UNDRAWN if (not self._is_iterable and not point.ahead
                                  and plannable(self._index_sampler)) else None

    def _restart(self, sample_seed: int | None, first_iter: bool = False) -> None:
        self._begin_epoch()
        self._load_dataset_state()
        self._num_yielded = 0
