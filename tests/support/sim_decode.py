"""SimJpeg: a stand-in GPU JPEG decoder on the simulated CUDA backend (``sim_cuda.SimCuda``).

It implements ``gpufeed._device.decode.GpuJpegDecoder`` the way a GPU decoder behaves, with
the CPU path's own code for the pixels (so its batches equal the CPU path's exactly):

* ``decode_into`` queues one kernel per image on the stream it is given; the kernel reads the
  image's encoded bytes from the host batch *when it runs* (a DMA of the bitstream), through a
  weak reference: bytes released before then are a violation (rule (14b)).
* ``early=True`` models nvJPEG's batched hardware decode: the pixels are written at the call,
  not in stream order. A block of the batch whose allocation has not run yet on its stream
  (work queued before it may still use that memory) is then a violation (rule (14c)).
* ``other_stream=True`` queues the kernels on a stream of its own (rule (14a) broken).
* ``fail``: a predicate on an image's bytes; those images are returned as failed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gpufeed._sources.encoded import EncodedImages, render_cpu
from support.sim_cuda import SimCuda


class SimJpeg:
    name = "sim-jpeg"

    def __init__(self, sim: SimCuda, codec: str = "simplejpeg", *, early: bool = False,
                 other_stream: bool = False, fail: Callable[[bytes], bool] | None = None,
                 cost: int = 1) -> None:
        self.sim, self.codec, self.early, self.other_stream = sim, codec, early, other_stream
        self.fail, self.cost = fail, cost
        self.decoded = self.uploaded = 0
        self._other: Any = None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.sim.empty(shape, dtype)

    def _stream(self, stream: Any) -> Any:
        if not self.other_stream:
            return stream
        if self._other is None:
            self._other = self.sim.new_stream()
            self._other.name = "decoder's own"
        return self._other

    def decode_into(self, images: EncodedImages, which: list[int], out: torch.Tensor,
                    stream: Any) -> list[int]:
        sim, failed = self.sim, []
        plans = images.plans.numpy().copy()
        ends = images.ends.numpy().copy()
        data = weakref.ref(images.data)  # a DMA holds an address, not the tensor
        for k in which:
            if self.fail is not None and self.fail(images.item(k).tobytes()):
                failed.append(k)
                continue
            start, end = (int(ends[k - 1]) if k else 0), int(ends[k])

            def decode(dst: torch.Tensor, k: int = k, start: int = start, end: int = end) -> None:
                host = data()
                if host is None:
                    sim.violations.append(f"decode of image {k} read its bytes after the host "
                                          "batch was released (its slot may be recycled)")
                    return
                pixels = np.empty(tuple(dst.shape), np.uint8)
                render_cpu(host.numpy()[start:end].tobytes(), plans[k], pixels, self.codec)
                dst.copy_(torch.from_numpy(pixels))

            self.decoded += 1
            if self.early:  # the hardware engine: written now, whatever is queued before
                with sim.lock:
                    view = sim._resolve(sim._handle(out[k]), "hardware decode")
                if view is not None:
                    decode(view)
                continue
            sim.launch(self._stream(stream), decode, out[k], cost=self.cost)
        return failed

    def upload_into(self, host: torch.Tensor, which: list[int], out: torch.Tensor,
                    stream: Any) -> None:
        sim = self.sim
        moved = sim.copy(host)
        self.uploaded += len(which)

        def scatter(src: torch.Tensor, dst: torch.Tensor) -> None:
            for j, k in enumerate(which):
                dst[k].copy_(src[j])

        sim.launch(self._stream(stream), scatter, moved, out)
