"""Fetching one batch: a batch source, vectorised gather, ``__getitems__``, or sample by sample.

A fetcher runs inside a worker (or the main process when ``num_workers=0``). It records which
sample it is on, so that an exception is reported with the index that caused it, and keeps the
thread's ``SampleScope`` on it, so that ``gpufeed.sample_generator()`` and its siblings are
seeded from that sample (``_order/sample_rng.py``). With a per-sample seed it also seeds the
global generators before each sample, except in thread workers (NOTE [ Seeding and threads ]).
"""

from __future__ import annotations

import copy
import operator
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from .._order.sample_rng import SampleScope, stream_base
from .._order.seeding import seeded
from .._sources.arrays import gather, gather_arrays
from .._sources.arrow import arrow_source
from .collate import collate_into
from .output import building
from .random_watch import TaskProbe
from .streaming import StreamedBatch
from .writer import SlotWriter

# What a fetcher does during its per-sample loop; MapFetcher.describe() adds which sample.
_AT_SAMPLE = "while fetching a sample"
# The same for IterFetcher's stream, whose describe() adds the sample's number.
_AT_STREAM = "while fetching a sample of this worker's stream"


def make_fetcher(
    dataset: Any, *, is_iterable: bool, auto_collation: bool,
    collate_fn: Callable[[Any], Any] | None, drop_last: bool, sample_seed: int | None,
    base_seed: int, worker_id: int = 0, seed_globals: bool = True,
) -> MapFetcher | IterFetcher:
    """The fetcher for ``dataset``, in a worker or in the main process (``num_workers=0``);
    the arguments are :class:`MapFetcher`'s and :class:`IterFetcher`'s."""
    if is_iterable:
        return IterFetcher(
            dataset, auto_collation=auto_collation, collate_fn=collate_fn, drop_last=drop_last,
            seed=sample_seed, base_seed=base_seed, worker_id=worker_id,
        )
    return MapFetcher(
        dataset, auto_collation=auto_collation, collate_fn=collate_fn, seed=sample_seed,
        base_seed=base_seed, seed_globals=seed_globals,
    )


def batch_source(dataset: Any) -> Any:
    """The object that reads ``dataset``'s batches in one call, or None (NOTE [ Batch sources ]
    in ``_sources/protocol.py``)."""
    if hasattr(type(dataset), "gpufeed_batch"):
        return dataset
    # An Arrow table or a Hugging Face dataset: never import those libraries ourselves.
    if "pyarrow" in sys.modules or "datasets" in sys.modules:
        return arrow_source(dataset)
    return None


class MapFetcher:
    """Batches of a map-style dataset from lists of indices.

    Args:
        auto_collation: True when batches are formed (``batch_size`` or ``batch_sampler``);
            False for ``batch_size=None``, where each "batch" is one sample.
        collate_fn: the user's function, or None for default collation into the slot.
        seed: base seed of per-sample random state (``_order/seeding.py``): each ``__getitem__``
            sees state from ``(seed, epoch, index)``, ``epoch`` given to :meth:`fetch`. None:
            the stock behaviour; the per-sample generators are then seeded from ``base_seed``,
            the iterator's (drawn as torch draws its workers').
        seed_globals: with ``seed``, also seed torch's, numpy's and Python's global generators
            before each sample (process workers, ``num_workers=0``); never in thread workers,
            which share them (NOTE [ Seeding and threads ]).
    """

    def __init__(
        self, dataset: Any, *, auto_collation: bool, collate_fn: Callable[[Any], Any] | None,
        seed: int | None = None, base_seed: int = 0, seed_globals: bool = True,
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.base_seed = base_seed
        self.scope = SampleScope(seed_globals=seed_globals)
        self.auto_collation = auto_collation
        self.collate_fn = None if collate_fn is default_collate else collate_fn
        self.arrays = gather_arrays(dataset) if self.collate_fn is None else None
        self.source = batch_source(dataset) if auto_collation else None
        # Batches are gathered with one op per array (``gather``), no user code involved.
        self.gathers = self.arrays is not None and self.source is None and auto_collation
        self.getitems = getattr(dataset, "__getitems__", None)
        # What it is doing, for error messages (describe).
        self.where = ""
        # An _plan.IndexPlan, when the main process sent one.
        self.plan: Any = None
        self.collate_s = 0.0
        # Set by a thread worker for a checked task (NOTE [ Seeding and threads ]).
        self.probe: TaskProbe | None = None

    def planned(self, k: int) -> Any:
        """Batch ``k`` of :attr:`plan` as this dataset takes its indices: one index unbatched,
        as stock passes it; a numpy view for gpufeed's gather; else a list of ints, as stock."""
        plan = self.plan
        if plan.single:
            return plan.index(k)
        if self.gathers:
            return plan.batch_array(k)
        indices = plan.batch(k)
        return indices if self.arrays is not None else indices.tolist()

    def fetch(self, indices: Any, writer: SlotWriter | None, *, epoch: int = 0) -> Any:
        if self.gathers:
            # No user code, nothing random: no scope.
            self.where = "while gathering a batch"
            self.collate_s = 0.0
            return gather(self.arrays, indices, _alloc_for(writer))  # type: ignore[arg-type]
        scope = self.scope
        scope.open(self.seed if self.seed is not None else self.base_seed, epoch)
        # NOTE [ Batches built in the slot ] in _host/output.py
        previous = building(writer)
        try:
            return self._fetch(indices, writer, epoch, scope)
        finally:
            building(previous)
            scope.close()

    def _fetch(self, indices: Any, writer: SlotWriter | None, epoch: int, scope: SampleScope
               ) -> Any:
        # The check for global draws, also for user code a source calls itself (transform=).
        scope.probe = self.probe
        collate_fn = self.collate_fn
        if collate_fn is not None and self.probe is not None:
            # User code is checked for global draws (NOTE [ Seeding and threads ]).
            collate_fn = self.probe.wrap(collate_fn)
        if not self.auto_collation:
            return self._fetch_one(indices, epoch, scope, collate_fn)
        if self.source is not None:
            return self._read(indices, writer, epoch, scope, collate_fn)
        # Default collation may copy each sample into the slot as it comes.
        stream_to = writer if collate_fn is None else None
        if self.seed is not None and self.scope.seed_globals:
            with seeded(self.seed, epoch) as reseed:
                samples = self._samples(indices, stream_to, scope, reseed)
        else:
            samples = self._samples(indices, stream_to, scope, None)
        self.where = "in collate_fn"
        scope.at_batch(indices)
        out, self.collate_s = _collated(samples, writer, collate_fn)
        return out

    def _fetch_one(self, index: Any, epoch: int, scope: SampleScope,
                   collate_fn: Callable[[Any], Any] | None) -> Any:
        """The "batch" of ``batch_size=None``: sample ``index``, through ``collate_fn``."""
        # Formatted only on error (describe), from the scope's index.
        self.where = _AT_SAMPLE
        scope.at(index)
        if self.seed is not None and self.scope.seed_globals:
            with seeded(self.seed, epoch) as reseed:
                reseed(index)
                sample = self.dataset[index]
        elif self.probe is not None:
            sample = self.probe.wrap(operator.getitem)(self.dataset, index)
        else:
            sample = self.dataset[index]
        self.where = "in collate_fn"
        scope.at_batch((index,))
        return collate_fn(sample) if collate_fn is not None else sample

    def _read(self, indices: Any, writer: SlotWriter | None, epoch: int, scope: SampleScope,
              collate_fn: Callable[[Any], Any] | None) -> Any:
        """The batch of ``indices`` from a batch source (NOTE [ Batch sources ])."""
        self.collate_s = 0.0
        self.where = "while reading a batch"
        scope.at_batch(indices)
        source: Any = self.source
        if collate_fn is None:
            # Fresh views of the slot: user code may keep them.
            return source.gpufeed_batch(
                indices, seed=self.seed, epoch=epoch, alloc=_alloc_for(writer, fresh=True))
        samples = source.gpufeed_samples(indices, seed=self.seed, epoch=epoch)
        self.where = "in collate_fn"
        out, self.collate_s = _collated(samples, writer, collate_fn)
        return out

    def _samples(self, indices: Any, stream_to: SlotWriter | None, scope: SampleScope,
                 reseed: Any) -> Any:
        """The samples of ``indices``: one ``__getitems__`` call, else one ``__getitem__``
        each, in a list or, from the first sample on, in a :class:`StreamedBatch` written into
        ``stream_to``'s slot (NOTE [ Streamed collation ] in ``_host/streaming.py``).
        ``reseed``: the ``seeded`` block's reseeding of the global generators, called before
        each sample, or None (NOTE [ Seeding and threads ]).
        """
        probe = self.probe
        if self.getitems is not None:
            self.where = "in __getitems__"
            scope.at_batch(indices)
            if reseed is not None:
                reseed.batch(indices)
                # Drawn inside the seeded block, even from a lazy result.
                return list(self.getitems(indices))
            return (self.getitems if probe is None else probe.wrap(self.getitems))(indices)
        get = operator.getitem if probe is None else probe.wrap(operator.getitem)
        samples: Any = []
        append, dataset, at = samples.append, self.dataset, scope.at
        # Not a batch sampler's generator, whose length is not known.
        stream = stream_to is not None and hasattr(indices, "__len__")
        # Formatted only on error (describe): this loop is per sample.
        self.where = _AT_SAMPLE
        # One sample of a batch the loader collates is not the batch (NOTE [ Batches built in
        # the slot ] in _host/output.py).
        previous = building(None)
        t0 = time.perf_counter()
        for i in indices:
            at(i)
            if reseed is not None:
                reseed(i)
            append(get(dataset, i))
            if stream:
                stream = False
                streamed = StreamedBatch.start(samples[0], stream_to, len(indices),
                                               time.perf_counter() - t0)
                if streamed is not None:
                    samples, append = streamed, streamed.add
        building(previous)
        return samples

    def describe(self, indices: Any) -> str:
        if self.where is _AT_SAMPLE:
            return f"while fetching sample index {self.scope.index!r}"
        if self.where in ("while gathering a batch", "in __getitems__", "while reading a batch"):
            return f"{self.where} (indices {_short(indices)})"
        return self.where


class IterFetcher:
    """Batches of an iterable-style dataset; each worker iterates its own copy.

    ``fetch(n)`` takes up to ``n`` samples (``n=None``: one sample, no collation) and raises
    StopIteration when the dataset is exhausted (or, with ``drop_last``, when short). No
    per-sample seeding of the global generators; the per-sample generators number this
    worker's samples in the order it fetches them (``_order/sample_rng.py``).
    """

    def __init__(
        self, dataset: Any, *, auto_collation: bool, collate_fn: Callable[[Any], Any] | None,
        drop_last: bool, seed: int | None = None, base_seed: int = 0, worker_id: int = 0,
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.base_seed = base_seed
        self.worker_id = worker_id
        self.scope = SampleScope()
        self.auto_collation = auto_collation
        self.collate_fn = None if collate_fn is default_collate else collate_fn
        self.drop_last = drop_last
        self.where = ""
        self._it: Iterator[Any] | None = None
        # A dataset state to load before the next iter (resume).
        self._state: Any = None
        # Set by a thread worker for a checked task.
        self.probe: TaskProbe | None = None
        self.ended = False
        self.count = 0
        self.collate_s = 0.0

    def describe(self, indices: Any) -> str:
        if self.where is _AT_STREAM:
            return f"while fetching sample {self.scope.index} of this worker's stream"
        return self.where

    def reset(self, state: Any = None) -> None:
        """Restart the stream; ``state`` (resume): load it into the dataset before ``iter``."""
        self._it = None
        self.ended = False
        self.count = 0
        self._state = state

    def fetch(self, n: int | None, writer: SlotWriter | None, *, epoch: int = 0) -> Any:
        if self.ended:
            raise StopIteration
        scope = self.scope
        base = self.seed if self.seed is not None else self.base_seed
        scope.open(stream_base(base, self.worker_id), epoch)
        # NOTE [ Batches built in the slot ] in _host/output.py
        previous = building(writer)
        try:
            return self._fetch(n, writer, scope)
        finally:
            building(previous)
            scope.close()

    def _fetch(self, n: int | None, writer: SlotWriter | None, scope: SampleScope) -> Any:
        first = self.count
        scope.at(first)
        probe, collate_fn = self.probe, self.collate_fn
        step = next if probe is None else probe.wrap(next)
        if collate_fn is not None and probe is not None:
            collate_fn = probe.wrap(collate_fn)
        if self._it is None:
            if self._state is not None:
                self.where = "in the dataset's load_state_dict"
                self.dataset.load_state_dict(self._state)
                self._state = None
            self.where = "in the dataset's __iter__"
            self._it = iter(self.dataset)
        # Formatted only on error (describe): the scope's index is the sample's number.
        self.where = _AT_STREAM
        if n is None:
            sample = step(self._it)
            self.count += 1
            self.where = "in collate_fn"
            scope.at_batch((first,))
            return collate_fn(sample) if collate_fn is not None else sample
        # A list, or a StreamedBatch from the first sample on (_host/streaming.py).
        samples: Any = []
        append = samples.append
        stream = collate_fn is None and writer is not None
        # One sample of a batch the loader collates is not the batch.
        building(None)
        t0 = time.perf_counter()
        for _ in range(n):
            scope.at(self.count)
            try:
                append(step(self._it))
            except StopIteration:
                self.ended = True
                break
            self.count += 1
            if stream:
                stream = False
                streamed = StreamedBatch.start(samples[0], writer, n, time.perf_counter() - t0)
                if streamed is not None:
                    samples, append = streamed, streamed.add
        building(writer)
        if not samples or (self.drop_last and len(samples) < n):
            raise StopIteration
        self.where = "in collate_fn"
        scope.at_batch(range(first, self.count))
        out, self.collate_s = _collated(samples, writer, collate_fn)
        return out


def thread_copy(dataset: Any) -> Any:
    """A thread worker's own shallow copy of an iterable dataset.

    NOTE [ Iterable datasets in thread workers ]: a process worker iterates its own (forked or
    pickled) copy of the dataset; many iterable datasets rely on it and keep their stream's
    state on ``self`` in ``__iter__`` (litdata's ``StreamingDataset``: its worker's chunks,
    reader and position). Thread workers therefore each get a shallow copy, which is also what
    ``get_worker_info().dataset`` gives them (so a ``worker_init_fn`` that configures it
    configures that worker's stream only, as under process workers). Attributes the copy shares
    with the original (lists, buffers) are not copied: nested state mutated in place, rather
    than rebound, stays shared. A dataset that cannot be copied is shared.
    """
    try:
        return copy.copy(dataset)
    except Exception:
        return dataset


def _collated(samples: list[Any] | StreamedBatch, writer: SlotWriter | None,
              collate_fn: Callable[[Any], Any] | None) -> tuple[Any, float]:
    """The batch of ``samples`` (``collate_fn``'s, else collated into ``writer``'s slot) and
    the seconds collating took (a streamed batch's row copies included)."""
    t0 = time.perf_counter()
    if isinstance(samples, StreamedBatch):
        out = samples.finish()
        return out, time.perf_counter() - t0 + samples.copy_s
    out = collate_into(samples, writer) if collate_fn is None else collate_fn(samples)
    return out, time.perf_counter() - t0


def _alloc_for(writer: SlotWriter | None, *, fresh: bool = False
               ) -> Callable[[tuple[int, ...], Any], Any]:
    """Memory for a batch leaf: a slot of the ring when there is one, else a fresh tensor.
    ``fresh``: a new view of the slot each call (NOTE [ Carved views ] in writer.py)."""
    if writer is not None:
        return writer.alloc_any_fresh if fresh else writer.alloc_any
    return lambda shape, dtype: torch.empty(shape, dtype=dtype)


def _short(indices: Any) -> str:
    if hasattr(indices, "tolist"):
        indices = indices.tolist()
    try:
        seq = list(indices)
    except TypeError:
        return repr(indices)
    if len(seq) <= 8:
        return repr(seq)
    return f"[{', '.join(map(repr, seq[:4]))}, ... {len(seq)} in all]"
