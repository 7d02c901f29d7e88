"""GPU JPEG decode with nvImageCodec on a real GPU (skipped without CUDA or the library).

The plumbing and every ordering rule are tested on the simulated backend
(``test_decode_sim.py``); here the real decoder is the judge: its pixels against the CPU path's
for the same crop boxes (the distribution of the differences is measured and printed, and
bounded), the batch structure, the fallbacks, and batches unchanged under a busy consumer
stream that frees memory while its work is queued (the pattern of pytorch/vision#9606).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

import gpufeed
from gpufeed._device import decode as _decode

pytestmark = pytest.mark.cuda

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("simplejpeg")

SIZE = 224
BATCH = 32
# The measured differences must stay within these (levels of 0..255): nvJPEG's IDCT and
# chroma upsampling and a float resize against libjpeg-turbo's and the uint8 kernel's.
MEAN_BOUND, P99_BOUND = 2.0, 12


def _need_decoder() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        _decode.make_decoder(torch.device("cuda", torch.cuda.current_device()))
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"no GPU decoder: {exc}")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: Any) -> Path:
    """The benchmark's photo-like JPEGs (500x375, quality 90), 96 of them, some progressive,
    a grayscale one, a PNG and a CMYK JPEG (the last two decoded by the workers)."""
    from bench.photos import DETAIL, photo_like

    root = tmp_path_factory.mktemp("gpu-photos")
    for k in range(96):
        d = root / f"c{k % 4}"
        d.mkdir(exist_ok=True)
        img = Image.fromarray(photo_like(375, 500, k, DETAIL[(375, 500)]))
        if k == 5:
            img = img.convert("L")
        img.save(d / f"{k:04d}.jpg", quality=90, progressive=k % 7 == 0)
    Image.fromarray(photo_like(300, 400, 1000, 20.0)).save(root / "c0" / "x.png")
    Image.fromarray(photo_like(300, 400, 1001, 20.0)).convert("CMYK").save(root / "c1" / "y.jpg")
    return root


def _batches(root: Path, decode: str, device: str | None, epochs: int = 1,
             **kw: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ds = gpufeed.sources.ImageFolder(root, size=SIZE, decode=decode, dct_scale=False, **kw)
    loader = gpufeed.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=7, num_workers=2,
                                device=device)
    out = []
    for _ in range(epochs):
        for x, y in loader:
            out.append((x.cpu(), y.cpu()))
    return out


@pytest.mark.parametrize("kw", [{}, {"crop": "center"}, {"memory_format": torch.channels_last}])
def test_pixels_within_a_few_levels_of_the_cpu_path(photos: Path, kw: dict[str, Any]) -> None:
    _need_decoder()
    gpu = _batches(photos, "gpu", "cuda", **kw)
    cpu = _batches(photos, "cpu", None, **kw)
    assert len(gpu) == len(cpu)
    diffs = []
    for (gx, gy), (cx, cy) in zip(gpu, cpu, strict=True):
        assert gx.shape == cx.shape and gx.dtype == torch.uint8 and torch.equal(gy, cy)
        diffs.append((gx.int() - cx.int()).abs().flatten())
    d = torch.cat(diffs).float()
    mean, p99, top = float(d.mean()), float(d.quantile(0.99)), int(d.max())
    print(f"GPU vs CPU path {kw or 'random-resized'}: mean {mean:.3f}, p99 {p99:.0f}, "
          f"max {top} levels over {d.numel()} values")
    assert mean <= MEAN_BOUND and p99 <= P99_BOUND, (mean, p99, top)


def test_batch_structure_and_layout(photos: Path) -> None:
    _need_decoder()
    ds = gpufeed.sources.ImageFolder(photos, size=SIZE, decode="gpu",
                                     memory_format=torch.channels_last)
    loader = gpufeed.DataLoader(ds, batch_size=BATCH, device="cuda")
    x, y = next(iter(loader))
    assert x.device.type == "cuda" and y.device.type == "cuda"
    assert x.shape == (BATCH, 3, SIZE, SIZE) and x.dtype == torch.uint8
    assert x.is_contiguous(memory_format=torch.channels_last) and y.dtype == torch.int64
    plan = loader._decode_plan
    assert plan is not None and plan.stage.batches >= 1


def test_image_shards_text_and_labels(tmp_path: Path) -> None:
    _need_decoder()
    from bench.photos import photo_like

    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for k in range(16):
            buf = io.BytesIO()
            Image.fromarray(photo_like(240, 320, k, 20.0)).save(buf, format="JPEG", quality=90)
            for ext, payload in (("jpg", buf.getvalue()), ("cls", str(k % 3).encode()),
                                 ("txt", f"caption {k}".encode())):
                info = tarfile.TarInfo(f"{k:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    kw: dict[str, Any] = dict(size=64, text="txt", dct_scale=False)
    gpu = gpufeed.sources.ImageShards(str(tmp_path / "s.tar"), decode="gpu", **kw)
    cpu = gpufeed.sources.ImageShards(str(tmp_path / "s.tar"), **kw)
    got = list(gpufeed.DataLoader(gpu, batch_size=8, seed=1, device="cuda"))
    want = list(gpufeed.DataLoader(cpu, batch_size=8, seed=1))
    for (gx, gy, gt), (cx, cy, ct) in zip(got, want, strict=True):
        assert gx.is_cuda and torch.equal(gy.cpu(), cy) and gt == ct
        assert (gx.cpu().int() - cx.int()).abs().float().mean() <= MEAN_BOUND


def test_batches_unchanged_under_a_busy_consumer_that_frees_memory(photos: Path) -> None:
    """Each step queues ~2 ms of work and a reduction of the batch on the consumer stream,
    frees the batch while that work is queued, and asks for the next: the sums equal those of
    a run that synchronises after every step (pytorch/vision#9606's pattern)."""
    _need_decoder()

    def sums(busy: bool) -> list[float]:
        ds = gpufeed.sources.ImageFolder(photos, size=SIZE, decode="gpu")
        loader = gpufeed.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=3,
                                    num_workers=2, device="cuda", device_depth=2)
        out = []
        for _ in range(2):
            for x, _y in loader:
                if busy:
                    torch.cuda._sleep(2_000_000)
                out.append(x.double().sum())
                del x
                if not busy:
                    torch.cuda.synchronize()
        return [float(s) for s in out]

    assert sums(busy=True) == sums(busy=False)


def test_workers_decode_what_the_gpu_path_does_not_take(tmp_path: Path) -> None:
    """A PNG and a CMYK JPEG are decoded in the workers: exactly the CPU path's pixels; the
    JPEG beside them within the bounds."""
    _need_decoder()
    from bench.photos import photo_like

    (tmp_path / "a").mkdir()
    Image.fromarray(photo_like(300, 400, 1000, 20.0)).save(tmp_path / "a" / "0.png")
    Image.fromarray(photo_like(300, 400, 1001, 20.0)).convert("CMYK").save(
        tmp_path / "a" / "1.jpg")
    Image.fromarray(photo_like(300, 400, 1002, 20.0)).save(tmp_path / "a" / "2.jpg")
    kw: dict[str, Any] = dict(size=96, dct_scale=False)
    gpu = gpufeed.sources.ImageFolder(tmp_path, decode="gpu", **kw)
    cpu = gpufeed.sources.ImageFolder(tmp_path, **kw)
    (x, _), = list(gpufeed.DataLoader(gpu, batch_size=3, device="cuda", seed=0))
    (cx, _), = list(gpufeed.DataLoader(cpu, batch_size=3, seed=0))
    x = x.cpu()
    assert torch.equal(x[:2], cx[:2])
    assert (x[2].int() - cx[2].int()).abs().float().mean() <= MEAN_BOUND
