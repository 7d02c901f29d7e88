"""``ImageFolder``: class-per-folder JPEGs decoded by libjpeg-turbo, a batch per call.

NOTE [ Decoding ]: JPEGs are decoded by ``simplejpeg`` (libjpeg-turbo in its wheel). It releases
the GIL (checked here: another thread kept running through one 0.5 s decode), so thread workers
decode on every core, and it decodes at a reduced DCT scale (1/2, 1/4 or 1/8 of the stored size)
for a fraction of the work. Pillow decodes with the same library but scales only through
``draft`` and holds more Python around each call; PyTurboJPEG wraps the same library through
ctypes and needs a system libturbojpeg, which a wheel cannot bring (here, where none is
installed, it fails to start). Other formats (PNG, WebP, BMP, ...) and JPEGs libjpeg-turbo
refuses (CMYK) go through Pillow. Exactness: with ``fast=False`` (default) a full-scale decode
equals Pillow's ``Image.open(f).convert("RGB")`` pixel for pixel (the accurate integer DCT and
smooth chroma upsampling; tested). Trading accuracy for speed: ``fast=True`` (fast DCT and
upsampling, a few percent faster, values off by a few levels), and ``dct_scale=True`` (default):
when the crop is at least twice the output size in both directions, decode at the smallest
scale that still gives at least the output size (the resampling then starts from a DCT-domain
downscale).

Crops and flips draw from one ``numpy`` generator per sample seeded by the loader's
``sample_seed(seed, epoch, index)`` (NOTE [ Batch sources ] in ``_sources/protocol.py``): batches
are the
same for any ``num_workers`` or ``worker_type``.
"""

from __future__ import annotations

import functools
import io
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .arrays import allocate
from .packed import PackedList
from .protocol import index_array, require, sample_seeds

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_JPEG_MAGIC = b"\xff\xd8\xff"
CROPS = ("random", "center")
ON_ERROR = ("raise", "skip")


class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """Images in ``root/<class>/<file>`` as uint8 CHW tensors of ``size`` and int labels.

    torchvision's layout: one sub-folder per class, labels in sorted class-name order, files
    sorted within a class, subfolders followed. Pair with ``gpufeed.Normalize`` on the device.
    Needs ``pip install 'gpufeed[image]'`` (simplejpeg and Pillow).

    Args:
        root: the folder of class folders.
        size: output ``int`` (square) or ``(height, width)``.
        crop: ``"random"``: a random-resized crop (area fraction drawn from ``scale``, aspect
            ratio log-uniform in ``ratio``; ``scale=None`` for a plain ``size`` window at a
            random place); ``"center"``: the largest central region of ``size``'s aspect ratio,
            shrunk by ``center_fraction``, resized to ``size`` (for a square ``size``:
            ``Resize(size / 0.875)`` then ``CenterCrop(size)``).
        flip: random horizontal flip with probability 1/2. Default: on for ``crop="random"``.
        scale, ratio: as torchvision's ``RandomResizedCrop``.
        fast: fast (less accurate) DCT and chroma upsampling (NOTE [ Decoding ]).
        dct_scale: decode at a reduced DCT scale when the crop is at least twice the output.
        on_error: ``"raise"`` (an error naming the file) or ``"skip"``: an unreadable image
            becomes a black image with label -1 (mask with ``labels >= 0``), counted in
            ``skipped`` of the process that read it.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, size: int | tuple[int, int],
        crop: str = "random", flip: bool | None = None,
        scale: tuple[float, float] | None = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3), center_fraction: float = 0.875,
        fast: bool = False, dct_scale: bool = True, on_error: str = "raise",
        extensions: Sequence[str] = IMG_EXTENSIONS,
    ) -> None:
        require("simplejpeg", "gpufeed.ImageFolder")
        require("PIL", "gpufeed.ImageFolder")
        if crop not in CROPS:
            raise ValueError(f"crop={crop!r} is not one of {CROPS}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r} is not one of {ON_ERROR}")
        hw = (size, size) if isinstance(size, int) else tuple(size)
        if len(hw) != 2 or not all(isinstance(v, int) and v > 0 for v in hw):
            raise ValueError(f"size={size!r} must be a positive int or (height, width)")
        if scale is not None and not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale={scale!r} must satisfy 0 < low <= high <= 1 (or be None)")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio={ratio!r} must satisfy 0 < low <= high")
        if not 0 < center_fraction <= 1:
            raise ValueError(f"center_fraction={center_fraction!r} must be in (0, 1]")
        self.root = os.fspath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder root {self.root!r} is not a folder")
        self.size: tuple[int, int] = (int(hw[0]), int(hw[1]))
        self.crop, self.scale, self.ratio = crop, scale, ratio
        self.flip = crop == "random" if flip is None else bool(flip)
        self.center_fraction, self.fast, self.dct_scale = center_fraction, fast, dct_scale
        self.on_error = on_error
        self.skipped = 0
        exts = tuple(e.lower() for e in extensions)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        self.class_to_idx = {c: k for k, c in enumerate(self.classes)}
        files: list[str] = []
        labels: list[int] = []
        for k, c in enumerate(self.classes):
            for dirpath, _, names in sorted(os.walk(os.path.join(self.root, c), followlinks=True)):
                rel = os.path.relpath(dirpath, self.root)
                for name in sorted(names):
                    if name.lower().endswith(exts):
                        files.append(os.path.join(rel, name))
                        labels.append(k)
        if not files:
            raise FileNotFoundError(
                f"no images ({', '.join(exts)}) in class folders under {self.root!r}; "
                "ImageFolder expects root/<class>/<image>")
        self.files = PackedList(files)  # NOTE [ Copy-on-write and Python objects ]
        self.targets = np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.files)

    def path(self, index: int) -> str:
        return os.path.join(self.root, self.files[index])

    # -- reading ----------------------------------------------------------------------------
    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.gpufeed_samples([index], seed=None, epoch=0)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        return self.gpufeed_samples(indices, seed=None, epoch=0)

    def gpufeed_samples(
        self, indices: Sequence[int], *, seed: int | None, epoch: int
    ) -> list[tuple[torch.Tensor, int]]:
        images, labels = self.gpufeed_batch(indices, seed=seed, epoch=epoch, alloc=None)
        return list(zip(images, labels.tolist(), strict=True))

    def gpufeed_batch(
        self, indices: Sequence[int], *, seed: int | None, epoch: int, alloc: Any
    ) -> list[torch.Tensor]:
        """``[images (B, 3, h, w) uint8, labels (B,) int64]``, decoded into ``alloc``'s memory."""
        idx = index_array(indices)
        n = len(idx)
        h, w = self.size
        images = allocate(alloc, (n, 3, h, w), torch.uint8)
        labels = allocate(alloc, (n,), torch.int64)
        labels.numpy()[:] = self.targets[idx]
        out = images.numpy().transpose(0, 2, 3, 1)  # NHWC views of the CHW slot
        for k, (i, s) in enumerate(zip(idx.tolist(), sample_seeds(idx, seed, epoch),
                                       strict=True)):
            try:
                hwc = self._load(i, np.random.Generator(np.random.PCG64(s)))
            except Exception as exc:
                if self.on_error == "raise":
                    raise ValueError(
                        f"cannot read image {self.path(i)!r} (sample {i}): {exc}. Fix or remove "
                        "the file, or pass ImageFolder(..., on_error='skip')") from exc
                self.skipped += 1
                images[k].zero_()
                labels[k] = -1
                continue
            np.copyto(out[k], hwc)  # HWC into the CHW slot
        return [images, labels]

    def _load(self, index: int, rng: np.random.Generator) -> np.ndarray:
        with open(self.path(index), "rb") as f:
            data = f.read()
        if data[:3] == _JPEG_MAGIC:
            try:
                return self._jpeg(data, rng)
            except ValueError:  # e.g. CMYK, or damage Pillow may still get past
                pass
        return self._pillow(data, rng)

    def _region(self, height: int, width: int, rng: np.random.Generator) -> tuple[float, ...]:
        """(top, left, h, w) of the crop in stored pixels, and the flip (1.0 or 0.0)."""
        oh, ow = self.size
        if self.crop == "center":
            fit = self.center_fraction * min(height / oh, width / ow)  # output's aspect ratio
            ch, cw = oh * fit, ow * fit
            top, left = (height - ch) / 2, (width - cw) / 2
        elif self.scale is None:  # a plain window, after scaling up an image that is too small
            up = max(1.0, oh / height, ow / width)
            ch, cw = oh / up, ow / up
            top = float(rng.integers(0, int(height - ch) + 1))
            left = float(rng.integers(0, int(width - cw) + 1))
        else:
            top, left, ch, cw = _random_resized(height, width, self.scale, self.ratio, rng)
        flip = float(self.flip and rng.random() < 0.5)
        return top, left, ch, cw, flip

    def _jpeg(self, data: bytes, rng: np.random.Generator) -> np.ndarray:
        simplejpeg = _codecs()[0]
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        top, left, ch, cw, flip = self._region(height, width, rng)
        oh, ow = self.size
        factor = 1
        if self.dct_scale:
            while factor < 8 and ch / (2 * factor) >= oh and cw / (2 * factor) >= ow:
                factor *= 2
        img = simplejpeg.decode_jpeg(
            data, colorspace="RGB", fastdct=self.fast, fastupsample=self.fast,
            min_height=math.ceil(height / factor), min_width=math.ceil(width / factor),
            min_factor=factor)
        sy, sx = img.shape[0] / height, img.shape[1] / width
        return _crop_resize(img, top * sy, left * sx, ch * sy, cw * sx, self.size, flip)

    def _pillow(self, data: bytes, rng: np.random.Generator) -> np.ndarray:
        Image = _codecs()[1]
        with Image.open(io.BytesIO(data)) as im:
            img = np.array(im.convert("RGB"))  # writable: the resize reads it through torch
        top, left, ch, cw, flip = self._region(img.shape[0], img.shape[1], rng)
        return _crop_resize(img, top, left, ch, cw, self.size, flip)


@functools.cache
def _codecs() -> tuple[Any, Any]:
    """``simplejpeg`` and ``PIL.Image``, imported once, at the first decode: the image extra
    is optional, so the package imports without them (``ImageFolder`` checks for them)."""
    return (require("simplejpeg", "gpufeed.ImageFolder"),
            require("PIL.Image", "gpufeed.ImageFolder"))


def _random_resized(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
    rng: np.random.Generator,
) -> tuple[float, float, float, float]:
    """torchvision's RandomResizedCrop parameters: ten tries, then the central crop."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return float(top), float(left), float(h), float(w)
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return float((height - h) // 2), float((width - w) // 2), float(h), float(w)


def _crop_resize(
    img: np.ndarray, top: float, left: float, h: float, w: float, size: tuple[int, int],
    flip: float,
) -> np.ndarray:
    """The region, on whole pixels, resized to ``size`` (bilinear with antialiasing), maybe
    flipped; HWC.

    NOTE [ Resampling ]: the region is cut first and then resized, as torchvision's
    ``resized_crop`` does, by torch's ``interpolate(mode="bilinear", antialias=True)``: on uint8
    input it runs a dedicated integer kernel, 3-4x faster here than Pillow's
    ``resize(box=...)`` on the same region (0.26 against 1.04 ms for 400x350 -> 224x224), which
    was the largest cost of a random-resized crop after the decode. It agrees with Pillow's
    bilinear resize of the cut region to within a level or so (tested); Pillow's ``box=`` would
    also read pixels just outside the region. For one image it runs in the calling thread
    (with two intra-op threads its CPU time equalled its wall time, measured here), so thread
    workers do not oversubscribe the cores through it.
    """
    oh, ow = size
    t = min(round(top), img.shape[0] - 1)
    lft = min(round(left), img.shape[1] - 1)
    # at least one pixel: a very thin image can give a region under half a pixel across
    ih = max(1, min(round(h), img.shape[0] - t))
    iw = max(1, min(round(w), img.shape[1] - lft))
    out = img[t:t + ih, lft:lft + iw]
    if (ih, iw) != (oh, ow):
        chw = torch.from_numpy(out).permute(2, 0, 1).unsqueeze(0)  # a (1, 3, h, w) view
        resized = torch.nn.functional.interpolate(chw, size=(oh, ow), mode="bilinear",
                                                  antialias=True, align_corners=False)
        # an HWC view of the (contiguous CHW) result: the copy into the CHW slot is then
        # plane by plane
        out = resized[0].permute(1, 2, 0).numpy()
    return out[:, ::-1] if flip else out
