"""JPEG codecs: a region decode equals the full decode of the same box; the fallback is used
and said once when libjpeg-turbo >= 3.0 is missing (NOTE [ Decoding ])."""

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._sources import jpeg

pytest.importorskip("simplejpeg")
Image = pytest.importorskip("PIL.Image")

TURBO, WHY = jpeg.find_turbojpeg()
needs_turbo = pytest.mark.skipif(
    TURBO is None, reason=f"needs libjpeg-turbo >= 3.0 (TurboJPEG 3 API): {WHY}; set "
    "GPUFEED_TURBOJPEG=/path/to/libturbojpeg.so.0 to run it")


def _photo(h, w, seed):
    """Smooth fields at three scales plus noise: photo-like entropy at quality 90."""
    rng = np.random.default_rng(seed)
    img = np.full((h, w, 3), 120.0, np.float32)
    for cells, amp in ((3, 60.0), (12, 25.0), (max(2, h // 4), 20.0)):
        field = torch.from_numpy(rng.standard_normal((1, 3, cells, cells)).astype(np.float32))
        img += amp * torch.nn.functional.interpolate(
            field, size=(h, w), mode="bicubic", align_corners=False)[0].permute(1, 2, 0).numpy()
    img += rng.normal(0, 6, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _jpeg(h, w, seed, subsampling):
    buf = io.BytesIO()
    img = _photo(h, w, seed)
    if subsampling == "gray":
        Image.fromarray(img[..., 0]).save(buf, "JPEG", quality=90)
    else:
        Image.fromarray(img).save(buf, "JPEG", quality=90, subsampling=subsampling)
    return buf.getvalue()


@needs_turbo
@pytest.mark.parametrize("subsampling", ["4:4:4", "4:2:2", "4:2:0", "gray"])
def test_region_decode_equals_the_full_decode_of_the_box(subsampling):
    """Boxes anywhere (left edges off the iMCU grid, odd sizes, at every DCT scale): the region
    decode gives the full decode's pixels of the box, within a level (here: equal)."""
    turbo, simple = jpeg.codec("turbojpeg"), jpeg.codec("simplejpeg")
    rng = np.random.default_rng(0)
    for h, w in ((375, 500), (257, 191)):
        data = _jpeg(h, w, 1, subsampling)
        for factor in (1, 2, 4, 8):
            full = simple.decode(data, factor=factor, box=None, fast=False)
            sh, sw = full.shape[:2]
            assert (sh, sw) == (-(-h // factor), -(-w // factor))
            np.testing.assert_array_equal(turbo.decode(data, factor=factor, box=None,
                                                       fast=False), full)
            for _ in range(25):
                bh, bw = int(rng.integers(1, sh + 1)), int(rng.integers(1, sw + 1))
                top, left = int(rng.integers(0, sh - bh + 1)), int(rng.integers(0, sw - bw + 1))
                got = turbo.decode(data, factor=factor, box=(top, left, bh, bw), fast=False)
                want = full[top:top + bh, left:left + bw]
                assert got.shape == want.shape
                diff = np.abs(got.astype(int) - want.astype(int)).max()
                assert diff <= 1, (subsampling, (h, w), factor, (top, left, bh, bw), diff)


class _Recording:
    """The library of a TurboJpeg, recording the cropping region and the fast upsampling in
    force at each decode."""

    def __init__(self, lib):
        self._lib, self.region, self.upsample, self.decodes = lib, None, 0, []

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def tj3Set(self, h, param, value):
        if param == jpeg._TJPARAM_FASTUPSAMPLE:
            self.upsample = value
        return self._lib.tj3Set(h, param, value)

    def tj3SetCroppingRegion(self, h, region):
        self.region = (region.x, region.y, region.w, region.h)
        return self._lib.tj3SetCroppingRegion(h, region)

    def tj3Decompress8(self, *args):
        self.decodes.append((self.region != (0, 0, 0, 0), self.upsample))
        return self._lib.tj3Decompress8(*args)


@needs_turbo
def test_fast_never_decodes_a_region_with_merged_upsampling():
    """``fast=True``: the fast DCT everywhere, the fast (merged) chroma upsampling only for a
    whole image. With a cropping region it corrupted the heap of the library we test with
    (segmentation faults and spurious "Corrupt JPEG data" in a worker: NOTE [ Decoding ])."""
    turbo = jpeg.TurboJpeg(TURBO)
    turbo.lib = rec = _Recording(turbo.lib)
    data = _jpeg(375, 500, 3, "4:2:0")
    exact = jpeg.codec("turbojpeg").decode(data, factor=1, box=(40, 37, 200, 300), fast=False)
    fast = turbo.decode(data, factor=1, box=(40, 37, 200, 300), fast=True)
    assert np.abs(fast.astype(int) - exact.astype(int)).mean() < 3  # the fast DCT: a level or so
    turbo.decode(data, factor=2, box=(10, 9, 100, 120), fast=True)
    turbo.decode(data, factor=1, box=None, fast=True)
    turbo.decode(data, factor=1, box=(0, 0, 375, 500), fast=True)  # the whole image: no region
    assert rec.decodes == [(True, 0), (True, 0), (False, 1), (False, 1)]


@needs_turbo
def test_turbojpeg_refuses_what_simplejpeg_refuses(tmp_path):
    """Damage is a ValueError from both codecs (ImageFolder then tries Pillow, then names the
    file), never a crash."""
    data = _jpeg(64, 64, 2, "4:2:0")
    for broken in (data[:200], b"\xff\xd8\xff\xe0" + b"garbage" * 10):
        for name in ("turbojpeg", "simplejpeg"):
            with pytest.raises(ValueError):
                c = jpeg.codec(name)
                c.decode(broken, factor=1, box=(0, 0, 8, 8), fast=False)


def _folder(root):
    (root / "a").mkdir(parents=True)
    for k in range(4):
        (root / "a" / f"{k}.jpg").write_bytes(_jpeg(120 + 10 * k, 160, k, "4:2:0"))
    return root


def test_fallback_is_used_and_said_once_when_turbojpeg_is_missing(tmp_path, monkeypatch,
                                                                   caplog):
    """With no libjpeg-turbo >= 3.0 (simulated), decoder="auto" decodes with simplejpeg, says
    so once per process on the gpufeed logger, and gives the images the preferred codec gives
    (when it is installed here; else the images simplejpeg gives with decoder="simplejpeg")."""
    root = _folder(tmp_path)
    kw = dict(size=48, crop="random", scale=(0.2, 1.0))
    reference = gpufeed.sources.ImageFolder(root, **kw)  # the preferred codec where it is installed
    want = torch.cat([b[0] for b in gpufeed.DataLoader(reference, batch_size=2, seed=3)])
    monkeypatch.setattr(jpeg, "find_turbojpeg", lambda: (None, "simulated: none installed"))
    monkeypatch.setattr(jpeg, "_said", set())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        first = gpufeed.sources.ImageFolder(root, **kw)
        second = gpufeed.sources.ImageFolder(root, **kw)
    said = [r for r in caplog.records if "simplejpeg" in r.getMessage()]
    assert len(said) == 1 and "simulated: none installed" in said[0].getMessage()
    assert "GPUFEED_TURBOJPEG" in said[0].getMessage()
    assert first.decoder == second.decoder == "simplejpeg"
    for nw in (0, 2):
        got = torch.cat([b[0] for b in gpufeed.DataLoader(first, batch_size=2, seed=3,
                                                           num_workers=nw)])
        assert (got.int() - want.int()).abs().max() <= 1
    with pytest.raises(ImportError, match=r"libjpeg-turbo >= 3\.0.*GPUFEED_TURBOJPEG"):
        jpeg.codec.cache_clear()
        try:
            gpufeed.sources.ImageFolder(root, decoder="turbojpeg", **kw)
        finally:
            jpeg.codec.cache_clear()
    with pytest.raises(ValueError, match="decoder='pil'"):
        gpufeed.sources.ImageFolder(root, decoder="pil", **kw)


def _find_turbojpeg(monkeypatch, env: str, found: str | None, lib_paths: tuple[str, ...]
                    ) -> tuple[str | None, str]:
    """find_turbojpeg() with GPUFEED_TURBOJPEG, the system search and the known paths given,
    and no pip wheel's library."""
    monkeypatch.setenv("GPUFEED_TURBOJPEG", env)
    monkeypatch.setattr(jpeg, "_LIB_PATHS", lib_paths)
    monkeypatch.setattr(jpeg.ctypes.util, "find_library", lambda name: found)
    monkeypatch.setattr(jpeg, "bundled_turbojpeg", lambda: [])
    jpeg.find_turbojpeg.cache_clear()
    try:
        return jpeg.find_turbojpeg()
    finally:
        jpeg.find_turbojpeg.cache_clear()


def test_a_library_without_the_turbojpeg3_api_is_not_used(tmp_path, monkeypatch):
    """GPUFEED_TURBOJPEG naming something that is not libjpeg-turbo >= 3.0 is reported, not
    loaded as one (Debian 12/13's libturbojpeg0 is 2.1.5)."""
    path, why = _find_turbojpeg(monkeypatch, str(tmp_path / "nowhere.so"), None, ())
    assert path is None and "nowhere.so does not exist" in why


def test_a_library_found_twice_is_tried_and_reported_once(tmp_path, monkeypatch):
    """The same path from GPUFEED_TURBOJPEG and the system search is loaded once, and the
    reason it was not used is said once."""
    bad = tmp_path / "libturbojpeg.so"
    bad.write_bytes(b"not a shared library")
    path, why = _find_turbojpeg(monkeypatch, str(bad), str(bad), (str(bad),))
    assert path is None and why.count("does not load") == 1


@needs_turbo
def test_a_damaged_jpeg_leaves_the_next_ones_to_turbojpeg():
    """A failed call spoils its TurboJPEG handle: the thread gets a fresh one, so the valid
    JPEGs after a damaged one are still decoded (not all sent to Pillow)."""
    turbo = jpeg.codec("turbojpeg")
    data = _jpeg(40, 56, 2, "4:2:0")
    want = turbo.decode(data, factor=1, box=None, fast=True)
    for bad in (b"\xff\xd8\xff not really", data[:len(data) // 3]):
        with pytest.raises(ValueError):
            turbo.decode(bad, factor=1, box=None, fast=False)
        assert turbo.header(data) == (40, 56)
        np.testing.assert_array_equal(turbo.decode(data, factor=1, box=None, fast=True), want)


def test_pip_install_alone_finds_a_turbojpeg3_library():
    """With the ``image`` extra installed and nothing set (no GPUFEED_TURBOJPEG, no system
    libjpeg-turbo 3), the library bundled in the turbojpeg wheel is found and loaded."""
    bundled = jpeg.bundled_turbojpeg()
    if not bundled:
        pytest.skip("the turbojpeg wheel (gpufeed[image] on this platform) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "GPUFEED_TURBOJPEG"}
    code = ("from gpufeed._sources import jpeg; print(jpeg.find_turbojpeg()[0]); "
            "print(jpeg.resolve_codec('auto'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    system = [p for p in (jpeg.ctypes.util.find_library("turbojpeg"), *jpeg._LIB_PATHS)
              if p and hasattr(_load(p), "tj3Init")]
    assert out[1] == "turbojpeg"
    assert out[0] in (system or bundled)


def _load(path):
    try:
        return jpeg.ctypes.CDLL(path)
    except OSError:
        return None


def test_the_image_extra_brings_turbojpeg_where_its_wheels_exist():
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    meta = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    for extra in ("image",):
        req = next(requirements.Requirement(r) for r in extras[extra]
                   if r.startswith("turbojpeg"))
        assert str(req.specifier) == "==0.0.2"
        for (platform, machine, version), wheel in {
                ("linux", "x86_64", "3.11"): True, ("linux", "x86_64", "3.13"): True,
                ("win32", "AMD64", "3.12"): True, ("win32", "x86", "3.10"): True,
                ("darwin", "arm64", "3.12"): True, ("darwin", "x86_64", "3.13"): True,
                ("darwin", "arm64", "3.13"): False, ("linux", "aarch64", "3.11"): False,
                ("linux", "x86_64", "3.14"): False}.items():
            env = {"sys_platform": platform, "platform_machine": machine,
                   "python_version": version}
            assert req.marker.evaluate(env) is wheel, (extra, env)
