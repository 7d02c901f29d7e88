"""``PackedList``: a list kept in one buffer, and the copy-on-write warning for Python lists.

NOTE [ Copy-on-write and Python objects ]: a forked worker shares its parent's pages until it
writes to one. Reading a Python object writes to it (its reference count), so a worker that
walks a ``Dataset``'s list of a million strings or rows copies every page holding them: one
copy per worker, growing over the epoch (pytorch/pytorch#13246). A ``PackedList`` keeps its
items in numpy buffers (data, plus offsets for strings, bytes and variable-length rows) and
makes a Python object only for the item asked for, so its pages are never written and stay
shared. :func:`check_copy_on_write` warns once per dataset holding a large Python container.
(The cyclic collector's writes are kept out of the workers: NOTE [ Frozen heap at fork ] in
``_host/frozen_heap.py``.)
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from .._base.stats import human_bytes

COW_THRESHOLD = 100_000  # Python objects in one container before the warning fires


class CopyOnWriteWarning(UserWarning):
    """A dataset holds a large Python container that forked process workers will copy."""


class PackedList(Sequence[Any]):
    """An immutable list of strings, bytes, numbers or rows of numbers, kept in numpy buffers.

    ``items`` must be all ``str``, all ``bytes``, all numbers (``bool``, ``int`` or ``float``;
    one array), or all rows of numbers (lists, tuples or 1-D arrays: equal lengths become one
    2-D array, unequal ones one flat array plus offsets). ``packed[i]`` gives back a ``str``,
    ``bytes``, Python number, or a 1-D numpy array (a copy) for a row; slices give a new
    ``PackedList``. No per-item Python object is kept, so forked workers that read it do not
    copy it (NOTE [ Copy-on-write and Python objects ]).

    Args:
        items: any iterable of one kind of item (a list, a generator, a numpy array).
        dtype: numpy dtype for numbers and rows (default: int64 for ints, float64 for floats,
            so values come back exactly; ``np.float32`` halves the memory of float rows).
    """

    _kind: str
    _data: np.ndarray
    _offsets: np.ndarray | None

    def __init__(self, items: Iterable[Any], *, dtype: Any = None) -> None:
        self._offsets = None
        if isinstance(items, PackedList):
            self._kind, self._data, self._offsets = items._kind, items._data, items._offsets
            return
        if isinstance(items, np.ndarray) and items.dtype != object:
            self._pack_array(items, dtype)
            return
        seq = items if isinstance(items, (list, tuple)) else list(items)
        if not seq:
            self._kind, self._data = "int", np.empty(0, dtype=dtype or np.int64)
            return
        first = seq[0]
        if isinstance(first, str):
            self._pack_bytes([_need(s, str, k).encode() for k, s in enumerate(seq)], "str")
        elif isinstance(first, (bytes, bytearray, memoryview)):
            self._pack_bytes([bytes(_need(b, (bytes, bytearray, memoryview), k))
                              for k, b in enumerate(seq)], "bytes")
        elif isinstance(first, (bool, int, float, np.number, np.bool_)):
            arr = np.asarray(seq, dtype=dtype)
            if arr.ndim != 1 or arr.dtype.kind not in "biuf":
                raise TypeError("PackedList items mix numbers with other things; pass one kind "
                                "(all str, all bytes, all numbers or all rows of numbers)")
            self._pack_array(arr, None)
        elif isinstance(first, (list, tuple, np.ndarray)):
            self._pack_rows(seq, dtype)
        else:
            raise TypeError(
                f"PackedList cannot pack {type(first).__name__} items; it holds str, bytes, "
                "numbers or rows of numbers (keep other objects in a list with "
                "worker_type='thread')")

    # -- building ---------------------------------------------------------------------------
    def _pack_bytes(self, parts: list[bytes], kind: str) -> None:
        self._offsets = _offsets(parts)
        self._data = np.frombuffer(b"".join(parts), dtype=np.uint8)
        self._kind = kind

    def _pack_array(self, arr: np.ndarray, dtype: Any) -> None:
        arr = np.ascontiguousarray(arr, dtype=dtype)
        if arr.ndim == 0 or arr.ndim > 2:
            raise ValueError(f"PackedList takes a 1-D or 2-D array, got shape {arr.shape}")
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"PackedList cannot pack a numpy array of dtype {arr.dtype}; "
                            "pass numbers, or a list of str or bytes")
        self._data = arr
        self._data.flags.writeable = False
        self._kind = "row" if arr.ndim == 2 else {"b": "bool", "f": "float"}.get(
            arr.dtype.kind, "int")

    def _pack_rows(self, seq: Sequence[Any], dtype: Any) -> None:
        rows = [np.asarray(r, dtype=dtype) for r in seq]
        for k, r in enumerate(rows):
            if r.ndim != 1 or r.dtype.kind not in "biuf":
                raise TypeError(f"PackedList item {k} is not a flat row of numbers "
                                f"(shape {r.shape}, dtype {r.dtype})")
        # an empty row's dtype is numpy's default (float64), not the data's: left out, so one
        # empty document among token ids keeps them int64
        kinds = {r.dtype for r in rows if len(r)} or {rows[0].dtype}
        common = np.result_type(*kinds) if dtype is None else np.dtype(dtype)
        if len({len(r) for r in rows}) == 1:
            self._data = np.ascontiguousarray(np.stack(rows).astype(common, copy=False))
            self._kind = "row"
        else:
            self._offsets = _offsets(rows)
            self._data = np.concatenate([r.astype(common, copy=False) for r in rows])
            self._kind = "ragged"
        self._data.flags.writeable = False

    # -- reading ----------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """What the items are: "str", "bytes", "int", "float", "bool", "row" or "ragged"."""
        return self._kind

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return int(self._data.nbytes + (0 if self._offsets is None else self._offsets.nbytes))

    def __len__(self) -> int:
        return len(self._data) if self._offsets is None else len(self._offsets) - 1

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> PackedList: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            if self._offsets is None:
                return _rebuild(self._kind, self._data[index], None)
            picked = range(*index.indices(len(self)))
            if not picked:  # of the same kind, not an empty list's
                return _rebuild(self._kind, self._data[:0], np.zeros(1, dtype=np.int64))
            return PackedList([self[i] for i in picked])
        n = len(self)
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(f"PackedList indices must be ints or slices, got {index!r}") from None
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"PackedList index {index} out of range for length {n}")
        kind = self._kind
        if self._offsets is None:
            return self._data[i].copy() if kind == "row" else self._data[i].item()
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        if kind == "str":
            return self._data[a:b].tobytes().decode()
        if kind == "bytes":
            return self._data[a:b].tobytes()
        return self._data[a:b].copy()

    def __contains__(self, value: object) -> bool:
        return any(_same(item, value) for item in self)

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        n = len(self)
        for i in range(*slice(start, stop).indices(n)):
            if _same(self[i], value):
                return i
        raise ValueError(f"{value!r} is not in the PackedList")

    def count(self, value: Any) -> int:
        return sum(1 for item in self if _same(item, value))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) \
                or len(other) != len(self):
            return False
        return all(_same(a, b) for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(self[i]) for i in range(min(3, len(self))))
        more = ", ..." if len(self) > 3 else ""
        return (f"PackedList([{head}{more}], kind={self._kind!r}, len={len(self)}, "
                f"{human_bytes(self.nbytes)} packed)")

    def __reduce__(self) -> Any:
        return _rebuild, (self._kind, self._data, self._offsets)


def _rebuild(kind: str, data: np.ndarray, offsets: np.ndarray | None) -> PackedList:
    out = PackedList.__new__(PackedList)
    out._kind, out._data, out._offsets = kind, data, offsets
    return out


def _offsets(parts: Sequence[Any]) -> np.ndarray:
    """Where each of ``parts`` starts in their concatenation, and where the last ends."""
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, parts), dtype=np.int64, count=len(parts)), out=offsets[1:])
    return offsets


def _need(item: Any, kind: Any, k: int) -> Any:
    if not isinstance(item, kind):
        raise TypeError(f"PackedList item {k} is a {type(item).__name__} among items of another "
                        "kind; pass one kind (all str, all bytes, all numbers or all rows)")
    return item


def _same(a: Any, b: Any) -> bool:
    """Item ``a`` equals ``b``: a row equals a row (array, list or tuple) of the same values;
    anything else by ``==``."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        other = b if isinstance(a, np.ndarray) else a
        if not isinstance(other, (np.ndarray, list, tuple)):
            return False
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except (TypeError, ValueError):  # e.g. a ragged list against a row
            return False
    return bool(a == b)


# -- the copy-on-write warning --------------------------------------------------------------
_warned_ids: set[int] = set()
_warned: weakref.WeakSet[Any] = weakref.WeakSet()


def _objects_in(value: Any) -> int:
    """About how many Python objects ``value`` holds (0 when it holds none per item)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        n = len(value)
        if n and isinstance(value, (list, tuple)) and isinstance(value[0], (list, tuple, dict)):
            n *= 1 + len(value[0])
        return n
    if isinstance(value, dict):
        return 2 * len(value)
    if isinstance(value, np.ndarray) and value.dtype == object:
        return int(value.size)
    return 0


def _large_containers(dataset: Any, prefix: str, depth: int) -> Iterator[tuple[str, int, str]]:
    attrs = getattr(dataset, "__dict__", None)
    if not isinstance(attrs, dict):
        return
    for name, value in attrs.items():
        n = _objects_in(value)
        if n > COW_THRESHOLD:
            yield f"{prefix}{name}", n, type(value).__name__
        elif depth > 0 and hasattr(value, "__getitem__") and hasattr(value, "__dict__") \
                and not isinstance(value, (type, np.ndarray)):
            yield from _large_containers(value, f"{prefix}{name}.", depth - 1)
        elif depth > 0 and isinstance(value, (list, tuple)) and len(value) <= 16:
            for k, inner in enumerate(value):  # ConcatDataset.datasets
                if hasattr(inner, "__getitem__") and hasattr(inner, "__dict__"):
                    yield from _large_containers(inner, f"{prefix}{name}[{k}].", depth - 1)


def check_copy_on_write(dataset: Any) -> None:
    """Warn once per dataset holding a Python container of over ``COW_THRESHOLD`` objects in
    its attributes, or two levels into wrapped datasets (``Subset.dataset``,
    ``ConcatDataset.datasets``). Called when process workers start."""
    try:
        if dataset in _warned:
            return
    except TypeError:  # not weak-referenceable
        if id(dataset) in _warned_ids:
            return
    found = list(_large_containers(dataset, "", 2))
    if not found:
        return
    try:
        _warned.add(dataset)
    except TypeError:
        _warned_ids.add(id(dataset))
    name = type(dataset).__name__
    where = "; ".join(f"{name}.{attr} is a Python {kind} of ~{n:,} objects"
                      for attr, n, kind in found)
    attr = found[0][0]
    warnings.warn(
        f"{where}. Each process worker that reads it touches the objects' reference counts and "
        f"so copies the pages holding them (copy-on-write; memory grows by up to one copy per "
        f"worker over an epoch, pytorch/pytorch#13246). Remedies: store it packed, e.g. "
        f"self.{attr.rsplit('.', 1)[-1]} = gpufeed.sources.PackedList(...) (one buffer, no "
        f"per-item objects), or use DataLoader(..., worker_type='thread') (one shared copy).",
        CopyOnWriteWarning, stacklevel=4)
