"""Comparing batches exactly (container types included), running a loader over a dataset with
identical seeding, and importing torchvision to compare with."""

from __future__ import annotations

import collections
import dataclasses
import gc
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch

#: how to get a torchvision that loads (docs/getting-started.md, "torchvision next to a
#: CPU-only torch")
TORCHVISION_HINT = ("install torchvision together with torch, from the same index and release "
                    "line, e.g. pip install torch==X torchvision==Y --index-url "
                    "https://download.pytorch.org/whl/cpu")


def torchvision_or_skip() -> Any:
    """torchvision, or skip the test with :data:`TORCHVISION_HINT`: also where it is installed
    but cannot load (its CUDA wheel next to a CPU-only torch raises ``RuntimeError: operator
    torchvision::nms does not exist``, which ``pytest.importorskip`` lets through)."""
    try:
        import torchvision
    except ImportError:
        pytest.skip(f"torchvision is not installed; {TORCHVISION_HINT}")
    except RuntimeError as exc:
        pytest.skip(f"torchvision cannot load next to torch {torch.__version__} ({exc}); "
                    f"{TORCHVISION_HINT}")
    return torchvision

# -- comparing batches -------------------------------------------------------------------------


def assert_same(expected: Any, got: Any, where: str = "batch", *, strides: bool = False
                ) -> None:
    """Exact, nested equality: container types, dtypes, shapes and values (``strides``: and
    tensors' strides)."""
    assert type(got) is type(expected), (
        f"{where}: got a {type(got).__name__}, expected a {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {got.shape} != {expected.shape}"
        assert torch.equal(got, expected), f"{where}: values differ\n{got}\n!=\n{expected}"
        assert not strides or got.stride() == expected.stride(), (
            f"{where}: strides {got.stride()} != {expected.stride()}")
    elif isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {got.shape} != {expected.shape}"
        assert np.array_equal(got, expected), f"{where}: values differ\n{got}\n!=\n{expected}"
    elif isinstance(expected, Mapping):
        assert list(got.keys()) == list(expected.keys()), f"{where}: keys differ"
        for k in expected:
            assert_same(expected[k], got[k], f"{where}[{k!r}]", strides=strides)
    elif dataclasses.is_dataclass(expected) and not isinstance(expected, type):
        for f in dataclasses.fields(expected):
            assert_same(getattr(expected, f.name), getattr(got, f.name), f"{where}.{f.name}",
                        strides=strides)
    elif isinstance(expected, Sequence) and not isinstance(expected, (str, bytes)):
        assert len(got) == len(expected), f"{where}: length {len(got)} != {len(expected)}"
        for k, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert_same(e, g, f"{where}[{k}]", strides=strides)
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def canon(x: Any) -> Any:
    """A hashable, exact description of a batch (types included), for multiset compares."""
    if isinstance(x, torch.Tensor):
        return ("Tensor", str(x.dtype), tuple(x.shape), tuple(x.flatten().tolist()))
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, tuple(x.ravel().tolist()))
    if isinstance(x, Mapping):
        return (type(x).__name__, tuple((k, canon(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(canon(v) for v in x))
    return (type(x).__name__, x)


def assert_same_batches(expected: list[Any], got: list[Any], *, ordered: bool = True) -> None:
    """Every batch equal (``ordered``) or the same multiset of batches."""
    assert len(got) == len(expected), f"{len(got)} batches, expected {len(expected)}"
    if ordered:
        for k, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert_same(e, g, f"batch {k}")
        return
    want = collections.Counter(repr(canon(b)) for b in expected)
    have = collections.Counter(repr(canon(b)) for b in got)
    assert have == want, f"different batches: missing {want - have}, extra {have - want}"


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def shutdown(it: Any) -> None:
    """Stop an iterator's workers now (gpufeed: ``close()``; stock: its shutdown method)."""
    if hasattr(it, "close"):
        it.close()
    elif hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def list_or_stop(loader: Any) -> list[Any]:
    """``list(loader)``, but the workers stop at once if it raises.

    A failed ``list(loader)`` leaves the iterator referenced by the traceback, its workers
    alive until the traceback goes; workers forked later then hold the old pipes open.
    """
    it = iter(loader)
    try:
        return list(it)
    except BaseException:
        shutdown(it)
        raise


def collect(
    loader_cls: type, dataset: Any, *, epochs: int = 1, seed: int = 0, **kwargs: Any
) -> list[list[Any]]:
    """``epochs`` epochs of ``loader_cls(dataset, **kwargs)``, every RNG seeded the same."""
    seed_all(seed)
    loader = loader_cls(dataset, **kwargs)
    try:
        return [list_or_stop(loader) for _ in range(epochs)]
    finally:
        if kwargs.get("persistent_workers"):
            del loader
            gc.collect()


