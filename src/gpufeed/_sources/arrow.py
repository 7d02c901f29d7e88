"""Hugging Face ``datasets.Dataset`` and ``pyarrow.Table``: a batch from one ``take``.

NOTE [ Arrow batches ]: the stock loader turns each row into Python objects (a dict of lists,
ints and strings), then ``default_collate`` turns them back into tensors. Here a batch is one
``take`` of its rows from the Arrow table; each numeric column (and each list column whose rows
have one length) becomes one numpy array written straight into the slot, strings a list of
``str``. What the stock path makes of a column depends on the dataset's format (``None``:
a list column becomes a *list* of per-position tensors, float64; ``"numpy"``: float64 scalars
become float32; ...), so for a ``datasets.Dataset`` the first batch is also fetched the stock
way on two rows and each column's fast result is checked against it, dtype and layout
included; a column that does not match exactly (nested features, images, nulls, a custom
transform) sends every batch down the stock path. A batch whose list rows differ in length
also goes the stock way (which raises as the stock loader does). A ``pyarrow.Table`` has no
stock meaning: its batch is ``{column: tensor}`` in Arrow's own dtypes (lists of one length:
``(B, L)``), strings and other columns as lists of Python values, each column's form decided
once on the whole table (a null anywhere in a column, or list rows of different lengths
anywhere, make it Python values in every batch), so that no column is a tensor in one batch
and a list in the next. Negative indices count from the end, as ``dataset[i]`` counts them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from .arrays import Alloc, allocate, torch_dtype
from .describe import dataset_repr
from .protocol import index_array, require, wrap_indices

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
        idx = wrap_indices(idx, len(self.dataset))  # from the end, as the dataset's [i] counts
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
            elif isinstance(stock, list) and all(isinstance(s, str) for s in stock):
                plan[name] = ("str", None)
            else:
                self.stock_only = True
                return plan
            got = _column(rows.column(name), plan[name], None)
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
    """(the format's columns of the dataset's Arrow table, its row mapping or None), when the
    dataset exposes them as ``datasets`` 2.x-5.x does (``data.table``, ``_indices``); else None
    (reads go through ``__getitem__``). Batches read this way are still checked against the
    stock path on the first batch (``_calibrate``)."""
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
    if isinstance(a, str):  # numpy's str_ is a str: equal, and what users compare
        return isinstance(b, str) and a == b
    return bool(type(a) is type(b) and a == b)


def _column(col: Any, plan: Any, alloc: Alloc | None) -> Any:
    """One column of a batch, as ``plan`` says; None when it cannot be done without objects."""
    import pyarrow as pa

    kind, dtype = plan if plan is not None else (None, None)
    if kind == "pylist":
        return col.to_pylist()
    if kind == "str" or (kind is None and pa.types.is_string(col.type)):
        return col.to_pylist() if col.null_count == 0 else None  # already str values
    if col.null_count:
        return None
    typ = col.type
    if pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ):
        arr = col.to_numpy()
    elif (pa.types.is_list(typ) or pa.types.is_large_list(typ)
          or pa.types.is_fixed_size_list(typ)) and _numeric(typ.value_type):
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
    if kind == "columns":
        if arr.ndim != 2:
            return None
        dst = allocate(alloc, (arr.shape[1], arr.shape[0]), dtype)
        np.copyto(dst.numpy(), arr.T, casting="unsafe")
        return list(dst)
    dst = allocate(alloc, arr.shape, dtype)
    np.copyto(dst.numpy(), arr, casting="unsafe")
    return dst


def _table_plan(table: Any) -> dict[str, Any]:
    """How each column of a ``pyarrow.Table`` is batched, decided once on the whole table so
    that a column's type does not change from batch to batch: Python values (``"pylist"``)
    for a column with a null anywhere, and for a list column whose rows differ in length
    anywhere; the rest by their Arrow type (NOTE [ Arrow batches ])."""
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


def _numeric(typ: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(typ) or pa.types.is_floating(typ)
                or pa.types.is_boolean(typ))


class ArrowDataset(Dataset[Any]):
    """A ``datasets.Dataset`` or ``pyarrow.Table`` whose variable-length list columns are
    padded per batch.

    ``dataset[i]`` and a user's ``collate_fn`` see the rows as the data gives them. With the
    default collate, each column named in ``pad`` comes as a ``(B, longest row in the batch)``
    tensor filled with its pad value, plus ``"<name>_length"`` (int64 row lengths), after the
    other columns, which are batched as ``gpufeed.DataLoader(data)`` batches them (NOTE [ Arrow
    batches ]). Needs ``pip install 'gpufeed[arrow]'``.

    Dtypes are those of the data's own format: for a ``datasets.Dataset`` a padded column
    has the dtype its format gives one row's list (``with_format("torch")``, ``"numpy"`` and
    none alike in ``datasets`` 2-5: integers int64, floats float32, booleans bool; read from
    the format on the first batch), so ``input_ids`` stored as int32 arrive as int64, as
    language-model losses expect; the other columns are batched as the stock loader batches
    them. A ``pyarrow.Table`` keeps Arrow's dtypes (it has no format).

    Args:
        data: a ``datasets.Dataset`` (format none, numpy or torch) or a ``pyarrow.Table``.
        pad: ``{column: pad value}`` for list-of-number columns, e.g. ``{"input_ids": 0}``.
            A null row is padded whole (length 0); a null inside a row, or a pad value the
            column's dtype cannot hold exactly, is a ValueError naming it.
    """

    def __init__(self, data: Any, *, pad: dict[str, Any] | None = None) -> None:
        pa = require("pyarrow", "gpufeed.ArrowDataset")
        self.data = data
        self.pad = dict(pad or {})
        hf = sys.modules.get("datasets")
        self.hf = hf is not None and isinstance(data, hf.Dataset)
        if not self.hf and not isinstance(data, pa.Table):
            raise TypeError(f"ArrowDataset takes a datasets.Dataset or a pyarrow.Table, got "
                            f"{type(data).__name__}")
        names = data.column_names
        missing = [c for c in self.pad if c not in names]
        if missing:
            raise ValueError(f"pad names columns {missing} that the data lacks; it has {names}")
        for c in self.pad:
            typ = (data.data if self.hf else data).schema.field(c).type
            if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)
                    or pa.types.is_fixed_size_list(typ)) or not _numeric(typ.value_type):
                raise TypeError(f"pad column {c!r} is {typ}, not a list of numbers")
        if self.hf:
            self._rest = data.remove_columns(list(self.pad)) if self.pad else data
            self._padded = data.with_format("arrow", columns=list(self.pad))
        else:
            self._rest = data.drop_columns(list(self.pad))
            self._padded = data.select(list(self.pad))
        self._source: ArrowSource | None = None
        self._pad_dtypes: dict[str, torch.dtype] = {}

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        kind = "datasets.Dataset" if self.hf else "pyarrow.Table"
        fmt = f", format {self.data.format.get('type')}" if self.hf else ""
        pads = ", ".join(f"{c} (pad {v!r})" for c, v in self.pad.items()) or "none"
        return dataset_repr(self, len(self), None, [
            f"Data: {kind}{fmt}, columns {list(self.data.column_names)}",
            f"Padded per batch: {pads}"])

    def __getitem__(self, index: int) -> Any:
        return self.gpufeed_samples([index], seed=None, epoch=0)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        return self.gpufeed_samples(indices, seed=None, epoch=0)

    def gpufeed_samples(self, indices: Sequence[int], *, seed: int | None, epoch: int) -> Any:
        return samples(self.data, index_array(indices), hf=self.hf)

    def gpufeed_batch(self, indices: Sequence[int], *, seed: int | None, epoch: int,
                      alloc: Any) -> Any:
        idx = index_array(indices)
        idx = wrap_indices(idx, len(self))  # counted from the end, as dataset[i] counts
        if self._source is None:
            self._source = ArrowSource(self._rest, hf=self.hf)
        out = dict(self._source.batch(idx, alloc)) if self._rest.num_columns else {}
        rows = self._padded[idx.tolist()] if self.hf else self._padded.take(idx)
        for name, value in self.pad.items():
            col = rows.column(name).combine_chunks()
            lengths = pa_lengths(col)
            values = col.flatten()
            if values.null_count:
                raise self._hole(name, idx, lengths, values)
            flat = values.to_numpy(zero_copy_only=False)
            width = int(lengths.max()) if len(lengths) else 0
            if name not in self._pad_dtypes:
                self._pad_dtypes[name] = self._checked_pad(
                    name, self._pad_dtype(name, col.type.value_type) if self.hf
                    else torch_dtype(np.dtype(col.type.value_type.to_pandas_dtype())))
            dst = allocate(alloc, (len(idx), width), self._pad_dtypes[name])
            arr = dst.numpy()
            arr.fill(value)
            starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
            arr[np.repeat(np.arange(len(idx)), lengths), np.arange(len(flat)) - starts] = flat
            n = allocate(alloc, (len(idx),), torch.int64)
            n.numpy()[:] = lengths
            out[name], out[f"{name}_length"] = dst, n
        return out

    @staticmethod
    def _hole(name: str, idx: np.ndarray, lengths: np.ndarray, values: Any) -> ValueError:
        """The error for a null inside a row of padded column ``name``."""
        import pyarrow as pa

        at = int(pa.compute.index(pa.compute.is_null(values), True).as_py())
        row = int(idx[np.searchsorted(np.cumsum(lengths), at, side="right")])
        return ValueError(
            f"ArrowDataset: row {row} of column {name!r} holds a null inside its list; padding "
            "fills the end of short rows, not holes. Fill the nulls first (e.g. "
            "dataset.map, or pyarrow.compute.fill_null on the flattened column)")

    def _checked_pad(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """``dtype``, once the pad value of column ``name`` was found to fit it exactly."""
        value = self.pad[name]
        ok = isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating))
        if ok and dtype == torch.bool:
            ok = value in (0, 1)
        elif ok and not dtype.is_floating_point:
            info = torch.iinfo(dtype)
            ok = float(value).is_integer() and info.min <= value <= info.max
        if not ok:
            raise ValueError(f"ArrowDataset: pad value {value!r} of column {name!r} does not fit "
                             f"its dtype {dtype}; give a value of that dtype, e.g. 0")
        return dtype

    def _pad_dtype(self, name: str, value_type: Any) -> torch.dtype:
        """The dtype a ``datasets.Dataset``'s own format gives a row of column ``name`` (a
        list of ``value_type``): its tensor's or array's, or for a Python list what
        ``torch.tensor`` makes of it (int64, float32, bool)."""
        import pyarrow as pa

        row = self.data.__getitems__([0])[0] if len(self.data) else {}  # as the stock loader
        value = row.get(name) if isinstance(row, dict) else None
        if isinstance(value, torch.Tensor):
            return value.dtype
        if isinstance(value, np.ndarray):
            return torch_dtype(value.dtype)
        if pa.types.is_boolean(value_type):
            return torch.bool
        return torch.float32 if pa.types.is_floating(value_type) else torch.int64


def pa_lengths(col: Any) -> np.ndarray:
    """Row lengths of a list array (null rows count as empty)."""
    import pyarrow as pa

    return np.asarray(pa.compute.fill_null(pa.compute.list_value_length(col), 0)
                      .to_numpy(zero_copy_only=False), dtype=np.int64)
