"""gpufeed: keep accelerators fed.

This module is the public API: everything a user imports is here, in ``__all__``. The package
is laid out by the stages a batch passes through (order, sources, memory, host, device, tools);
``docs/how-it-works/module-map.md`` is the map: one line per module, one batch's path through
them, and the index of the design NOTEs.
"""

from torch.utils.data import get_worker_info

from ._base.errors import WorkerError
from ._base.stats import DeviceStats, LoaderStats, StageStats
from ._base.tuning import AutotuneStats, TuningDecision
from ._device.pageable import PageableCopyWarning
from ._device.prefetch import DeviceIterator
from ._device.stage import to_device
from ._device.transforms import Normalize
from ._host.config import WorkerType
from ._host.output import batch_empty
from ._loader import DataLoader
from ._memory.release import PinningFallbackWarning
from ._order.sample_rng import RandomStateWarning, sample_generator, sample_random, sample_rng
from ._order.sampler import (
    SeededRandomSampler,
    ShardedIterable,
    ShardedSampler,
    ShardInfo,
    get_shard_info,
)
from ._order.seeding import sample_seed
from ._sources.arrays import ArrayDataset
from ._sources.hdf5 import HDF5Dataset
from ._sources.images import ImageFolder
from ._sources.packed import CopyOnWriteWarning, PackedList
from ._sources.padded import ArrowDataset
from ._sources.tarimages import ImageShards
from ._tools.doctor import DoctorReport, Finding, diagnose
from ._tools.profiler import Profiler, ProfileReport, profile
from ._tools.trace import Trace, trace
from ._tools.tuner import Budget, Trial, TuneResult, tune

__version__ = "0.1.0"

# The documented submodules, reachable as attributes after `import gpufeed`.
from . import errors as errors
from . import random as random
from . import samplers as samplers
from . import sources as sources
from . import stats as stats
from . import tools as tools

__all__ = [
    "ArrayDataset",
    "ArrowDataset",
    "AutotuneStats",
    "Budget",
    "CopyOnWriteWarning",
    "DataLoader",
    "DeviceIterator",
    "DeviceStats",
    "DoctorReport",
    "Finding",
    "HDF5Dataset",
    "ImageFolder",
    "ImageShards",
    "LoaderStats",
    "Normalize",
    "PackedList",
    "PageableCopyWarning",
    "PinningFallbackWarning",
    "ProfileReport",
    "Profiler",
    "RandomStateWarning",
    "SeededRandomSampler",
    "ShardInfo",
    "ShardedIterable",
    "ShardedSampler",
    "StageStats",
    "Trace",
    "Trial",
    "TuneResult",
    "TuningDecision",
    "WorkerError",
    "WorkerType",
    "__version__",
    "batch_empty",
    "diagnose",
    "get_shard_info",
    "get_worker_info",
    "profile",
    "sample_generator",
    "sample_random",
    "sample_rng",
    "sample_seed",
    "to_device",
    "trace",
    "tune",
]
