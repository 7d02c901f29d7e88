"""_pinning: cudaHostRegister bookkeeping (a fake CUDA runtime on CPU), pin_batch, is_pinned."""

from __future__ import annotations

import dataclasses
import gc
import mmap
import os
import weakref
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from gpufeed._base import cuda as _cuda
from gpufeed._memory import pinning as _pinning

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Item:
    x: torch.Tensor
    tag: str


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records calls, returns chosen error codes, and
    remembers registered ranges (for the fake ``Tensor.is_pinned`` below)."""

    class cudaError(int):  # the runtime's spelling
        pass

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.register_code = 0
        self.unregister_code = 0
        self.ranges: dict[int, int] = {}  # ptr -> size, registered through this runtime
        self.elsewhere: list[tuple[int, int]] = []  # pinned by someone else (pin_memory())

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        if self.register_code == 0:
            self.ranges[ptr] = size
        return self.register_code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        if self.unregister_code == 0:
            self.ranges.pop(ptr, None)
        return self.unregister_code

    def cudaGetErrorString(self, code: int) -> str:
        return {2: "out of memory", 1: "invalid argument"}.get(int(code), "unknown")

    def cudaGetLastError(self) -> int:
        self.calls.append(("get_last_error",))
        return 0

    def pinned(self, ptr: int) -> bool:
        spans = [*self.ranges.items(), *self.elsewhere]
        return any(p <= ptr < p + n for p, n in spans)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    """A CUDA runtime on CPU. ``Tensor.is_pinned`` is faked with torch's real semantics: it
    asks about the first byte of the tensor's *storage* (ATen ``is_pinned``:
    ``isPinnedPtr(self.storage().data())``), not about the tensor's own bytes."""
    fake = FakeCudart()
    monkeypatch.setattr(_pinning, "cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(
        torch.Tensor, "is_pinned", lambda self: fake.pinned(self.untyped_storage().data_ptr())
    )
    return fake


def test_without_cuda_everything_is_a_quiet_no_op() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    t = torch.zeros(8)
    assert _pinning.register(t) is None
    _pinning.unregister(None)
    assert _pinning.is_pinned(t) is False
    batch = {"x": t, "n": 3}
    assert _pinning.pin_batch(batch) is batch


def test_is_pinned_never_raises_on_other_devices() -> None:
    assert _pinning.is_pinned(torch.empty(2, device="meta")) is False


def test_register_rejects_what_it_cannot_pin() -> None:
    with pytest.raises(TypeError, match=r"expects a torch\.Tensor, got list"):
        _pinning.register([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPU tensor, got one on meta"):
        _pinning.register(torch.empty(4, device="meta"))


def test_register_pins_exactly_the_tensors_bytes_portable(cudart: FakeCudart) -> None:
    base = torch.zeros(1024, dtype=torch.uint8)
    view = base[100:200]  # a slot inside a larger (sparse) region: only its bytes are locked
    h = _pinning.register(view)
    assert h is not None and h.owned and h.active
    assert cudart.calls == [("register", view.data_ptr(), 100, 1)]  # portable flag
    _pinning.unregister(h)
    assert cudart.calls[-1] == ("unregister", view.data_ptr())
    assert not h.active and "released" in repr(h)


def test_register_is_idempotent_per_region_and_reference_counted(cudart: FakeCudart) -> None:
    t = torch.zeros(256)
    h1, h2 = _pinning.register(t), _pinning.register(t[:])
    assert [c[0] for c in cudart.calls] == ["register"]
    _pinning.unregister(h1)
    _pinning.unregister(h1)  # twice on one handle: no effect
    assert [c[0] for c in cudart.calls] == ["register"]  # h2 still holds the region
    _pinning.unregister(h2)
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]
    _pinning.unregister(h2)
    assert len(cudart.calls) == 2


def test_already_pinned_memory_is_shared_not_owned(cudart: FakeCudart) -> None:
    t = torch.zeros(16)
    cudart.elsewhere.append((t.data_ptr(), 64))  # e.g. from pin_memory()
    h = _pinning.register(t)
    assert h is not None and not h.owned
    _pinning.unregister(h)
    assert cudart.calls == []  # never unpins memory it did not pin
    assert _pinning.registered_bytes() == 0


def test_register_failure_raises_a_clear_error_and_clears_cuda_state(
    cudart: FakeCudart,
) -> None:
    cudart.register_code = 2
    t = torch.zeros(64)
    with pytest.raises(RuntimeError, match=r"out of memory \(cudaError 2\).*ulimit -l"):
        _pinning.register(t)
    assert cudart.calls[-1] == ("get_last_error",)  # no stale error for torch's next launch
    cudart.register_code = 0
    h = _pinning.register(t)  # a failed attempt left no bookkeeping behind
    assert h is not None and cudart.calls[-1][0] == "register"
    _pinning.unregister(h)
    cudart.register_code = 712
    cudart.ranges.clear()
    with pytest.raises(RuntimeError, match=r"already page-locked.*register the whole region"):
        _pinning.register(t)


def test_unregister_failure_raises(cudart: FakeCudart) -> None:
    h = _pinning.register(torch.zeros(32))
    cudart.unregister_code = 1
    with pytest.raises(RuntimeError, match=r"cudaHostUnregister.*invalid argument"):
        _pinning.unregister(h)
    _pinning.unregister(h)  # the handle is spent either way


def test_empty_tensor_needs_no_pinning(cudart: FakeCudart) -> None:
    assert _pinning.register(torch.zeros(0)) is None
    assert cudart.calls == []


def test_pin_batch_maps_every_cpu_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[torch.Tensor] = []

    def fake_pin(self: torch.Tensor, *args: Any) -> torch.Tensor:
        out = self.clone()
        pinned.append(out)
        return out

    monkeypatch.setattr(_pinning, "cuda_usable", lambda: True)
    monkeypatch.setattr(_pinning, "is_pinned", lambda t: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    x = torch.arange(3)
    batch = {"pair": Pair(x, [x, "s"]), "item": Item(x, "t"), "n": 7}
    out = _pinning.pin_batch(batch)
    assert len(pinned) == 3
    assert isinstance(out["pair"], Pair) and isinstance(out["item"], Item)
    assert out["pair"].x is pinned[0] and out["pair"].y[1] == "s" and out["n"] == 7
    assert out["item"].tag == "t" and batch["pair"].x is x  # the input is not modified


PAGE = 4096


def test_slots_of_one_region_are_each_registered(cudart: FakeCudart) -> None:
    """The ring registers slot after slot of one region. A slot is a slice whose storage
    starts at the region, so torch's is_pinned() on it answers about the region's first
    byte: once slot 0 is registered every later slot looked "already pinned" and was never
    registered (its batches were then pinned again, per batch, by pin_batch)."""
    region = torch.zeros(4 * PAGE, dtype=torch.uint8)
    slots = [region[k * PAGE : (k + 1) * PAGE] for k in range(4)]
    assert slots[2].is_pinned() is False
    handles = [_pinning.register(slot) for slot in slots]
    assert all(h is not None and h.owned for h in handles)
    assert [c[1:3] for c in cudart.calls] == [(s.data_ptr(), PAGE) for s in slots]
    assert all(_pinning.is_pinned(s) for s in slots)
    assert _pinning.registered_bytes() == 4 * PAGE
    for h in handles:
        _pinning.unregister(h)
    assert cudart.ranges == {} and _pinning.registered_bytes() == 0


def test_is_pinned_asks_about_the_tensors_own_bytes(cudart: FakeCudart) -> None:
    region = torch.zeros(3 * PAGE, dtype=torch.uint8)
    h = _pinning.register(region[PAGE : 2 * PAGE])
    assert not region[PAGE:].is_pinned()  # torch: about the region's first byte
    assert _pinning.is_pinned(region[PAGE : 2 * PAGE])
    assert _pinning.is_pinned(region[PAGE + 10 : PAGE + 20])
    assert not _pinning.is_pinned(region[: 2 * PAGE])  # starts before the registration
    assert not _pinning.is_pinned(region[PAGE : 2 * PAGE + 1])  # ends after it
    assert not _pinning.is_pinned(region[PAGE:PAGE])  # empty: nothing to be pinned
    _pinning.unregister(h)


def test_a_range_inside_a_registration_is_shared_not_registered_again(
    cudart: FakeCudart,
) -> None:
    whole = torch.zeros(4 * PAGE, dtype=torch.uint8)
    h = _pinning.register(whole)
    inner = _pinning.register(whole[PAGE : 2 * PAGE])
    assert inner is not None and not inner.owned and cudart.names() == ["register"]
    _pinning.unregister(inner)
    _pinning.unregister(h)
    assert cudart.names() == ["register", "unregister"]


def test_memory_stays_mapped_until_unregistered(cudart: FakeCudart) -> None:
    """A ring that lets go of its region before unregistering its slots must not get the
    memory unmapped while it is still registered: the handle keeps it mapped."""
    order: list[str] = []
    unregister = cudart.cudaHostUnregister

    def logged(ptr: int) -> int:
        order.append("cudaHostUnregister")
        return unregister(ptr)

    cudart.cudaHostUnregister = logged  # type: ignore[method-assign]
    mm = mmap.mmap(-1, 2 * PAGE)
    weakref.finalize(mm, order.append, "munmap")
    region = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    handle = _pinning.register(region[PAGE:])
    del mm, region  # the owner drops its region first
    gc.collect()
    assert order == []
    _pinning.unregister(handle)
    gc.collect()
    assert order == ["cudaHostUnregister", "munmap"]


def test_a_handle_collected_while_active_unregisters_first(cudart: FakeCudart) -> None:
    order: list[str] = []
    arr = np.zeros(PAGE, dtype=np.uint8)
    weakref.finalize(arr, order.append, "freed")
    handle = _pinning.register(torch.from_numpy(arr))
    assert handle is not None
    del arr, handle
    gc.collect()
    assert cudart.names() == ["register", "unregister"] and order == ["freed"]
    assert _pinning.registered_bytes() == 0


def test_a_handle_outside_its_process_does_nothing(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked child holds copies of the parent's handles but has no CUDA context."""
    t = torch.zeros(PAGE, dtype=torch.uint8)
    handle = _pinning.register(t)
    assert handle is not None
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)
    _pinning.unregister(handle)
    assert cudart.names() == ["register"] and not handle.active
    monkeypatch.undo()
    _pinning._refcounts.clear()  # what the parent's own handle would have released


def test_a_forked_child_forgets_the_bookkeeping(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pinning, "_refcounts", {(1, PAGE): 1})
    monkeypatch.setattr(_pinning, "_tracked", {_cuda.Fences()})
    monkeypatch.setattr(_pinning, "_lock", _pinning._lock)
    _pinning._forget_after_fork()
    assert _pinning.registered_bytes() == 0 and len(_pinning._tracked) == 0


# ---------------------------------------------------------------- CUDA (run on a GPU)


@pytest.mark.cuda
def test_cuda_register_shared_memory_then_unregister() -> None:
    ring = torch.zeros(1 << 22, dtype=torch.uint8).share_memory_()  # like the loader's ring
    assert not _pinning.is_pinned(ring)
    h = _pinning.register(ring)
    h_again = _pinning.register(ring)
    assert _pinning.is_pinned(ring) and _pinning.is_pinned(ring[4096:])
    out = ring[:1024].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(out.sum()) == 0
    _pinning.unregister(h)
    assert _pinning.is_pinned(ring)  # still held by h_again
    _pinning.unregister(h_again)
    _pinning.unregister(h_again)
    assert not _pinning.is_pinned(ring)


@pytest.mark.cuda
def test_cuda_already_pinned_tensor_is_not_registered_twice() -> None:
    t = torch.zeros(1024).pin_memory()
    h = _pinning.register(t)
    assert h is not None and not h.owned
    _pinning.unregister(h)
    assert _pinning.is_pinned(t)


@pytest.mark.cuda
def test_cuda_failed_register_raises_and_leaves_no_stale_error() -> None:
    import numpy as np

    memory = np.zeros(1 << 20, dtype=np.float32)
    tail = torch.from_numpy(memory[1 << 19 :])  # its own storage, inside `memory`
    whole = torch.from_numpy(memory)  # a storage overlapping `tail`, starting before it
    h = _pinning.register(tail)
    with pytest.raises(RuntimeError, match="already page-locked"):
        _pinning.register(whole)
    torch.ones(4, device="cuda").add_(1)  # torch's launch check must not see that error
    torch.cuda.synchronize()
    _pinning.unregister(h)
    h = _pinning.register(whole)  # fine once the overlapping part is released
    assert h is not None and _pinning.is_pinned(tail)
    _pinning.unregister(h)


@pytest.mark.cuda
def test_cuda_pin_batch_and_pinned_memory_back_to_start() -> None:
    import gc

    torch.cuda.synchronize()
    batch = (torch.zeros(1 << 20), {"y": torch.ones(4)}, "tag")
    pinned = _pinning.pin_batch(batch)
    assert _pinning.is_pinned(pinned[0]) and _pinning.is_pinned(pinned[1]["y"])
    assert pinned[2] == "tag" and not _pinning.is_pinned(batch[0])
    assert _pinning.pin_batch(pinned)[0] is pinned[0]  # already pinned: kept
    del pinned
    gc.collect()
    torch.cuda.synchronize()
    # Given back to torch's caching host allocator: a pinned tensor of the same size takes
    # the freed block rather than a new cudaHostAlloc. (The allocator's active-bytes figure
    # is not a measure: torch 2.11 reported 4 MiB still active, and a negative 'freed'.)
    allocs = torch.cuda.host_memory_stats()["num_host_alloc"]
    again = torch.zeros(1 << 20).pin_memory()
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == allocs
    del again


@pytest.mark.cuda
def test_cuda_slots_of_a_shared_memfd_region_are_each_page_locked() -> None:
    """Like the loader's ring: one MAP_SHARED memfd mapping, registered slot by slot."""
    slot, slots = 16 * PAGE, 4
    fd = os.memfd_create("gpufeed-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, slot * slots)
    mm = mmap.mmap(fd, slot * slots)
    os.close(fd)
    region = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
    handles = [_pinning.register(region[k * slot : (k + 1) * slot]) for k in range(slots)]
    assert all(h is not None and h.owned for h in handles)
    # torch's own answer, on tensors whose storage starts at each slot
    own = [torch.frombuffer(mm, dtype=torch.uint8, offset=k * slot, count=slot)
           for k in range(slots)]
    assert all(t.is_pinned() for t in own)
    own[2].fill_(7)
    out = region[2 * slot : 3 * slot].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(out.sum()) == 7 * slot
    for h in handles:
        _pinning.unregister(h)
    assert not any(t.is_pinned() for t in own)
