"""Hugging Face ``datasets.Dataset`` and ``pyarrow.Table``: a batch from one ``take``.

NOTE [ Arrow batches ]: the stock loader turns each row into Python objects, then
``default_collate`` turns them back into tensors. Here a batch is one ``take`` of its rows from
the Arrow table; each numeric column (and each list column whose rows have one length) becomes
one numpy array written straight into the slot, strings a list of ``str`` (``numpy.str_``
where the format gives those). For a ``datasets.Dataset`` what the stock path makes of a
column depends on the format (``None``: a list column becomes a *list* of per-position float64
tensors; ``"numpy"``: float64 scalars become float32; ...), so the first batch is also fetched
the stock way on two rows and each column's fast result is checked against it, dtype and
layout included; a column that does not match exactly (nested features, images, nulls, a
custom transform) sends every batch down the stock path. One batch goes the stock way when the
column's dtype cannot hold its integers (uint64 above int64's range: never wrapped by a cast),
an index is out of range (for the dataset's own IndexError) or its list rows differ in length
(which raises as the stock loader does). A ``pyarrow.Table`` has no stock meaning: its batch is
``{column: tensor}`` in Arrow's own dtypes (lists of one length: ``(B, L)``), strings and other
columns as lists of Python values, each column's form decided once on the whole table (a null,
or list rows of different lengths, anywhere make it Python values in every batch), so that no
column is a tensor in one batch and a list in the next. Negative indices count from the end,
as ``dataset[i]`` counts them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from .arrays import Alloc, allocate, torch_dtype
from .protocol import index_array, wrap_indices

_FAST_FORMATS = (None, "numpy", "torch", "np", "pt")


def arrow_source(dataset: Any) -> Any:
    """An :class:`ArrowSource` for a ``datasets.Dataset`` or ``pyarrow.Table``, else None."""
    hf = sys.modules.get("datasets")
    if hf is not None and isinstance(dataset, hf.Dataset):
        fmt = dataset.format
        if fmt.get("type") not in _FAST_FORMATS or fmt.get("output_all_columns"):
            return None
        return ArrowSource(dataset, hf=True)
    pa = sys.modules.get("pyarrow")
    if pa is not None and isinstance(dataset, pa.Table):
        return ArrowSource(dataset, hf=False)
    return None


class ArrowSource:
    """Reads a batch of rows with one ``take`` (NOTE [ Arrow batches ])."""

    def __init__(self, dataset: Any, *, hf: bool) -> None:
        self.dataset = dataset
        self.hf = hf
        self.table = dataset.with_format(
            "arrow", columns=dataset.format.get("columns")) if hf else dataset
        # name -> ("tensor"|"columns"|"str"|"pylist", dtype); a table's is fixed for good here
        self.plan: dict[str, Any] | None = None if hf else _table_plan(dataset)
        self.stock_only = False
        self.raw = _raw_table(dataset) if hf else None

    def _rows(self, idx: np.ndarray) -> Any:
        """Rows ``idx`` (in range, none negative: ``batch`` sees to both) as an Arrow table."""
        if self.raw is not None:  # the Arrow table itself: a fifth of the cost of __getitem__
            table, mapping = self.raw
            return table.take(idx if mapping is None else mapping.take(idx))
        return self.table[idx.tolist()] if self.hf else self.table.take(idx)

    def gpufeed_samples(self, indices: Sequence[int], *, seed: int | None, epoch: int) -> Any:
        return samples(self.dataset, index_array(indices), hf=self.hf)

    def gpufeed_batch(self, indices: Sequence[int], *, seed: int | None, epoch: int,
                      alloc: Any) -> Any:
        return self.batch(index_array(indices), alloc)

    def batch(self, idx: np.ndarray, alloc: Alloc | None) -> Any:
        """The batch of rows ``idx`` (an index array), its tensors from ``alloc``."""
        n = len(self.dataset)
        low, high = (int(idx.min()), int(idx.max())) if len(idx) else (0, 0)
        if high >= n or low < -n:  # Arrow's take would name it in its own words
            if self.hf:  # the dataset's IndexError, as the stock loader raises it
                return default_collate(self.dataset.__getitems__(idx.tolist()))
            bad = high if high >= n else low
            raise IndexError(f"index {bad} is out of range for a table of {n} rows")
        if low < 0:  # from the end, as the dataset's [i] counts
            idx = wrap_indices(idx, n)
        if self.plan is None:
            self.plan = self._calibrate(idx[:2])
        if self.stock_only:
            return default_collate(self.dataset.__getitems__(idx.tolist()))
        rows = self._rows(idx)
        out: dict[str, Any] = {}
        for name in rows.column_names:
            value = _column(rows.column(name), self.plan.get(name), alloc)
            if value is None:  # rows of different lengths, or nulls: the stock path decides
                if not self.hf:
                    out[name] = rows.column(name).to_pylist()
                    continue
                return default_collate(self.dataset.__getitems__(idx.tolist()))
            out[name] = value
        return out

    def _calibrate(self, probe: np.ndarray) -> dict[str, Any]:
        """Per column: how the stock path lays it out; a mismatch sends batches the stock way."""
        want = default_collate(self.dataset.__getitems__(probe.tolist()))
        rows = self._rows(probe)
        plan: dict[str, Any] = {}
        if not isinstance(want, dict) or list(want) != rows.column_names:
            self.stock_only = True
            return plan
        for name in rows.column_names:
            stock = want[name]
            if isinstance(stock, torch.Tensor):
                plan[name] = ("tensor", stock.dtype)
            elif isinstance(stock, list) and stock and all(
                    isinstance(t, torch.Tensor) and t.dim() == 1 for t in stock):
                plan[name] = ("columns", stock[0].dtype)
            elif isinstance(stock, list) and stock and all(
                    type(s) is type(stock[0]) for s in stock) and type(stock[0]) in (str, np.str_):
                plan[name] = ("str", type(stock[0]))  # numpy's format gives numpy.str_
            else:
                self.stock_only = True
                return plan
            try:
                got = _column(rows.column(name), plan[name], None)
            except (TypeError, ValueError, RuntimeError):  # a dtype numpy cannot hold, ...
                got = None
            if got is None or not _same(stock, got):
                self.stock_only = True
                return plan
        return plan


def samples(data: Any, idx: np.ndarray, *, hf: bool) -> Any:
    """Rows ``idx`` of a ``datasets.Dataset`` (``hf``) or ``pyarrow.Table`` as the stock path
    gives them: the dataset's own ``__getitems__``, or the table's rows as dicts."""
    if hf:
        return data.__getitems__(idx.tolist())
    return data.take(wrap_indices(idx, data.num_rows)).to_pylist()  # from the end, as a list


def _raw_table(dataset: Any) -> tuple[Any, Any] | None:
    """(the format's columns of the dataset's Arrow table, its row mapping or None) where
    ``datasets`` 2.x-5.x exposes them (``data.table``, ``_indices``); else None (reads go
    through ``__getitem__``). Either way ``_calibrate`` checks the first batch."""
    import pyarrow as pa

    table = getattr(getattr(dataset, "data", None), "table", None)
    indices = getattr(dataset, "_indices", None)
    if not isinstance(table, pa.Table):
        return None
    mapping = None
    if indices is not None:
        inner = getattr(indices, "table", None)
        if not isinstance(inner, pa.Table) or inner.num_columns != 1:
            return None
        mapping = inner.column(0)
    columns = dataset.format.get("columns") or table.column_names
    try:
        return table.select(list(columns)), mapping
    except (KeyError, ValueError, pa.ArrowInvalid):
        return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and bool(torch.equal(a, b))
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b, strict=True))
    return bool(type(a) is type(b) and a == b)  # str and numpy.str_ too: as stock gives it


def _column(col: Any, plan: Any, alloc: Alloc | None) -> Any:
    """One column of a batch, as ``plan`` says; None when it cannot be done without objects."""
    import pyarrow as pa

    kind, dtype = plan if plan is not None else (None, None)
    if kind == "pylist":
        return col.to_pylist()
    if kind == "str" or (kind is None and pa.types.is_string(col.type)):
        if col.null_count:
            return None
        values = col.to_pylist()  # str values
        return values if dtype in (None, str) else list(map(dtype, values))
    if col.null_count:
        return None
    if numeric_type(col.type):
        arr = col.to_numpy()
    elif numeric_list(col.type):
        flat = col.combine_chunks()
        lengths = pa.compute.list_value_length(flat).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            return None
        values = flat.flatten()
        if values.null_count:
            return None
        arr = values.to_numpy(zero_copy_only=False).reshape(len(col), -1)
    else:
        return None if plan is not None else col.to_pylist()
    if dtype is None:
        dtype = torch_dtype(arr.dtype)
    elif not _fits(arr, dtype):  # e.g. uint64 above int64's range: never wrapped silently,
        return None  # the stock path decides (it raises, as the stock loader does)
    if kind == "columns":
        if arr.ndim != 2:
            return None
        dst = allocate(alloc, (arr.shape[1], arr.shape[0]), dtype)
        _copy(dst, arr.T)
        return list(dst)
    dst = allocate(alloc, arr.shape, dtype)
    _copy(dst, arr)
    return dst


def _fits(arr: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether integers ``arr`` keep their values as ``dtype`` (True for other kinds: a float
    cast rounds as the stock path's does; ``_calibrate`` compares the first rows)."""
    if arr.dtype.kind not in "iu" or dtype.is_floating_point or dtype.is_complex \
            or dtype == torch.bool or not arr.size:
        return True
    if _holds(arr.dtype, dtype):
        return True
    info = torch.iinfo(dtype)
    return bool(info.min <= int(arr.min()) and int(arr.max()) <= info.max)


@functools.cache
def _holds(source: np.dtype, dtype: torch.dtype) -> bool:
    """Whether every value of integer dtype ``source`` fits integer ``dtype``."""
    info, have = torch.iinfo(dtype), np.iinfo(source)
    return bool(info.min <= have.min and have.max <= info.max)


def _copy(dst: torch.Tensor, arr: np.ndarray) -> None:
    """``arr`` into ``dst``, cast to its dtype (torch's cast for dtypes numpy lacks:
    bfloat16, float8, ...)."""
    try:
        out = dst.numpy()
    except TypeError:
        dst.copy_(torch.from_numpy(np.array(arr)))  # a copy: Arrow's are read-only
        return
    np.copyto(out, arr, casting="unsafe")


def _table_plan(table: Any) -> dict[str, Any]:
    """How each column of a ``pyarrow.Table`` is batched (NOTE [ Arrow batches ]): Python
    values (``"pylist"``) for a column with a null, or list rows of different lengths,
    anywhere; the rest by their Arrow type."""
    import pyarrow as pa

    plan: dict[str, Any] = {}
    for name in table.column_names:
        col = table.column(name)
        typ = col.type
        if pa.types.is_string(typ) or pa.types.is_large_string(typ):
            plan[name] = ("str", None) if col.null_count == 0 else ("pylist", None)
        elif col.null_count:
            plan[name] = ("pylist", None)
        elif pa.types.is_list(typ) or pa.types.is_large_list(typ):
            lengths = pa.compute.list_value_length(col)
            bounds = pa.compute.min_max(lengths).as_py() if len(col) else {}
            if bounds.get("min") != bounds.get("max") or pa.compute.list_flatten(col).null_count:
                plan[name] = ("pylist", None)
    return plan


def numeric_type(typ: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(typ) or pa.types.is_floating(typ)
                or pa.types.is_boolean(typ))


def numeric_list(typ: Any) -> bool:
    """Whether the Arrow type ``typ`` is a list (plain, large or fixed-size) of numbers."""
    import pyarrow as pa

    return bool(pa.types.is_list(typ) or pa.types.is_large_list(typ)
                or pa.types.is_fixed_size_list(typ)) and numeric_type(typ.value_type)
