"""Ray Data as a source: batches from Ray's streaming executor, copied once out of its blocks.

The batches are Ray's: the same rows in the same order, a short last batch unless
``drop_last``; how they are cut and copied: NOTE [ Ray Data batches ] (2) and (3).

NOTE [ Ray Data batches ]
-------------------------
Preprocessing that needs more CPUs than the GPU node has runs in Ray Data (``map_batches`` on
any node of the cluster); gpufeed is the last mile on the trainer. ``gpufeed.DataLoader`` takes a
``ray.data.Dataset`` or a ``ray.data.DataIterator`` (``ds.streaming_split(n)[rank]``, or
``ray.train.get_dataset_shard(name)``) and wraps it in ``RayBatches``, an iterable dataset whose
items are whole batches (the loader runs it with ``batch_size=None``):

::

    Ray's streaming executor  ->  iter_batches(batch_size=None)  ->  cut_batches    ->  the loop
    (map_batches on any node;     (Ray's threads pull blocks to       (the loop's thread: one
     blocks in the object store)   this node, numpy views of them)     copy per column)

1. Ray orders, shuffles and shards the rows; gpufeed draws no index. A sampler, ``shuffle=True``,
   ``seed=``, ``rank=``/``world_size=`` and gpufeed's own workers are refused with the Ray way to
   do the same (``check_ray_arguments``); Ray's own iteration options come through
   ``ray_options=`` (``RAY_OPTIONS``).
2. The loop's own thread iterates Ray's iterator (``RayIter``, ``_host/ray_iter.py``); no gpufeed
   thread runs: Ray's iterator already fetches and formats blocks ahead in threads of its own
   (``prefetch_batches``, 1 by default), and a loader thread in front of it added a hand-over
   per batch that cost the trainer more CPU than it overlapped. Ray hands over whole blocks
   (``iter_batches(batch_size=None)``) and the batches are cut here (``cut_batches``):
   Ray's own cutting costs the trainer about as much CPU per batch as the copy gpufeed must make
   anyway, and copies a batch that spans two blocks before gpufeed copies it again. Each number
   column is copied once, from the block's read-only object-store views, into the batch's own
   memory (page-locked when a CUDA device stage copies it ahead); Ray's views are never handed
   out nor kept past the block. Measurements:
   docs/how-it-works/measurements/sources.md#ray-data-batches. Ray's ``prefetch_batches`` then
   counts blocks: raise it where a block holds fewer rows than a batch. With Ray's local shuffle
   buffer or a ``collate_fn``, Ray cuts the batches. ``stats()`` counts each batch (``fetch``:
   Ray's wait and the copy; ``collate``: a ``collate_fn``) and ``gpufeed.trace`` draws them on
   the loop thread's "fetching" track; the device stage copies ahead as for any batch. A block
   is held until its last rows are copied, as Ray's own iterator holds it.
3. A batch is ``{column: tensor}`` as ``iter_torch_batches`` gives it, for number columns
   (bool, int, uint, float, complex); any other column (strings, objects, ragged rows, dates)
   is a numpy array of the batch's rows (a copy, never a view that would keep the whole block
   alive; an object array of one array per row where the batch spans blocks whose rows differ
   in shape, as Ray's own concatenation makes it). With a ``collate_fn``, the function gets
   Ray's numpy batch (as ``iter_torch_batches(collate_fn=)`` does) and its result is the batch.
4. Each ``iter()`` is one pass of Ray's iterator. Ray's iterator cannot start mid-pass, so a
   loader state taken mid-epoch is refused; one taken between epochs resumes at the next epoch.
5. An error in Ray (a ``map_batches`` function that raised, a task Ray gave up on) reaches the
   loop as Ray raised it, from Ray's ``next`` in the loop's thread: a ``RayTaskError`` whose
   text is Ray's (the operator, the worker process and node, the function's own traceback).
6. Ray's iterator is closed in the thread that iterates it, the loop's, as soon as the epoch
   ends, fails, or the loader's iterator is closed or dropped (the ``finally`` below,
   ``RayIter.close``): Ray then shuts its executor down (or tells the split coordinator), so no
   Ray task runs on for a loop that stopped. Ctrl-C in Ray's ``next`` interrupts the wait and
   passes through Ray's iterator, which shuts its executor down on the way out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from .arrays import Alloc, allocate, torch_dtype

#: the options of Ray's ``iter_batches`` the loader passes on (``ray_options=``)
RAY_OPTIONS = ("local_shuffle_buffer_size", "local_shuffle_seed", "prefetch_batches")


def is_ray_data(obj: Any) -> bool:
    """Whether ``obj`` is a Ray Data ``Dataset`` or ``DataIterator`` (Ray is not imported: an
    object of Ray's exists only once Ray is)."""
    data = sys.modules.get("ray.data")
    return data is not None and isinstance(obj, (data.Dataset, data.DataIterator))


_ORDER_FIX = (
    "Ray Data orders the rows: shuffle them in Ray (ds.random_shuffle() for a full shuffle, "
    "ds.randomize_block_order() for a cheap one, or ray_options={'local_shuffle_buffer_size': "
    "N} for a buffer on the trainer)"
)
_SEED_FIX = ("seed Ray's shuffle instead: ds.random_shuffle(seed=...) or "
             "ray_options={'local_shuffle_seed': ...}")
_SHARE_FIX = ("give each rank its own share: ds.streaming_split(world_size, equal=True)[rank], "
              "or ray.train.get_dataset_shard(name) under Ray Train")


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
        "seed": _SEED_FIX,
        "generator": _SEED_FIX,
        "rank": _SHARE_FIX,
        "world_size": _SHARE_FIX,
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
        batch_size, drop_last: the loader's, passed to Ray's ``iter_batches``.
        options: more ``iter_batches`` options (``RAY_OPTIONS``).
        raw: hand over Ray's numpy batch as it is (a user's ``collate_fn`` makes the batch).
        alloc: memory for a column when iterated as a dataset, else ``torch.empty`` (the
            loader's iterator gives ``batches`` its own: page-locked for a CUDA device stage).
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
        return self.batches(self.alloc)

    def batches(self, alloc: Alloc | None) -> Iterator[Any]:
        """One pass of Ray's iterator: the batches, each numeric column copied once into
        ``alloc``'s memory (rule (2)); Ray's numpy batches as they are with ``raw``."""
        cut = not self.raw and self.options.get("local_shuffle_buffer_size") is None
        stream = iter(self.source.iter_batches(
            batch_size=None if cut else self.batch_size, batch_format="numpy",
            drop_last=False if cut else self.drop_last, **self.options))
        try:
            if cut:  # whole blocks from Ray, batches cut here (rule (2))
                yield from cut_batches(stream, self.batch_size, self.drop_last, alloc)
            elif self.raw:
                yield from stream
            else:  # Ray's local shuffle buffer makes the batches
                for batch in stream:
                    yield assemble([batch], alloc)
        finally:
            # rule (6): Ray's generator is closed here, in the thread that runs it
            close: Callable[[], None] | None = getattr(stream, "close", None)
            if close is not None:
                close()

    def state_dict(self) -> dict[str, Any]:
        """Nothing to save: a pass of Ray's iterator starts from its beginning (rule (4))."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to load: the loader resumes Ray Data only at an epoch's start (rule (4))."""


def ray_state_error(epoch: int, done: int) -> RuntimeError:
    """Why a loader over Ray Data cannot save its place mid-epoch (rule (4))."""
    return RuntimeError(
        f"loader.state_dict() at batch {done} of epoch {epoch} over Ray Data cannot be resumed: "
        "Ray's iterator cannot restart in the middle of a pass. Take the state between epochs "
        "(before iter(loader) or after the loop over it ends): it resumes at the next epoch"
    )


NUMERIC = "biufc"  # numpy kinds a tensor holds: bool, int, uint, float, complex
Block = Mapping[str, np.ndarray]


def block_rows(block: Block) -> int:
    """Rows in a numpy block (0 for one without columns)."""
    for col in block.values():
        return len(col)
    return 0


def cut_batches(blocks: Iterable[Block], batch_size: int, drop_last: bool,
                alloc: Alloc | None) -> Iterator[dict[str, Any]]:
    """Batches of ``batch_size`` rows of ``blocks`` in order (the last one short unless
    ``drop_last``), each column copied once into ``alloc``'s memory (``torch.empty``
    without)."""
    pieces: list[Block] = []  # the rows of the batch being gathered, block by block
    have = 0
    for block in blocks:
        n = block_rows(block)
        start = 0
        if have:  # the batch begun in an earlier block takes this block's first rows
            take = min(batch_size - have, n)
            pieces.append(_rows(block, 0, take))
            have += take
            start = take
            if have < batch_size:
                continue
            yield assemble(pieces, alloc)
            pieces, have = [], 0
        while n - start >= batch_size:
            yield assemble([_rows(block, start, start + batch_size)], alloc)
            start += batch_size
        if start < n:
            pieces, have = [_rows(block, start, n)], n - start
    if have and not drop_last:
        yield assemble(pieces, alloc)


def _rows(block: Block, start: int, stop: int) -> dict[str, np.ndarray]:
    return {name: col[start:stop] for name, col in block.items()}


def assemble(pieces: list[Block], alloc: Alloc | None) -> dict[str, Any]:
    """One batch of ``pieces`` (consecutive rows, one or more blocks' worth): ``{column:
    tensor}`` for number columns, a numpy array of the rows for the others."""
    return {name: column([p[name] for p in pieces], alloc) for name in pieces[0]}


def column(parts: list[np.ndarray], alloc: Alloc | None) -> Any:
    """One column of a batch from its ``parts`` (one per block the batch spans)."""
    first = parts[0]
    trailing = first.shape[1:]
    if all(p.dtype.kind in NUMERIC and p.shape[1:] == trailing for p in parts):
        dtype = first.dtype if len(parts) == 1 else np.result_type(*parts)
        out = allocate(alloc, (sum(len(p) for p in parts), *trailing), torch_dtype(dtype))
        if out.numel():
            dst, at = out.numpy(), 0
            for p in parts:  # the only copy: Ray's read-only rows into the batch's memory
                np.copyto(dst[at:at + len(p)], p, casting="same_kind")
                at += len(p)
        return out
    if len(parts) == 1:
        return first.copy()
    try:
        return np.concatenate(parts)
    except ValueError:  # pieces of different shapes: one array per row
        rows = [row for p in parts for row in p]
        out_obj = np.empty(len(rows), dtype=object)
        for i, row in enumerate(rows):
            out_obj[i] = row
        return out_obj
