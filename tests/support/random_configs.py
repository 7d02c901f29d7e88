"""Random loader configurations for the differential tests (``tests/test_random_configs.py``):
one seed gives one configuration, the same on every run; :func:`outcome` runs a loader class
over it and writes down everything a program could see.

What a configuration draws: a map-style dataset (``__getitem__``, ``__getitems__``, wrapped in
``ConcatDataset`` or ``Subset``) or an iterable one (sharded by worker, sized or not), one of
twelve sample kinds, batching (a batch size with ``drop_last``, none, a ``BatchSampler``, a
list of index lists), the order (sequential, ``shuffle`` with or without a generator, torch's
samplers with their own generators, a list), a ``collate_fn``, workers (none, processes,
threads, persistent, ``prefetch_factor``, ``in_order=False``, ``pin_memory``, ``timeout``),
gpufeed's device stage on the CPU, a sample that raises, and a loop that stops early.
"""

from __future__ import annotations

import collections
import random
import re
import warnings
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

Point = collections.namedtuple("Point", "x y")
KINDS = ("tensor", "tuple", "dict", "numpy", "nested", "big", "int", "str", "bool",
         "channels-last", "strided", "bytes")


class Failing(KeyError):
    pass


def sample(kind: str, i: int, fail_at: int | None) -> Any:
    if i == fail_at:
        raise Failing(f"bad sample {i}")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + i
    if kind == "tensor":
        return t
    if kind == "tuple":
        return (t, i)
    if kind == "dict":
        return {"img": t, "label": i, "name": f"s{i}"}
    if kind == "numpy":
        return np.full((3,), i, dtype=np.int16)
    if kind == "nested":
        return {"a": [t, (i, float(i))], "b": Point(t * 2, torch.tensor(i))}
    if kind == "big":  # above the streamed-collation threshold
        return (torch.full((64, 200), float(i)), torch.tensor([i, -i]))
    if kind == "int":
        return i
    if kind == "str":
        return f"s{i}"
    if kind == "bool":
        return bool(i % 2)
    if kind == "channels-last":
        return torch.full((1, 3, 40, 40), float(i)).to(memory_format=torch.channels_last)[0]
    if kind == "strided":
        return torch.arange(400.0).reshape(20, 20).t()[::2] + i
    return torch.full((9000,), i % 250, dtype=torch.uint8)  # bytes


class MapData(tud.Dataset):
    def __init__(self, n: int, kind: str, fail_at: int | None) -> None:
        self.n, self.kind, self.fail_at = n, kind, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return sample(self.kind, i, self.fail_at)


class MapItems(MapData):
    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [sample(self.kind, i, self.fail_at) for i in indices]


class Stream(tud.IterableDataset):
    def __init__(self, n: int, kind: str, fail_at: int | None, shard: bool) -> None:
        self.n, self.kind, self.fail_at, self.shard = n, kind, fail_at, shard

    def __iter__(self) -> Any:
        info = tud.get_worker_info()
        start, step = (info.id, info.num_workers) if self.shard and info else (0, 1)
        for i in range(start, self.n, step):
            yield sample(self.kind, i, self.fail_at)


class SizedStream(Stream):
    def __len__(self) -> int:
        return self.n


def as_list(batch: list[Any]) -> list[Any]:
    return list(batch)


def identity(x: Any) -> Any:
    return x


def config(seed: int, *, resumable: bool = False) -> dict[str, Any]:
    """The configuration of ``seed``: ``make`` (a fresh dataset and arguments), ``gpufeed``
    (arguments only gpufeed takes), ``ordered`` and ``stop_after`` (batches of the first epoch
    taken before the loop breaks, or None). ``resumable``: map-style data, in order, no errors
    (what :func:`resume_matches` compares)."""
    rng = random.Random(seed)
    n = rng.choice([0, 1, 2, 5, 7, 16, 23])
    kind = rng.choice(KINDS)
    fail_at = rng.choice([None, None, None, 0, 3, 5])
    iterable = rng.random() < 0.3
    if resumable:
        fail_at, iterable = None, False
    workers = rng.choice([0, 1, 2, 3])
    kw: dict[str, Any] = {"num_workers": workers}
    batching = rng.choice(["size", "none"] if iterable else ["size", "none", "sampler"])
    if batching == "size":
        kw.update(batch_size=rng.choice([1, 2, 3, 4, 8]), drop_last=rng.random() < 0.4)
    elif batching == "none":
        kw["batch_size"] = None
    order = rng.random()
    collate = rng.random()
    if workers:
        if rng.random() < 0.3:
            kw["persistent_workers"] = True
        if rng.random() < 0.3:
            kw["prefetch_factor"] = rng.choice([1, 2, 5])
        if rng.random() < 0.2 and not resumable:
            kw["in_order"] = False
        if rng.random() < 0.15:
            kw["timeout"] = 60
    if rng.random() < 0.15:
        kw["pin_memory"] = True
    extra: dict[str, Any] = {}
    if workers and rng.random() < 0.4:
        extra["worker_type"] = "thread"
    if rng.random() < 0.25:
        extra["device"] = "cpu"
    wrap = rng.choice([None, None, None, "concat", "subset"])
    with_items = rng.random() < 0.3
    shard, sized = rng.random() < 0.7, rng.random() < 0.5
    lists = rng.random() < 0.5
    ordered = kw.get("in_order", True)
    stop_after = rng.choice([None, None, 1, 2]) if ordered else None

    def make() -> tuple[Any, dict[str, Any]]:
        args = dict(kw)
        data: Any
        if iterable:
            data = (SizedStream if sized else Stream)(n, kind, fail_at, shard)
        else:
            data = (MapItems if with_items else MapData)(n, kind, fail_at)
            if wrap == "concat":
                data = tud.ConcatDataset([data, MapData(3, kind, None)])
            elif wrap == "subset":
                data = tud.Subset(data, list(range(0, n, 2)))
            size = len(data)
            if batching == "sampler":
                args["batch_sampler"] = (
                    [[i, (i * 3) % size] for i in range(0, size, 2)] if lists and size
                    else tud.BatchSampler(tud.SequentialSampler(range(size)), 3, False))
            elif order < 0.3:
                args.update(shuffle=True, generator=torch.Generator().manual_seed(seed))
            elif order < 0.4:
                args["shuffle"] = True
            elif order < 0.5 and size:
                args["sampler"] = tud.RandomSampler(
                    data, generator=torch.Generator().manual_seed(seed + 1))
            elif order < 0.6 and size:
                args["sampler"] = tud.SubsetRandomSampler(
                    list(range(0, size, 2)), generator=torch.Generator().manual_seed(seed + 2))
            elif order < 0.7 and size:
                args["sampler"] = tud.WeightedRandomSampler(
                    [1.0] * size, max(1, size // 2),
                    generator=torch.Generator().manual_seed(seed + 3))
            elif order < 0.8:
                args["sampler"] = list(reversed(range(size)))
        if collate < 0.15 and not (resumable and batching == "none"):  # no error to resume
            args["collate_fn"] = as_list  # (unbatched, it would get a scalar sample)
        elif collate < 0.25:
            args["collate_fn"] = identity
        return data, args

    return {"make": make, "gpufeed": extra, "ordered": ordered, "stop_after": stop_after,
            "label": f"n={n} {kind} iterable={iterable} fail_at={fail_at} {kw} {extra} "
                     f"batching={batching} stop_after={stop_after}"}


def canon(x: Any) -> Any:
    """A batch as plain values, with every type and dtype in it."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.tolist())
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.shape, x.tolist())
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return (type(x).__name__, tuple(canon(v) for v in x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [canon(v) for v in x])
    if isinstance(x, dict):
        return (type(x).__name__, [(k, canon(v)) for k, v in x.items()])
    return (type(x).__name__, x)


def _error(exc: BaseException) -> tuple[str, str]:
    """An error as a program matching on it sees it: its type and first line (torch's words
    whole; gpufeed's context is on the next line)."""
    # (a KeyError subclass's message is its repr: one line, with "\n" for its newlines)
    first = str(exc).split("\n")[0].split("\\n")[0]
    return type(exc).__name__, first.replace("worker thread", "worker process")


def outcome(loader_cls: type, conf: dict[str, Any], epochs: int = 2, **extra: Any) -> list[Any]:
    """What a program sees of two epochs: ``len()``, every batch or error (the loop goes on
    after an error, as stock allows), the end of each epoch, and the generators afterwards
    (torch's global one and the loader's). Warnings are left out (tested on their own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _outcome(loader_cls, conf, epochs, extra)


def _outcome(loader_cls: type, conf: dict[str, Any], epochs: int, extra: dict[str, Any]
             ) -> list[Any]:
    torch.manual_seed(1234)
    data, args = conf["make"]()
    seen: list[Any] = []
    try:
        loader = loader_cls(data, **args, **extra)
    except Exception as exc:
        return [("constructor", *_error(exc))]
    try:
        seen.append(("len", len(loader)))
    except Exception as exc:
        seen.append(("len", *_error(exc)))
    for epoch in range(epochs):
        got: list[Any] = []
        it = iter(loader)
        for _ in range(200):
            if epoch == 0 and conf["stop_after"] is not None and (
                    len(got) == conf["stop_after"]):
                break
            try:
                got.append(canon(next(it)))
            except StopIteration:
                got.append("end")
                break
            except Exception as exc:
                got.append(_error(exc))
        # unordered: which worker's error comes first is the workers' race
        seen.append(got if conf["ordered"] else sorted(
            re.sub(r"worker process \d+", "worker process N", repr(x)) for x in got))
        del it
    seen.append(("global generator", torch.get_rng_state().tolist()))
    generator = args.get("generator")
    if generator is not None:
        seen.append(("loader generator", generator.get_state().tolist()))
    return seen


def resume_matches(conf: dict[str, Any], cut_seed: int, epochs: int = 3) -> tuple[bool, str]:
    """Run gpufeed over ``conf`` for ``epochs``; run it again, take ``state_dict()`` after a
    random number of batches (right after an epoch's last batch or after its end too), load it
    into a fresh loader and compare what that gives with the rest of the first run. Epochs
    after the cut one are compared where their order comes from state the loader keeps (not
    from torch's global generator, which a loader's checkpoint leaves to the program)."""
    import gpufeed

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(cut_seed)  # both runs draw the same orders from the global generator
        data, args = conf["make"]()
        try:
            reference = gpufeed.DataLoader(data, **args, **conf["gpufeed"])
        except ValueError:  # e.g. shuffle=True over no data: refused as stock refuses it
            return True, "refused"
        run = [[canon(b) for b in reference] for _ in range(epochs)]
        lengths = [len(e) for e in run]
        total = sum(lengths)
        if total == 0:
            return True, "no batches"
        rng = random.Random(cut_seed)
        cut = rng.randrange(0, total + 1)
        torch.manual_seed(cut_seed)
        data, args = conf["make"]()
        loader = gpufeed.DataLoader(data, **args, **conf["gpufeed"])
        taken = 0
        while taken < cut:
            ends_here = cut in [sum(lengths[: e + 1]) for e in range(epochs)]
            for _ in loader:
                taken += 1
                if taken == cut and not (ends_here and rng.random() < 0.5):
                    break
        state = loader.state_dict()
        del loader
        torch.manual_seed(4321)  # another global state: the loader's state must carry its own
        data, args = conf["make"]()
        fresh = gpufeed.DataLoader(data, **args, **conf["gpufeed"])
        fresh.load_state_dict(state)
        want = [b for e in run for b in e][cut:]
        if args.get("shuffle") and args.get("generator") is None:
            epoch_end = next(s for s in (sum(lengths[: e + 1]) for e in range(epochs))
                             if s >= cut)
            # a state between epochs (before the first included) leaves the next epoch's
            # order to the resumed run's global generator (docs/guides/distributed.md,
            # "Resume mid-epoch")
            want = want[: epoch_end - cut] if cut else []
        got: list[Any] = []
        for _ in range(epochs + 1):
            if len(got) >= len(want):
                break
            got.extend(canon(b) for b in fresh)
        return got[: len(want)] == want, f"cut {cut} of {lengths}"
