"""Normalize: equal to the host reference computation; leaf selection, errors, plumbing."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch

from gpufeed._device.stage import to_device
from gpufeed._device.transforms import Normalize

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
Batch = namedtuple("Batch", ["image", "label"])


@dataclasses.dataclass(frozen=True)
class Record:
    image: torch.Tensor
    label: torch.Tensor


def images(n: int = 4, h: int = 5, w: int = 6, *, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)


def reference(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The host-side computation users would otherwise write."""
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return ((x.float() / 255 - mean) / std).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_equals_the_host_reference(dtype: torch.dtype, channels_last: bool) -> None:
    x = images()
    out = Normalize(MEAN, STD, dtype=dtype, channels_last=channels_last)(x)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, reference(x, dtype))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("channels_last", [False, True])
def test_nhwc_input_gives_nchw_output(channels_last: bool) -> None:
    x = images()
    nhwc = x.permute(0, 2, 3, 1).contiguous()
    out = Normalize(MEAN, STD, layout="NHWC", channels_last=channels_last)(nhwc)
    assert out.shape == x.shape and torch.equal(out, reference(x))


@pytest.mark.parametrize("channels_last", [False, True])
def test_channels_last_input_is_read_by_its_strides(channels_last: bool) -> None:
    """A (N, 3, H, W) batch in channels-last memory (``ImageFolder(memory_format=
    torch.channels_last)``): the same values out, in the layout ``channels_last`` asks for."""
    x = images()
    out = Normalize(MEAN, STD, channels_last=channels_last)(
        x.contiguous(memory_format=torch.channels_last))
    assert torch.equal(out, reference(x))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)


def test_float_input_is_not_rescaled_and_input_is_untouched() -> None:
    x = torch.rand(2, 3, 4, 4)
    keep = x.clone()
    out = Normalize((0.5, 0.5, 0.5), (2.0, 2.0, 2.0))(x)
    assert torch.equal(out, (x - 0.5) / 2.0) and torch.equal(x, keep)


def test_other_integer_dtypes_scale_by_their_max() -> None:
    x = torch.randint(0, 1 << 15, (2, 1, 3, 3), dtype=torch.int16)
    out = Normalize((0.0,), (1.0,))(x)
    assert torch.equal(out, x.float() / 32767)


@pytest.mark.parametrize(
    ("batch", "key"),
    [
        ((images(), torch.arange(4)), 0),
        ([torch.arange(4), images()], 1),
        ({"image": images(), "label": torch.arange(4)}, "image"),
        (Batch(images(), torch.arange(4)), "image"),
        (Batch(images(), torch.arange(4)), 0),
        (Record(images(), torch.arange(4)), "image"),
    ],
)
def test_key_selects_one_leaf_and_keeps_the_others(batch: Any, key: int | str) -> None:
    out = Normalize(MEAN, STD, key=key)(batch)
    assert type(out) is type(batch)
    assert torch.equal(_get(out, key), reference(_get(batch, key)))
    assert _get(batch, key).dtype == torch.uint8  # the input batch is not modified
    others = [v for v in _leaves(batch) if v is not _get(batch, key)]
    assert all(any(v is o for o in _leaves(out)) for v in others)  # passed through as is


def _get(batch: Any, key: int | str) -> Any:
    return getattr(batch, key) if isinstance(key, str) and not isinstance(batch, dict) else (
        batch[key]
    )


def _leaves(batch: Any) -> list[Any]:
    if isinstance(batch, dict):
        return list(batch.values())
    if dataclasses.is_dataclass(batch):
        return [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return list(batch)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mean": (0.5,), "std": (1.0, 1.0)}, ValueError, "same length"),
        ({"mean": (), "std": ()}, ValueError, "one value per channel"),
        ({"std": (1.0, 0.0, 1.0)}, ValueError, "std must be > 0"),
        ({"dtype": torch.int32}, ValueError, "not a floating dtype"),
        ({"layout": "CHW"}, ValueError, "'NCHW' or 'NHWC'"),
        ({"key": 1.5}, TypeError, "key must be"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"mean": MEAN, "std": STD, **kwargs}
    with pytest.raises(error, match=match):
        Normalize(args.pop("mean"), args.pop("std"), **args)


def test_bad_batches_say_how_to_fix_them() -> None:
    n = Normalize(MEAN, STD)
    with pytest.raises(TypeError, match="pass key="):
        n((images(), torch.arange(4)))
    with pytest.raises(ValueError, match="has 3 channels but got a tensor of shape"):
        n(torch.zeros(2, 4, 5, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NHWC"):
        Normalize(MEAN, STD, layout="NHWC")(torch.zeros(3, 5, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="channels_last=True needs a 4-D"):
        Normalize(MEAN, STD, channels_last=True)(torch.zeros(2, 3, 5, dtype=torch.uint8))
    with pytest.raises(KeyError, match="no such leaf"):
        Normalize(MEAN, STD, key="img")({"image": images()})
    with pytest.raises(TypeError, match="real-valued image"):
        n(torch.zeros(2, 3, 1, 1, dtype=torch.bool))


def test_runs_as_to_device_transform() -> None:
    batches = [(images(seed=i), torch.tensor([i])) for i in range(5)]
    n = Normalize(MEAN, STD, key=0, dtype=torch.bfloat16, channels_last=True)
    out = list(to_device(batches, "cpu", transform=n))
    for (x, y), (ox, oy) in zip(batches, out, strict=True):
        assert torch.equal(ox, reference(x, torch.bfloat16)) and oy is y


def test_repr_names_the_settings() -> None:
    assert "channels_last=True" in repr(Normalize(MEAN, STD, channels_last=True))


# ---------------------------------------------------------------- CUDA (run on a GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_the_host_reference(dtype: torch.dtype) -> None:
    x = images(8, 32, 32)
    out = Normalize(MEAN, STD, dtype=dtype, channels_last=True)(x.cuda())
    assert out.is_cuda and out.is_contiguous(memory_format=torch.channels_last)
    # CUDA divides by a scalar through its reciprocal: one float32 rounding apart at most
    torch.testing.assert_close(out.cpu(), reference(x, dtype))


@pytest.mark.cuda
def test_cuda_to_device_ships_uint8_and_normalises_on_the_side_stream() -> None:
    batches = [
        (images(16, 24, 24, seed=i).pin_memory(), torch.tensor([i]).pin_memory())
        for i in range(50)
    ]
    n = Normalize(MEAN, STD, key=0, dtype=torch.float16, channels_last=True)
    streams: set[int] = set()

    def on_side(batch: Any) -> Any:
        streams.add(torch.cuda.current_stream().stream_id)
        return n(batch)

    consumer = torch.cuda.current_stream().stream_id
    it = to_device(batches, "cuda", transform=on_side)
    for (x, _), (ox, oy) in zip(batches, it, strict=True):
        assert ox.dtype == torch.float16 and oy.is_cuda
        assert ox.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(ox.cpu(), reference(x, torch.float16))
    assert it.stats().bytes_copied == sum(x.numel() + 8 for x, _ in batches)  # uint8 + int64
    assert len(streams) == 1 and consumer not in streams  # one side stream, not the consumer's
    assert it.stats().pageable_batches == 0
