"""Batches of ``batch_size`` rows cut from Ray's blocks, copied once into memory of their own.

Why gpufeed cuts them, not Ray: NOTE [ Ray Data batches ] (2) in ``_sources/ray.py``. A block
comes from Ray once, as numpy arrays (views of the object store for number columns), and each
batch is one copy per column from the block's rows into the batch's tensor, a batch that spans
two blocks included.

The batches are Ray's: the same rows in the same order, a short last batch unless
``drop_last``. A number column (bool, int, uint, float, complex) becomes a tensor; any other
column (strings, objects, ragged rows, dates) stays a numpy array, a copy of the batch's rows
(never a view that would keep the whole block alive). Where a batch spans two blocks whose
pieces of a column differ in shape (ragged rows that are uniform within each block), the
column is an object array with one array per row, as Ray's own concatenation makes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from .arrays import Alloc, allocate, torch_dtype

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
