"""Ray Data as a source: batches from Ray's streaming executor, written into the ring.

NOTE [ Ray Data batches ]
-------------------------
Preprocessing that needs more CPUs than the GPU node has runs in Ray Data (``map_batches`` on
any node of the cluster); gpufeed is the last mile on the trainer. ``gpufeed.DataLoader`` takes a
``ray.data.Dataset`` or a ``ray.data.DataIterator`` (``ds.streaming_split(n)[rank]``, or
``ray.train.get_dataset_shard(name)``) and wraps it in ``RayBatches``, an iterable dataset whose
items are whole batches (the loader runs it with ``batch_size=None``):

::

    Ray's streaming executor  ->  iter_batches(batch_format="numpy")  ->  RayBatches  ->  ring
    (map_batches on any node;     (Ray's prefetch thread pulls blocks     one copy per      slot
     blocks in the object store)   to this node, slices batches)          column into it

1. Ray orders, shuffles and shards the rows; gpufeed draws no index. A sampler, ``shuffle=True``,
   ``seed=``, ``rank=``/``world_size=`` and gpufeed's own workers are refused with the Ray way to
   do the same (``check_ray_arguments``); Ray's own iteration options come through
   ``ray_options=`` (``RAY_OPTIONS``).
2. One thread of the loader (a thread worker, ``DataLoader._get_iterator``) iterates Ray's
   iterator and writes each numeric column of a batch into the batch's slot (``alloc``: the
   slot's memory, page-locked with CUDA), so the loop gets tensors that the device stage copies
   ahead like any other batch, and ``stats()`` and ``gpufeed.trace`` see the fetches as any
   thread worker's. The numpy views Ray hands over (read-only, in the object store) are copied
   once, into the slot, and never kept. The thread works a strict two batches ahead (Ray's
   ``prefetch_batches`` fetches ahead too): left to size its own work-ahead it carved some 26
   slots of a 1.5 MB batch every epoch, whose first writes cost more trainer CPU than the copy
   (2.5 against 1.0 ms a batch).
3. A batch is ``{column: tensor}`` as ``iter_torch_batches`` gives it; a column numpy cannot
   make a number array of (strings, ragged rows) stays the numpy array Ray gives. With a
   ``collate_fn``, the function gets Ray's numpy batch (as ``iter_torch_batches(collate_fn=)``
   does) and its result is the batch.
4. Each ``iter()`` is one pass of Ray's iterator. Ray's iterator cannot start mid-pass, so a
   loader state taken mid-epoch is refused; one taken between epochs resumes at the next epoch.
5. An error in Ray (a ``map_batches`` function that raised, a task Ray gave up on) reaches the
   loop as Ray raised it: its type (``RayTaskError``, whose text is Ray's), the operator, the
   worker process and node it ran in, the function's own traceback and message.
6. The iterator is closed in the thread that iterates it, as soon as the epoch ends, fails or is
   dropped (the ``finally`` below): Ray then shuts its executor down (or tells the split
   coordinator), so no Ray task keeps running for a loop that stopped. A loop that stops
   (Ctrl-C, ``break``) while the thread waits in Ray's ``next`` is left at once; the thread
   closes Ray's iterator when that batch comes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from .arrays import Alloc, allocate, torch_dtype

#: the options of Ray's ``iter_batches`` the loader passes on (``ray_options=``)
RAY_OPTIONS = ("local_shuffle_buffer_size", "local_shuffle_seed", "prefetch_batches")
_NUMERIC = "biufc"


def is_ray_data(obj: Any) -> bool:
    """Whether ``obj`` is a Ray Data ``Dataset`` or ``DataIterator`` (Ray is not imported: an
    object of Ray's exists only once Ray is)."""
    data = sys.modules.get("ray.data")
    if data is None:
        return False
    return isinstance(obj, (data.Dataset, data.DataIterator))


_ORDER_FIX = (
    "Ray Data orders the rows: shuffle them in Ray (ds.random_shuffle() for a full shuffle, "
    "ds.randomize_block_order() for a cheap one, or ray_options={'local_shuffle_buffer_size': "
    "N} for a buffer on the trainer)"
)


def check_ray_arguments(source: Any, **given: Any) -> None:
    """Refuse an argument that cannot apply to a Ray Data source, naming what to use instead
    (NOTE [ Ray Data batches ] (1))."""
    batch_size, options = given.pop("batch_size"), given.pop("ray_options")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"batch_size={batch_size!r}: over Ray Data the loader takes batches of a fixed "
            "number of rows from Ray's iter_batches; give batch_size=N (N >= 1)"
        )
    name = type(source).__name__
    fixes = {
        "shuffle": _ORDER_FIX,
        "sampler": _ORDER_FIX,
        "batch_sampler": _ORDER_FIX + "; give batch_size=N",
        "seed": "seed Ray's shuffle instead: ds.random_shuffle(seed=...) or "
                "ray_options={'local_shuffle_seed': ...}",
        "generator": "seed Ray's shuffle instead: ds.random_shuffle(seed=...) or "
                     "ray_options={'local_shuffle_seed': ...}",
        "rank": "give each rank its own share: ds.streaming_split(world_size, equal=True)[rank], "
                "or ray.train.get_dataset_shard(name) under Ray Train",
        "world_size": "give each rank its own share: ds.streaming_split(world_size, "
                      "equal=True)[rank], or ray.train.get_dataset_shard(name) under Ray Train",
        "num_workers": "preprocessing runs in Ray's workers: scale it with "
                       "ds.map_batches(fn, concurrency=N, num_cpus=...) on any node, and "
                       "leave num_workers=0",
        "worker_init_fn": "run set-up in Ray's workers: a callable class in map_batches "
                          "(its __init__ runs once per worker)",
        "persistent_workers": "Ray's workers persist as Ray schedules them; leave "
                              "persistent_workers=False",
        "prefetch_factor": "Ray fetches ahead: ray_options={'prefetch_batches': N}; the "
                           "device stage copies device_depth batches ahead",
        "multiprocessing_context": "Ray starts its own workers; leave multiprocessing_context "
                                   "unset",
    }
    for arg, value in given.items():
        if value is None or value is False or (arg == "num_workers" and value == 0):
            continue  # left as it defaults
        raise ValueError(f"{arg}={value!r} cannot apply to a Ray Data {name}: {fixes[arg]}")
    if options is not None:
        if not isinstance(options, Mapping):
            raise TypeError(f"ray_options must be a dict of Ray iter_batches options, "
                            f"got {type(options).__name__}")
        unknown = sorted(set(options) - set(RAY_OPTIONS))
        if unknown:
            raise ValueError(
                f"ray_options: {', '.join(map(repr, unknown))} not taken; the loader passes "
                f"{', '.join(RAY_OPTIONS)} to Ray's iter_batches (batch_size and drop_last "
                "are the loader's own arguments)"
            )


class RayBatches(IterableDataset[Any]):
    """Batches of a Ray Data ``Dataset`` or ``DataIterator`` (NOTE [ Ray Data batches ]).

    Args:
        source: the Ray ``Dataset`` or ``DataIterator``.
        batch_size, drop_last: the loader's, passed to Ray's ``iter_batches``.
        options: more ``iter_batches`` options (``RAY_OPTIONS``).
        raw: hand over Ray's numpy batch as it is (a user's ``collate_fn`` makes the batch).
        alloc: memory for a column (the slot's, from the loader), else ``torch.empty``.
    """

    def __init__(self, source: Any, *, batch_size: int, drop_last: bool,
                 options: Mapping[str, Any] | None = None, raw: bool = False,
                 alloc: Alloc | None = None) -> None:
        self.source = source
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.options = dict(options or {})
        self.raw = raw
        self.alloc = alloc

    def __repr__(self) -> str:
        return f"RayBatches({type(self.source).__name__}, batch_size={self.batch_size})"

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.source.iter_batches(
            batch_size=self.batch_size, batch_format="numpy", drop_last=self.drop_last,
            **self.options))
        try:
            for batch in batches:
                yield batch if self.raw else self.to_tensors(batch)
        finally:
            # rule (6): Ray's generator is closed here, in the thread that runs it
            close: Callable[[], None] | None = getattr(batches, "close", None)
            if close is not None:
                close()

    def state_dict(self) -> dict[str, Any]:
        """Nothing to save: a pass of Ray's iterator starts from its beginning (rule (4))."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to load: the loader resumes Ray Data only at an epoch's start (rule (4))."""

    def to_tensors(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``{column: tensor}``, each numeric column copied once into ``alloc``'s memory."""
        return {name: self._column(col) for name, col in batch.items()}

    def _column(self, col: Any) -> Any:
        if not isinstance(col, np.ndarray) or col.dtype.kind not in _NUMERIC:
            return col  # rule (3): strings, objects, ragged rows stay as Ray gives them
        out = allocate(self.alloc, col.shape, torch_dtype(col.dtype))
        if col.size:
            np.copyto(out.numpy(), col, casting="no" if col.dtype.isnative else "equiv")
        return out


def ray_state_error(epoch: int, done: int) -> RuntimeError:
    """Why a loader over Ray Data cannot save its place mid-epoch (rule (4))."""
    return RuntimeError(
        f"loader.state_dict() at batch {done} of epoch {epoch} over Ray Data cannot be resumed: "
        "Ray's iterator cannot restart in the middle of a pass. Take the state between epochs "
        "(before iter(loader) or after the loop over it ends): it resumes at the next epoch"
    )
