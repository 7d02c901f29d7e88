"""JPEG decode in the device stage: the workers' encoded images become the CPU path's batch.

With ``ImageFolder(..., decode="gpu")`` (or ``"auto"``) under ``gpufeed.DataLoader(device=
"cuda")``, the workers write each image's encoded bytes and plan (``_sources/encoded.py``) into
the ring, and the device stage decodes, crops, resizes and flips them on the GPU into a batch of
the CPU path's shape, layout and dtype (NOTE [ Device stage: streams, events and slots ] rule
(14) in ``prefetch.py``; the library's choice: NOTE [ Decoding ] in ``_sources/jpeg.py``).

    _loader.py             decode_plan(dataset, device, ...) -> DecodePlan, or None (CPU path)
    DeviceIterator._issue  DeviceDecode.place(host batch, copy, backend, side): allocate on S,
                           wait until S is idle (rule 14c), decode the JPEGs on S, upload the
                           rest rendered on the CPU, copy the other fields as usual

The decoder is an adapter (:class:`GpuJpegDecoder`): ``_device/nvimgcodec.py`` on the GPU, a
stand-in on the simulated backend in the tests (``tests/support/sim_decode.py``).
"""

from __future__ import annotations

import copy as _copy
import importlib.util
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._sources.decoded import DecodedImages
from .._sources.encoded import JPEG, KIND, RAW, SKIP, EncodedImages, render_cpu, say_once
from .prefetch import map_tensors

logger = logging.getLogger("gpufeed")


class GpuJpegDecoder(Protocol):
    """What the device stage asks of a GPU JPEG decoder. Every call runs with the side stream
    current; its work must be queued on ``stream`` (rule (14a)), and it may read the host
    bytes until the work queued on ``stream`` so far has run (rule (14b))."""

    name: str

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A device tensor from the current stream's pool."""

    def decode_into(self, images: EncodedImages, which: list[int], out: torch.Tensor,
                    stream: Any) -> list[int]:
        """Decode images ``which`` (JPEGs) of ``images`` by their plans into ``out[k]`` (an HWC
        view of the output batch), on ``stream``; returns those it could not decode."""

    def upload_into(self, host: torch.Tensor, which: list[int], out: torch.Tensor,
                    stream: Any) -> None:
        """Copy ``host[j]`` (HWC uint8 on the CPU) into ``out[which[j]]``, on ``stream``."""


@dataclass(frozen=True)
class DecodePlan:
    """A loader's GPU decode: ``source``, the dataset the workers read (a shallow copy of the
    user's that ships encoded images), and ``stage``, what the device stage runs."""

    source: Any
    stage: DeviceDecode


class DeviceDecode:
    """The device stage's decode step (rule (14)); ``place`` stands in for the copy of a batch
    whose image field is an :class:`EncodedImages`."""

    def __init__(self, decoder: GpuJpegDecoder, cpu_codec: str) -> None:
        self.decoder, self.cpu_codec = decoder, cpu_codec
        self.batches = self.idle_waits = 0

    def place(self, host: Any, copy: Callable[[torch.Tensor], torch.Tensor], backend: Any,
              side: Any) -> tuple[Any, Any]:
        """(the device batch, what must stay referenced until E_copy has completed)."""
        held: list[Any] = [host]
        if isinstance(host, EncodedImages):
            return self._decode(host, backend, side, held), held
        if type(host) in (list, tuple) and any(isinstance(x, EncodedImages) for x in host):
            out = [self._decode(x, backend, side, held) if isinstance(x, EncodedImages)
                   else map_tensors(copy, x) for x in host]
            return (out if type(host) is list else tuple(out)), held
        return map_tensors(copy, host), host

    def _decode(self, enc: EncodedImages, backend: Any, side: Any,
                held: list[Any]) -> torch.Tensor:
        n = len(enc.ends)
        oh, ow = enc.size
        dec = self.decoder
        # the batch in its final layout, from S's pool (rule 1); written through HWC views
        if enc.channels_last:
            images = dec.empty((n, oh, ow, 3), torch.uint8).permute(0, 3, 1, 2)
        else:
            images = dec.empty((n, 3, oh, ow), torch.uint8)
        hwc = images.permute(0, 2, 3, 1)
        self._wait_idle(backend, side)
        plans = enc.plans.numpy()
        kinds = plans[:, KIND]
        jpegs = [k for k in range(n) if kinds[k] == JPEG]
        failed = dec.decode_into(enc, jpegs, hwc, side) if jpegs else []
        rest = sorted([k for k in range(n) if kinds[k] != JPEG] + failed)
        if failed:
            say_once("gpu-decode-failed", "gpufeed's GPU decoder (%s) could not decode %d of "
                     "a batch's %d JPEGs; they were decoded on the CPU (said once)", dec.name,
                     len(failed), len(jpegs))
        if rest:
            host = torch.empty((len(rest), oh, ow, 3), dtype=torch.uint8)
            pixels = host.numpy()
            for j, k in enumerate(rest):
                if kinds[k] == RAW:
                    pixels[j] = enc.item(k).reshape(oh, ow, 3)
                elif kinds[k] == SKIP:
                    pixels[j] = 0
                else:
                    render_cpu(enc.item(k), plans[k], pixels[j], self.cpu_codec)
            held.append(host)  # read by the upload when it runs (rule 14b)
            dec.upload_into(host, rest, hwc, side)
        self.batches += 1
        return images

    def _wait_idle(self, backend: Any, side: Any) -> None:
        """Rule (14c): nothing queued on S before the decode (the batch's allocation
        included) may still run when the decoder writes."""
        idle = backend.record_event(side)
        if not idle.query():
            self.idle_waits += 1
            idle.synchronize()


def make_decoder(device: torch.device) -> GpuJpegDecoder:
    """The GPU JPEG decoder for ``device`` (raises ImportError or RuntimeError when it cannot
    be made). The tests replace this function by their stand-in."""
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec(
            "nvidia.nvimgcodec") is None:
        raise ImportError(
            "nvImageCodec is not installed (pip install 'gpufeed[gpu-decode]', which installs "
            "nvidia-nvimgcodec-cu12[nvjpeg]; -cu13 for a CUDA 13 build of torch)")
    from .nvimgcodec import NvImageCodec

    return NvImageCodec(device)


#: plans made, per dataset: (device, batched) -> plan (one decoder per dataset and device)
_plans: weakref.WeakKeyDictionary[Any, dict[tuple[Any, bool], DecodePlan | None]] = \
    weakref.WeakKeyDictionary()


def decode_plan(dataset: Any, device: torch.device | None, *, batched: bool) -> DecodePlan | None:
    """The GPU decode of ``dataset`` under a loader delivering to ``device``, or None (the CPU
    path); made once per dataset, device and ``batched`` (the loader collates with the default
    collate function, the only case where a source writes whole batches: NOTE [ Batch
    sources ]). ``decode="gpu"`` says once why it is not taken."""
    mode = getattr(dataset, "decode", "cpu") if isinstance(dataset, DecodedImages) else "cpu"
    if mode == "cpu":
        return None
    made = _plans.setdefault(dataset, {})
    key = (device, batched)
    if key not in made:
        made[key] = _make_plan(dataset, mode, device, batched)
    return made[key]


def _make_plan(dataset: Any, mode: str, device: torch.device | None,
               batched: bool) -> DecodePlan | None:
    if device is None or device.type != "cuda":
        why = "the loader has no CUDA device stage (device='cuda')"
    elif not batched:
        why = "the loader has a collate_fn of its own (the GPU path needs the default one)"
    elif getattr(dataset, "transform", None) is not None:
        why = "the dataset has a transform= (it runs in the workers, on decoded pixels)"
    else:
        try:
            decoder = make_decoder(device)
        except (ImportError, RuntimeError, OSError) as exc:
            why = str(exc)
        else:
            shipped = _copy.copy(dataset)
            shipped._encoded, shipped._origin = True, dataset  # skipped counts the user's
            return DecodePlan(shipped, DeviceDecode(decoder, dataset.decoder))
    if mode == "gpu":
        say_once(f"gpu-decode-off:{why}", "%s(decode='gpu') decodes on the CPU: %s (NOTE "
                 "[ Decoding ] in gpufeed/_sources/jpeg.py)", type(dataset).__name__, why)
    else:
        logger.info("%s(decode='auto') decodes on the CPU: %s", type(dataset).__name__, why)
    return None
