"""_pinning: cudaHostRegister bookkeeping (a fake CUDA runtime on CPU), pin_batch, is_pinned."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch

from gpufeed import _pinning

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Item:
    x: torch.Tensor
    tag: str


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records calls, returns chosen error codes."""

    class cudaError(int):  # the runtime's spelling
        pass

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.register_code = 0
        self.unregister_code = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.register_code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return self.unregister_code

    def cudaGetErrorString(self, code: int) -> str:
        return {2: "out of memory", 1: "invalid argument"}.get(int(code), "unknown")

    def cudaGetLastError(self) -> int:
        self.calls.append(("get_last_error",))
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(_pinning, "cuda_usable", lambda: True)
    monkeypatch.setattr(_pinning, "is_pinned", lambda t: False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
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


def test_already_pinned_memory_is_shared_not_owned(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_pinning, "is_pinned", lambda t: True)
    h = _pinning.register(torch.zeros(16))
    assert h is not None and not h.owned
    _pinning.unregister(h)
    assert cudart.calls == []  # never unpins memory it did not pin


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
    before = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    batch = (torch.zeros(1 << 20), {"y": torch.ones(4)}, "tag")
    pinned = _pinning.pin_batch(batch)
    assert _pinning.is_pinned(pinned[0]) and _pinning.is_pinned(pinned[1]["y"])
    assert pinned[2] == "tag" and not _pinning.is_pinned(batch[0])
    assert _pinning.pin_batch(pinned)[0] is pinned[0]  # already pinned: kept
    del pinned
    gc.collect()
    torch.cuda.synchronize()
    torch.empty(1).pin_memory()  # lets the caching host allocator process freed blocks
    assert torch.cuda.host_memory_stats().get("active_bytes.current", 0) <= before + 512
