"""GPU JPEG decode in the device stage, on the simulated GPU with a stand-in decoder.

The workers ship encoded bytes and plans through the ring; the device stage decodes on its
side stream (``support.sim_decode.SimJpeg``: the CPU path's pixels, in kernels queued on the
stream), and the consumer's kernels, running late on their own stream, must see exactly the
CPU path's batches. Each part of NOTE [ Device stage: streams, events and slots ] rule (14) is
broken once to show that it is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._device import decode as _decode
from gpufeed._device.decode import DeviceDecode
from gpufeed._sources import jpeg as _jpeg
from support.fakes import photo_array
from support.procs import deadline
from support.sim_cuda import SimCuda
from support.sim_decode import SimJpeg

pytest.importorskip("simplejpeg")
Image = pytest.importorskip("PIL.Image")

SIZE = 24
BATCH = 4




@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> Any:
    """Two classes of JPEGs (baseline and progressive), one PNG and one CMYK JPEG: the last
    two are decoded by the workers."""
    root = tmp_path_factory.mktemp("gpu-imgs")
    k = 0
    for c in ("a", "b"):
        (root / c).mkdir()
        for j in range(9):
            h, w = 40 + 7 * (j % 4), 36 + 5 * (j % 5)
            Image.fromarray(photo_array(h, w, k)).save(root / c / f"{j}.jpg", quality=90,
                                                   progressive=j % 3 == 0)
            k += 1
    Image.fromarray(photo_array(30, 44, 99)).save(root / "a" / "p.png")
    Image.fromarray(photo_array(33, 41, 98)).convert("CMYK").save(root / "b" / "cmyk.jpg")
    return root


@pytest.fixture(autouse=True)
def _deadline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_jpeg, "_said", set())  # "once per process": once per test here
    with deadline(60):
        yield


def expected(root: Any, epochs: int, **kw: Any) -> list[tuple[np.ndarray, np.ndarray]]:
    """The CPU path's batches (full-scale decode: the GPU path never scales in the DCT)."""
    ds = gpufeed.sources.ImageFolder(root, size=SIZE, dct_scale=False, **kw)
    loader = gpufeed.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=3)
    return [(x.numpy().copy(), y.numpy().copy()) for _ in range(epochs) for x, y in loader]


def consume(sim: SimCuda, loader: Any, epochs: int, cost: int = 4) -> list[Any]:
    """The training loop: a kernel per batch on the consumer stream, reading it late."""
    seen: list[Any] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        seen.append((x.numpy().copy(), y.numpy().copy()))

    for _ in range(epochs):
        for x, y in loader:
            assert x.dtype == torch.uint8 and x.shape[1:] == (3, SIZE, SIZE)
            sim.launch(sim.consumer, step, x, y, cost=cost)
    sim.drain()
    return seen


def run(monkeypatch: pytest.MonkeyPatch, root: Any, seed: int, *, epochs: int = 2,
        worker_type: str = "thread", num_workers: int = 2, decoder: Any = None,
        **kw: Any) -> tuple[SimCuda, Any, list[str]]:
    sim = SimCuda(seed, max_steps=1 + seed % 3, copy_cost=(1, 4))
    sim.install(monkeypatch)
    dec = decoder(sim) if decoder is not None else SimJpeg(sim)
    monkeypatch.setattr(_decode, "make_decoder", lambda device: dec)
    ds = gpufeed.sources.ImageFolder(root, size=SIZE, decode="gpu", **kw)
    loader = gpufeed.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=3, device="cuda",
                                num_workers=num_workers, worker_type=worker_type,
                                device_depth=2)
    seen = consume(sim, loader, epochs)
    want = expected(root, epochs, **kw)
    bad = list(dict.fromkeys(sim.violations))[:3]
    for k, ((gx, gy), (wx, wy)) in enumerate(zip(seen, want, strict=False)):
        if not (np.array_equal(gx, wx) and np.array_equal(gy, wy)):
            bad.append(f"batch {k}: differs from the CPU path's")
    if len(seen) != len(want):
        bad.append(f"{len(seen)} batches, the CPU path gives {len(want)}")
    return sim, dec, bad


# -- 1. the plumbing --------------------------------------------------------------------------
def test_gpu_batches_equal_the_cpu_paths(monkeypatch: pytest.MonkeyPatch, folder: Any,
                                         worker_type: str, caplog: Any) -> None:
    """Encoded bytes and plans through the ring (process or thread workers), decoded on the
    side stream: the consumer sees the CPU path's batches; the PNG and the CMYK JPEG went to
    the CPU in the workers (said once per process)."""
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        _, dec, bad = run(monkeypatch, folder, 0, worker_type=worker_type)
    assert bad == []
    assert dec.decoded == 2 * 18 and dec.uploaded == 2 * 2
    if worker_type == "thread":  # (process workers log in their own process)
        assert any("decodes some images on the CPU" in r.message for r in caplog.records)


@pytest.mark.parametrize("kw", [dict(crop="center"), dict(memory_format=torch.channels_last),
                                dict(scale=None, flip=True)])
def test_center_crops_layouts_and_windows(monkeypatch: pytest.MonkeyPatch, folder: Any,
                                          kw: dict[str, Any]) -> None:
    _, _, bad = run(monkeypatch, folder, 1, epochs=1, num_workers=0, **kw)
    assert bad == []


def test_channels_last_layout_is_kept(monkeypatch: pytest.MonkeyPatch, folder: Any) -> None:
    sim = SimCuda(0)
    sim.install(monkeypatch)
    monkeypatch.setattr(_decode, "make_decoder", lambda device: SimJpeg(sim))
    ds = gpufeed.sources.ImageFolder(folder, size=SIZE, decode="gpu",
                                     memory_format=torch.channels_last)
    x, y = next(iter(gpufeed.DataLoader(ds, batch_size=BATCH, device="cuda")))
    assert x.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.int64
    sim.drain()


def test_a_file_the_decoder_refuses_is_decoded_on_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                                          folder: Any, caplog: Any) -> None:
    """The decoder's failures are rendered on the CPU by the same plan and uploaded on S."""
    def refusing(sim: SimCuda) -> SimJpeg:
        return SimJpeg(sim, fail=lambda data: len(data) % 3 == 0)

    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        _, dec, bad = run(monkeypatch, folder, 2, epochs=1, num_workers=0, decoder=refusing)
    assert bad == [] and dec.uploaded > 1
    said = [r for r in caplog.records if "could not decode" in r.message]
    assert len(said) <= 1  # once per process (an earlier test may have said it already)


def test_a_loader_that_decoded_on_the_gpu_still_pickles(monkeypatch: pytest.MonkeyPatch,
                                                        folder: Any) -> None:
    import copy
    import pickle

    sim = SimCuda(0)
    sim.install(monkeypatch)
    monkeypatch.setattr(_decode, "make_decoder", lambda device: SimJpeg(sim))
    ds = gpufeed.sources.ImageFolder(folder, size=SIZE, decode="gpu")
    loader = gpufeed.DataLoader(ds, batch_size=BATCH, device="cuda")
    next(iter(loader))
    sim.drain()
    assert loader._decode_plan is not None
    again = pickle.loads(pickle.dumps(loader))
    assert copy.deepcopy(loader).dataset.decode == again.dataset.decode == "gpu"


def test_skipped_images_are_black_with_label_minus_one(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Any) -> None:
    (tmp_path / "a").mkdir()
    Image.fromarray(photo_array(40, 40, 1)).save(tmp_path / "a" / "0.jpg")
    (tmp_path / "a" / "1.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    sim = SimCuda(0)
    sim.install(monkeypatch)
    monkeypatch.setattr(_decode, "make_decoder", lambda device: SimJpeg(sim))
    ds = gpufeed.sources.ImageFolder(tmp_path, size=SIZE, decode="gpu", on_error="skip")
    (x, y), = list(gpufeed.DataLoader(ds, batch_size=2, device="cuda"))
    sim.drain()
    assert y.tolist() == [0, -1] and int(x[1].sum()) == 0 and int(x[0].sum()) > 0
    assert ds.skipped == 1  # counted on the user's dataset (the workers read a copy)


def test_image_shards_keep_their_fields(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import io
    import tarfile

    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for k in range(6):
            buf = io.BytesIO()
            Image.fromarray(photo_array(40, 44, k)).save(buf, format="JPEG")
            for ext, payload in (("jpg", buf.getvalue()), ("cls", str(k % 2).encode()),
                                 ("txt", f"caption {k}".encode())):
                info = tarfile.TarInfo(f"{k:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    sim = SimCuda(0)
    sim.install(monkeypatch)
    monkeypatch.setattr(_decode, "make_decoder", lambda device: SimJpeg(sim))
    kw = dict(size=SIZE, text="txt", dct_scale=False)
    gpu = gpufeed.sources.ImageShards(str(tmp_path / "s.tar"), decode="gpu", **kw)
    cpu = gpufeed.sources.ImageShards(str(tmp_path / "s.tar"), **kw)
    got = list(gpufeed.DataLoader(gpu, batch_size=3, seed=1, device="cuda"))
    sim.drain()
    want = list(gpufeed.DataLoader(cpu, batch_size=3, seed=1))
    for (gx, gy, gt), (wx, wy, wt) in zip(got, want, strict=True):
        assert torch.equal(gx, wx) and torch.equal(gy, wy) and gt == wt


# -- 2. the fallback: no library, no device stage, a collate_fn of one's own --------------------
def test_without_the_library_the_cpu_decodes_said_once(monkeypatch: pytest.MonkeyPatch,
                                                       folder: Any, caplog: Any) -> None:
    sim = SimCuda(0)
    sim.install(monkeypatch)

    def missing(device: Any) -> Any:
        raise ImportError("nvImageCodec is not installed (pip install 'gpufeed[gpu-decode]')")

    monkeypatch.setattr(_decode, "make_decoder", missing)
    ds = gpufeed.sources.ImageFolder(folder, size=SIZE, decode="gpu", dct_scale=False)
    loader = gpufeed.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=3, device="cuda")
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        got = [(x.numpy().copy(), y.numpy().copy()) for _ in range(2) for x, y in loader]
    sim.drain()
    said = [r.getMessage() for r in caplog.records if "decode='gpu'" in r.getMessage()]
    assert len(said) == 1 and "gpu-decode" in said[0]
    for (gx, gy), (wx, wy) in zip(got, expected(folder, 2), strict=True):
        assert np.array_equal(gx, wx) and np.array_equal(gy, wy)


@pytest.mark.parametrize(("mode", "loud"), [("gpu", True), ("auto", False)])
def test_without_a_device_stage_the_cpu_decodes(monkeypatch: pytest.MonkeyPatch, folder: Any,
                                                mode: str, loud: bool, caplog: Any) -> None:
    ds = gpufeed.sources.ImageFolder(folder, size=SIZE, decode=mode, dct_scale=False)
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        got = list(gpufeed.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=3))
    want = expected(folder, 1)
    assert all(np.array_equal(x.numpy(), wx) for (x, _), (wx, _) in zip(got, want, strict=True))
    said = [r.getMessage() for r in caplog.records if f"decode='{mode}'" in r.getMessage()]
    assert len(said) == (1 if loud else 0)
    if loud:
        assert "no CUDA device stage" in said[0]


def test_a_collate_fn_of_ones_own_keeps_the_cpu_path(monkeypatch: pytest.MonkeyPatch,
                                                     folder: Any) -> None:
    sim = SimCuda(0)
    sim.install(monkeypatch)
    monkeypatch.setattr(_decode, "make_decoder", lambda device: SimJpeg(sim))
    ds = gpufeed.sources.ImageFolder(folder, size=SIZE, decode="auto")
    loader = gpufeed.DataLoader(ds, batch_size=BATCH, device="cuda",
                                collate_fn=torch.utils.data.default_collate.__call__)
    x, _ = next(iter(loader))
    sim.drain()
    assert x.shape == (BATCH, 3, SIZE, SIZE)
    assert _decode.decode_plan(ds, torch.device("cuda", 0), batched=False) is None


def test_bad_decode_value_names_the_choices(folder: Any) -> None:
    with pytest.raises(ValueError, match="decode='GPU' is not one of"):
        gpufeed.sources.ImageFolder(folder, size=SIZE, decode="GPU")


# -- 3. each part of rule (14), broken: caught --------------------------------------------------
def caught(monkeypatch: pytest.MonkeyPatch, root: Any, epochs: int = 1, **kw: Any) -> list[int]:
    out = []
    for seed in range(3):
        with monkeypatch.context() as m:
            if run(m, root, seed, epochs=epochs, num_workers=0, **kw)[2]:
                out.append(seed)
    return out


def test_holds_in_every_regime(monkeypatch: pytest.MonkeyPatch, folder: Any) -> None:
    """The same runs as the mutations below, unbroken: clean (the hardware-like decoder
    included, thanks to the idle wait)."""
    assert caught(monkeypatch, folder) == []
    assert caught(monkeypatch, folder, decoder=lambda sim: SimJpeg(sim, early=True)) == []


def test_catches_a_decode_queued_off_the_side_stream(monkeypatch: pytest.MonkeyPatch,
                                                     folder: Any) -> None:
    """(14a): E_ready does not cover kernels on another stream: the consumer reads poison."""
    assert caught(monkeypatch, folder,
                  decoder=lambda sim: SimJpeg(sim, other_stream=True, cost=6)) == [0, 1, 2]


def test_catches_a_host_batch_released_before_the_decode_read_it(
        monkeypatch: pytest.MonkeyPatch, folder: Any) -> None:
    """(14b): the slot's bytes must stay until E_copy (recorded after the decode is queued)."""
    real = DeviceDecode.place

    def place(self: DeviceDecode, host: Any, copy: Any, backend: Any, side: Any) -> Any:
        batch, _ = real(self, host, copy, backend, side)
        return batch, None

    monkeypatch.setattr(DeviceDecode, "place", place)
    assert caught(monkeypatch, folder, decoder=lambda sim: SimJpeg(sim, cost=4)) == [0, 1, 2]


def test_catches_a_hardware_decode_not_waiting_for_the_side_stream(
        monkeypatch: pytest.MonkeyPatch, folder: Any) -> None:
    """(14c): a decoder that writes before the work queued on S has run (nvJPEG's batched
    hardware path) overwrites memory that work may still use, unless S is idle first."""
    monkeypatch.setattr(DeviceDecode, "_wait_idle", lambda self, backend, side: None)
    assert caught(monkeypatch, folder, decoder=lambda sim: SimJpeg(sim, early=True)) == [0, 1, 2]


def test_catches_a_missing_wait_on_handover(monkeypatch: pytest.MonkeyPatch,
                                            folder: Any) -> None:
    """Rule (2) for decoded batches. The idle wait of (14c) completes batch i's decode before
    batch i+1's starts, so only an epoch's last batch can be read early: three epochs."""
    monkeypatch.setattr(SimCuda, "wait_event", lambda self, stream, event: None)
    assert caught(monkeypatch, folder, epochs=3,
                  decoder=lambda sim: SimJpeg(sim, cost=6)) == [0, 1, 2]
