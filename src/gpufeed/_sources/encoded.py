"""What the workers write for a JPEG decoded on the GPU: the files' bytes and each one's plan.

With ``decode="gpu"`` (NOTE [ Decoding ] in ``jpeg.py``) a batch's image field is an
:class:`EncodedImages`: the encoded files back to back in one uint8 tensor of the slot, and per
image a plan of int32s: which stored pixels to decode (the crop box, drawn from the per-sample
generator as the CPU path draws it), what to resize them to, what to cut and whether to flip.
The device stage (``_device/decode.py``) turns it into the CPU path's batch on its side stream.

A file the GPU path does not take (:func:`gpu_takes`: not a JPEG; not 8-bit baseline, extended
or progressive Huffman with 1 or 3 components; Adobe-marked RGB; without its end marker) is
decoded by the worker, and its final pixels (HWC, the output's size) take its place in the bytes
(``RAW``); a file that fails with ``on_error="skip"`` is ``SKIP`` (black, label -1). Which files
went to the CPU is said once per process (a warning on the ``gpufeed`` logger).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from .arrays import allocate
from .jpeg import codec, say_once
from .protocol import SourceChanged, sample_seeds
from .resample import box, center_cut_into, center_resize, cut, resize_into

# A plan's columns. KIND: what the bytes are; TOP..BW: the stored pixels to decode; RH, RW: the
# size they are resized to (the region's own size: no resize); CT, CL: the cut of the output's
# size out of the resized image; FLIP: mirrored left to right.
KIND, TOP, LEFT, BH, BW, RH, RW, CT, CL, FLIP = range(10)
PLAN_WIDTH = 10
JPEG, RAW, SKIP = 0, 1, 2
#: ``decode=`` of the image sources: the workers, the device stage, or the device stage when it can
DECODE_MODES = ("cpu", "gpu", "auto")

JPEG_MAGIC = b"\xff\xd8\xff"
#: start-of-frame markers the GPU path takes: baseline, extended sequential and progressive,
#: all Huffman (0xC3 lossless and the arithmetic-coded 0xC9-0xCB are left to the CPU)
_GPU_FRAMES = (0xC0, 0xC1, 0xC2)


class EncodedImages(NamedTuple):
    """A batch's images before they are decoded: ``data`` (uint8, the files or RAW pixels back
    to back), ``ends`` (int64 (B,): where each image's bytes end in ``data``), ``plans``
    (int32 (B, 10), the columns above) and ``layout`` (int64 (3,): output height, width, and
    1 for channels-last memory). Every field is a tensor, so the batch travels in the ring."""

    data: torch.Tensor
    ends: torch.Tensor
    plans: torch.Tensor
    layout: torch.Tensor

    def item(self, k: int) -> np.ndarray:
        """The bytes of image ``k`` (a view of ``data``)."""
        ends = self.ends.numpy()
        start = int(ends[k - 1]) if k else 0
        return self.data.numpy()[start:int(ends[k])]

    @property
    def size(self) -> tuple[int, int]:
        return int(self.layout[0]), int(self.layout[1])

    @property
    def channels_last(self) -> bool:
        return bool(self.layout[2])


class JpegFrame(NamedTuple):
    """A JPEG's start-of-frame: its marker (0xC0-0xCF), sample precision, size, components."""

    marker: int
    precision: int
    height: int
    width: int
    components: int


def jpeg_frame(data: bytes | np.ndarray | memoryview) -> JpegFrame | None:
    """The frame header of the JPEG ``data``, or None if none is found before the scan (not a
    JPEG, or damaged). Reads only the markers, a few hundred bytes at most past the EXIF."""
    buf = data if isinstance(data, bytes) else np.asarray(data, np.uint8).tobytes()
    n = len(buf)
    if n < 4 or bytes(buf[:3]) != JPEG_MAGIC:
        return None
    i = 2
    while i + 4 <= n:
        if buf[i] != 0xFF:
            return None
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length
            i += 2
            continue
        length = (buf[i + 2] << 8) | buf[i + 3]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if i + 10 > n:
                return None
            return JpegFrame(marker, buf[i + 4], (buf[i + 5] << 8) | buf[i + 6],
                             (buf[i + 7] << 8) | buf[i + 8], buf[i + 9])
        if marker in (0xDA, 0xD9) or length < 2:
            return None
        i += 2 + length
    return None


def complete(data: bytes) -> bool:
    """Whether the JPEG ``data`` ends with its EOI marker (trailing bytes allowed in its last
    KiB): a file cut short lacks it. In entropy-coded data 0xFF is followed by 0x00 or a
    restart marker, so 0xFFD9 there is the end of the image."""
    return data.endswith(b"\xff\xd9") or b"\xff\xd9" in data[max(2048, len(data) - 1024):]


def _adobe_rgb(data: bytes) -> bool:
    """Whether an Adobe APP14 segment says the 3 components are stored as RGB (transform 0),
    which a YCbCr decoder would convert wrongly."""
    at = data.find(b"\xff\xeeAdobe", 2, 65536)
    return at >= 0 and at + 15 < len(data) and data[at + 15] == 0


def gpu_takes(data: bytes) -> JpegFrame | None:
    """The frame of ``data`` when the GPU path decodes it (NOTE [ Decoding ]), else None."""
    frame = jpeg_frame(data)
    if (frame is None or frame.marker not in _GPU_FRAMES or frame.precision != 8
            or frame.components not in (1, 3) or not frame.height or not frame.width):
        return None
    if frame.components == 3 and _adobe_rgb(data):
        return None
    if not complete(data):
        return None  # cut short: the CPU path decodes it whole (or refuses it)
    return frame


def _plan(src: Any, height: int, width: int, rng: np.random.Generator) -> list[int]:
    """The plan of one JPEG of ``height x width`` stored pixels, its random draws taken as the
    CPU path takes them at full scale (``DecodedImages._render`` with ``dct_scale=False``)."""
    oh, ow = src.size
    if src.crop == "center":
        nh, nw = center_resize(height, width, src.size, src.center_fraction)
        flip = src._flip(rng)
        return [JPEG, 0, 0, height, width, nh, nw, round((nh - oh) / 2.0),
                round((nw - ow) / 2.0), int(flip)]
    top, left, ch, cw, flip = src._region(height, width, rng)
    t, lft, bh, bw = box(top, left, ch, cw, height, width)
    return [JPEG, t, lft, bh, bw, oh, ow, 0, 0, int(flip)]


def plan_hwc(region: np.ndarray, plan: np.ndarray | list[int], dst: np.ndarray) -> None:
    """The CPU's rendering of a plan: ``region`` (the decoded box, HWC uint8) resized, cut and
    flipped into ``dst`` (an HWC view of the output's size) as the CPU path does."""
    rh, rw, flip = int(plan[RH]), int(plan[RW]), float(plan[FLIP])
    if (rh, rw) == dst.shape[:2] and not plan[CT] and not plan[CL]:
        resize_into(dst, region, flip)
    else:
        center_cut_into(dst, region, (rh, rw), flip)


def encoded_batch(src: Any, idx: np.ndarray, *, seed: int | None, epoch: int,
                  alloc: Any) -> list[Any]:
    """The fields of a batch of ``src`` (a ``DecodedImages``) with its images left encoded
    (an :class:`EncodedImages`), its tensors from ``alloc`` (the slot)."""
    n = len(idx)
    oh, ow = src.size
    labels = allocate(alloc, (n,), torch.int64)
    labels.numpy()[:] = src.targets[idx]
    plans = np.zeros((n, PLAN_WIDTH), np.int32)
    parts: list[np.ndarray] = []
    cpu = 0
    for k, (i, s) in enumerate(zip(idx.tolist(), sample_seeds(idx, seed, epoch), strict=True)):
        try:
            data = src._read(i)
            frame = gpu_takes(data)
            if frame is not None:
                plans[k] = _plan(src, frame.height, frame.width,
                                 np.random.Generator(np.random.PCG64(s)))
                parts.append(np.frombuffer(data, np.uint8))
                continue
            pixels = np.empty((oh, ow, 3), np.uint8)
            src._load(i, s, pixels)  # the CPU path (its own generator of seed s)
            cpu += 1
        except SourceChanged:
            raise
        except Exception as exc:
            if src.on_error == "raise":
                raise src._unreadable(i, exc) from exc
            getattr(src, "_origin", src).skipped += 1  # the user's dataset (a copy reads)
            labels[k] = -1
            plans[k, KIND] = SKIP
            parts.append(np.empty(0, np.uint8))
            continue
        plans[k, KIND] = RAW
        parts.append(pixels.reshape(-1))
    if cpu:
        say_once("gpu-decode-file", "gpufeed decodes some images on the CPU although "
                 "decode='gpu': the GPU path takes 8-bit baseline or progressive JPEGs with "
                 "1 or 3 components, complete; other files are decoded in the workers as "
                 "before (this worker found %d in a batch of %d)", cpu, n)
    sizes = [len(p) for p in parts]
    ends = allocate(alloc, (n,), torch.int64)
    ends.numpy()[:] = np.cumsum(sizes, dtype=np.int64)
    data_t = allocate(alloc, (max(1, sum(sizes)),), torch.uint8)
    if parts:
        np.concatenate(parts, out=data_t.numpy()[:sum(sizes)])
    plans_t = allocate(alloc, (n, PLAN_WIDTH), torch.int32)
    plans_t.numpy()[:] = plans
    layout = allocate(alloc, (3,), torch.int64)
    layout.numpy()[:] = (oh, ow, int(src.memory_format is torch.channels_last))
    return src._fields(idx, EncodedImages(data_t, ends, plans_t, layout), labels)


def region_of(plan: np.ndarray | list[int]) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a plan's stored pixels."""
    return int(plan[TOP]), int(plan[LEFT]), int(plan[BH]), int(plan[BW])


def render_cpu(data: bytes | np.ndarray, plan: np.ndarray, dst: np.ndarray, decoder: str) -> None:
    """Image ``data`` decoded on the CPU and rendered by ``plan`` into ``dst`` (HWC, the
    output's size): the codec ``decoder`` on the plan's region at full scale, else Pillow."""
    raw = data if isinstance(data, bytes) else data.tobytes()
    try:
        region = codec(decoder).decode(raw, factor=1, box=region_of(plan), fast=False)
    except ValueError:
        import io

        from PIL import Image

        with Image.open(io.BytesIO(raw)) as im:
            region = cut(np.array(im.convert("RGB")), region_of(plan))
    plan_hwc(region, plan, dst)
