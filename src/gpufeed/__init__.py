"""gpufeed: keep accelerators fed.

The top level holds what nearly every program touches: the loader (:class:`DataLoader`, a
drop-in for torch's with ``device=``), the device stage (:func:`to_device`, :class:`Normalize`),
the measuring tools (:func:`trace`, :func:`profile`, :func:`tune`, :func:`diagnose`), the error
a failed worker raises (:class:`WorkerError`) and ``get_worker_info`` (torch's, re-exported so
that a dataset written for gpufeed needs no second import). The rest lives in documented
submodules, each behind a sorted ``__all__``:

- :mod:`gpufeed.sources`: datasets with fast paths (``ImageFolder``, ``ImageShards``,
  ``ArrayDataset``, ``ArrowDataset``, ``HDF5Dataset``, ``PackedList``, ``batch_empty``);
- :mod:`gpufeed.samplers`: seeded, resumable, sharded samplers and ``get_shard_info``;
- :mod:`gpufeed.random`: per-sample random state that does not depend on the workers;
- :mod:`gpufeed.stats`: what ``loader.stats()`` returns;
- :mod:`gpufeed.tools`: the reports and classes behind the measuring tools;
- :mod:`gpufeed.errors`: the exceptions and warnings, to catch or filter them.

The package is laid out by the stages a batch passes through (order, sources, memory, host,
device, tools); ``docs/how-it-works/module-map.md`` is the map: one line per module, one
batch's path through them, and the index of the design NOTEs.
"""

from torch.utils.data import get_worker_info

from ._base.errors import WorkerError
from ._device.stage import to_device
from ._device.transforms import Normalize
from ._loader import DataLoader
from ._tools.doctor import diagnose
from ._tools.profiler import profile
from ._tools.trace import trace
from ._tools.tuner import tune

__version__ = "0.1.0"

# The documented submodules, reachable as attributes after `import gpufeed`.
from . import errors as errors
from . import random as random
from . import samplers as samplers
from . import sources as sources
from . import stats as stats
from . import tools as tools

__all__ = [
    "DataLoader",
    "Normalize",
    "WorkerError",
    "__version__",
    "diagnose",
    "errors",
    "get_worker_info",
    "profile",
    "random",
    "samplers",
    "sources",
    "stats",
    "to_device",
    "tools",
    "trace",
    "tune",
]
