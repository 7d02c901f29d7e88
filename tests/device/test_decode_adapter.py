"""The nvImageCodec adapter's own logic on the CPU, against a fake ``nvidia.nvimgcodec``.

The fake keeps the library's Python surface that the adapter calls (``Decoder.decode`` of a
list with ``params=`` and ``cuda_stream=``, ``CodeStream``, ``Region``, ``DecodeSource`` or a
code stream's ``get_sub_code_stream``, ``DecodeParams``, ``ColorSpec``, images exported by
DLPack, None for an image it cannot decode) and decodes with simplejpeg, so the adapter's
regions, resize, cut, flip, grayscale and failures are checked here against the CPU path.
What the real library does on a GPU is for the ``cuda`` tests (test_decode_cuda.py).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._device import nvimgcodec as _adapter
from gpufeed._sources.encoded import JPEG, KIND, plan_hwc, region_of
from support.fakes import photo_array

simplejpeg = pytest.importorskip("simplejpeg")
Image = pytest.importorskip("PIL.Image")


def fake_nvimgcodec(mode: str, refuse: bytes = b"") -> types.ModuleType:
    """A stand-in for ``nvidia.nvimgcodec``; ``mode``: how regions are given ("source",
    "sub" or "" for none); images containing ``refuse`` come back as None."""
    nv = types.ModuleType("nvidia.nvimgcodec")
    calls: dict[str, Any] = {"decode": []}

    class ColorSpec:
        SRGB = "srgb"

    class SampleFormat:
        I_RGB = "interleaved rgb"

    class DecodeParams:
        def __init__(self, **kw: Any) -> None:
            calls["params"] = kw

    class Region:
        def __init__(self, start: tuple[int, int], end: tuple[int, int]) -> None:
            self.start, self.end = start, end

    class CodeStream:
        def __init__(self, data: Any) -> None:
            self.data, self.region = bytes(np.asarray(data)), None

    if mode == "sub":
        def get_sub_code_stream(self: Any, region: Region) -> Any:
            sub = CodeStream(np.frombuffer(self.data, np.uint8))
            sub.region = region
            return sub

        CodeStream.get_sub_code_stream = get_sub_code_stream  # type: ignore[attr-defined]

    class Img:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def __dlpack__(self, stream: Any = None) -> Any:
            return self.t.__dlpack__()

        def __dlpack_device__(self) -> Any:
            return self.t.__dlpack_device__()

    class Decoder:
        def __init__(self, device_id: int = -1, options: str = "") -> None:
            calls["device_id"], calls["options"] = device_id, options

        def decode(self, sources: list[Any], params: Any = None, cuda_stream: int = 0) -> Any:
            calls["decode"].append((len(sources), cuda_stream))
            out: list[Img | None] = []
            for src in sources:
                region = getattr(src, "region", None)
                stream = src.stream if hasattr(src, "stream") else src
                if refuse and refuse in stream.data:
                    out.append(None)
                    continue
                rgb = calls["params"].get("sample_format") == SampleFormat.I_RGB
                gray = simplejpeg.decode_jpeg_header(stream.data)[2] == "Gray" and not rgb
                img = simplejpeg.decode_jpeg(stream.data, colorspace="GRAY" if gray else "RGB")
                if region is not None:
                    (t, lft), (b, r) = region.start, region.end
                    img = img[t:b, lft:r]
                out.append(Img(torch.from_numpy(np.ascontiguousarray(img))))
            return out

    nv.ColorSpec, nv.DecodeParams, nv.Region = ColorSpec, DecodeParams, Region  # type: ignore[attr-defined]
    nv.SampleFormat = SampleFormat  # type: ignore[attr-defined]
    nv.CodeStream, nv.Decoder = CodeStream, Decoder  # type: ignore[attr-defined]
    if mode == "source":
        class DecodeSource:
            def __init__(self, stream: Any, region: Region) -> None:
                self.stream, self.region = stream, region

        nv.DecodeSource = DecodeSource  # type: ignore[attr-defined]
    nv.calls = calls  # type: ignore[attr-defined]
    return nv


class _Stream:
    cuda_stream = 1234




@pytest.fixture(scope="module")
def folder(tmp_path_factory: Any) -> Any:
    root = tmp_path_factory.mktemp("adapter")
    (root / "a").mkdir()
    for k in range(7):
        img = Image.fromarray(photo_array(60 + 9 * k, 80 - 4 * k, k))
        if k == 3:
            img = img.convert("L")
        img.save(root / "a" / f"{k}.jpg", quality=92)
    return root


def _adapter_for(monkeypatch: pytest.MonkeyPatch, nv: types.ModuleType) -> Any:
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", nv)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return _adapter.NvImageCodec(torch.device("cpu"))


@pytest.mark.parametrize("mode", ["source", "sub", ""])
@pytest.mark.parametrize("kw", [{}, {"crop": "center"}, {"memory_format": torch.channels_last}])
def test_adapter_renders_the_cpu_paths_pixels(monkeypatch: pytest.MonkeyPatch, folder: Any,
                                             mode: str, kw: dict[str, Any]) -> None:
    """Every image of a batch through the adapter (a region where the library takes one, else
    the whole image cut), against the CPU path's render of the same plan: the float resize
    rounds within a level of the uint8 kernel's."""
    nv = fake_nvimgcodec(mode)
    dec = _adapter_for(monkeypatch, nv)
    assert dec.regions == mode
    ds = gpufeed.sources.ImageFolder(folder, size=32, dct_scale=False, **kw)
    ds._encoded = True
    images, _ = ds.gpufeed_batch(list(range(len(ds))), seed=5, epoch=0, alloc=None)
    plans = images.plans.numpy()
    assert (plans[:, KIND] == JPEG).all()
    n = len(ds)
    out = torch.zeros((n, 32, 32, 3), dtype=torch.uint8)
    assert dec.decode_into(images, list(range(n)), out, _Stream()) == []
    assert nv.calls["decode"] == [(n, 1234)]  # type: ignore[attr-defined]
    assert nv.calls["params"]["apply_exif_orientation"] is False  # type: ignore[attr-defined]
    assert nv.calls["options"] == ":fancy_upsampling=1"  # type: ignore[attr-defined]
    for k in range(n):
        data = images.item(k).tobytes()
        whole = simplejpeg.decode_jpeg(data, colorspace="RGB")
        t, lft, bh, bw = region_of(plans[k])
        want = np.empty((32, 32, 3), np.uint8)
        plan_hwc(whole[t:t + bh, lft:lft + bw], plans[k], want)
        diff = np.abs(out[k].numpy().astype(int) - want.astype(int))
        assert diff.max() <= 1, (k, diff.max())


def test_images_the_library_refuses_are_returned(monkeypatch: pytest.MonkeyPatch,
                                                folder: Any) -> None:
    ds = gpufeed.sources.ImageFolder(folder, size=32, dct_scale=False)
    ds._encoded = True
    images, _ = ds.gpufeed_batch([0, 1, 2], seed=1, epoch=0, alloc=None)
    victim = images.item(1).tobytes()[-40:-20]
    dec = _adapter_for(monkeypatch, fake_nvimgcodec("source", refuse=victim))
    out = torch.zeros((3, 32, 32, 3), dtype=torch.uint8)
    assert dec.decode_into(images, [0, 1, 2], out, _Stream()) == [1]
    assert int(out[1].sum()) == 0 and int(out[0].sum()) > 0


def test_make_decoder_without_the_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufeed._device import decode as _decode

    monkeypatch.setattr(_decode.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"gpufeed\[gpu-decode\]"):
        _decode.make_decoder(torch.device("cuda", 0))


def test_the_installed_librarys_surface_takes_the_adapters_calls(folder: Any) -> None:
    """With nvImageCodec importable (no GPU needed), the objects the adapter makes are made:
    its decode parameters, and a code stream of a slot's bytes cut to a region."""
    nv = pytest.importorskip("nvidia.nvimgcodec")
    params = dict(apply_exif_orientation=False, allow_any_depth=False,
                  color_spec=getattr(nv.ColorSpec, "SRGB", None) or nv.ColorSpec.RGB)
    if hasattr(getattr(nv, "SampleFormat", None), "I_RGB"):
        params["sample_format"] = nv.SampleFormat.I_RGB
    nv.DecodeParams(**params)
    data = np.frombuffer((folder / "a" / "0.jpg").read_bytes(), np.uint8)
    stream = nv.CodeStream(data)
    assert (stream.height, stream.width) == (60, 80) and stream.codec_name == "jpeg"
    region = nv.Region(start=(2, 3), end=(20, 30))
    assert hasattr(nv.CodeStream, "get_sub_code_stream") or hasattr(nv, "DecodeSource")
    if hasattr(nv.CodeStream, "get_sub_code_stream"):
        stream.get_sub_code_stream(region=region)
