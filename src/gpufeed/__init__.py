"""gpufeed: keep accelerators fed.

    gpufeed/
      __init__.py      the public API (this file)
      _loader.py       DataLoader: torch's, with worker_type, ring_bytes and device=
      _iterator.py     iterators: in the main process, or over workers; order, epochs
      _pool.py         process and thread workers: start, talk, watch, stop
      _worker.py       the worker loop and its messages
      _fetch.py        one batch: vectorised gather, __getitems__, or sample by sample
      _collate.py      collating straight into a slot; packing and unpacking leaves
      _ring.py         the slot ring: shared memory, free list, byte budget, lifetimes
      _datasets.py     ArrayDataset and the vectorised gather
      _tree.py         walking nested batches
      _errors.py       WorkerError and worker tracebacks
"""

from torch.utils.data import get_worker_info

from ._datasets import ArrayDataset
from ._errors import WorkerError
from ._loader import DataLoader

__version__ = "0.1.0"

__all__ = [
    "ArrayDataset",
    "DataLoader",
    "WorkerError",
    "__version__",
    "get_worker_info",
]
