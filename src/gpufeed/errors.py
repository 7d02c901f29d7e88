"""The exceptions and warnings gpufeed raises, in one place to catch or filter them.

::

    RuntimeError
     └── WorkerError            a worker failed: its exception, exit code or signal, and batch
    UserWarning
     ├── RandomStateWarning     a transform draws from a global generator under thread workers
     ├── CopyOnWriteWarning     a Python list in the dataset grows every process worker's memory
     ├── PageableCopyWarning    a non-blocking copy from pageable memory is not asynchronous
     ├── PinningFallbackWarning the ring could not be page-locked; copies are synchronous
     └── ThreadWorkersWarning   num_workers="auto" on thread workers the GIL holds back
"""

from ._base.errors import WorkerError
from ._device.pageable import PageableCopyWarning
from ._host.auto_iter import ThreadWorkersWarning
from ._memory.release import PinningFallbackWarning
from ._order.sample_rng import RandomStateWarning
from ._sources.packed import CopyOnWriteWarning

__all__ = [
    "CopyOnWriteWarning",
    "PageableCopyWarning",
    "PinningFallbackWarning",
    "RandomStateWarning",
    "ThreadWorkersWarning",
    "WorkerError",
]
