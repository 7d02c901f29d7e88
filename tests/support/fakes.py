"""Fakes for the loader tests: datasets, collate functions, worker_init_fns.

Importable by module name (``support.fakes``), so everything here also works with
``multiprocessing_context="spawn"``.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import itertools
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Pair:
    """A dataclass batch, as a custom ``collate_fn`` might return."""

    left: Any
    right: Any


class Box:
    """A plain object holding tensors, as a custom ``collate_fn`` might return."""

    def __init__(self, data: Any, tag: str) -> None:
        self.data = data
        self.tag = tag

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is Box
            and self.tag == other.tag
            and torch.equal(self.data, other.data)  # type: ignore[attr-defined]
        )

    __hash__ = None  # type: ignore[assignment]


class DatasetBoom(Exception):
    """A user exception type that must survive the trip from a worker."""


# -- samples and datasets ----------------------------------------------------------------------


def rich_sample(i: int) -> dict[str, Any]:
    """Sample ``i``: tensors, a numpy array, int, float, str, tuple and namedtuple."""
    i = int(i)
    return {
        "x": torch.arange(3, dtype=torch.float32) + i,
        "a": np.full((2, 2), i, dtype=np.int16),
        "i": i,
        "f": i / 4,
        "s": f"s{i}",
        "t": (torch.tensor(i, dtype=torch.int64), i * 2),
        "p": Point(torch.full((2,), i % 250, dtype=torch.uint8), float(i)),
    }


class RichDataset(Dataset):
    """Map-style; sample ``i`` is :func:`rich_sample` ``(i)``."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return rich_sample(i)


class RangeIterable(IterableDataset):
    """Iterable; shards ``range(n)`` by worker id, so each sample comes exactly once."""

    def __init__(self, n: int = 23, *, rich: bool = True, length: bool = False) -> None:
        self.n = n
        self.rich = rich
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            yield rich_sample(i) if self.rich else i

    def __len__(self) -> int:
        if not self.length:
            raise TypeError("RangeIterable(length=False) has no len()")
        return self.n


class NoLenIterable(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(5))


class KindDataset(Dataset):
    """Samples of one kind: 'tensor', 'tuple', 'dict', 'namedtuple', 'numpy', 'int', ..."""

    def __init__(self, kind: str, n: int = 10) -> None:
        self.kind = kind
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        k = self.kind
        if k == "tensor":
            return torch.full((2, 3), i, dtype=torch.float64)
        if k == "tensor0d":
            return torch.tensor(i * 1.5)
        if k == "dtypes":
            return (
                torch.tensor([i % 2 == 0, True]),
                torch.full((3,), i, dtype=torch.bfloat16),
                torch.full((2,), complex(i, -i), dtype=torch.complex64),
                torch.full((2,), i, dtype=torch.int8),
                torch.full((1,), i, dtype=torch.float16),
            )
        if k == "tuple":
            return (torch.tensor([i, i + 1]), i)
        if k == "list":
            return [torch.tensor([i]), float(i)]
        if k == "dict":
            return {"b": torch.tensor([i]), "a": i, "nested": {"z": [i, torch.tensor(i)]}}
        if k == "ordereddict":
            return collections.OrderedDict([("b", torch.tensor([i])), ("a", i)])
        if k == "namedtuple":
            return Point(torch.tensor([i, i]), i)
        if k == "numpy":
            return np.arange(4, dtype=np.float32).reshape(2, 2) + i
        if k == "numpy_scalar":
            return np.float64(i) / 3
        if k == "int":
            return i
        if k == "float":
            return i / 3
        if k == "bool":
            return i % 3 == 0
        if k == "str":
            return f"sample-{i}"
        if k == "bytes":
            return f"b{i}".encode()
        if k == "none_collate":  # only with a collate_fn that keeps samples as they are
            return {"i": i, "meta": None}
        raise ValueError(k)


def identity_collate(batch: Any) -> Any:
    return batch


def pair_collate(batch: list[Any]) -> Pair:
    xs = torch.stack([torch.as_tensor(b[0]) for b in batch])
    return Pair(left=xs, right=[b[1] for b in batch])


def box_collate(batch: list[Any]) -> Box:
    return Box(torch.stack([torch.as_tensor(b[0]) for b in batch]), tag=f"n={len(batch)}")


def numpy_collate(batch: list[Any]) -> dict[str, Any]:
    """A collate_fn returning numpy arrays (C-, F-ordered and strided) and python values."""
    arr = np.stack([np.asarray(b[0]) for b in batch]).astype(np.float32)
    return {
        "c": arr,
        "f": np.asfortranarray(arr.reshape(len(batch), -1)),
        "strided": arr[:, ::2],
        "ids": [int(b[1]) for b in batch],
    }


class RandomDataset(Dataset):
    """Sample ``i`` draws from torch, numpy and random: equal to stock iff seeding is."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return (
            torch.rand(2),
            torch.from_numpy(np.random.rand(2)),
            random.random(),
            i,
        )


class SampleRandomDataset(RandomDataset):
    """RandomDataset drawing from gpufeed's per-sample generators (the rule under thread
    workers): the same bytes for any number and kind of workers with ``seed=``."""

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        import gpufeed

        return (
            torch.rand(2, generator=gpufeed.random.sample_generator()),
            torch.from_numpy(gpufeed.random.sample_rng().random(2)),
            gpufeed.random.sample_random().random(),
            i,
        )


class WorkerInfoDataset(Dataset):
    """Sample ``i`` reports ``get_worker_info()`` as seen where it was fetched."""

    def __init__(self, n: int = 12) -> None:
        self.n = n
        self.marker = "the dataset"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = get_worker_info()
        if info is None:
            return {"i": i, "id": -1, "num_workers": 0, "seed": 0, "dataset": ""}
        return {
            "i": i,
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "dataset": f"{type(info.dataset).__name__}:{info.dataset.marker}:{info.dataset.n}",
        }


class VarLenDataset(Dataset):
    """Sample ``i`` is a 1-d tensor of length ``i % 5 + 1`` filled with ``i``."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((i % 5 + 1,), float(i))


def pad_collate(batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest sample; returns (padded, lengths)."""
    lengths = torch.tensor([len(x) for x in batch])
    out = torch.zeros(len(batch), int(lengths.max()))
    for k, x in enumerate(batch):
        out[k, : len(x)] = x
    return out, lengths


class GrowingDataset(Dataset):
    """Batch ``k`` (of ``batch_size``) holds a fixed leaf and one that grows with ``k``.

    The first batch is the smallest, so slots learnt from it are too small later on.
    """

    def __init__(self, n: int = 40, batch_size: int = 4, step: int = 700) -> None:
        self.n, self.batch_size, self.step = n, batch_size, step

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        k = i // self.batch_size
        return {
            "fixed": torch.full((8,), i, dtype=torch.int32),
            "grow": torch.arange(1 + k * self.step, dtype=torch.float64) + i,
        }


class BlockDataset(Dataset):
    """Sample ``i``: ``{"x": float32 [size] filled with i, "y": i}`` (bytes for the ring)."""

    def __init__(self, n: int = 64, size: int = 256) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((self.size,), float(i)), "y": i}


class EmptyLaterDataset(Dataset):
    """Samples 0..3 have 3 elements; later samples are empty tensors."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.ones(3 if i < 4 else 0)


class GetitemsDataset(Dataset):
    """``__getitems__`` tags every sample with the size and a unique id of its call."""

    def __init__(self, n: int = 23) -> None:
        self.n = n
        self._count = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int, str]:
        return (i, 0, "per-sample")

    def __getitems__(self, indices: list[int]) -> list[tuple[int, int, str]]:
        with self._lock:
            k = next(self._count)
        call = f"{os.getpid()}-{threading.get_ident()}-{k}"
        return [(int(i), len(indices), call) for i in indices]

    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["n"])  # type: ignore[misc]


class FailingDataset(Dataset):
    """Raises ``exc_type`` for sample ``bad``."""

    def __init__(self, n: int = 20, bad: int = 13, exc_type: type[Exception] = DatasetBoom):
        self.n, self.bad, self.exc_type = n, bad, exc_type

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise self.exc_type(f"cannot load sample {i}")
        return i


class KillDataset(Dataset):
    """Kills (SIGKILL) or exits (``os._exit(3)``) the worker process that fetches ``bad``.

    Never the process that built it (the test process).
    """

    def __init__(self, n: int = 20, bad: int = 9, how: str = "sigkill") -> None:
        self.n, self.bad, self.how = n, bad, how
        self.owner = os.getpid()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad and os.getpid() != self.owner:
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                os._exit(3)
        return i


class SleepDataset(Dataset):
    """Sleeps ``seconds`` on samples ``>= slow_from`` (and only on ``== slow_from`` if once)."""

    def __init__(self, n: int = 20, slow_from: int = 5, seconds: float = 30.0, once: bool = True):
        self.n, self.slow_from, self.seconds, self.once = n, slow_from, seconds, once

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.slow_from or (not self.once and i >= self.slow_from):
            time.sleep(self.seconds)
        return i


class CountingDataset(Dataset):
    """Counts fetched samples (shared across thread workers)."""

    def __init__(self, n: int = 200) -> None:
        self.n = n
        self.fetched = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self._lock:
            self.fetched += 1
        return i


class GcProbeDataset(Dataset):
    """Runs ``gc.collect()`` in the worker and returns how many finalizers raised there."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        seen: list[str] = []
        old = sys.unraisablehook
        sys.unraisablehook = lambda u: seen.append(repr(u.exc_value))
        try:
            gc.collect()
        finally:
            sys.unraisablehook = old
        return len(seen)


def record_init(directory: str, worker_id: int) -> None:
    """``worker_init_fn`` (bind ``directory`` with functools.partial): one file per call."""
    info = get_worker_info()
    ok = info is not None and info.id == worker_id
    name = f"{worker_id}-{int(ok)}-{os.getpid()}-{uuid.uuid4().hex}"
    Path(directory, name).touch()


def init_calls(directory: str | Path) -> collections.Counter[int]:
    """Calls of :func:`record_init` per worker id; asserts get_worker_info() was right."""
    counts: collections.Counter[int] = collections.Counter()
    for p in Path(directory).iterdir():
        wid, ok = p.name.split("-")[:2]
        assert ok == "1", f"get_worker_info() was wrong inside worker_init_fn ({p.name})"
        counts[int(wid)] += 1
    return counts


def failing_init(worker_id: int) -> None:
    raise ValueError(f"init failed in worker {worker_id}")


def late_failing_init(worker_id: int) -> None:
    """Every worker fails; worker 0 last, after the others' errors have reached the main
    process."""
    time.sleep(0.4 if worker_id == 0 else 0.0)
    raise ValueError(f"init failed in worker {worker_id}")


def second_worker_failing_init(worker_id: int) -> None:
    """Worker 1 fails at once; worker 0 starts late and works."""
    if worker_id == 1:
        raise ValueError(f"init failed in worker {worker_id}")
    time.sleep(0.4)


def staggered_failing_init(worker_id: int) -> None:
    """Worker 0 fails at once; worker 1 fails after the main process has reacted."""
    time.sleep(0.5 * worker_id)
    raise ValueError(f"init failed in worker {worker_id}")



class IndexDataset(Dataset[dict[str, Any]]):
    """Sample i: ``{"x": arange(width) + i * width (float32), "y": i}``, so a batch's
    checksum tells which samples it holds (the simulated-CUDA tests)."""

    def __init__(self, n: int, width: int = 16) -> None:
        self.n, self.width = n, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.arange(self.width, dtype=torch.float32) + i * self.width, "y": i}


def photo_array(h: int, w: int, seed: int) -> np.ndarray:
    """A photo-like (h, w, 3) uint8 image: smooth waves per channel plus a little noise, so
    that JPEG and resampling behave as on photos (the GPU decode tests' images)."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    chans = [(127 + 100 * np.sin(x / (5 + 3 * c) + y / (7 + c) + seed)).astype(np.uint8)
             for c in range(3)]
    return np.stack(chans, -1) + rng.integers(0, 20, (h, w, 3), dtype=np.uint8)
