"""gpufeed: keep accelerators fed.

    gpufeed/
      __init__.py      the public API (this file)
      _loader.py       DataLoader: torch's, with worker_type, ring_bytes and device=
      _host/iterator.py    what both iterators share; the one without workers
      _host/worker_iter.py     the iterator over workers: dispatch, chunking, order, epochs
      _host/pool.py         process and thread workers: start, talk, watch, stop
      _host/worker.py       the worker loop and its messages
      _host/fetch.py        one batch: batch source, vectorised gather, __getitems__, or per sample
      _host/collate.py      collating straight into a slot; packing and unpacking leaves
      _memory/ring.py         the slot ring: shared memory, free list, byte budget, lifetimes
      _memory/release.py      release fences of pinned slots; PinningFallbackWarning
      _sources/arrays.py     ArrayDataset and the vectorised gather
      _base/tree.py         walking nested batches
      _base/errors.py       WorkerError and worker tracebacks
      _order/plan.py         an epoch's batches as slices of one permutation
      _device/stage.py       to_device and DeviceStats
      _device/prefetch.py     DeviceIterator: side-stream copies, events, record_stream, depth bound
      _device/streams.py      CUDA streams and events, and a synchronous stand-in for tests
      _device/pageable.py     detecting copies that cannot be asynchronous; PageableCopyWarning
      _memory/pinning.py      cudaHostRegister of ring slots; pinning fallback batches
      _base/cuda.py         device guards, events, graph capture, Fences (the CUDA seams)
      _device/transforms.py  Normalize: uint8 -> float on the device, channels_last
      _base/stats.py        StatsRecorder and LoaderStats: stats as data
      _tools/profiler.py     Profiler: the input-bound share of any loop
      _tools/tuner.py        tune(): trials over workers, worker type, prefetch, pinning
      _tools/doctor.py       diagnose(): shm, fd and memlock limits, CPUs, memory, GPU link
      _order/sampler.py      ShardedSampler (DistributedSampler semantics, resumable), seeded
      shuffle
      _order/shards.py       rank and world size; sharding iterable datasets by (rank, worker)
      _order/seeding.py      per-sample random state from (seed, epoch, index)
      _order/resume.py       Progress: state_dict / load_state_dict, epochs, resuming samplers
      _order/rewind.py       replaying a sampler's epoch: recorded seeds, unrewindable ones
      _order/state.py        the state_dict format, its checks, dataset states
      _order/delivery.py     counting delivered batches; iterable datasets' worker turns
      _sources/packed.py       PackedList; the copy-on-write warning for Python lists
      _sources/protocol.py      batch sources: whole-batch reads; optional extras
      _sources/images.py       ImageFolder: JPEG folders, simplejpeg, crops seeded per sample
      _sources/arrow.py        datasets.Dataset / pyarrow.Table: a batch from one take
      _sources/hdf5.py         HDF5Dataset: a handle per process, one sorted read per key
      _tools/measure.py      measure_loader, PSS of the process tree
      _cli/main.py          gpufeed bench | tune | profile | doctor
      benchmarks/      python -m gpufeed.benchmarks [cpu|gpu]; the no-loader ceiling
"""

from torch.utils.data import get_worker_info

from ._base.errors import WorkerError
from ._base.stats import LoaderStats, StageStats
from ._device.stage import DeviceIterator, DeviceStats, PageableCopyWarning, to_device
from ._device.transforms import Normalize
from ._loader import DataLoader
from ._memory.release import PinningFallbackWarning
from ._order.sampler import (
    SeededRandomSampler,
    ShardedIterable,
    ShardedSampler,
    ShardInfo,
    get_shard_info,
)
from ._order.seeding import sample_seed
from ._sources.arrays import ArrayDataset
from ._sources.arrow import ArrowDataset
from ._sources.hdf5 import HDF5Dataset
from ._sources.images import ImageFolder
from ._sources.packed import CopyOnWriteWarning, PackedList
from ._tools.doctor import DoctorReport, Finding, diagnose
from ._tools.profiler import Profiler, ProfileReport, profile
from ._tools.tuner import Budget, Trial, TuneResult, tune

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
