"""``ImageFolder``: class-per-folder images decoded, cropped and flipped a batch per call.

Decoding is ``jpeg.py``'s (NOTE [ Decoding ]: only the crop's region of a JPEG when
libjpeg-turbo >= 3.0 is there, else the whole image by simplejpeg); other formats go through
Pillow. The layout, ``samples`` and their errors are torchvision's (``folder.py``). Crops and
flips draw from one ``numpy`` generator per sample seeded by the loader's
``sample_seed(seed, epoch, index)`` (NOTE [ Batch sources ] in ``_sources/protocol.py``): batches
are the same for any ``num_workers`` or ``worker_type``.
"""

from __future__ import annotations

import functools
import io
import math
import numbers
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .arrays import allocate
from .describe import dataset_repr
from .folder import IMG_EXTENSIONS, Samples, find_classes, pack, scan
from .jpeg import codec, resolve_codec
from .packed import PackedList
from .protocol import index_array, require, sample_seeds
from .resample import box, center_cut_into, center_resize, random_resized, resize_into

__all__ = ["IMG_EXTENSIONS", "ImageFolder"]

_JPEG_MAGIC = b"\xff\xd8\xff"
CROPS = ("random", "center")
ON_ERROR = ("raise", "skip")
_NO_TRANSFORM = (
    "gpufeed.ImageFolder decodes, crops and flips itself (size=, crop=, scale=, ratio=, "
    "flip=) into uint8 CHW tensors and takes no {name}=. Normalise on the device: "
    "gpufeed.DataLoader(..., device='cuda', device_transform=gpufeed.Normalize(mean, std, "
    "key=0)); for other transforms, a collate_fn or device_transform that takes the uint8 "
    "batch. For arbitrary PIL transforms keep torchvision.datasets.ImageFolder(root, "
    "transform=...) and pass it to gpufeed.DataLoader, which loads it as the stock loader "
    "does.")


class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """Images in ``root/<class>/<file>`` as uint8 (3, h, w) tensors of ``size`` and int labels.

    torchvision's ``ImageFolder`` layout and attributes: ``classes`` (sorted sub-folders),
    ``class_to_idx``, ``samples`` and ``imgs`` (``(path, class_index)`` per image, made on
    access; assigning a list of pairs re-packs them), ``targets`` (an int64 array), the same
    FileNotFoundError for a class folder without a valid file. Pair with ``gpufeed.Normalize``
    on the device. Needs ``pip install 'gpufeed[image]'`` (simplejpeg and Pillow).

    Args:
        root: the folder of class folders.
        size: output ``int`` (square) or ``(height, width)``.
        crop: ``"random"``: a random-resized crop (area fraction drawn from ``scale``, aspect
            ratio log-uniform in ``ratio``, torchvision's ``RandomResizedCrop``;
            ``scale=None`` for a plain ``size`` window at a random place); ``"center"``:
            torchvision's ``Resize(S)`` then ``CenterCrop(size)`` with
            ``S = int(min(size) / center_fraction)`` (256 for 224 and the default 0.875; larger
            when a non-square ``size`` would not fit): the shorter side resized to ``S``, the
            longer to ``int(S * longer / shorter)``, by torch's antialiased bilinear filter as
            torchvision's tensor path, then the central ``size`` with its rounding. Equal to
            torchvision's tensor path (``decode_jpeg``) to within a level or two (tested); its
            PIL path (Pillow's resize) differs from both by about a level. Exceptions: with
            ``dct_scale`` an image whose sides are at least twice the resized ones is decoded at
            1/2, 1/4 or 1/8 scale first (a random crop's box then snaps to whole pixels of
            the scaled image, so its edges move by up to half a scaled pixel: on a smooth
            1200x900 photo resized to 64, 2 levels on average and up to 25 at edges;
            ``dct_scale=False`` for equality), and ``fast=True``.
        flip: random horizontal flip with probability 1/2. Default: on for ``crop="random"``.
        scale, ratio: as torchvision's ``RandomResizedCrop``.
        center_fraction: for ``crop="center"``, the share of the resized image kept (0.875:
            224 of 256).
        fast: the fast (less accurate) DCT, and fast chroma upsampling where the whole image
            is decoded (never with a region: NOTE [ Decoding ]).
        dct_scale: decode at a reduced DCT scale when the region is at least twice the output
            in both directions (faster; the resampling then starts from a DCT-domain downscale).
        on_error: ``"raise"`` (an error naming the file) or ``"skip"``: an unreadable image
            becomes a black image with label -1 (mask with ``labels >= 0``), counted in
            ``skipped`` of the process that read it.
        extensions: file endings taken (default torchvision's ``IMG_EXTENSIONS``); not with
            ``is_valid_file``.
        is_valid_file: ``path -> bool``, torchvision's alternative to ``extensions`` (full path).
        allow_empty: accept class folders without a valid file (torchvision's knob).
        decoder: ``"auto"`` (libjpeg-turbo >= 3.0's region decode when found, else simplejpeg,
            said once), ``"turbojpeg"`` (raise if missing) or ``"simplejpeg"``.
        memory_format: the images' layout in memory, their shape being ``(B, 3, h, w)``
            either way: ``torch.contiguous_format`` (CHW planes, as torchvision's) or
            ``torch.channels_last`` (HWC, as the decoder writes it: no transposition in the
            workers, about a tenth of a 224 crop's cost; the layout channels-last models take
            on the GPU). Values are equal; ``view`` on a channels-last batch needs
            ``.contiguous()`` first (NOTE [ Resampling ] in ``resample.py``).
        transform, target_transform, loader: refused with a TypeError that names what to use
            instead (``device_transform=gpufeed.Normalize(...)``, a ``collate_fn``, or
            torchvision's own ``ImageFolder`` in ``gpufeed.DataLoader``).
    """

    def __init__(
        self, root: str | os.PathLike[str], *, size: int | tuple[int, int],
        crop: str = "random", flip: bool | None = None,
        scale: tuple[float, float] | None = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3), center_fraction: float = 0.875,
        fast: bool = False, dct_scale: bool = True, on_error: str = "raise",
        extensions: Sequence[str] | None = None,
        is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False,
        decoder: str = "auto", memory_format: torch.memory_format = torch.contiguous_format,
        transform: Any = None, target_transform: Any = None, loader: Any = None,
    ) -> None:
        for name, value in (("transform", transform), ("target_transform", target_transform),
                            ("loader", loader)):
            if value is not None:
                raise TypeError(_NO_TRANSFORM.format(name=name))
        require("simplejpeg", "gpufeed.ImageFolder")
        require("PIL", "gpufeed.ImageFolder")
        if crop not in CROPS:
            raise ValueError(f"crop={crop!r} is not one of {CROPS}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r} is not one of {ON_ERROR}")
        given: Any = size  # an int, a numpy int, or a pair of them
        hw = (given, given) if isinstance(given, numbers.Integral) else tuple(given)
        if len(hw) != 2 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                   and int(v) > 0 for v in hw):
            raise ValueError(f"size={size!r} must be a positive int or (height, width)")
        if scale is not None and not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(f"scale={scale!r} must satisfy 0 < low <= high <= 1 (or be None)")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio={ratio!r} must satisfy 0 < low <= high")
        if not 0 < center_fraction <= 1:
            raise ValueError(f"center_fraction={center_fraction!r} must be in (0, 1]")
        if memory_format not in (torch.contiguous_format, torch.channels_last):
            raise ValueError(f"memory_format={memory_format!r}: pass torch.contiguous_format "
                             "(CHW images) or torch.channels_last (HWC memory)")
        if is_valid_file is not None and not callable(is_valid_file):
            raise TypeError(f"is_valid_file must be a callable path -> bool, got "
                            f"{is_valid_file!r}")
        self.root = os.path.expanduser(os.fspath(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder root {self.root!r} is not a folder")
        self.size: tuple[int, int] = (int(hw[0]), int(hw[1]))
        self.crop, self.scale, self.ratio = crop, scale, ratio
        self.flip = crop == "random" if flip is None else bool(flip)
        self.center_fraction, self.fast, self.dct_scale = center_fraction, fast, dct_scale
        self.on_error, self.memory_format = on_error, memory_format
        self.decoder = resolve_codec(decoder)
        self.skipped = 0
        self.classes = find_classes(self.root)
        self.class_to_idx = {c: k for k, c in enumerate(self.classes)}
        if extensions is None and is_valid_file is None:
            extensions = IMG_EXTENSIONS
        files, labels = scan(self.root, self.classes, extensions=extensions,
                             is_valid_file=is_valid_file, allow_empty=allow_empty)
        self.files = PackedList(files)  # NOTE [ Copy-on-write and Python objects ]
        self.targets = np.asarray(labels, dtype=np.int64)
        _pillow_ready()

    # -- torchvision's attributes ------------------------------------------------------------
    @property
    def samples(self) -> Samples:
        """``(path, class_index)`` per image, torchvision's ``samples``; assignable."""
        return Samples(self.root, self.files, self.targets)

    @samples.setter
    def samples(self, value: Iterable[tuple[str, int]]) -> None:
        # a PackedList and one array (NOTE [ Copy-on-write and Python objects ] in packed.py)
        self.files, self.targets = pack(self.root, value)

    imgs = samples

    def __len__(self) -> int:
        return len(self.files)

    def path(self, index: int) -> str:
        return os.path.join(self.root, self.files[index])

    def __repr__(self) -> str:
        if self.crop == "center":
            crop = f"Resize({int(min(self.size) / self.center_fraction)}) + CenterCrop"
        elif self.scale is None:
            crop = "a random window"
        else:
            crop = f"random-resized, scale={self.scale}, ratio=({self.ratio[0]:.4g}, " \
                   f"{self.ratio[1]:.4g})"
        return dataset_repr(self, len(self), self.root, [
            f"Classes: {len(self.classes)}",
            f"Output: uint8 3x{self.size[0]}x{self.size[1]}, crop={self.crop!r} ({crop}), "
            f"flip={self.flip}"
            + (", channels_last" if self.memory_format is torch.channels_last else ""),
            f"Decoder: {self.decoder}, dct_scale={self.dct_scale}, fast={self.fast}, "
            f"on_error={self.on_error!r}"])

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
        if self.memory_format is torch.channels_last:  # (B, h, w, 3) memory, seen as (B, 3, h, w)
            images = allocate(alloc, (n, h, w, 3), torch.uint8).permute(0, 3, 1, 2)
        else:
            images = allocate(alloc, (n, 3, h, w), torch.uint8)
        labels = allocate(alloc, (n,), torch.int64)
        labels.numpy()[:] = self.targets[idx]
        hwc = images.numpy().transpose(0, 2, 3, 1)  # HWC views of the slot, in either layout
        for k, (i, s) in enumerate(zip(idx.tolist(), sample_seeds(idx, seed, epoch),
                                       strict=True)):
            try:
                self._load(i, s, hwc[k])
            except Exception as exc:
                if self.on_error == "raise":
                    raise ValueError(
                        f"cannot read image {self.path(i)!r} (sample {i}): {exc}. Fix or remove "
                        "the file, or pass ImageFolder(..., on_error='skip')") from exc
                self.skipped += 1
                images[k].zero_()
                labels[k] = -1
        return [images, labels]

    def _load(self, index: int, seed: int, dst: np.ndarray) -> None:
        """Image ``index``, cropped, resized and flipped with draws from a generator seeded
        ``seed``, written into ``dst`` (an HWC view of its place in the batch)."""
        with open(self.path(index), "rb") as f:
            data = f.read()
        if data[:3] == _JPEG_MAGIC:
            try:
                self._jpeg(data, np.random.Generator(np.random.PCG64(seed)), dst)
                return
            except ValueError:  # e.g. CMYK, or damage Pillow may still get past
                pass
        # a fresh generator: the same crop and flip as the codec would have drawn
        self._pillow(data, np.random.Generator(np.random.PCG64(seed)), dst)

    def _region(self, height: int, width: int, rng: np.random.Generator) -> tuple[float, ...]:
        """(top, left, h, w) of a random crop in stored pixels, and the flip (1.0 or 0.0)."""
        oh, ow = self.size
        if self.scale is None:  # a plain window, after scaling up an image that is too small
            up = max(1.0, oh / height, ow / width)
            ch, cw = oh / up, ow / up
            top = float(rng.integers(0, int(height - ch) + 1))
            left = float(rng.integers(0, int(width - cw) + 1))
        else:
            top, left, ch, cw = random_resized(height, width, self.scale, self.ratio, rng)
        return top, left, ch, cw, self._flip(rng)

    def _flip(self, rng: np.random.Generator) -> float:
        return float(self.flip and rng.random() < 0.5)

    def _factor(self, h: float, w: float, oh: int, ow: int) -> int:
        """The DCT scale (1, 2, 4 or 8) that leaves a ``h x w`` region at least twice
        ``oh x ow`` before the last halving (1 without ``dct_scale``)."""
        factor = 1
        while self.dct_scale and factor < 8 and h / (2 * factor) >= oh and w / (2 * factor) >= ow:
            factor *= 2
        return factor

    def _jpeg(self, data: bytes, rng: np.random.Generator, dst: np.ndarray) -> None:
        jc = codec(self.decoder)
        height, width = jc.header(data)
        if self.crop == "center":
            nh, nw = center_resize(height, width, self.size, self.center_fraction)
            img = jc.decode(data, factor=self._factor(height, width, nh, nw), box=None,
                            fast=self.fast)
            center_cut_into(dst, img, (nh, nw), self._flip(rng))
            return
        top, left, ch, cw, flip = self._region(height, width, rng)
        factor = self._factor(ch, cw, *self.size)
        sh, sw = math.ceil(height / factor), math.ceil(width / factor)  # the scaled image
        sy, sx = sh / height, sw / width
        region = box(top * sy, left * sx, ch * sy, cw * sx, sh, sw)
        if _complete(data):
            img = jc.decode(data, factor=factor, box=region, fast=self.fast)
        else:  # truncated: decoded whole, so that every crop finds it (NOTE [ Decoding ])
            t, lft, bh, bw = region
            img = jc.decode(data, factor=factor, box=None, fast=self.fast)[
                t:t + bh, lft:lft + bw]
        resize_into(dst, img, flip)

    def _pillow(self, data: bytes, rng: np.random.Generator, dst: np.ndarray) -> None:
        Image = _pil()
        try:
            im = Image.open(io.BytesIO(data))
        except Image.UnidentifiedImageError:  # its message names the BytesIO, not the file
            raise ValueError("Pillow cannot identify it as an image") from None
        with im:
            img = np.array(im.convert("RGB"))  # writable: the resize reads it through torch
        height, width = img.shape[:2]
        if self.crop == "center":
            nh, nw = center_resize(height, width, self.size, self.center_fraction)
            center_cut_into(dst, img, (nh, nw), self._flip(rng))
            return
        top, left, ch, cw, flip = self._region(height, width, rng)
        t, lft, bh, bw = box(top, left, ch, cw, height, width)
        resize_into(dst, img[t:t + bh, lft:lft + bw], flip)


def _complete(data: bytes) -> bool:
    """Whether the JPEG ``data`` ends with its EOI marker (trailing bytes allowed in its last
    KiB): a file cut short lacks it. In entropy-coded data 0xFF is followed by 0x00 or a
    restart marker, so 0xFFD9 there is the end of the image."""
    return data.endswith(b"\xff\xd9") or b"\xff\xd9" in data[max(2048, len(data) - 1024):]


def _pillow_ready() -> None:
    """Import now, in the thread that builds the dataset, what Pillow's ``Image.open`` would
    import at its first file (every plugin: about 70 ms, once per process). Done by a thread
    worker, an import in flight while another thread forks (another loader starting process
    workers) leaves its lock held in the child for good (see ``_host/random_watch.py``)."""
    _pil().init()


@functools.cache
def _pil() -> Any:
    """``PIL.Image``, imported once, when an ``ImageFolder`` is built: the image extra is
    optional, so the package imports without it."""
    return require("PIL.Image", "gpufeed.ImageFolder")
