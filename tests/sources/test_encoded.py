"""What the workers write for a GPU decode (``_sources/encoded.py``): the files' bytes, the
plans drawn as the CPU path draws its crops, and which files stay on the CPU."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._sources import encoded as E
from gpufeed._sources.encoded import gpu_takes, jpeg_frame, plan_hwc
from support.fakes import photo_array

pytest.importorskip("simplejpeg")
Image = pytest.importorskip("PIL.Image")


def _jpeg(img: Image.Image, **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()




def test_frames_the_gpu_path_takes() -> None:
    rgb = Image.fromarray(photo_array(37, 53, 0))
    base = _jpeg(rgb, quality=90)
    frame = jpeg_frame(base)
    assert frame is not None and (frame.height, frame.width, frame.components) == (37, 53, 3)
    assert frame.marker == 0xC0 and gpu_takes(base) == frame
    prog = _jpeg(rgb, progressive=True)
    assert jpeg_frame(prog).marker == 0xC2 and gpu_takes(prog) is not None  # type: ignore[union-attr]
    gray = _jpeg(rgb.convert("L"))
    assert gpu_takes(gray) is not None and jpeg_frame(gray).components == 1  # type: ignore[union-attr]
    with_exif = _jpeg(rgb, exif=b"Exif\x00\x00" + b"\x00" * 300)
    assert gpu_takes(with_exif) is not None
    # left to the CPU: CMYK, cut short, not a JPEG, no frame before the scan
    assert jpeg_frame(_jpeg(rgb.convert("CMYK"))).components == 4  # type: ignore[union-attr]
    assert gpu_takes(_jpeg(rgb.convert("CMYK"))) is None
    assert gpu_takes(base[: len(base) // 2]) is None
    png = io.BytesIO()
    rgb.save(png, format="PNG")
    assert jpeg_frame(png.getvalue()) is None and gpu_takes(png.getvalue()) is None
    assert jpeg_frame(b"\xff\xd8\xff\xda\x00\x02") is None
    assert jpeg_frame(np.frombuffer(base, np.uint8)) == frame  # a view of a slot reads too


def test_lossless_and_arithmetic_frames_are_left_to_the_cpu() -> None:
    base = bytearray(_jpeg(Image.fromarray(photo_array(20, 20, 1))))
    at = base.find(b"\xff\xc0")
    for marker in (0xC3, 0xC9):
        base[at + 1] = marker
        assert jpeg_frame(bytes(base)).marker == marker  # type: ignore[union-attr]
        assert gpu_takes(bytes(base)) is None


@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> Any:
    root = tmp_path_factory.mktemp("enc")
    (root / "a").mkdir()
    for k in range(5):
        Image.fromarray(photo_array(40 + 5 * k, 60 - 3 * k, k)).save(root / "a" / f"{k}.jpg")
    Image.fromarray(photo_array(30, 30, 9)).save(root / "a" / "5.png")
    (root / "a" / "6.jpg").write_bytes(b"\xff\xd8\xff\xe0 broken")
    return root


@pytest.mark.parametrize("crop", ["random", "center"])
def test_encoded_batch_holds_files_and_the_cpu_paths_boxes(folder: Any, crop: str) -> None:
    """The bytes are the files'; rendering each plan's box on the CPU gives the CPU path's
    image (dct_scale=False: the full-scale boxes); the PNG travels as its final pixels; a
    broken file with on_error='skip' is SKIP with label -1."""
    kw: dict[str, Any] = dict(size=24, crop=crop, dct_scale=False, on_error="skip")
    enc_ds = gpufeed.sources.ImageFolder(folder, **kw)
    enc_ds._encoded = True
    cpu_ds = gpufeed.sources.ImageFolder(folder, **kw)
    idx = list(range(7))
    images, labels = enc_ds.gpufeed_batch(idx, seed=11, epoch=2, alloc=None)
    want, want_labels = cpu_ds.gpufeed_batch(idx, seed=11, epoch=2, alloc=None)
    assert labels.tolist() == want_labels.tolist() == [0] * 6 + [-1]
    plans = images.plans.numpy()
    assert plans[:, E.KIND].tolist() == [E.JPEG] * 5 + [E.RAW, E.SKIP]
    assert images.size == (24, 24) and not images.channels_last
    for k in range(5):
        data = images.item(k).tobytes()
        assert data == (folder / "a" / f"{k}.jpg").read_bytes()
        img = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
        t, lft, bh, bw = (int(plans[k][c]) for c in (E.TOP, E.LEFT, E.BH, E.BW))
        out = np.empty((24, 24, 3), np.uint8)
        plan_hwc(img[t:t + bh, lft:lft + bw], plans[k], out)
        np.testing.assert_array_equal(out, want[k].permute(1, 2, 0).numpy())
    raw = images.item(5).reshape(24, 24, 3)
    np.testing.assert_array_equal(raw, want[5].permute(1, 2, 0).numpy())
    assert images.item(6).size == 0 and enc_ds.skipped == 1


def test_encoded_batch_goes_into_the_slot(folder: Any) -> None:
    """Every tensor of the batch comes from ``alloc`` (the ring's slot), as small as the
    files."""
    ds = gpufeed.sources.ImageFolder(folder, size=24)
    ds._encoded = True
    made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append((shape, dtype))
        return torch.empty(shape, dtype=dtype)

    images, _ = ds.gpufeed_batch([0, 1, 2], seed=1, epoch=0, alloc=alloc)
    total = sum((folder / "a" / f"{k}.jpg").stat().st_size for k in range(3))
    assert ((total,), torch.uint8) in made and len(made) == 5
    assert images.data.numel() == total


def test_errors_name_the_file_as_the_cpu_path_does(folder: Any) -> None:
    ds = gpufeed.sources.ImageFolder(folder, size=24)
    ds._encoded = True
    with pytest.raises(ValueError, match=r"cannot read image .*6\.jpg.* on_error='skip'"):
        ds.gpufeed_batch([6], seed=1, epoch=0, alloc=None)


def test_dataset_indexing_and_repr_keep_the_cpu_path(folder: Any) -> None:
    ds = gpufeed.sources.ImageFolder(folder, size=24, decode="gpu")
    img, label = ds[0]
    assert img.shape == (3, 24, 24) and label == 0
    assert "decode='gpu'" in repr(ds)
