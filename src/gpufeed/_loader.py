"""``gpufeed.DataLoader``: torch's DataLoader, fed through a shared slot ring."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, cast

import torch
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, Sampler, default_collate

from ._base import timeline as _timeline
from ._base.stats import LoaderStats, StatsRecorder
from ._device.decode import decode_plan
from ._device.prefetch import DeviceIterator
from ._device.streams import parse_device
from ._host.arguments import check_arguments, check_num_workers, warn_thread_workers
from ._host.auto_iter import AutoIter, make_tuner
from ._host.autotune import AutoTuner
from ._host.config import IterConfig, WorkerType
from ._host.frameworks import AccelerateHooks, DefaultPrefetch
from ._host.iterator import BaseIter, SingleIter
from ._host.late_slots import LateVerdict
from ._host.priority import check_worker_nice
from ._host.random_watch import GlobalDrawWatch
from ._host.ray_iter import RayIter
from ._host.worker_iter import WorkerIter
from ._memory import pinning as _pinning
from ._memory.keeper import RingKeeper
from ._memory.pinning import pin_device_index
from ._order.resume import Delivered, LoaderPosition
from ._order.sampler import build_sampler, resolve_world
from ._order.seeding import resolve_seed
from ._sources.ray import RayBatches, check_ray_arguments, is_ray_data, ray_state_error

_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(AccelerateHooks, _TorchDataLoader[_T_co]):
    """A drop-in ``torch.utils.data.DataLoader`` whose workers write into a recycled ring.

    Every argument of ``torch.utils.data.DataLoader`` has the same meaning and default; an
    instance *is* a ``torch.utils.data.DataLoader``, so changing the import is enough. The
    keyword-only knobs below are gpufeed's own.

    One default differs in what it does, not in what you get: with ``prefetch_factor`` unset
    and batches that take under ~10 ms of worker time, workers get several batches per message
    and work up to ``2 * chunk * num_workers`` batches ahead (never more than 64 MB of extra
    ring slots), hiding the 0.1-0.4 ms a process wake-up costs. An explicit ``prefetch_factor``
    (or ``timeout``) is a strict bound, as in torch. Unset, it reads 2 (torch's), and a loader
    rebuilt with that value (Lightning's sampler injection) keeps it unset.

    Args:
        worker_type: ``"process"`` (default; like torch) or ``"thread"``. Threads share the
            dataset without copy-on-write growth and need no shared memory; they scale when
            the per-sample work releases the GIL (numpy, torch ops, Pillow decode, file I/O),
            not for pure-Python work.
        ring_bytes: the most bytes of (shared) memory the slot ring may hold. Default: room
            for the batches in flight (``prefetch_factor * num_workers``, more when batches
            are tiny) plus 2 held by your loop (plus ``device_depth + 1`` with a device
            stage), sized from the first batch. More keeps more batches held by the user in
            recycled memory; less falls back sooner to a fresh allocation per batch (the
            stock loader's path).
        device: a device to deliver batches on (e.g. ``"cuda"``): copies run ahead on a side
            stream (see ``gpufeed.to_device``), from a page-locked ring (whatever
            ``pin_memory`` says). None (default) delivers host batches.
        device_transform: a callable applied to each batch on the device, after the copy
            (e.g. ``gpufeed.Normalize``). Needs ``device``.
        device_depth: batches copied ahead of the one in use; the stage's GPU memory is at
            most ``2 * device_depth + 2`` batches in a ``for`` loop (see ``gpufeed.to_device``).
        seed: base seed (an int >= 0) of the shuffle and of the random state each
            ``__getitem__`` sees, from ``(seed, epoch, index)``: the same bytes for any
            ``num_workers`` or ``worker_type``, and after a resume. It seeds
            ``gpufeed.random.sample_generator()`` and its siblings everywhere, and the global
            generators in process workers and with ``num_workers=0`` (~10-20 us per sample),
            never in thread workers (NOTE [ Seeding and threads ] in ``_order/seeding.py``).
            None (default): torch's own sampler and worker seeding.
        deterministic: per-sample random state on (``True``) or off (``False``: the stock
            per-worker seeding, for speed or stock behaviour). Default: on iff ``seed`` is given.
        rank, world_size: shard the dataset for this process (``DistributedSampler``
            semantics, see ``gpufeed.samplers.ShardedSampler``). Default: with ``seed`` given,
            from an initialised ``torch.distributed``; otherwise no sharding, as the stock
            loader (every rank reads every sample; a ``DistributedSampler``, Lightning or
            Accelerate's ``prepare`` shard it as they shard the stock loader). Iterable
            datasets learn the rank from ``get_shard_info()`` either way.
        max_workers: with ``num_workers="auto"``, the most workers it may run. Default: 8 per
            usable CPU (affinity and cgroup quota, divided among torchrun's local ranks), at
            most 64: workers waiting on I/O cost little CPU, and the CPU budget bounds the rest.
        memory_budget: with ``num_workers="auto"``, the most bytes (an int, or "8GiB") the
            workers' private memory and the ring (shared, and pinned when pinned) may hold
            together. Default: a quarter of the memory available when the loader is built,
            divided among the local ranks. More workers or work-ahead past it are not tried.
        worker_nice: how much lower than your loop's the process workers' CPU priority is.
            None (default): +5 once the loop is main-bound on cores the workers and the main
            process oversubscribe, else unchanged (NOTE [ Worker priority ] in
            ``_host/priority.py``); 0: never changed (stock's workers); 1-19: from the start.
        ray_options: with a Ray Data ``dataset``, more options of Ray's ``iter_batches``
            (``local_shuffle_buffer_size``, ``local_shuffle_seed``, ``prefetch_batches``).

    ``dataset`` may be a ``ray.data.Dataset`` or ``ray.data.DataIterator``
    (``ds.streaming_split(n)[rank]``, ``ray.train.get_dataset_shard(name)``): preprocessing runs
    where Ray schedules it, and each batch, ``{column: tensor}`` as ``iter_torch_batches`` gives
    it, is copied once out of Ray's blocks in your loop's thread (page-locked with a CUDA
    device stage) and goes through the device stage like any other (NOTE [ Ray Data batches ]
    in ``_sources/ray.py``). Ray orders and shards the rows: a sampler, ``shuffle=True``,
    ``seed=``, ``rank=`` or gpufeed's own workers are refused with the Ray way to do the same;
    ``loader.dataset`` is then a wrapper whose ``source`` is yours.

    ``num_workers="auto"`` sizes the workers and how far they work ahead while you iterate:
    it grows them while your loop waits and the last growth paid off, shrinks them while it
    does not wait, within ``max_workers``, the CPU budget (the CPU the process tree *uses*, so
    workers waiting on I/O may outnumber the cores) and ``memory_budget``, and holds when the
    machine is too noisy to tell. Changes never restart the epoch, nor drop, repeat or reorder
    a batch; ``loader.num_workers`` stays an int (the count in force), and
    ``loader.stats().autotune`` lists the decisions, also logged at INFO. It needs a map-style
    dataset: an ``IterableDataset``'s data depends on the worker count. With ``seed=`` the
    batches are the same bytes whatever it decides; without, random transforms draw from each
    worker's own generator as in torch (each started worker gets its own seed), so a batch's
    random draws depend on which worker ran it, and so on timing.

    ``state_dict()`` / ``load_state_dict()`` save and restore the position of the batches
    delivered to you (not those prefetched), the epoch and the seed: a resumed loader yields
    exactly the batches an uninterrupted one would have, whatever its ``num_workers``. Without
    ``seed=``, a stock shuffle's epoch seed is saved; a sampler that cannot be rewound gives a
    state that says so (NOTE [ Rewinding samplers ] in ``_order/rewind.py``). Loaders pickle and
    ``copy.deepcopy`` like torch's (not while persistent workers run).
    """

    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_type: WorkerType = "process",
        ring_bytes: int | None = None,
        device: str | torch.device | None = None,
        device_transform: Callable[[Any], Any] | None = None,
        device_depth: int = 2,
        seed: int | None = None,
        deterministic: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        max_workers: int | None = None,
        memory_budget: int | str | None = None,
        worker_nice: int | None = None,
        ray_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(prefetch_factor, DefaultPrefetch):  # read back from a loader: unset
            prefetch_factor = None
        check_num_workers(num_workers, auto=True)  # stock's TypeError for 2.0, at once
        rows_per_batch = None
        if is_ray_data(dataset):  # NOTE [ Ray Data batches ] in _sources/ray.py
            check_ray_arguments(
                dataset, batch_size=batch_size, ray_options=ray_options, shuffle=shuffle,
                sampler=sampler, batch_sampler=batch_sampler, seed=seed, generator=generator,
                rank=rank, world_size=world_size, num_workers=num_workers,
                worker_init_fn=worker_init_fn, persistent_workers=persistent_workers,
                prefetch_factor=prefetch_factor, multiprocessing_context=multiprocessing_context)
            dataset = RayBatches(dataset, batch_size=cast(int, batch_size), drop_last=drop_last,
                                 options=ray_options, raw=collate_fn is not None)
            rows_per_batch, batch_size, drop_last = batch_size, None, False  # Ray batches
        elif ray_options is not None:
            raise ValueError("ray_options applies to a Ray Data dataset (ray.data.Dataset or "
                             f"DataIterator), not to {type(dataset).__name__}; drop it")
        tuner = make_tuner(num_workers, max_workers=max_workers, memory_budget=memory_budget,
                           worker_type=worker_type, prefetch_factor=prefetch_factor,
                           iterable=isinstance(dataset, IterableDataset))
        if tuner is not None:
            num_workers = tuner.workers  # torch's checks see an int: the count it starts with
        check_arguments(
            num_workers=num_workers, worker_type=worker_type, prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context, ring_bytes=ring_bytes,
            device=device, device_transform=device_transform, device_depth=device_depth,
            deterministic=deterministic)
        check_worker_nice(worker_nice)
        # Private, read through properties: frameworks that rebuild a loader from its public
        # attributes (Lightning's distributed sampler injection) must not pin the rank and
        # world size resolved before torch.distributed was initialised.
        self._rank, self._world_size, in_world = resolve_world(rank, world_size)
        # gpufeed shards by rank itself only when asked (seed=, rank= or world_size=); else
        # every rank reads every sample, as with the stock loader (NOTE [ Sharding by rank ]).
        distributed = in_world and (seed is not None or rank is not None
                                    or world_size is not None)
        if not distributed and not isinstance(dataset, IterableDataset):
            self._rank, self._world_size = 0, 1  # every rank reads the whole dataset
        self.deterministic = seed is not None if deterministic is None else deterministic
        self.seed = (
            resolve_seed(seed, generator, distributed=distributed)
            if seed is not None or self.deterministic or distributed else None
        )
        built = build_sampler(
            dataset, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            seed=self.seed if seed is not None or distributed else None, rank=rank,
            world_size=world_size, drop_last=drop_last, shard=distributed,
        )
        if built is not sampler:
            sampler, shuffle = built, None
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, cast(int, num_workers),
            collate_fn,
            pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        if prefetch_factor is None and self.prefetch_factor is not None:  # torch's 2, unchosen
            self.prefetch_factor = DefaultPrefetch(self.prefetch_factor)
        self.worker_type = worker_type
        self.ring_bytes = ring_bytes
        # "cuda" stays without index until iteration starts (the current device then).
        self.device = parse_device(device, resolve=False) if device is not None else None
        self.device_transform = device_transform
        self.device_depth = device_depth
        self.max_workers, self.memory_budget = max_workers, memory_budget
        self.worker_nice = worker_nice
        if tuner is not None:  # vars() keeps "auto": frameworks rebuild the loader from it
            self.__dict__["num_workers"], self._autotune = "auto", tuner
        self._recorder = StatsRecorder()
        self._random_watch = GlobalDrawWatch()  # warns once per loader
        self._position = LoaderPosition()
        self._keeper = RingKeeper()  # NOTE [ Slot lifetime ] (e): a pinned ring across epochs
        self._late_verdict = LateVerdict()  # NOTE [ Slots bound when a task starts ] (e)
        self._workers_warned: tuple[int, str] | None = None
        self.check_worker_number_rationality()  # torch's __init__ asked before worker_type
        if rows_per_batch is not None:  # what was asked (torch's checks forbid it to be set)
            self.__dict__["batch_size"] = rows_per_batch
            self.__dict__["drop_last"] = cast(RayBatches, dataset).drop_last

    _autotune: AutoTuner | None = None
    _late_verdict: LateVerdict | None = None  # (a loader pickled before it had one)
    worker_nice: int | None = None  # (idem)

    @property
    def num_workers(self) -> int:
        """The worker count in force: an int, also with ``num_workers="auto"`` (the autotuner's
        count now). Setting an int later fixes the count from the next ``iter()`` on."""
        tuner = self._autotune
        return tuner.workers if tuner is not None else self.__dict__["num_workers"]

    @num_workers.setter
    def num_workers(self, value: int) -> None:
        if value == "auto":
            if self._autotune is None:
                raise ValueError("num_workers='auto' is chosen when the DataLoader is built: "
                                 "gpufeed.DataLoader(dataset, ..., num_workers='auto')")
            return
        check_num_workers(value)
        self.__dict__["num_workers"], self._autotune = value, None

    @property
    def rank(self) -> int:
        """This process's rank among the loaders that share the dataset (0 without sharding)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many ranks share the dataset (1 without sharding)."""
        return self._world_size

    def __getstate__(self) -> dict[str, Any]:
        """Pickle / ``copy.deepcopy`` the loader's configuration, as torch's DataLoader does.

        The copy iterates to the batches the original would give from its next ``iter()``
        (same sampler and generator states, epoch, seed, loaded state, stats so far); an epoch
        in progress is not carried (as in torch, whose copy starts a new iterator). Like torch,
        a loader whose persistent workers are running cannot be copied.
        """
        state = dict(self.__dict__)
        iterator = state.get("_iterator")
        if iterator is not None:
            if not (isinstance(iterator, BaseIter) and iterator.closed):
                raise NotImplementedError(
                    f"{type(self).__name__} with persistent_workers=True cannot be pickled or "
                    "copied once it has started iterating (its workers are running), as with "
                    "torch's DataLoader; copy it before the first iter(), or build a new one"
                )
            state["_iterator"] = None
        state.pop("_decode_plan", None)  # its GPU decoder: made again at the next iter()
        return state

    def __copy__(self) -> DataLoader:
        """A shallow copy, sharing a running iterator, as ``copy.copy`` of torch's gives."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # bypasses DataLoader.__setattr__'s "already initialized"

    def state_dict(self) -> dict[str, Any]:
        """The position of the batches delivered so far, the epoch and the seed, as plain
        Python values (``torch.save``-able, ``torch.load(weights_only=True)``-able).

        Over Ray Data, only between epochs (RuntimeError mid-epoch): the state resumes at the
        next epoch (NOTE [ Ray Data batches ] (4) in ``_sources/ray.py``)."""
        if not isinstance(self.dataset, RayBatches):
            return dict(self._position.state_dict(self))
        with warnings.catch_warnings():  # said below, in the error, when it applies
            warnings.simplefilter("ignore")
            state = dict(self._position.state_dict(self))
        if state["batches_delivered"] or state["delivered_ahead"]:
            raise ray_state_error(cast(int, state["epoch"]), cast(int, state["batches_delivered"]))
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue, at the next ``iter(loader)``, right after the last batch ``state`` counted.

        Raises ``ValueError`` when the dataset length, world size, rank or batch size differ.
        """
        seed = self._position.load_state_dict(self, state)
        if seed is not None:
            self.seed = seed

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` run epoch ``epoch`` (epochs otherwise count up)."""
        self._position.set_epoch(self, epoch)

    def stats(self) -> LoaderStats:
        """Per-stage timings, ring and prefetch occupancy, and counters since construction
        (never reset; docs/guides/stats.md explains every figure).

        Stages: ``fetch`` and ``collate`` (worker side), ``startup`` (your loop blocked on the
        first batch of an ``iter()``), ``wait`` (blocked on each later one), ``step`` (your
        loop's own time between batches). Counters: ``batches``, ``samples``, ``ring_slots``
        and ``ring_bytes`` (the ring's capacity and memory at the last batch handed over),
        ``ring_grow`` (slots carved), ``ring_fallback`` (batches that got no slot: with
        process workers they travel in a memory file of their own, never /dev/shm),
        ``ring_unsupported`` (batches with a tensor the ring cannot hold: nested, sparse or
        quantized, a tensor subclass, or on another device; such tensors travel torch's own
        way, as with the stock loader, and the batch equals stock's), ``worker_nice``.
        """
        snap = self._recorder.snapshot()
        if self._autotune is not None:
            snap = dataclasses.replace(snap, autotune=self._autotune.snapshot())
        return snap

    def _iter_config(self) -> IterConfig:
        """All an iterator knows of this loader, read now (NOTE [ Shutdown ] in
        ``_host/pool.py``: it holds no reference back to the loader)."""
        # A CUDA device stage needs page-locked batches to copy asynchronously: pin then too.
        on_cuda = self.device is not None and self.device.type == "cuda"
        pin = (self.pin_memory or on_cuda) and _pinning.cuda_usable()
        plan = self.__dict__.get("_decode_plan")  # the workers ship encoded images
        return IterConfig(
            dataset=self.dataset if plan is None else plan.source,
            is_iterable=isinstance(self.dataset, IterableDataset),
            auto_collation=self._auto_collation,
            whole_batches=isinstance(self.dataset, RayBatches),
            index_sampler=self._index_sampler,
            collate_fn=self.collate_fn,
            drop_last=self.drop_last,
            len_called=self._IterableDataset_len_called,
            rank=self.rank, world_size=self.world_size,
            sample_seed=self.seed if self.deterministic else None, generator=self.generator,
            position=self._position, recorder=self._recorder,
            random_watch=self._random_watch,
            pin_memory=self.pin_memory, pin=pin,
            pin_device=pin_device_index(self.device, self.pin_memory_device) if pin else None,
            device_depth=self.device_depth if self.device is not None else None,
            num_workers=self.num_workers, worker_type=self.worker_type, in_order=self.in_order,
            timeout=float(self.timeout), timeout_text=str(self.timeout),
            persistent=self.persistent_workers, worker_nice=self.worker_nice,
            prefetch_factor=self.prefetch_factor,
            # unset: gpufeed sizes work-ahead itself (NOTE [ Messages ] in _host/messages.py)
            prefetch_explicit=self.prefetch_factor is not None
            and not isinstance(self.prefetch_factor, DefaultPrefetch),
            ring_bytes=self.ring_bytes, keeper=self._keeper, late_verdict=self._late_verdict,
            worker_init_fn=self.worker_init_fn, autotune=self._autotune,
            multiprocessing_context=self.multiprocessing_context,
        )

    def check_worker_number_rationality(self) -> None:
        """torch's warning when ``num_workers`` exceeds the CPUs this process may use, in
        torch's words ("worker processes"; "worker threads" for thread workers), once per
        loader and worker count: torch repeats it at every ``iter()``."""
        kind = self.__dict__.get("worker_type")
        if kind is None or self.__dict__.get("_workers_warned") == (self.num_workers, kind):
            return  # in torch's __init__ (gpufeed's calls again), or said already
        if self._autotune is not None:  # "auto": the count is the autotuner's, in its budget
            return
        self._workers_warned = (self.num_workers, kind)
        if kind == "process":
            super().check_worker_number_rationality()
            return
        warn_thread_workers(self.num_workers)

    def _get_iterator(self) -> BaseIter:  # type: ignore[override]
        if isinstance(self.dataset, RayBatches):  # Ray's iterator, in the loop's thread
            return RayIter(self._iter_config())  # (NOTE [ Ray Data batches ] (2))
        if self.num_workers == 0:
            return SingleIter(self._iter_config())
        if self._autotune is not None:  # it keeps the CPU use within budget itself
            return AutoIter(self._iter_config())
        self.check_worker_number_rationality()
        started = time.perf_counter()
        iterator = WorkerIter(self._iter_config())
        _timeline.span_until_now(self._recorder, "start workers", started)  # NOTE [ Timeline ]
        return iterator

    def _next_base_seed_generator(self) -> torch.Generator | None:
        """What the next ``iter()`` draws a base seed from (a kept iterator draws none)."""
        it = self._iterator
        return None if isinstance(it, BaseIter) and not it.closed else self.generator

    def __iter__(self) -> Any:
        iterator = self._iterator
        if isinstance(iterator, BaseIter) and iterator.closed:  # closed by the user: afresh
            self._iterator = None
        device = parse_device(self.device) if self.device is not None else None
        batched = self._auto_collation and self.collate_fn is default_collate
        plan = self._decode_plan = decode_plan(self.dataset, device, batched=batched)
        it = super().__iter__()  # (its workers read plan.source: NOTE [ Decoding ])
        if device is None:
            return it
        return Delivered(DeviceIterator(
            it, device, depth=self.device_depth, transform=self.device_transform,
            recorder=self._recorder, decode=None if plan is None else plan.stage,
        ), self._position.current(), recorder=self._recorder,
            count_samples=self._auto_collation or isinstance(self.dataset, RayBatches))

