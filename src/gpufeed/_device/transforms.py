"""Transforms that run on the device, after the host-to-device copy (``to_device(transform=)``).

Ship images as uint8 and convert on the GPU: a uint8 batch is 4x fewer bytes over PCIe than in
float32, and the conversion costs the GPU microseconds; ``to_device`` runs it on its side
stream, overlapping the step like the copy. Any callable ``batch -> batch`` will do;
:class:`Normalize`, the common one, works on CPU tensors too, with the same results.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass(eq=False)
class Normalize:
    """Convert integer (e.g. uint8) images to floats and normalise each channel.

    For each selected image tensor ``x`` (N, C, H, W), the result is the host reference
    ``((x.float() / 255 - mean) / std).to(dtype)`` (255 is the input dtype's max; computed in
    float32, or float64 when ``dtype=torch.float64``; floating inputs are not divided): bit
    for bit on the CPU, within one float32 rounding on CUDA (whose division by a scalar
    multiplies by its reciprocal). The output is (N, C, H, W) on ``x``'s device.

    Args:
        mean: per-channel means, in [0, 1] units for integer inputs (e.g. ImageNet's
            (0.485, 0.456, 0.406)), in the input's units for floating inputs.
        std: per-channel standard deviations, same units, all > 0.
        dtype: output dtype: float32, or float16/bfloat16 to halve the device memory and
            bandwidth of the batch (computed in float32, rounded once at the end).
        channels_last: give the output the ``torch.channels_last`` memory format (4-D
            only); convolutions with tensor cores are faster on it, nothing else changes.
        key: which leaf of the batch to transform: None when the batch is the image tensor;
            an int to index a tuple/list (``key=0`` for ``(images, labels)``); a str for a
            dict key or a namedtuple/dataclass field. Other leaves pass through untouched.
        layout: "NCHW" (default) or "NHWC" for the input; NHWC inputs (as decoders and
            numpy arrays usually store images) are permuted to NCHW, which with
            ``channels_last=True`` costs no copy beyond the conversion itself.
    """

    mean: Sequence[float]
    std: Sequence[float]
    _: dataclasses.KW_ONLY
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    key: int | str | None = None
    layout: Literal["NCHW", "NHWC"] = "NCHW"

    def __post_init__(self) -> None:
        self.mean = tuple(float(m) for m in self.mean)
        self.std = tuple(float(s) for s in self.std)
        if not self.mean or len(self.mean) != len(self.std):
            raise ValueError(
                f"mean and std need one value per channel and the same length, got "
                f"{len(self.mean)} and {len(self.std)}"
            )
        if any(not s > 0 for s in self.std):
            raise ValueError(f"std must be > 0 for every channel, got {self.std}")
        if self.dtype not in _FLOATS:
            raise ValueError(
                f"dtype={self.dtype} is not a floating dtype; use torch.float32, torch.float16 "
                "or torch.bfloat16"
            )
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout={self.layout!r}; use 'NCHW' or 'NHWC'")
        key = self.key
        if key is not None and (isinstance(key, bool) or not isinstance(key, int | str)):
            raise TypeError(f"key must be an int, a str or None, got {type(key).__name__}")
        self._stats: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, ...]] = {}

    def __call__(self, batch: Any) -> Any:
        if self.key is None:
            if not isinstance(batch, torch.Tensor):
                raise TypeError(
                    f"Normalize got a {type(batch).__name__} batch but key=None; pass key= to "
                    "pick the image leaf, e.g. Normalize(..., key=0) for (images, labels) or "
                    "key='image' for a dict"
                )
            return self.apply(batch)
        return _replace(batch, self.key, self.apply(_select(batch, self.key)))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise one image tensor (the transform without leaf selection)."""
        if not isinstance(x, torch.Tensor) or x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"Normalize needs a real-valued image tensor, got {_describe(x)}")
        if self.layout == "NHWC":
            if x.ndim != 4:
                raise ValueError(f"layout='NHWC' needs an (N, H, W, C) tensor, got {_describe(x)}")
            x = x.permute(0, 3, 1, 2)
        if x.ndim < 2 or x.shape[1] != len(self.mean):
            raise ValueError(
                f"Normalize has {len(self.mean)} channels but got {_describe(x)}; channels must "
                "be dim 1 (N, C, H, W), or pass layout='NHWC' for (N, H, W, C)"
            )
        if self.channels_last and x.ndim != 4:
            raise ValueError(f"channels_last=True needs a 4-D tensor, got {_describe(x)}")
        compute = torch.float64 if self.dtype == torch.float64 else torch.float32
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        mean, std = self._stats_for(x.device, compute, x.ndim)
        if x.device.type == "cuda":  # cached across calls: used on this stream now
            stream = torch.cuda.current_stream(x.device)
            mean.record_stream(stream)
            std.record_stream(stream)
        y = x.to(dtype=compute, memory_format=fmt, copy=True)
        if not x.is_floating_point():
            y.div_(torch.iinfo(x.dtype).max)
        y.sub_(mean).div_(std)
        return y if self.dtype == compute else y.to(self.dtype)

    def _stats_for(
        self, device: torch.device, dtype: torch.dtype, ndim: int
    ) -> tuple[torch.Tensor, ...]:
        """mean and std shaped for broadcasting, cached per (device, dtype, ndim). They come
        from the pool of the stream that made them and may be read later on another: ``apply``
        gives them ``record_stream`` for its stream, so freeing this object never recycles
        their memory under a kernel still reading it."""
        key = (device, dtype, ndim)
        if key not in self._stats:
            shape = (1, len(self.mean)) + (1,) * (ndim - 2)
            self._stats[key] = tuple(
                torch.tensor(v, dtype=dtype).view(shape).to(device) for v in (self.mean, self.std)
            )
        return self._stats[key]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"a {type(x).__name__}"


def _select(batch: Any, key: int | str) -> Any:
    try:
        if isinstance(key, str) and not isinstance(batch, dict):
            return getattr(batch, key)
        return batch[key]
    except (KeyError, IndexError, AttributeError, TypeError):
        raise KeyError(
            f"Normalize(key={key!r}) found no such leaf in a {type(batch).__name__} batch; "
            "use an index for tuples/lists, a key or field name for dicts/namedtuples/dataclasses"
        ) from None


def _replace(batch: Any, key: int | str, value: Any) -> Any:
    if dataclasses.is_dataclass(batch) and isinstance(key, str):
        out: Any = copy.copy(batch)
        object.__setattr__(out, key, value)  # frozen dataclasses too
        return out
    if isinstance(batch, dict):
        out = copy.copy(batch)
        out[key] = value
        return out
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        field = key if isinstance(key, str) else batch._fields[key]
        return batch._replace(**{field: value})  # type: ignore[attr-defined]
    if isinstance(batch, tuple | list):
        items = list(batch)
        items[int(key)] = value
        return tuple(items) if isinstance(batch, tuple) else items
    raise TypeError(f"Normalize(key={key!r}) cannot rebuild a {type(batch).__name__} batch")
