"""Hugging Face's ``Trainer`` and Accelerate, fed by ``gpufeed.DataLoader``: one line changes.

``accelerate.Accelerator.prepare(loader)`` rebuilds every loader as its own wrapper
(``DataLoaderShard``, or ``DataLoaderDispatcher`` with ``dispatch_batches``) around a new stock
``torch.utils.data.DataLoader``, and ``transformers.Trainer`` builds its loaders through it.
:class:`Accelerator` (its ``prepare`` and ``skip_first_batches``), :class:`Trainer` and
:class:`TrainerMixin` (for a ``Trainer`` subclass of your own) keep gpufeed's loader there.

NOTE [ Adopting Accelerate's wrapper ]: Accelerate does everything around the loader in its
wrapper, which reads its batches from one attribute, ``base_dataloader``.

(1) The wrapper stays Accelerate's own, built by Accelerate from the loader it was given: sharding
    by process (``BatchSamplerShard``, ``IterableDatasetShard``), the seedable sampler,
    ``split_batches``, ``even_batches``, ``dispatch_batches``, device placement, the
    end-of-loader flag and the remainder that ``gather_for_metrics`` drops (``GradientState``),
    ``set_epoch`` and ``skip_first_batches`` keep their meanings and their code.
(2) Only ``base_dataloader`` is replaced, by a ``gpufeed.DataLoader`` built from the stock
    arguments Accelerate gave its stock one (the batch sampler it built among them) and the
    gpufeed options of the loader it was given (or the Trainer's ``gpufeed_options``).
(3) So the batches are the stock wrapper's, sample for sample, read through gpufeed's workers,
    ring and device stage.
(4) The wrapper snapshots ``base_dataloader.state_dict()`` before each batch, for
    ``use_stateful_dataloader``; without it nothing reads the snapshot, and none is taken
    (gpufeed's ``state_dict`` would say, once per loader, what it cannot replay, for a
    checkpoint nobody makes).
(5) Adopting is idempotent: a wrapper whose base is gpufeed's is left as it is.

The wrapper's ``__class__`` reads its base's, so ``isinstance(prepared, gpufeed.DataLoader)``
holds, as ``isinstance(prepared, torch.utils.data.DataLoader)`` held before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import IterableDataset

from ._host.frameworks import adopting, refuse_double_shard
from ._loader import DataLoader

try:
    import accelerate as _accelerate
    from accelerate.data_loader import DataLoaderAdapter as _Adapter
except ImportError as _missing:  # pragma: no cover - exercised only without Accelerate
    raise ImportError(
        "gpufeed.hf needs Hugging Face Accelerate (and transformers for gpufeed.hf.Trainer): "
        "pip install accelerate transformers") from _missing

if TYPE_CHECKING:
    import transformers

__all__ = ["Accelerator", "Trainer", "TrainerMixin"]

# The gpufeed options a loader's replacement keeps as they are (NOTE [ Adopting Accelerate's
# wrapper ], rule (2)), and those a Trainer takes: not seed=, rank= or world_size=, as under
# Accelerate the order and the shard are Accelerate's, and gpufeed must not shard again.
_KEPT_OPTIONS = ("worker_type", "ring_bytes", "device_depth", "max_workers", "memory_budget",
                 "worker_nice", "deterministic")
_TRAINER_OPTIONS = frozenset({*_KEPT_OPTIONS, "device_transform", "num_workers"})


def _options_of(loader: DataLoader[Any]) -> dict[str, Any]:
    """The gpufeed options of a user's loader, to build its replacement alike (rule (2))."""
    options = {name: getattr(loader, name) for name in _KEPT_OPTIONS}
    if loader.deterministic:
        options["seed"] = loader.seed
    if loader.__dict__.get("num_workers") == "auto":
        options["num_workers"] = "auto"
    if loader.device is not None:
        options["device"] = loader.device
        options["device_transform"] = loader.device_transform
    return options


def _sampling(base: _TorchDataLoader[Any]) -> dict[str, Any]:
    """The sampling arguments that rebuild ``base``'s batches: torch sets ``batch_size`` to
    None exactly when a ``batch_sampler`` was given."""
    if isinstance(base.dataset, IterableDataset):
        return {"batch_size": base.batch_size, "drop_last": base.drop_last}
    if base.batch_size is not None:
        return {"batch_size": base.batch_size, "sampler": base.sampler,
                "drop_last": base.drop_last}
    if base.batch_sampler is not None:
        return {"batch_sampler": base.batch_sampler}
    return {"batch_size": None, "sampler": base.sampler}


_STOCK_ARGUMENTS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device")


def _rebuild(base: _TorchDataLoader[Any], options: Mapping[str, Any],
             device: torch.device | None) -> DataLoader[Any]:
    """A ``gpufeed.DataLoader`` giving the batches of the stock loader ``base`` (NOTE
    [ Adopting Accelerate's wrapper ], rule (2))."""
    kwargs = {name: getattr(base, name) for name in _STOCK_ARGUMENTS}
    kwargs |= {"in_order": getattr(base, "in_order", True), **_sampling(base), **options}
    if kwargs.get("worker_type", "process") == "process":
        kwargs["multiprocessing_context"] = base.multiprocessing_context
    elif _is_seed_worker(base.worker_init_fn):
        kwargs["worker_init_fn"] = None
    if "device" not in kwargs and device is not None and device.type == "cuda":
        kwargs["device"] = device  # the device stage copies ahead; the wrapper's move is a no-op
    return DataLoader(base.dataset, **kwargs)


def _is_seed_worker(fn: Any) -> bool:
    """Whether ``fn`` is (a ``functools.partial`` of) the Trainer's ``seed_worker``, which seeds
    the global generators: in a thread worker, those of the training loop (dropout), at every
    epoch's start. Thread workers share the loop's generators, as ``num_workers=0`` does."""
    inner = getattr(fn, "func", fn)
    return (getattr(inner, "__name__", "") == "seed_worker"
            and getattr(inner, "__module__", "").startswith("transformers."))


def _no_snapshot() -> None:
    """No ``state_dict`` snapshot per batch without ``use_stateful_dataloader`` (NOTE
    [ Adopting Accelerate's wrapper ], rule (4))."""


def _adopt(prepared: Any, options: Mapping[str, Any]) -> Any:
    """Put a gpufeed loader under Accelerate's wrapper ``prepared`` (NOTE [ Adopting
    Accelerate's wrapper ]), or rebuild a bare stock loader as a gpufeed one."""
    base = prepared.__dict__.get("base_dataloader") if isinstance(prepared, _Adapter) else None
    if base is None:
        if type(prepared) is _TorchDataLoader:  # skip_first_batches of an unprepared loader
            return _rebuild(prepared, options, None)
        return prepared  # a gpufeed loader already, or a wrapper this module does not know
    if isinstance(base, DataLoader):
        return prepared  # rule (5)
    device = getattr(prepared, "device", None)
    prepared.base_dataloader = _rebuild(base, options, device)
    if not getattr(prepared, "use_stateful_dataloader", False):
        prepared._update_state_dict = _no_snapshot  # rule (4)
    else:
        prepared.dl_state_dict = prepared.base_dataloader.state_dict()
    return prepared


def _gpufeed_base(loader: Any) -> DataLoader[Any] | None:
    """The gpufeed loader that ``loader`` is or wraps, if any."""
    base = loader.__dict__.get("base_dataloader", loader)
    return base if isinstance(base, DataLoader) else None


class Accelerator(_accelerate.Accelerator):
    """``accelerate.Accelerator``, whose ``prepare`` keeps a ``gpufeed.DataLoader`` gpufeed's.

    Everything else is Accelerate's, with the same arguments. A ``gpufeed.DataLoader`` passed to
    ``prepare`` (alone or with the model and optimizer) comes back in Accelerate's usual wrapper:
    sharded by process, placed on ``accelerator.device``, with ``split_batches``,
    ``dispatch_batches``, ``even_batches`` and ``use_seedable_sampler`` from the
    ``DataLoaderConfiguration``, the end-of-loader flag that gradient accumulation and
    ``gather_for_metrics`` read, and ``set_epoch``; its batches are the ones the stock loader
    would give there, read through gpufeed (its workers, ring, device stage with a CUDA device,
    ``stats()``). Any other loader is prepared as Accelerate prepares it.

    A loader that shards by rank itself (``seed=`` under ``torch.distributed``, or
    ``rank=``/``world_size=``) is refused, as Accelerate would shard it again.
    """

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Callable[..., Any] | None = None) -> Any:
        """Accelerate's ``prepare_data_loader``; a gpufeed loader stays gpufeed's."""
        mine = _gpufeed_base(data_loader)
        if mine is None or isinstance(data_loader, _Adapter):
            return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        refuse_double_shard(mine.rank, mine.world_size, isinstance(mine.dataset, IterableDataset))
        with adopting():
            prepared = super().prepare_data_loader(
                data_loader, device_placement=device_placement,
                slice_fn_for_dispatch=slice_fn_for_dispatch)
        return _adopt(prepared, _options_of(mine))

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Accelerate's ``skip_first_batches``: the first ``num_batches`` batches of the
        epoch are skipped by the batch sampler, unread; a gpufeed loader stays gpufeed's."""
        return _skip(dataloader, num_batches, None)


def _skip(dataloader: Any, num_batches: int, options: Mapping[str, Any] | None) -> Any:
    """``accelerate.skip_first_batches`` keeping a gpufeed loader (``options`` None: its own)."""
    mine = _gpufeed_base(dataloader)
    if mine is None:
        if options is None:
            return _accelerate.skip_first_batches(dataloader, num_batches=num_batches)
    elif options is None:
        options = _options_of(mine)
    with adopting():
        skipped = _accelerate.skip_first_batches(dataloader, num_batches=num_batches)
    return _adopt(skipped, options or {})


class TrainerMixin:
    """Mix into a ``transformers.Trainer`` (subclass) first, to read every loader it builds
    through ``gpufeed.DataLoader``: ``class MyTrainer(TrainerMixin, SFTTrainer)``.

    The Trainer builds its loaders as it always does (its ``dataloader_*`` arguments, the
    collator, column removal, ``seed_worker``, the samplers of ``train_sampling_strategy``,
    ``accelerator.prepare``); each is then read through a gpufeed loader in place of the stock
    one under Accelerate's wrapper, so the batches, their order and a mid-epoch resume (the
    Trainer's ``get_resumed_dataloader``) are the stock Trainer's.

    Args:
        gpufeed_options: gpufeed's own ``DataLoader`` options for every loader, e.g.
            ``{"worker_type": "thread"}`` or ``{"num_workers": "auto"}`` (which overrides
            ``dataloader_num_workers``). Not ``seed``, ``rank`` or ``world_size``: the Trainer's
            ``seed``/``data_seed`` and Accelerate order and shard the batches.
    """

    def __init__(self, *args: Any, gpufeed_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        options = dict(gpufeed_options or {})
        unknown = sorted(set(options) - _TRAINER_OPTIONS)
        if unknown:
            raise ValueError(
                f"gpufeed_options {unknown} cannot be given to the Trainer's loaders; it takes "
                f"{sorted(_TRAINER_OPTIONS)} (the Trainer's seed, data_seed and Accelerate's "
                "use_seedable_sampler order and shard its batches)")
        if "num_workers" in options and options["num_workers"] != "auto":
            raise ValueError(
                f"gpufeed_options num_workers={options['num_workers']!r}: only 'auto' is taken "
                "here; set a fixed count with TrainingArguments(dataloader_num_workers=...)")
        self.gpufeed_options = options
        super().__init__(*args, **kwargs)

    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, read through gpufeed."""
        return _adopt(super().get_train_dataloader(), self.gpufeed_options)  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The Trainer's evaluation loader (kept across evaluations with persistent workers,
        as the Trainer keeps it), read through gpufeed."""
        loader = super().get_eval_dataloader(eval_dataset)  # type: ignore[misc]
        return _adopt(loader, self.gpufeed_options)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The Trainer's test (``predict``) loader, read through gpufeed."""
        loader = super().get_test_dataloader(test_dataset)  # type: ignore[misc]
        return _adopt(loader, self.gpufeed_options)

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """The training loader of a mid-epoch resume: the epoch's first ``num_batches``
        batches skipped by the batch sampler, unread, the rest read through gpufeed."""
        return _skip(dataloader, num_batches, self.gpufeed_options)


def _make_trainer() -> type:
    try:
        import transformers
    except ImportError as missing:
        raise ImportError("gpufeed.hf.Trainer needs transformers: pip install transformers"
                          ) from missing

    class Trainer(TrainerMixin, transformers.Trainer):
        __doc__ = (f"``transformers.Trainer`` reading its loaders through ``gpufeed.DataLoader``"
                   f" (see :class:`TrainerMixin`).\n\n{TrainerMixin.__doc__}")

    Trainer.__module__, Trainer.__qualname__ = __name__, "Trainer"
    return Trainer


if TYPE_CHECKING:
    class Trainer(TrainerMixin, transformers.Trainer):
        ...


def __getattr__(name: str) -> Any:
    """``Trainer`` is built on first use, so that Accelerate alone serves ``Accelerator``."""
    if name == "Trainer":
        trainer = _make_trainer()
        globals()["Trainer"] = trainer
        return trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
