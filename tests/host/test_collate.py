"""Packing a batch into its slot and viewing it back (gpufeed._host.collate): what crosses the
pipe, and how the main process rebuilds the batch from the slot's bytes."""

from __future__ import annotations

import gc
import pickle
import weakref
from collections import namedtuple
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch

from gpufeed._host.collate import LeafRef, SlotWriter, leaf_ref, pack, unpack

Pair = namedtuple("Pair", "a b")


def _writer(size: int = 1 << 20) -> SlotWriter:
    writer = SlotWriter(torch.zeros(size, dtype=torch.uint8), shared_fallback=False)
    writer.begin(4096, size - 4096)
    return writer


def _round_trip(batch: Any) -> tuple[Any, SlotWriter, np.ndarray]:
    """Pack ``batch`` into a slot, pickle the description as a worker sends it, view it back
    from the slot's bytes as the main process does."""
    writer = _writer()
    packed = pack(batch, writer)
    wire = pickle.loads(ForkingPickler.dumps((packed.batch, packed.leaves)))
    base = writer.region.numpy()[writer.start:writer.start + packed.used + 64]
    return unpack(wire, base), writer, base


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_a_nested_batch_comes_back_viewing_the_slot() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    batch = {
        "x": t, "t": t.t(),  # a non-contiguous leaf
        "y": torch.arange(4), "half": torch.ones(3, dtype=torch.bfloat16),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3), "empty": torch.zeros(0, 5),
        "pair": Pair(torch.tensor([True, False]), [torch.tensor(7.5), "text", 3]),
    }
    back, _, base = _round_trip(batch)
    _same(batch, back)
    lo, hi = base.ctypes.data, base.ctypes.data + base.nbytes
    for leaf in (back["x"], back["t"], back["y"], back["half"], back["pair"].a):
        assert lo <= leaf.data_ptr() < hi  # a view of the slot, not a copy
    assert lo <= back["np"].ctypes.data < hi


@pytest.mark.parametrize("kind", [tuple, list])
def test_a_flat_batch_keeps_its_container(kind: type) -> None:
    batch = kind([torch.randn(8, 3), torch.arange(8)])
    back, _, _ = _round_trip(batch)
    _same(batch, back)


def test_leaves_are_placed_by_index_beside_any_value() -> None:
    """Values the ring does not hold stay in the tree; comparing them with a LeafRef must
    never run their ``==`` (a numpy object array's is elementwise, and truthless)."""
    odd = np.array([None, 1], dtype=object)
    batch = (odd, [torch.ones(2), torch.zeros(3)])
    back, _, _ = _round_trip(batch)
    assert back[0] is not odd and list(back[0]) == [None, 1]
    _same(batch[1], back[1])


def test_leaf_refs_pickle_by_name_and_come_back_as_themselves() -> None:
    ref = leaf_ref(37)
    assert isinstance(ref, LeafRef) and ref.index == 37
    assert pickle.loads(pickle.dumps(ref)) is ref
    assert pickle.loads(pickle.dumps(leaf_ref(3))) is leaf_ref(3)


def test_the_slot_is_held_until_the_last_view_is_gone() -> None:
    """The base array stands for the slot: its weak reference (the release) fires only when
    no view of any leaf is left, the one-call 1-D leaves included."""
    back, _, base = _round_trip((torch.randn(4, 3), torch.arange(4)))
    fired: list[Any] = []
    ref = weakref.ref(base, fired.append)
    del base
    x, y = back
    del back, x
    gc.collect()
    assert not fired  # the labels still view the slot
    sliced = y[1:3]
    del y
    gc.collect()
    assert not fired and ref() is not None
    del sliced
    gc.collect()
    assert fired
