"""Where ``ImageFolder`` crops and how it resamples: torchvision's geometry, written in place.

NOTE [ Resampling ]
-------------------
A region is cut first and then resized, as torchvision's ``resized_crop`` does, by torch's
antialiased bilinear filter (``interpolate(mode="bilinear", antialias=True)``): on uint8 input it
runs a dedicated integer kernel (torchvision's tensor path runs the same), 3-4x faster than
Pillow's ``resize(box=...)`` on the same region. It agrees with Pillow's bilinear resize of the
cut region to within a level or so (tested); Pillow's ``box=`` would also read pixels just
outside the region. For one image it runs in the calling thread (with two intra-op threads its
CPU time equalled its wall time), so thread workers do not oversubscribe the cores through it.

Every image is written straight into its place in the batch (the loader's slot), in the batch's
memory format. Into a channels-last batch (``ImageFolder(memory_format=torch.channels_last)``)
the resize writes there itself, through the kernel's ``out=`` form (the same operator
``interpolate`` calls, so the same pixels, tested). Into planes it does not: the kernel works in
channels-last memory, and given planar ``out=`` it took about twice as long as into HWC
memory, more than the transposition it saves. So a channels-first batch's image is resized into
a new HWC image and then copied into planes, mirrored on the way when flipped (numpy; the same
pixels, tested), as is a plain window (no resize). A flip into channels-last memory is torch's
``flip`` (numpy mirrors 3-byte HWC pixels one at a time). ``center_cut_into`` resizes the whole
image into HWC memory in either layout and copies the central cut.
Measurements: docs/how-it-works/measurements/sources.md#resampling.
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: the antialiased bilinear kernel that ``interpolate`` calls, in its ``out=`` form
_AA_OUT = torch.ops.aten._upsample_bilinear2d_aa.out


def random_resized(
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


def center_resize(height: int, width: int, size: tuple[int, int],
                  fraction: float) -> tuple[int, int]:
    """(height, width) after torchvision's ``Resize(S)``, ``S = int(min(size) / fraction)``
    raised until the result holds ``size``: the shorter side ``S``, the longer
    ``int(S * longer / shorter)``."""
    oh, ow = size
    short, long = (width, height) if width <= height else (height, width)
    o_short, o_long = (ow, oh) if width <= height else (oh, ow)
    s = max(int(min(size) / fraction), o_short, math.ceil(o_long * short / long))
    while int(s * long / short) < o_long:
        s += 1
    new_long = int(s * long / short)
    return (new_long, s) if width <= height else (s, new_long)


def box(top: float, left: float, h: float, w: float, height: int,
         width: int) -> tuple[int, int, int, int]:
    """A region on whole pixels inside a ``height x width`` image, at least one pixel across
    (a very thin image can give a region under half a pixel)."""
    t = min(round(top), height - 1)
    lft = min(round(left), width - 1)
    return t, lft, max(1, min(round(h), height - t)), max(1, min(round(w), width - lft))


def cut(img: np.ndarray, region: tuple[int, int, int, int] | None) -> np.ndarray:
    """``img``'s ``region`` = (top, left, height, width); all of it for None."""
    if region is None:
        return img
    top, left, h, w = region
    return img[top:top + h, left:left + w]


def write(dst: np.ndarray, img: np.ndarray, flip: float) -> None:
    """``img`` (HWC uint8 of ``dst``'s size) into ``dst`` (an HWC view of the batch's image,
    any memory format), mirrored left to right when ``flip``."""
    if flip and _is_last(dst):  # numpy mirrors 3-byte pixels one by one (10x slower)
        torch.from_numpy(dst).copy_(torch.from_numpy(img).flip(1))
        return
    np.copyto(dst, img[:, ::-1] if flip else img)


def resize_into(dst: np.ndarray, img: np.ndarray, flip: float) -> None:
    """``img`` (HWC uint8) resized to ``dst``'s size, written into ``dst`` (an HWC view of the
    batch's image; NOTE [ Resampling ])."""
    if img.shape[:2] == dst.shape[:2]:
        write(dst, img, flip)
        return
    if not _is_last(dst):  # planes: resized in the kernel's layout, then written (see NOTE)
        write(dst, _resized_hwc(img, dst.shape[:2]), flip)
        return
    out = torch.from_numpy(dst)
    _AA_OUT(_nchw(img), list(dst.shape[:2]), False, None, None,
            out=out.permute(2, 0, 1).unsqueeze(0))
    if flip:
        out.copy_(out.flip(1))


def center_cut_into(dst: np.ndarray, img: np.ndarray, resized: tuple[int, int],
                    flip: float) -> None:
    """torchvision's ``Resize`` of ``img`` to ``resized`` then ``CenterCrop`` to ``dst``'s size
    (its rounding), written into ``dst`` (an HWC view of the batch's image)."""
    h, w = dst.shape[:2]
    top = round((resized[0] - h) / 2.0)
    left = round((resized[1] - w) / 2.0)
    if img.shape[:2] == resized:
        write(dst, img[top:top + h, left:left + w], flip)
        return
    whole = _resized_hwc(img, resized)  # in the kernel's layout, whatever dst's (NOTE)
    write(dst, whole[top:top + h, left:left + w], flip)


def _nchw(img: np.ndarray) -> torch.Tensor:
    """An HWC image as the kernel's (1, 3, h, w) input, its memory untouched."""
    return torch.from_numpy(img).permute(2, 0, 1).unsqueeze(0)


def _resized_hwc(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """``img`` (HWC uint8) resized to ``size`` by the antialiased kernel, into new HWC memory:
    the kernel's own layout, where it writes about twice as fast as into planes (NOTE)."""
    hwc = torch.empty((1, *size, 3), dtype=torch.uint8)
    _AA_OUT(_nchw(img), list(size), False, None, None, out=hwc.permute(0, 3, 1, 2))
    return hwc.numpy()[0]


def _is_last(dst: np.ndarray) -> bool:
    """Whether the HWC view ``dst`` keeps its channels innermost (a channels-last batch)."""
    return dst.strides[2] == dst.itemsize
