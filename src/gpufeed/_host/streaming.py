"""Collating a batch sample by sample: each large tensor goes into its row of the slot at once.

NOTE [ Streamed collation ]
---------------------------
With the default ``collate_fn``, a dataset read one sample at a time makes the stock loader's
worker hold every sample of the batch, then stack them into a second copy: its memory peaks at
two batches. When the first sample has tensors (or numeric numpy arrays) of ``STREAM_BYTES`` or
more, gpufeed allocates the batch's stacked tensors in the slot at once
(``SlotWriter.alloc_any``), copies each sample's large tensors into their rows as it comes, and
keeps only its *skeleton*: containers and small leaves, each copied tensor replaced by a
marker. The worker then holds at most one sample besides the batch, at the same rate.
Measurements: docs/how-it-works/measurements/host.md#streamed-collation.

The batch is ``default_collate``'s (values, dtypes, shapes, strides, container types, error
messages): torch's own ``collate`` collates the skeletons with the loader's rules
(``collate_rules``) plus one that answers each marker's column with its stacked tensor. Only
plain containers are walked (``tuple``, ``list``, ``dict``, named tuples); anything else, and
small tensors, are collated at the end as usual.

A sample that does not match the first (another number of large tensors, or one of another
shape, dtype, or kind), a marker's column holding anything else, or any error while collating
the skeletons ends the streaming: the samples so far are rebuilt with views of their rows and
collated the ordinary way, which gives ``default_collate``'s own result or error. The rows
keep their space and the ordinary way takes more: a cost only batches whose samples differ pay.

Walking and copying row by row costs about 10 us of Python per sample more than one stack, so
a batch is streamed only when its first sample took ``STREAM_MIN_S`` or more to fetch, where
that is under 5% (image decoding takes milliseconds).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import collate, np_str_obj_array_pattern

from .collate import collate_into, collate_rules, ringable
from .writer import SlotWriter

# NOTE [ Streamed collation ]'s thresholds.
STREAM_BYTES = 32 * 1024
STREAM_MIN_S = 200e-6


class _Marker:
    """Stands for the ``i``-th large tensor of a sample in its skeleton."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<gpufeed streamed tensor {self.i}>"


_MARKERS: dict[int, _Marker] = {}


def _marker(i: int) -> _Marker:
    """The one marker of index ``i`` (``setdefault`` is atomic: thread workers agree)."""
    m = _MARKERS.get(i)
    return m if m is not None else _MARKERS.setdefault(i, _Marker(i))


class _Mismatch(Exception):
    """A sample (or a column) that the streamed batch cannot take: collate the ordinary way."""


def _large(x: Any) -> tuple[torch.Tensor, bool] | None:
    """``x`` as a tensor to copy into a row, and whether it was a numpy array; or None."""
    t = type(x)
    if t is torch.Tensor:
        if (x.nbytes < STREAM_BYTES or x.requires_grad or not ringable(x) or x.is_conj()
                or x.is_neg()):  # (a lazy conjugate or negation: its bytes are not its values)
            return None
        return x, False
    if t is np.ndarray:
        if (x.nbytes < STREAM_BYTES or not x.dtype.isnative or x.dtype.kind not in "biufc"
                or np_str_obj_array_pattern.search(x.dtype.str) is not None):
            return None
        # Converted as default_collate converts it.
        return torch.as_tensor(x), True
    return None


def _walk(x: Any, leaf: Callable[[Any], Any]) -> Any:
    """``x`` with its plain containers rebuilt and the rest given to ``leaf``, in order."""
    t = type(x)
    if t is tuple or t is list:
        return t([_walk(v, leaf) for v in x])
    if t is dict:
        return {k: _walk(v, leaf) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(t, "_fields") and hasattr(t, "_make"):
        return t._make([_walk(v, leaf) for v in x])
    return leaf(x)


def _skeleton(x: Any, found: list[tuple[torch.Tensor, bool]]) -> Any:
    """``x`` with each large tensor replaced by its marker (appended to ``found``)."""
    def leaf(v: Any) -> Any:
        big = _large(v)
        if big is None:
            return v
        found.append(big)
        return _marker(len(found) - 1)

    return _walk(x, leaf)


def _rebuild(x: Any, views: list[Any]) -> Any:
    """A skeleton with its markers replaced by ``views`` (the rows of one sample)."""
    return _walk(x, lambda v: views[v.i] if type(v) is _Marker else v)


def _copy_row(row: torch.Tensor, t: torch.Tensor) -> None:
    """``row.copy_(t)``, as a ``memmove`` where ``t`` is contiguous (``copy_`` costs a few
    microseconds more, a large share of a 100 KB row's copy)."""
    if t.is_contiguous():
        ctypes.memmove(row.data_ptr(), t.data_ptr(), t.nbytes)
    else:
        row.copy_(t)


class StreamedBatch:
    """A batch of at most ``n`` samples collated as they come (NOTE [ Streamed collation ]):
    ``start``, ``add`` each later sample, ``finish``. ``copy_s``: time spent copying rows."""

    __slots__ = ("copy_s", "n", "outs", "pending", "rows", "skeletons", "specs", "writer")

    def __init__(self, writer: SlotWriter, n: int,
                 found: list[tuple[torch.Tensor, bool]], skeleton: Any) -> None:
        self.writer = writer
        self.n = n
        self.specs = [(t.shape, t.dtype, is_numpy) for t, is_numpy in found]
        self.outs = [writer.alloc_any((n, *t.shape), t.dtype) for t, _ in found]
        self.rows = [out.unbind(0) for out in self.outs]
        self.skeletons: list[Any] = []
        # Samples taken after a mismatch, as they are.
        self.pending: list[Any] = []
        self.copy_s = 0.0
        self._copy(found, skeleton)

    @classmethod
    def start(cls, sample: Any, writer: SlotWriter | None, n: int, fetch_s: float = 1.0
              ) -> StreamedBatch | None:
        """The batch begun with ``sample`` (``fetch_s`` to fetch), or None: not worth it."""
        if writer is None or n < 2 or fetch_s < STREAM_MIN_S:
            return None
        found: list[tuple[torch.Tensor, bool]] = []
        skeleton = _skeleton(sample, found)
        if not found:
            return None
        return cls(writer, n, found, skeleton)

    def _copy(self, found: list[tuple[torch.Tensor, bool]], skeleton: Any) -> None:
        k = len(self.skeletons)
        t0 = time.perf_counter()
        for rows, (t, _) in zip(self.rows, found, strict=True):
            _copy_row(rows[k], t)
        self.copy_s += time.perf_counter() - t0
        self.skeletons.append(skeleton)

    def add(self, sample: Any) -> None:
        """Take the next sample: into the rows, or as it is once a sample did not match."""
        if self.pending:
            self.pending.append(sample)
            return
        found: list[tuple[torch.Tensor, bool]] = []
        skeleton = _skeleton(sample, found)
        specs = self.specs
        if len(found) != len(specs) or any(
                t.shape != shape or t.dtype != dtype or is_numpy != was_numpy
                for (t, is_numpy), (shape, dtype, was_numpy) in zip(found, specs, strict=True)):
            self.pending.append(sample)
            return
        self._copy(found, skeleton)

    def __len__(self) -> int:
        return len(self.skeletons) + len(self.pending)

    def samples(self) -> list[Any]:
        """The samples taken, rebuilt with views of their rows."""
        out = []
        for k, skeleton in enumerate(self.skeletons):
            views = [rows[k].numpy() if is_numpy else rows[k]
                     for rows, (_, _, is_numpy) in zip(self.rows, self.specs, strict=True)]
            out.append(_rebuild(skeleton, views))
        return out + self.pending

    def finish(self) -> Any:
        """The collated batch of the samples taken (``default_collate``'s)."""
        m = len(self.skeletons)
        if self.pending:
            return collate_into(self.samples(), self.writer)
        outs = self.outs if m == self.n else [out[:m] for out in self.outs]
        # The markers whose columns were answered.
        seen = []

        def column(batch: list[Any], *, collate_fn_map: Any = None) -> torch.Tensor:
            first = batch[0]
            for b in batch:
                if b is not first:
                    raise _Mismatch
            seen.append(first)
            return outs[first.i]

        rules = collate_rules(self.writer)
        rules[_Marker] = column
        try:
            batch = collate(self.skeletons, collate_fn_map=rules)
            # A marker's column was never reached.
            if len(seen) != len(outs):
                raise _Mismatch
        except Exception:
            # The ordinary way gives default_collate's own result or error.
            return collate_into(self.samples(), self.writer)
        return batch


