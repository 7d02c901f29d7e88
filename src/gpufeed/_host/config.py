"""IterConfig: all a host iterator knows of its loader.

``DataLoader._iter_config()`` builds one when an iterator starts (and, for a persistent
iterator, at each epoch: ``BaseIter._reset``). The iterators read this and never the loader:
they import nothing from ``_loader.py``, and the config holds no reference to the loader (NOTE
[ Shutdown ] in ``_host/pool.py``). Values are copied when it is built; the fields marked
"live" are objects the loader and its iterators share. A persistent iterator takes from each
epoch's config only ``sample_seed`` (``load_state_dict`` may bring another) and ``len_called``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

import torch

from .._base.stats import StatsRecorder
from .._memory.keeper import RingKeeper
from .._order.resume import LoaderPosition
from .autotune import AutoTuner
from .late_slots import LateVerdict
from .random_watch import GlobalDrawWatch

#: the type of ``DataLoader``'s ``worker_type``: a type checker catches a typo; the loader
#: raises ``ValueError`` at run time
WorkerType = Literal["process", "thread"]
WORKER_TYPES: tuple[WorkerType, ...] = get_args(WorkerType)


@dataclass(frozen=True, kw_only=True)
class IterConfig:
    """What a host iterator reads of its loader; built by ``DataLoader._iter_config()``."""

    # -- what to read, and how to batch it
    dataset: Any
    is_iterable: bool  # an ``IterableDataset``: counts, not indices, and per-worker streams
    auto_collation: bool
    whole_batches: bool = False  # each item is a batch (Ray Data): samples counted by its rows
    index_sampler: Any  # the loader's batch sampler, or its sampler without auto-collation
    collate_fn: Callable[[Any], Any] | None
    drop_last: bool
    len_called: int | None  # ``len(loader)`` of an iterable dataset, when it was asked
    rank: int
    world_size: int
    # -- seeds and order
    sample_seed: int | None  # per-sample random state (``deterministic``), else None
    generator: torch.Generator | None  # live: each iterator draws its base seed from it
    position: LoaderPosition  # live: epochs, resume, delivered batches
    recorder: StatsRecorder  # live: the loader's stats
    random_watch: GlobalDrawWatch  # live: thread workers' draws from global generators
    # -- pinning and the device stage
    pin_memory: bool  # as asked (warned about without an accelerator)
    pin: bool  # batches (or the ring) page-locked: asked for, or a CUDA device stage
    pin_device: int | None  # the device pinning runs under (resolved at iteration start)
    device_depth: int | None  # the device stage's depth; None: batches are delivered on host
    # -- workers (``num_workers > 0``)
    num_workers: int
    worker_type: WorkerType
    in_order: bool
    timeout: float  # seconds per batch; <= 0: none
    timeout_text: str  # the timeout as given: torch's message prints it so
    persistent: bool
    prefetch_factor: int | None
    prefetch_explicit: bool  # given by the user (a strict bound), not torch's default
    ring_bytes: int | None
    keeper: RingKeeper | None = None  # live: the loader's pinned ring between epochs
    late_verdict: LateVerdict | None = None  # live: its loop kept workers waiting (late_slots)
    worker_nice: int | None = None  # NOTE [ Worker priority ] (None: decided from costs)
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: Any
    autotune: AutoTuner | None = None  # live, with ``num_workers="auto"``: the loader's tuner


class ConfigSource(Protocol):
    """What torch's persistent-worker hook hands an iterator (``BaseIter._reset``)."""

    def _iter_config(self) -> IterConfig: ...
