"""``transform=`` on ImageFolder and ImageShards: the stock loader's batches, per-sample random
draws for any workers, other shapes and dtypes, refusals (NOTE [ Image transforms ])."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader as StockLoader

import gpufeed
from gpufeed.random import RandomStateWarning, sample_generator
from gpufeed.sources import ImageFolder, ImageShards

pytest.importorskip("simplejpeg")
pytest.importorskip("PIL.Image")

from test_images import make_folder
from test_shards import shards_of

WORKERS = ((0, "process"), (1, "process"), (2, "process"), (2, "thread"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("imgs"))


def flip_to_float(img: torch.Tensor) -> torch.Tensor:
    """What the benchmark's row does: a flip and a dtype conversion, in torch."""
    return img.flip(-1).to(torch.float32).div_(255)


def corner(img: torch.Tensor) -> torch.Tensor:
    """A view of the image it was given: its top-left corner."""
    return img[:, :8, :8]


def generator_flip(img: torch.Tensor) -> torch.Tensor:
    """A random flip drawn from the sample's generator, and a noise level from it."""
    g = sample_generator()
    out = img.flip(-1) if torch.rand(1, generator=g).item() < 0.5 else img
    return out.float() + torch.rand((), generator=g)


def global_flip(img: torch.Tensor) -> torch.Tensor:
    """torchvision's habit: draws from torch's global generator; slow enough that the loop
    waits on it."""
    time.sleep(0.003)
    out = img.flip(-1) if torch.rand(1).item() < 0.5 else img
    return out.float() + torch.rand(())


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _batches(loader) -> list:
    return list(loader)


@pytest.mark.parametrize("transform", [flip_to_float, corner])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_batches_equal_the_stock_loaders(folder, transform, memory_format):
    """A transform of a deterministic crop: the stock loader's batches, for every worker kind
    and count, default collation and a list-returning collate_fn."""
    ds = ImageFolder(folder, size=16, crop="center", flip=False, transform=transform,
                     memory_format=memory_format)
    want = _batches(StockLoader(ds, batch_size=5))
    assert want[0][0].shape[1:] == transform(torch.zeros(3, 16, 16, dtype=torch.uint8)).shape
    for nw, wt in WORKERS:
        got = _batches(gpufeed.DataLoader(ds, batch_size=5, num_workers=nw, worker_type=wt))
        assert _equal(got, want), (nw, wt)
    if memory_format is torch.channels_last and transform is flip_to_float:
        assert got[0][0].is_contiguous(memory_format=torch.channels_last)
    listed = _batches(gpufeed.DataLoader(ds, batch_size=5, num_workers=2, collate_fn=list))
    assert _equal([[s[0] for s in b] for b in listed], [list(b[0]) for b in want])


def test_sample_generator_draws_are_the_same_for_any_workers(folder):
    ds = ImageFolder(folder, size=16, transform=generator_flip)
    runs = {(nw, wt): _batches(gpufeed.DataLoader(ds, batch_size=4, shuffle=True, seed=3,
                                                   num_workers=nw, worker_type=wt))
            for nw, wt in WORKERS}
    first = runs[(0, "process")]
    for key, got in runs.items():
        assert _equal(got, first), key
    noise = torch.cat([b[0][:, 0, 0, 0] - b[0][:, 0, 0, 0].floor() for b in first])
    assert noise.unique().numel() == len(ds)  # a draw per sample, not one per batch
    other = _batches(gpufeed.DataLoader(ds, batch_size=4, shuffle=True, seed=4))
    assert not _equal(other, first)


def test_global_draws_are_seeded_per_sample_where_the_fetch_owns_them(folder):
    """torch.rand in the transform: the same batches for 0, 1 and 2 process workers with
    seed=, and another epoch draws again."""
    ds = ImageFolder(folder, size=16, crop="center", transform=global_flip)
    runs = [_batches(gpufeed.DataLoader(ds, batch_size=6, seed=1, num_workers=nw))
            for nw in (0, 1, 2)]
    assert _equal(runs[1], runs[0]) and _equal(runs[2], runs[0])
    loader = gpufeed.DataLoader(ds, batch_size=6, seed=1)
    epochs = [_batches(loader), _batches(loader)]
    assert _equal(epochs[0], runs[0]) and not _equal(epochs[1], epochs[0])


def test_global_draws_in_thread_workers_are_named(folder):
    ds = ImageFolder(folder, size=16, crop="center", transform=global_flip)
    loader = gpufeed.DataLoader(ds, batch_size=2, seed=1, num_workers=2, worker_type="thread")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _batches(loader)
    said = [str(w.message) for w in caught if issubclass(w.category, RandomStateWarning)]
    assert len(said) == 1 and "drew from torch's global random generator" in said[0]
    quiet = ImageFolder(folder, size=16, transform=generator_flip)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RandomStateWarning)
        _batches(gpufeed.DataLoader(quiet, batch_size=2, seed=1, num_workers=2,
                                    worker_type="thread"))


def test_shards_take_the_same_transform(folder, tmp_path):
    _, paths = shards_of(folder, tmp_path / "shards")
    kw = dict(size=12, transform=generator_flip)
    want = _batches(gpufeed.DataLoader(ImageFolder(folder, **kw), batch_size=5, shuffle=True,
                                       seed=2))
    shards = ImageShards(paths, **kw)
    assert "Transform: <function generator_flip" in repr(shards)
    for nw, wt in ((0, "process"), (2, "thread")):
        got = _batches(gpufeed.DataLoader(shards, batch_size=5, shuffle=True, seed=2,
                                          num_workers=nw, worker_type=wt))
        assert _equal(got, want), (nw, wt)


def test_other_shapes_and_outputs(folder, tmp_path):
    sizes = ImageFolder(folder, size=16, transform=lambda x: x[:, : int(x.sum()) % 5 + 4])
    with pytest.raises(RuntimeError, match=r"stack expects each tensor to be equal size.*"
                                           r"another shape or dtype.*collate_fn="):
        _batches(gpufeed.DataLoader(sizes, batch_size=6))
    listed = _batches(gpufeed.DataLoader(sizes, batch_size=6, collate_fn=list))
    assert len({s[0].shape for b in listed for s in b}) > 1
    dtypes = ImageFolder(folder, size=8, transform=lambda x: x.float() if x.sum() % 2 else x)
    with pytest.raises(RuntimeError, match=r"torch.float32.*torch.uint8|torch.uint8.*float32"):
        _batches(gpufeed.DataLoader(dtypes, batch_size=18))
    pil = ImageFolder(folder, size=8, transform=lambda x: "not a tensor")
    with pytest.raises(TypeError, match=r"returned str for sample \d+.*a tensor"):
        _batches(gpufeed.DataLoader(pil, batch_size=4))
    arrays = ImageFolder(folder, size=8, transform=lambda x: x.numpy().sum(0))
    assert next(iter(gpufeed.DataLoader(arrays, batch_size=4)))[0].shape == (4, 8, 8)
    with pytest.raises(TypeError, match=r"transform must be a callable.*transforms\.v2"):
        ImageFolder(folder, size=8, transform="flip")


def test_a_skipped_image_is_transformed_black(folder, tmp_path):
    bad = make_folder(tmp_path / "bad", sizes=((20, 20),))
    (bad / "ant" / "0.jpg").write_bytes(b"\xff\xd8\xff not really")
    ds = ImageFolder(bad, size=8, on_error="skip", transform=lambda x: x.float() + 1)
    images, labels = next(iter(gpufeed.DataLoader(ds, batch_size=len(ds))))
    assert labels[0] == -1 and torch.equal(images[0], torch.ones(3, 8, 8))
    assert (labels[1:] >= 0).all() and images[1:].amax() > 1


def test_target_transform_and_loader_are_still_refused(folder):
    for name in ("target_transform", "loader"):
        with pytest.raises(TypeError, match=rf"takes no {name}=.*goes in transform="):
            ImageFolder(folder, size=8, **{name: lambda x: x})


def test_a_gpu_decode_with_a_transform_is_refused_naming_the_fix(tmp_path):
    """The transform runs on decoded pixels in the workers: decode='gpu' cannot give it any."""
    root = tmp_path / "set"
    (root / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"decode=.cpu.*device_transform"):
        gpufeed.sources.ImageFolder(root, size=8, transform=lambda x: x, decode="gpu")
