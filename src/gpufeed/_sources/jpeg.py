"""JPEG decoders of the image sources: a region of the image at a DCT scale, from libjpeg-turbo.

NOTE [ Decoding ]
-----------------
A random-resized crop keeps about half of the image on average, a 224 window of a 256 image
77%; libjpeg-turbo can decode only such a region: rows below it are never entropy-decoded, rows
above it and columns beside it skip the inverse DCT, upsampling and colour conversion (the
saving comes mostly from the rows below). Two codecs give the same pixels for the same box
(tested):

- ``turbojpeg`` (preferred): libjpeg-turbo >= 3.0's TurboJPEG 3 API through ``ctypes``
  (``tj3SetScalingFactor`` then ``tj3SetCroppingRegion``, one ``tj3Decompress8``; ctypes
  releases the GIL for the call, so thread workers decode on every core; one handle per thread).
  The region's left edge must sit on an iMCU boundary of the scaled image (8, 16 or 32 stored
  pixels, by chroma subsampling, over the scale): the box is widened to the boundary on the
  left and by ``_MARGIN`` pixels on both sides (chroma upsampling treats a region's edge
  columns as image edges, which changed them by up to 30 levels when decoded flush), decoded,
  and cut. The library comes from ``$GPUFEED_TURBOJPEG`` (a path), else the system's
  ``libturbojpeg``, else the one bundled in the ``turbojpeg`` wheel (pinned to 0.0.2 by the
  ``image`` extra, on the platforms it has wheels for); one without ``tj3Init`` (libjpeg-turbo
  2.x) is not used. That wheel's own API decodes whole images only, so it is never imported:
  its library is found among the distribution's files. That library (a 3.0 beta) has two
  faults worked around: merged upsampling with a region (below), and a handle that refuses
  every later header after one failed call (the handle is dropped after a failure).
- ``simplejpeg`` (fallback, always installed with ``gpufeed[image]``): libjpeg-turbo in its
  wheel, GIL released, DCT scaling but no region: the whole image is decoded, then cut. Used,
  and said once per process on the ``gpufeed`` logger, when no TurboJPEG 3 library is found.

Other decoders were measured and not chosen; the libjpeg API reports fatal errors by
``longjmp``, which ``ctypes`` cannot catch. Measurements (and the wheels surveyed):
docs/how-it-works/measurements/sources.md#region-decoding and the sections after it.

Damaged files. Rows below a region are never entropy-decoded, so a region decode would find a
file cut short only when the crop reached its end: the same file refused in one epoch and read
in the next. A JPEG that does not end with its EOI marker (0xFFD9, trailing bytes allowed in its
last KiB) is therefore decoded whole and then cut, so it fails, and goes to Pillow (which
refuses it as the stock path does) whatever the crop. Damage inside the entropy-coded data of a
complete file is found when it lies above or inside the region; below it, it is not read (the
region's pixels are intact; the stock path would refuse the file). A failed decode's Pillow
fallback draws its crop from a fresh generator of the same seed: the box the codec would cut.

Exactness: with ``fast=False`` a full-scale decode equals Pillow's
``Image.open(f).convert("RGB")`` pixel for pixel (accurate integer DCT, smooth chroma
upsampling; tested); ``fast=True`` trades a few levels for a few percent of speed: the fast
integer DCT always, and the fast (merged) chroma upsampling only for a whole image, because
merged upsampling with a cropping region crashes libjpeg-turbo (the wheel's library included).
Measurements: docs/how-it-works/measurements/sources.md#merged-upsampling-with-a-region.
Other formats, and JPEGs a codec refuses (CMYK, 12-bit, recoverable damage), go through Pillow.

On the GPU (``decode="gpu"``; what the workers write: ``_sources/encoded.py``) the device stage
(``_device/decode.py``) decodes the batch on its side stream, crops, resizes and flips there,
ordered as its rule (14) in ``_device/prefetch.py`` says. The decoder is nvImageCodec, behind the
optional extra ``gpufeed[gpu-decode]`` (``nvidia-nvimgcodec-cu12[nvjpeg]``: nvJPEG comes in its own
wheel; ``-cu13`` for a CUDA 13 torch): it decodes a batch on the caller's stream, a region per
image, returns None for an image it cannot decode instead of failing the batch, and pins no torch
version (the libraries compared: docs/how-it-works/measurements/sources.md#gpu-decoder). Its 0.9
wheel imports without a GPU (its Decoder then raises RuntimeError, and the CPU decodes), so its
Python surface is checked here. ``_device/nvimgcodec.py`` adapts it to the CPU path's pixels (within
one level, tests/device/test_decode_adapter.py). An image the library refuses is rendered on the CPU
in the main process and uploaded, said once per process. What is and is not verified on a GPU:
docs/guides/gpu-decode.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import logging
import math
import os
import threading
from typing import Any

import numpy as np

from .protocol import require
from .resample import cut

logger = logging.getLogger("gpufeed")

CODECS = ("auto", "turbojpeg", "simplejpeg")
#: Columns decoded beyond each side of a box, so chroma upsampling sees real neighbours.
_MARGIN = 2
# TurboJPEG 3 (turbojpeg.h): tj3Init types, tj3Get/tj3Set parameters, pixel formats, and the
# iMCU width per chrominance subsampling (444, 422, 420, gray, 440, 411, 441)
_TJINIT_DECOMPRESS = 1
_TJPARAM_SUBSAMP, _TJPARAM_WIDTH, _TJPARAM_HEIGHT = 4, 5, 6
_TJPARAM_FASTUPSAMPLE, _TJPARAM_FASTDCT = 9, 10
_TJPF_RGB = 0
_TJ_MCU_WIDTH = (8, 16, 16, 8, 8, 32, 8)
_LIB_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libturbojpeg.so.0", "/usr/lib/aarch64-linux-gnu/libturbojpeg.so.0",
    "/usr/lib64/libturbojpeg.so.0", "/usr/lib/libturbojpeg.so.0",
    "/usr/local/lib/libturbojpeg.so.0", "/opt/libjpeg-turbo/lib64/libturbojpeg.so",
    "/opt/homebrew/opt/jpeg-turbo/lib/libturbojpeg.dylib",
    "/usr/local/opt/jpeg-turbo/lib/libturbojpeg.dylib",
)

_INSTALL = (
    "pip install 'gpufeed[image]' brings one (in the turbojpeg wheel) on Linux x86-64, macOS "
    "and Windows, CPython 3.10-3.13; elsewhere install libjpeg-turbo >= 3.0 (its own "
    "packages, Homebrew jpeg-turbo, conda-forge libjpeg-turbo; Debian 12/13's libturbojpeg0 "
    "is 2.1.5) and set GPUFEED_TURBOJPEG=/path/to/libturbojpeg.so.0")


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int),
                ("h", ctypes.c_int)]


class _Scale(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Handle:
    """A TurboJPEG 3 decompressor, destroyed with its owner (one per thread)."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.ptr = lib, lib.tj3Init(_TJINIT_DECOMPRESS)
        if not self.ptr:
            raise MemoryError("tj3Init failed to create a TurboJPEG decompressor")

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            try:
                self.lib.tj3Destroy(ptr)
            except Exception:  # interpreter shutdown: the library may be half torn down
                pass


class TurboJpeg:
    """libjpeg-turbo >= 3.0 through ctypes: a region at a DCT scale in one call."""

    name = "turbojpeg"

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        if not hasattr(lib, "tj3Init"):
            raise OSError(f"{path} has no TurboJPEG 3 API (libjpeg-turbo < 3.0)")
        vp, cp, size, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int
        for fn, args, res in (("tj3Init", [i], vp), ("tj3Destroy", [vp], None),
                              ("tj3DecompressHeader", [vp, cp, size], i), ("tj3Get", [vp, i], i),
                              ("tj3Set", [vp, i, i], i), ("tj3SetScalingFactor", [vp, _Scale], i),
                              ("tj3SetCroppingRegion", [vp, _Region], i),
                              ("tj3Decompress8", [vp, cp, size, vp, i, i], i),
                              ("tj3GetErrorStr", [vp], cp)):
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = args, res
        self.lib, self.path = lib, path
        self._local = threading.local()

    def _handle(self) -> Any:
        handle = getattr(self._local, "handle", None)
        if handle is None:
            handle = self._local.handle = _Handle(self.lib)
        return handle.ptr

    def _fail(self, h: Any, what: str) -> ValueError:
        """The error of handle ``h``, which is then dropped: after a failed call a handle
        refuses every later header, valid or not (libjpeg-turbo 2.1.92, NOTE [ Decoding ])."""
        error = ValueError(f"{what}: "
                           f"{(self.lib.tj3GetErrorStr(h) or b'').decode(errors='replace')}")
        self._local.handle = None  # destroyed; the thread's next call makes a fresh one
        return error

    def _read_header(self, h: Any, data: bytes) -> tuple[int, int]:
        if self.lib.tj3DecompressHeader(h, data, len(data)) != 0:
            raise self._fail(h, "cannot read the JPEG header")
        return self.lib.tj3Get(h, _TJPARAM_HEIGHT), self.lib.tj3Get(h, _TJPARAM_WIDTH)

    def header(self, data: bytes) -> tuple[int, int]:
        return self._read_header(self._handle(), data)

    def decode(self, data: bytes, *, factor: int, box: tuple[int, int, int, int] | None,
               fast: bool) -> np.ndarray:
        lib, h = self.lib, self._handle()
        height, width = self._read_header(h, data)
        lib.tj3Set(h, _TJPARAM_FASTDCT, int(fast))
        if lib.tj3SetScalingFactor(h, _Scale(1, factor)) != 0:
            raise self._fail(h, f"cannot decode at 1/{factor} scale")
        sh, sw = -(-height // factor), -(-width // factor)
        top, left, bh, bw = box if box is not None else (0, 0, sh, sw)
        cropped = False
        subsamp = lib.tj3Get(h, _TJPARAM_SUBSAMP)
        if box is not None and 0 <= subsamp < len(_TJ_MCU_WIDTH) and (bh, bw) != (sh, sw):
            mcu = -(-_TJ_MCU_WIDTH[subsamp] // factor)  # the iMCU width in the scaled image
            x0 = max(0, left - _MARGIN) // mcu * mcu
            x1 = min(sw, left + bw + _MARGIN)
            # refused e.g. for a lossless JPEG: then decoded whole, and cut
            cropped = lib.tj3SetCroppingRegion(h, _Region(x0, top, x1 - x0, bh)) == 0
        if not cropped:
            x0, x1 = 0, sw
            lib.tj3SetCroppingRegion(h, _Region(0, 0, 0, 0))  # TJUNCROPPED
        # never merged upsampling with a region (NOTE [ Decoding ]: it corrupts the heap)
        lib.tj3Set(h, _TJPARAM_FASTUPSAMPLE, int(fast and not cropped))
        out = np.empty((bh if cropped else sh, x1 - x0, 3), np.uint8)
        if lib.tj3Decompress8(h, data, len(data), out.ctypes.data, out.strides[0],
                              _TJPF_RGB) != 0:
            raise self._fail(h, "cannot decode the JPEG")
        if cropped:  # the region's rows only; its columns from the iMCU boundary
            return out[:, left - x0:left - x0 + bw]
        return cut(out, box)


class SimpleJpeg:
    """simplejpeg: the whole image at a DCT scale, then cut."""

    name = "simplejpeg"

    def __init__(self) -> None:
        self.lib = require("simplejpeg", "gpufeed.sources.ImageFolder")

    def header(self, data: bytes) -> tuple[int, int]:
        try:
            height, width, colorspace, _ = self.lib.decode_jpeg_header(data)
        except KeyError as exc:  # a subsampling it has no name for (4:4:1): Pillow decodes it
            raise ValueError(f"simplejpeg cannot read this JPEG's header ({exc!r})") from None
        if colorspace in ("CMYK", "YCCK"):  # converted by Pillow, as the stock path does
            raise ValueError(f"simplejpeg leaves {colorspace} JPEGs to Pillow")
        return int(height), int(width)

    def decode(self, data: bytes, *, factor: int, box: tuple[int, int, int, int] | None,
               fast: bool) -> np.ndarray:
        height, width = self.header(data)
        img = self.lib.decode_jpeg(
            data, colorspace="RGB", fastdct=fast, fastupsample=fast,
            min_height=math.ceil(height / factor), min_width=math.ceil(width / factor),
            min_factor=factor)
        return cut(img, box)


def bundled_turbojpeg() -> list[str]:
    """The libturbojpeg files inside the installed ``turbojpeg`` distribution (NOTE
    [ Decoding ]), found among its recorded files: the package is never imported."""
    try:
        files = importlib.metadata.files("turbojpeg") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    found = []
    for f in files:
        name = f.name.lower()
        if name.startswith("libturbojpeg") or (name.startswith("turbojpeg-")
                                                and name.endswith(".dll")):
            found.append(str(f.locate()))
    return sorted(found)


@functools.cache
def find_turbojpeg() -> tuple[str | None, str]:
    """(path of a libturbojpeg with the TurboJPEG 3 API, or None; what was found instead)."""
    seen: list[str] = []
    tried: set[str] = set()
    env = os.environ.get("GPUFEED_TURBOJPEG")
    found = ctypes.util.find_library("turbojpeg")
    for path in (env, found, *_LIB_PATHS, *bundled_turbojpeg()):
        if not path or path in tried or (os.sep in path and not os.path.exists(path)):
            if path == env and env and not os.path.exists(env):
                seen.append(f"GPUFEED_TURBOJPEG={env} does not exist")
            continue
        tried.add(path)
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            seen.append(f"{path} does not load ({exc})")
            continue
        if hasattr(lib, "tj3Init"):
            return path, ""
        seen.append(f"{path} is libjpeg-turbo 2.x (no TurboJPEG 3 API)")
    return None, "; ".join(seen) or "no libturbojpeg found"


@functools.cache
def codec(name: str) -> TurboJpeg | SimpleJpeg:
    """The codec ``name`` (``"turbojpeg"`` or ``"simplejpeg"``), made once per process.

    ``header(data)`` gives the stored image's (height, width); ``decode(data, factor=, box=,
    fast=)`` its RGB HWC uint8 pixels decoded at 1/``factor`` scale (sides rounded up), cut to
    ``box`` = (top, left, height, width) in that scaled image (None: all of it). Both raise
    ValueError on a JPEG the codec cannot decode (the caller then tries Pillow)."""
    if name == "simplejpeg":
        return SimpleJpeg()
    path, why = find_turbojpeg()
    if path is None:
        raise ImportError(
            f"decoder='turbojpeg' needs libjpeg-turbo >= 3.0 (the TurboJPEG 3 API): {why}. "
            f"{_INSTALL}, or use decoder='auto'")
    return TurboJpeg(path)


_said: set[str] = set()
_said_lock = threading.Lock()


def say_once(key: str, message: str, *args: Any) -> None:
    """``message`` as a warning on the ``gpufeed`` logger, once per process per ``key``."""
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    logger.warning(message, *args)


def resolve_codec(prefer: str) -> str:
    """The codec a ``decoder=prefer`` knob gets: ``"auto"`` takes TurboJPEG 3 when it loads,
    else simplejpeg, saying so once per process (NOTE [ Decoding ])."""
    if prefer not in CODECS:
        raise ValueError(f"decoder={prefer!r} is not one of {CODECS}")
    if prefer != "auto":
        codec(prefer)  # raises now, in the main process, when it cannot load
        return prefer
    path, why = find_turbojpeg()
    if path is not None:
        try:
            codec("turbojpeg")
            return "turbojpeg"
        except OSError as exc:
            why = str(exc)
    require("simplejpeg", "gpufeed.sources.ImageFolder")
    say_once("simplejpeg", "gpufeed.sources.ImageFolder and ImageShards decode JPEGs with "
             "simplejpeg: whole images, then cut. Decoding only each crop's region needs "
             "libjpeg-turbo >= 3.0 (%s). %s (NOTE [ Decoding ] in gpufeed/_sources/jpeg.py)",
             why, _INSTALL)
    return "simplejpeg"
