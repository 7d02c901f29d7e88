"""The gather lane: a planned batch of gpufeed's own gather in one step (worker side).

NOTE [ Gather lane ]
--------------------
A batch that is nothing but a gather (``MapFetcher.gathers``: an ``ArrayDataset`` or a
``TensorDataset`` with the default collate) would go the general way (the plan's slice,
``fetch``, ``gather``, a slot view per leaf, ``pack``), Python that costs a tabular batch about
half its bare gather. The lane does it in one function: ``index_select(out=)`` of each array
straight from the plan's slice (int32 or int64) into views of the slot, made once per slot.
Measurements: docs/how-it-works/measurements/host.md#gather-lane.

It gives what the general way gives (the same bytes, dtypes, shapes and kind of leaves) and
takes nothing else: :meth:`GatherLane.run` returns None and the general way, which raises the
error or does the rest, takes:

- a batch shorter than the plan's batch size, or one that does not fit the slot (spilled);
- an ``IndexError`` (a negative index, which the general way counts from the end, or one out
  of range): the slot's partial bytes are written again;
- arrays it cannot index as they are (not C-contiguous or not native byte order, requiring
  grad, dtypes ``index_select`` lacks, empty: ``GatherLane.make`` returns None), and any other
  error, after which the lane is off for the worker's life.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._memory.heap import HeapFollower
from .._memory.region import ALIGN, contiguous_at
from .._sources.arrays import torch_dtype
from .collate import leaf_ref
from .fetch import MapFetcher
from .messages import Fetched, Slot, Task
from .writer import SlotWriter, dtype_name

_VIEWS_KEPT = 4096  # slots whose views are kept (a ring has a few hundred)


class GatherLane:
    """The lane of one worker's fetcher (see NOTE [ Gather lane ])."""

    def __init__(self, sources: list[torch.Tensor]) -> None:
        self.sources = sources
        # per array: (row shape, dtype, item size, dtype's wire name, elements per row)
        self.rows = [(tuple(t.shape[1:]), t.dtype, t.element_size(), dtype_name(t.dtype),
                      math.prod(t.shape[1:])) for t in sources]
        self.refs = [leaf_ref(i) for i in range(len(sources))]
        self.on = True
        # (slot offset, slot size, rows) -> (views, leaves, used, need)
        self._slots: dict[tuple[int, int, int], tuple[list[torch.Tensor], list[Any], int, int]
                          ] = {}

    @staticmethod
    def make(arrays: Sequence[Any] | None) -> GatherLane | None:
        """A lane over ``MapFetcher.arrays``, or None where one cannot be indexed as it is."""
        if not arrays:
            return None
        sources = []
        for a in arrays:
            if isinstance(a, torch.Tensor):
                if a.requires_grad or a.device.type != "cpu" or a.layout != torch.strided:
                    return None
                t = a
            elif isinstance(a, np.ndarray) and a.flags.c_contiguous and a.dtype.isnative:
                try:
                    with warnings.catch_warnings():  # read-only memmaps: the lane only reads
                        warnings.simplefilter("ignore", UserWarning)
                        t = torch.from_numpy(a)
                except (TypeError, ValueError):
                    return None
                if t.dtype != torch_dtype(a.dtype):
                    return None
            else:
                return None
            try:  # index_select lacks some dtypes (1-D uint16 on torch 2.13)
                torch.index_select(t, 0, torch.zeros(1, dtype=torch.int64),
                                   out=torch.empty((1, *t.shape[1:]), dtype=t.dtype))
            except (RuntimeError, IndexError):  # (NotImplementedError is a RuntimeError)
                return None
            sources.append(t)
        return GatherLane(sources)

    @staticmethod
    def of(fetcher: Any) -> GatherLane | None:
        """The lane of a worker's fetcher, if its batches are gathers it can take."""
        if isinstance(fetcher, MapFetcher) and fetcher.gathers:
            return GatherLane.make(fetcher.arrays)
        return None

    def take(self, fetcher: Any, task: Task, writer: SlotWriter, heap: HeapFollower | None
             ) -> Fetched | None:
        """``task`` by the lane, or None: not planned, no slot bound, or left by :meth:`run`."""
        slot = task.slot
        if not task.planned or slot is None or slot.id < 0:
            return None
        result = self.run(fetcher, task.batch, slot, writer)
        if result is not None and heap is not None:  # as the general way follows its batches
            heap.follow_batch(result.need)
        return result

    def run(self, fetcher: Any, k: int, slot: Slot, writer: SlotWriter) -> Fetched | None:
        """Batch ``k`` of the plan gathered into ``slot``, or None (NOTE [ Gather lane ])."""
        plan = fetcher.plan
        bs = plan.batch_size
        lo = k * bs
        if plan.single or lo + bs > plan.n:
            return None
        t0 = time.perf_counter()
        perm = plan.perm
        idx = torch.arange(lo, lo + bs) if perm is None else perm[lo:lo + bs]
        kept = self._slots.get((slot.offset, slot.size, bs))
        if kept is None:
            kept = self._carve(writer, slot, bs)
            if kept is None:
                return None
        views, leaves, used, need = kept
        writer.begin(slot.offset, slot.size, slot.id)
        try:
            for src, out in zip(self.sources, views, strict=True):
                torch.index_select(src, 0, idx, out=out)
        except IndexError:
            return None
        except Exception:
            self.on = False
            return None
        t1 = time.perf_counter()
        return tuple.__new__(Fetched, (  # in C: a NamedTuple's __new__ is Python code
            k, slot.id, used, need, (self.refs.copy(), leaves), t1 - t0, 0.0, None, None, False,
            t0))

    def _carve(self, writer: SlotWriter, slot: Slot, bs: int
               ) -> tuple[list[torch.Tensor], list[Any], int, int] | None:
        """Views of ``slot`` for a full batch, and their leaves; None if it does not fit."""
        views, leaves = [], []
        cur = need = used = 0
        for shape, dtype, isz, name, per_row in self.rows:
            nbytes = bs * per_row * isz
            if cur + nbytes > slot.size:
                return None
            full = (bs, *shape)
            views.append(contiguous_at(writer.typed(dtype), full, (slot.offset + cur) // isz))
            leaves.append((cur // isz, name, full, None, False, False))
            used = cur + nbytes
            step = (nbytes + ALIGN - 1) // ALIGN * ALIGN
            need += step
            cur += step
        if len(self._slots) >= _VIEWS_KEPT:
            self._slots.clear()
        self._slots[(slot.offset, slot.size, bs)] = (views, leaves, used, need)
        return views, leaves, used, need
