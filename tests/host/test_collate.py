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

from gpufeed._host.collate import LeafRef, leaf_ref, pack, unpack
from gpufeed._host.writer import SlotWriter
from gpufeed._memory.region import align

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


def test_carved_views_are_kept_per_offset_shape_and_dtype_and_always_right(monkeypatch) -> None:
    """A view is handed out again only for the same offset, shape and dtype, never past the
    slot's end, and the bounded cache starts over when full (NOTE [ Carved views ])."""
    import gpufeed._host.writer as writer_module

    monkeypatch.setattr(writer_module, "VIEW_CACHE", 5)
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    writer = SlotWriter(region, shared_fallback=False)
    base = region.data_ptr()
    layouts = [[((4, 3), torch.float32), ((4,), torch.int64)],
               [((2, 3), torch.float32), ((2,), torch.int64)],  # the same slot, smaller
               [((4,), torch.int64), ((4, 3), torch.float32)],  # the same shapes, swapped
               [((4, 3), torch.float64), ((5,), torch.uint8)],
               [((4, 3), torch.float32), ((4,), torch.int64)]]
    kept: dict[tuple[Any, ...], torch.Tensor] = {}
    reused = 0
    for round_ in range(3):
        for slot in (0, 4096, 8192):
            for k, layout in enumerate(layouts):
                for _again in range(2):  # the second time from the cache
                    writer.begin(slot, 4096)
                    off = slot
                    for n, (shape, dtype) in enumerate(layout):
                        t = writer.alloc(shape, dtype)
                        assert t is not None
                        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
                        assert t.data_ptr() == base + off
                        t.fill_(round_ * 100 + k * 10 + n)  # written where the leaf lies
                        nbytes = t.numel() * t.element_size()
                        expect = torch.full(shape, round_ * 100 + k * 10 + n, dtype=dtype)
                        assert torch.equal(region[off:off + nbytes].view(dtype).view(shape), expect)
                        reused += kept.get((off, shape, dtype)) is t
                        kept[(off, shape, dtype)] = t
                        off = align(off + nbytes)
                    assert len(writer._views) <= 5
    assert reused  # some views were handed out again (and were right)
    writer.begin(0, 48)  # a view of the same offset and shape no longer fits
    assert writer.alloc((4, 3), torch.float32) is not None
    writer.begin(0, 40)
    assert writer.alloc((4, 3), torch.float32) is None
    writer.begin(0, 0)  # no slot at all
    assert writer.alloc((4, 3), torch.float32) is None


def test_batch_sources_get_a_view_of_their_own() -> None:
    """Cached views go only to gpufeed's own code; a dataset's ``gpufeed_batch`` gets new ones,
    which it may keep or reshape in place without touching later batches."""
    writer = _writer()
    a = writer.alloc((8,), torch.int32)
    writer.begin(4096, 1 << 16)
    assert writer.alloc((8,), torch.int32) is a  # gpufeed's own: the same view again
    writer.begin(4096, 1 << 16)
    f = writer.alloc_any_fresh((8,), torch.int32)
    f.resize_(2, 4)  # what a user's code might do to its own view
    writer.begin(4096, 1 << 16)
    g = writer.alloc_any_fresh((8,), torch.int32)
    assert g is not f and g.shape == (8,) and g.data_ptr() == a.data_ptr()
    writer.begin(4096, 1 << 16)
    assert writer.alloc((8,), torch.int32).shape == (8,)


def test_pack_describes_kept_views_as_it_describes_any_slot_tensor() -> None:
    """``pack``'s shortcut for views the writer carved gives the very description its general
    path gives; a kept view of another slot is not described as this slot's: the batch is
    refused, as any tensor in the ring outside its slot (NOTE [ Batches built in the slot ])."""
    def batch(alloc: Any) -> list[torch.Tensor]:
        x, y = alloc((5, 3), torch.float32), alloc((5,), torch.int64)
        x.copy_(torch.arange(15.0).reshape(5, 3))
        y.copy_(torch.arange(5))
        return [x, y]

    kept, fresh = _writer(), _writer()
    for slot in (4096, 8192, 4096, 8192):
        kept.begin(slot, 4096)
        got = pack(batch(kept.alloc), kept)
        fresh.begin(slot, 4096)
        want = pack(batch(fresh.alloc_fresh), fresh)
        assert (got.leaves, got.used, got.need) == (want.leaves, want.used, want.need)
    kept.begin(4096, 4096)
    old = batch(kept.alloc)
    kept.begin(8192, 4096)  # the view of slot 4096 in a batch of slot 8192
    with pytest.raises(ValueError, match="outside the batch's own slot"):
        pack(old, kept)
