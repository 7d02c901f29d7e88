"""The decoding half of the image sources: crop, resize and flip a batch into the slot.

JPEGs decode as NOTE [ Decoding ] in ``jpeg.py`` says, other formats through Pillow. Crops and
flips draw from one numpy generator per sample, seeded by ``sample_seed(seed, epoch, index)``
(NOTE [ Batch sources ]), so batches are the same for any ``num_workers`` or ``worker_type``; a
``transform=`` then runs on each image (NOTE [ Image transforms ]).
"""

from __future__ import annotations

import functools
import io
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .arrays import allocate
from .encoded import DECODE_MODES, JPEG_MAGIC, complete, encoded_batch
from .image_transform import allocate_images, check_transform, stack_outputs, transform_calls
from .jpeg import codec, resolve_codec
from .protocol import SourceChanged, index_array, require, sample_seeds
from .resample import box, center_cut_into, center_resize, cut, random_resized, resize_into

CROPS = ("random", "center")
ON_ERROR = ("raise", "skip")
_NO_TRANSFORM = (
    "gpufeed.{cls} decodes, crops and flips itself (size=, crop=, scale=, ratio=, "
    "flip=) into uint8 CHW tensors and takes no {name}=. A function of each image goes in "
    "transform=; normalise on the device: gpufeed.DataLoader(..., device='cuda', "
    "device_transform=gpufeed.Normalize(mean, std, key=0)); a function of the labels, in a "
    "collate_fn. {instead}")


class DecodedImages(Dataset[tuple[torch.Tensor, int]]):
    """What ``ImageFolder`` (a class-per-folder tree) and ``ImageShards`` (tar shards) share:
    images decoded, cropped, resized and flipped into uint8 (3, h, w) tensors, with int labels
    (``targets``), from bytes a subclass reads (``_read``) and names in errors (``_name``). The
    arguments (what an image becomes) are ``ImageFolder``'s (its docstring explains each)."""

    #: for arbitrary PIL transforms, what to use instead (in the refusal of ``transform=``)
    _instead = ""
    targets: np.ndarray
    #: the workers' copy under a GPU decode ships encoded images (``_device/decode.py``)
    _encoded = False

    def __init__(
        self, *, size: int | tuple[int, int], crop: str = "random", flip: bool | None = None,
        scale: tuple[float, float] | None = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3), center_fraction: float = 0.875,
        fast: bool = False, dct_scale: bool = True, on_error: str = "raise",
        decoder: str = "auto", memory_format: torch.memory_format = torch.contiguous_format,
        transform: Any = None, target_transform: Any = None, loader: Any = None,
        decode: str = "cpu",
    ) -> None:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r} is not one of {DECODE_MODES}: 'cpu' (the "
                             "workers decode), 'gpu' (the device stage decodes JPEGs: needs "
                             "device='cuda' and nvImageCodec) or 'auto' (the GPU when it can)")
        for name, value in (("target_transform", target_transform), ("loader", loader)):
            if value is not None:
                raise TypeError(_NO_TRANSFORM.format(cls=type(self).__name__, name=name,
                                                     instead=self._instead))
        require("simplejpeg", f"gpufeed.{type(self).__name__}")
        require("PIL", f"gpufeed.{type(self).__name__}")
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
        self.size: tuple[int, int] = (int(hw[0]), int(hw[1]))
        self.crop, self.scale, self.ratio = crop, scale, ratio
        self.flip = crop == "random" if flip is None else bool(flip)
        self.center_fraction, self.fast, self.dct_scale = center_fraction, fast, dct_scale
        self.on_error, self.memory_format = on_error, memory_format
        self.transform = check_transform(transform, f"gpufeed.{type(self).__name__}")
        if decode == "gpu" and transform is not None:
            raise ValueError(
                f"decode='gpu' with transform={transform!r}: the transform runs in the workers "
                "on decoded pixels, which a GPU decode does not make there. Pass decode='cpu' "
                "(or 'auto', which then decodes on the CPU), or apply the transform on the "
                "device with gpufeed.DataLoader(device_transform=...)")
        self.decoder = resolve_codec(decoder)
        self.decode = decode
        self.skipped = 0
        _pillow_ready()

    # -- what a subclass says ---------------------------------------------------------------
    def _read(self, index: int) -> bytes:
        """The encoded bytes of image ``index``."""
        raise NotImplementedError

    def _name(self, index: int) -> str:
        """Image ``index`` as an error names it (a path, a shard's member)."""
        raise NotImplementedError

    def _settings(self) -> list[str]:
        """The ``repr`` lines of the output settings."""
        if self.crop == "center":
            crop = f"Resize({int(min(self.size) / self.center_fraction)}) + CenterCrop"
        elif self.scale is None:
            crop = "a random window"
        else:
            crop = f"random-resized, scale={self.scale}, ratio=({self.ratio[0]:.4g}, " \
                   f"{self.ratio[1]:.4g})"
        return [
            f"Output: uint8 3x{self.size[0]}x{self.size[1]}, crop={self.crop!r} ({crop}), "
            f"flip={self.flip}"
            + (", channels_last" if self.memory_format is torch.channels_last else ""),
            f"Decoder: {self.decoder}, dct_scale={self.dct_scale}, fast={self.fast}, "
            f"on_error={self.on_error!r}" + (f", decode={self.decode!r}"
                                             if self.decode != "cpu" else ""),
            *([f"Transform: {self.transform!r}"] if self.transform is not None else [])]

    # -- reading ----------------------------------------------------------------------------
    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.gpufeed_samples([index], seed=None, epoch=0)[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, int]]:
        return self.gpufeed_samples(indices, seed=None, epoch=0)

    def gpufeed_samples(self, indices: Sequence[int], *, seed: int | None,
                        epoch: int) -> list[Any]:
        idx = index_array(indices)
        images: list[Any]
        labels: np.ndarray | torch.Tensor
        if self.transform is not None:  # its outputs as they are (NOTE [ Image transforms ])
            images, labels = self._transformed(idx, seed=seed, epoch=epoch)
        else:
            batch, labels = self._decode(idx, seed=seed, epoch=epoch, alloc=None)
            images = list(batch)
        fields = self._fields(idx, images, labels.tolist())
        return list(zip(*fields, strict=True)) if len(fields) > 1 else images

    def gpufeed_batch(self, indices: Sequence[int], *, seed: int | None, epoch: int,
                      alloc: Any) -> Any:
        """The batch ``default_collate`` would make of the samples (``_fields``), its images
        and labels decoded into ``alloc``'s memory."""
        idx = index_array(indices)
        if self._encoded:  # for the device stage's decode (_sources/encoded.py)
            fields = encoded_batch(self, idx, seed=seed, epoch=epoch, alloc=alloc)
            return fields if len(fields) > 1 else fields[0]
        if self.transform is not None:
            outputs, found = self._transformed(idx, seed=seed, epoch=epoch, reuse=True)
            images = stack_outputs(outputs, idx, alloc, owner=f"gpufeed.{type(self).__name__}",
                                   channels_last=self.memory_format is torch.channels_last)
            labels = allocate(alloc, (len(idx),), torch.int64)
            labels.numpy()[:] = found
        else:
            images, labels = self._decode(idx, seed=seed, epoch=epoch, alloc=alloc)
        fields = self._fields(idx, images, labels)
        return fields if len(fields) > 1 else images

    def _fields(self, idx: np.ndarray, images: Any, labels: Any) -> list[Any]:
        """A batch's fields in a sample's order: here ``[images, labels]``."""
        return [images, labels]

    def _decode(self, idx: np.ndarray, *, seed: int | None, epoch: int,
                alloc: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``images (B, 3, h, w) uint8, labels (B,) int64`` of samples ``idx``."""
        n = len(idx)
        images = allocate_images(alloc, n, (3, *self.size), torch.uint8,
                                 channels_last=self.memory_format is torch.channels_last)
        labels = allocate(alloc, (n,), torch.int64)
        labels.numpy()[:] = self.targets[idx]
        hwc = images.numpy().transpose(0, 2, 3, 1)  # HWC views of the slot, in either layout
        for k, (i, s) in enumerate(zip(idx.tolist(), sample_seeds(idx, seed, epoch),
                                       strict=True)):
            if not self._load_or_skip(i, s, hwc[k]):
                images[k].zero_()
                labels[k] = -1
        return images, labels

    def _transformed(self, idx: np.ndarray, *, seed: int | None, epoch: int,
                     reuse: bool = False) -> tuple[list[Any], np.ndarray]:
        """The transform's output of each image of ``idx``, and the labels (-1 where skipped);
        ``reuse``: decode the images into one buffer while no output shares its memory."""
        labels = self.targets[idx].copy()
        outputs: list[Any] = []
        buffer: torch.Tensor | None = None
        transform: Any = self.transform
        last = self.memory_format is torch.channels_last
        with transform_calls(transform, seed=seed, epoch=epoch) as call:
            for k, (i, s) in enumerate(zip(idx.tolist(), sample_seeds(idx, seed, epoch),
                                           strict=True)):
                if buffer is None or not reuse:
                    buffer = allocate_images(None, 1, (3, *self.size), torch.uint8,
                                             channels_last=last)[0]
                hwc = buffer.numpy().transpose(1, 2, 0)
                if not self._load_or_skip(i, s, hwc):
                    buffer.zero_()
                    labels[k] = -1
                out = call(i, buffer)
                outputs.append(out)
                if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == \
                        buffer.untyped_storage().data_ptr():  # the image, or a view of it
                    buffer = None
        return outputs, labels

    def _load_or_skip(self, index: int, seed: int, dst: np.ndarray) -> bool:
        """:meth:`_load`; False for an image that ``on_error="skip"`` skips."""
        try:
            self._load(index, seed, dst)
            return True
        except SourceChanged:
            raise
        except Exception as exc:
            if self.on_error == "raise":
                raise self._unreadable(index, exc) from exc
            self.skipped += 1
            return False

    def _unreadable(self, index: int, exc: Exception) -> ValueError:
        return ValueError(f"cannot read image {self._name(index)} (sample {index}): {exc}. Fix "
                          f"or remove the file, or pass {type(self).__name__}(..., "
                          "on_error='skip')")

    def _load(self, index: int, seed: int, dst: np.ndarray) -> None:
        """Image ``index``, cropped, resized and flipped with draws from a generator seeded
        ``seed``, written into ``dst`` (an HWC view of its place in the batch)."""
        data = self._read(index)
        if data[:3] == JPEG_MAGIC:
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

        def decode(factor: int, region: tuple[int, int, int, int] | None) -> np.ndarray:
            if region is None or complete(data):
                return jc.decode(data, factor=factor, box=region, fast=self.fast)
            # truncated: decoded whole, so that every crop finds it (NOTE [ Decoding ])
            return cut(jc.decode(data, factor=factor, box=None, fast=self.fast), region)

        self._render(*jc.header(data), decode, rng, dst, scales=True)

    def _pillow(self, data: bytes, rng: np.random.Generator, dst: np.ndarray) -> None:
        Image = _pil()
        try:
            im = Image.open(io.BytesIO(data))
        except Image.UnidentifiedImageError:  # its message names the BytesIO, not the file
            raise ValueError("Pillow cannot identify it as an image") from None
        with im:
            img = np.array(im.convert("RGB"))  # writable: the resize reads it through torch
        height, width = img.shape[:2]
        self._render(height, width, lambda _, region: cut(img, region), rng, dst, scales=False)

    def _render(self, height: int, width: int, decode: Callable[..., np.ndarray],
                rng: np.random.Generator, dst: np.ndarray, *, scales: bool) -> None:
        """An image of ``height x width`` stored pixels cropped, resized and flipped into
        ``dst``; ``decode(factor, box)`` gives its pixels at 1/``factor`` scale cut to ``box``
        (None: all of them), the DCT scale taken only where it ``scales``."""
        if self.crop == "center":
            nh, nw = center_resize(height, width, self.size, self.center_fraction)
            factor = self._factor(height, width, nh, nw) if scales else 1
            center_cut_into(dst, decode(factor, None), (nh, nw), self._flip(rng))
            return
        top, left, ch, cw, flip = self._region(height, width, rng)
        factor = self._factor(ch, cw, *self.size) if scales else 1
        sh, sw = math.ceil(height / factor), math.ceil(width / factor)  # the scaled image
        sy, sx = sh / height, sw / width
        resize_into(dst, decode(factor, box(top * sy, left * sx, ch * sy, cw * sx, sh, sw)), flip)

def _pillow_ready() -> None:
    """Import now, in the thread that builds the dataset, what Pillow's ``Image.open`` would
    import at its first file (every plugin: about 70 ms, once per process). Done by a thread
    worker, an import in flight while another thread forks (another loader starting process
    workers) leaves its lock held in the child for good (see ``_host/random_watch.py``)."""
    _pil().init()


@functools.cache
def _pil() -> Any:
    """``PIL.Image``, imported once, when an image source is built: the image extra is
    optional, so the package imports without it."""
    return require("PIL.Image", "gpufeed.sources.ImageFolder or gpufeed.sources.ImageShards")
