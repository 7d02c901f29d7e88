"""The GPU JPEG decoder of the device stage: NVIDIA nvImageCodec (NOTE [ Decoding ]).

``NvImageCodec`` implements ``_device/decode.py``'s ``GpuJpegDecoder``: one batched
``Decoder.decode`` of the batch's JPEGs on the side stream (``cuda_stream=``), each one only its
plan's region where the library takes a region (``DecodeSource``/``CodeStream`` with a
``Region``), then per image, on the same stream, torch's antialiased bilinear resize (in float,
rounded: the uint8 kernel is the CPU's), the cut and the flip, written into the batch. EXIF
orientation is not applied (the CPU path ignores it too). Unverified on hardware so far: see
docs/guides/gpu-decode.md.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .._sources.encoded import CL, CT, FLIP, RH, RW, EncodedImages, region_of


class NvImageCodec:
    """nvImageCodec's batched decoder on one device (its hardware engine, CUDA and hybrid
    backends, as the library picks per image)."""

    name = "nvimagecodec"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available to torch")
        nv: Any = importlib.import_module("nvidia.nvimgcodec")
        self.nv, self.device = nv, device
        # smooth chroma upsampling, as libjpeg-turbo's default (the CPU path's)
        self.decoder = nv.Decoder(device_id=device.index or 0, options=":fancy_upsampling=1")
        params: dict[str, Any] = dict(apply_exif_orientation=False, allow_any_depth=False,
                                      color_spec=getattr(nv.ColorSpec, "SRGB", None)
                                      or nv.ColorSpec.RGB)
        formats = getattr(nv, "SampleFormat", None)
        if formats is not None and hasattr(formats, "I_RGB"):  # grayscale JPEGs as RGB too
            params["sample_format"] = formats.I_RGB
        self.params = nv.DecodeParams(**params)
        # region decoding: a code stream's sub-stream of a Region (0.9), or DecodeSource(code
        # stream, region) where a version has it; else the whole image, cut on the device
        if hasattr(nv.CodeStream, "get_sub_code_stream"):
            self.regions = "sub"
        elif hasattr(nv, "DecodeSource"):
            self.regions = "source"
        else:
            self.regions = ""
        self.version = getattr(nv, "__version__", "?")

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _source(self, data: np.ndarray, plan: np.ndarray) -> Any:
        nv = self.nv
        stream = nv.CodeStream(data)
        if not self.regions:
            return stream
        t, lft, bh, bw = region_of(plan)
        region = nv.Region(start=(t, lft), end=(t + bh, lft + bw))
        if self.regions == "source":
            return nv.DecodeSource(stream, region)
        return stream.get_sub_code_stream(region=region)

    def decode_into(self, images: EncodedImages, which: list[int], out: torch.Tensor,
                    stream: Any) -> list[int]:
        plans = images.plans.numpy()
        sources = [self._source(images.item(k), plans[k]) for k in which]
        try:
            decoded = self.decoder.decode(sources, params=self.params,
                                          cuda_stream=stream.cuda_stream)
        except Exception:  # the whole batch refused: every image goes to the CPU
            return list(which)
        failed: list[int] = []
        for k, img in zip(which, decoded, strict=True):
            if img is None:
                failed.append(k)
                continue
            region = torch.from_dlpack(img)  # (h, w, c) uint8 on the device, ordered on S
            if region.shape[-1] == 1:
                region = region.expand(-1, -1, 3)
            if not self.regions:
                t, lft, bh, bw = region_of(plans[k])
                region = region[t:t + bh, lft:lft + bw]
            self._render(region, plans[k], out[k])
        return failed

    @staticmethod
    def _render(region: torch.Tensor, plan: np.ndarray, dst: torch.Tensor) -> None:
        """``region`` (HWC uint8) resized to the plan's size, cut and flipped into ``dst``."""
        oh, ow = dst.shape[:2]
        x = region.permute(2, 0, 1).unsqueeze(0)
        rh, rw = int(plan[RH]), int(plan[RW])
        if (x.shape[2], x.shape[3]) != (rh, rw):
            y = F.interpolate(x.float(), size=(rh, rw), mode="bilinear", antialias=True,
                              align_corners=False)
            x = y.round_().clamp_(0, 255).to(torch.uint8)
        ct, cl = int(plan[CT]), int(plan[CL])
        x = x[0, :, ct:ct + oh, cl:cl + ow]
        if plan[FLIP]:
            x = x.flip(-1)
        dst.copy_(x.permute(1, 2, 0))

    def upload_into(self, host: torch.Tensor, which: list[int], out: torch.Tensor,
                    stream: Any) -> None:
        moved = host.to(self.device, non_blocking=True)
        for j, k in enumerate(which):
            out[k].copy_(moved[j])
