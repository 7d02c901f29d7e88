"""``gpufeed.sources.ArrowDataset``: Arrow rows with variable-length list columns padded per batch
(the other columns batched as NOTE [ Arrow batches ] in ``_sources/arrow.py`` says)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .arrays import allocate, torch_dtype
from .arrow import ArrowSource, numeric_list, samples
from .protocol import dataset_repr, index_array, require, wrap_indices


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
        pa = require("pyarrow", "gpufeed.sources.ArrowDataset")
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
            if not numeric_list(typ):
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
