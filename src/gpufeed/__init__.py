"""gpufeed: keep accelerators fed.

    gpufeed/
      __init__.py      the public API (this file)
      _loader.py       DataLoader: torch's, with worker_type, ring_bytes and device=
      _base_iter.py    what both iterators share; the one without workers
      _iterator.py     the iterator over workers: dispatch, chunking, order, epochs
      _pool.py         process and thread workers: start, talk, watch, stop
      _worker.py       the worker loop and its messages
      _fetch.py        one batch: batch source, vectorised gather, __getitems__, or per sample
      _collate.py      collating straight into a slot; packing and unpacking leaves
      _ring.py         the slot ring: shared memory, free list, byte budget, lifetimes
      _release.py      release fences of pinned slots; PinningFallbackWarning
      _datasets.py     ArrayDataset and the vectorised gather
      _tree.py         walking nested batches
      _errors.py       WorkerError and worker tracebacks
      _plan.py         an epoch's batches as slices of one permutation
      _device.py       to_device and DeviceStats
      _prefetch.py     DeviceIterator: side-stream copies, events, record_stream, depth bound
      _streams.py      CUDA streams and events, and a synchronous stand-in for tests
      _pageable.py     detecting copies that cannot be asynchronous; PageableCopyWarning
      _pinning.py      cudaHostRegister of ring slots; pinning fallback batches
      _cuda.py         device guards, events, graph capture, Fences (the CUDA seams)
      _gpu_transforms.py  Normalize: uint8 -> float on the device, channels_last
      _stats.py        StatsRecorder and LoaderStats: stats as data
      _profiler.py     Profiler: the input-bound share of any loop
      _tuner.py        tune(): trials over workers, worker type, prefetch, pinning
      _doctor.py       diagnose(): shm, fd and memlock limits, CPUs, memory, GPU link
      _sampler.py      ShardedSampler (DistributedSampler semantics, resumable), seeded shuffle
      _shards.py       rank and world size; sharding iterable datasets by (rank, worker)
      _seeding.py      per-sample random state from (seed, epoch, index)
      _resume.py       Progress: state_dict / load_state_dict, epochs, resuming samplers
      _rewind.py       replaying a sampler's epoch: recorded seeds, unrewindable ones
      _state.py        the state_dict format, its checks, dataset states
      _delivery.py     counting delivered batches; iterable datasets' worker turns
      _packed.py       PackedList; the copy-on-write warning for Python lists
      _sources.py      batch sources: whole-batch reads; optional extras
      _images.py       ImageFolder: JPEG folders, simplejpeg, crops seeded per sample
      _arrow.py        datasets.Dataset / pyarrow.Table: a batch from one take
      _hdf5.py         HDF5Dataset: a handle per process, one sorted read per key
      _measure.py      measure_loader, PSS of the process tree
      _cli.py          gpufeed bench | tune | profile | doctor
      benchmarks/      python -m gpufeed.benchmarks [cpu|gpu]; the no-loader ceiling
"""

from torch.utils.data import get_worker_info

from ._arrow import ArrowDataset
from ._datasets import ArrayDataset
from ._device import DeviceIterator, DeviceStats, PageableCopyWarning, to_device
from ._doctor import DoctorReport, Finding, diagnose
from ._errors import WorkerError
from ._gpu_transforms import Normalize
from ._hdf5 import HDF5Dataset
from ._images import ImageFolder
from ._loader import DataLoader
from ._packed import CopyOnWriteWarning, PackedList
from ._profiler import Profiler, ProfileReport, profile
from ._release import PinningFallbackWarning
from ._sampler import (
    SeededRandomSampler,
    ShardedIterable,
    ShardedSampler,
    ShardInfo,
    get_shard_info,
)
from ._seeding import sample_seed
from ._stats import LoaderStats, StageStats
from ._tuner import Budget, Trial, TuneResult, tune

__version__ = "0.1.0"

__all__ = [
    "ArrayDataset",
    "ArrowDataset",
    "Budget",
    "CopyOnWriteWarning",
    "DataLoader",
    "DeviceIterator",
    "DeviceStats",
    "DoctorReport",
    "Finding",
    "HDF5Dataset",
    "ImageFolder",
    "LoaderStats",
    "Normalize",
    "PackedList",
    "PageableCopyWarning",
    "PinningFallbackWarning",
    "ProfileReport",
    "Profiler",
    "SeededRandomSampler",
    "ShardInfo",
    "ShardedIterable",
    "ShardedSampler",
    "StageStats",
    "Trial",
    "TuneResult",
    "WorkerError",
    "__version__",
    "diagnose",
    "get_shard_info",
    "get_worker_info",
    "profile",
    "sample_seed",
    "to_device",
    "tune",
]
