"""Index plans: seeded shuffles, sharding across ranks and workers, resumable positions.

Two resumable samplers, both a pure function of ``(seed, epoch)`` so a resume can regenerate them:

- :class:`ShardedSampler` -- ``torch.utils.data.DistributedSampler`` semantics (and order: the
  same permutation of ``seed + epoch``, the same padding or dropping, the same rank striding).
- :class:`SeededRandomSampler` -- a ``RandomSampler`` (without replacement) for one process.

NOTE [ Epoch counting ]: ``__iter__`` uses the current epoch and then advances it by one, so a
loader gives a fresh shuffle every epoch without help. ``set_epoch(e)`` (the DistributedSampler
idiom, called before each epoch) still pins epoch ``e`` exactly, so both styles agree. ``epoch``
always names the epoch the *next* ``__iter__`` will use.

Iterable datasets are sharded by ``(rank, worker)`` in ``_order/shards.py`` (re-exported here).
The multi-GPU recipe (torchrun, DDP, ``nn.DataParallel``) is in docs/guides/distributed.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import IterableDataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from .shards import (
    ShardedIterable,
    ShardInfo,
    get_shard_info,
    resolve_world,
    set_shard_info,
    shard_for,
)

__all__ = [
    "SeededRandomSampler",
    "ShardInfo",
    "ShardedIterable",
    "ShardedSampler",
    "build_sampler",
    "get_shard_info",
    "resolve_world",
    "set_shard_info",
    "shard_for",
]


class _Cursor(Iterator[int]):
    """One epoch's indices, counting how many it has handed out."""

    def __init__(self, indices: list[int], position: int) -> None:
        self.indices = indices
        self.position = position

    def __next__(self) -> int:
        if self.position >= len(self.indices):
            raise StopIteration
        self.position += 1
        return self.indices[self.position - 1]


class _Resumable:
    """Epoch counter and resumable cursor shared by both samplers (see NOTE [ Epoch counting ])."""

    epoch: int = 0
    seed: int
    _cursor: _Cursor | None = None
    _cursor_epoch: int = 0
    _seek: tuple[int, int] | None = None
    set_epoch_calls = 0  # how many times set_epoch ran (the epoch also advances by itself)

    def _order(self, epoch: int) -> torch.Tensor:
        raise NotImplementedError

    def _identity(self) -> dict[str, Any]:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``__iter__`` yield epoch ``epoch`` (from its start, unless resumed)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch
        self.set_epoch_calls += 1

    def __iter__(self) -> Iterator[int]:
        epoch, order, start = self.take_epoch()
        self._cursor = _Cursor(order.tolist(), start)
        self._cursor_epoch = epoch
        return self._cursor

    def take_epoch(self) -> tuple[int, torch.Tensor, int]:
        """``__iter__`` (advancing the epoch alike) for loaders that slice the order themselves:
        ``(epoch, order, start)``, this rank's whole epoch as an int64 tensor and where to start
        (non-zero after :meth:`seek`)."""
        epoch = self.epoch
        start = self._seek[1] if self._seek is not None and self._seek[0] == epoch else 0
        self._seek = None
        self.epoch = epoch + 1
        self._cursor = None
        return epoch, self._order(epoch), start

    def seek(self, epoch: int, position: int) -> None:
        """Make the next ``__iter__`` yield epoch ``epoch`` without its first ``position`` indices
        (all of them: nothing): regenerated from ``(seed, epoch)`` and sliced, nothing fetched."""
        self.set_epoch(epoch)
        size = len(self)  # type: ignore[arg-type]
        if not isinstance(position, int) or not 0 <= position <= size:
            raise ValueError(
                f"position must be an int in [0, {size}] (indices in one epoch of this rank), "
                f"got {position!r}"
            )
        self._seek = (epoch, position)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: the epoch in progress and how many indices it handed out.

        These are indices *drawn from the sampler*; a loader that prefetches is ahead of the user,
        which is why the loader records delivered batches itself and calls :meth:`seek`."""
        if self._cursor is not None and self._cursor.position < len(self._cursor.indices):
            epoch, position = self._cursor_epoch, self._cursor.position
        elif self._seek is not None:
            epoch, position = self._seek
        else:
            epoch, position = self.epoch, 0
        return {"epoch": epoch, "position": position, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; a changed dataset length or world size raises."""
        mine = self._identity()
        for key in ("dataset_len", "world_size", "rank", "shuffle", "drop_last"):
            if key in mine and state.get(key) != mine[key]:
                raise ValueError(
                    f"cannot resume {type(self).__name__}: the state was saved with "
                    f"{key}={state.get(key)!r} but this sampler has {key}={mine[key]!r}; "
                    f"resume with the same {key} (or start a fresh epoch without the state)"
                )
        try:
            seed, epoch, position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"not a {type(self).__name__} state (need int seed, epoch and position): {state!r}"
            ) from exc
        self.seed = seed
        self.seek(epoch, position)


class ShardedSampler(_Resumable, DistributedSampler[int]):
    """``DistributedSampler`` semantics, resumable and epoch-advancing.

    Every rank shuffles with ``torch.randperm`` seeded by ``seed + epoch`` (identical on all ranks),
    pads by repeating the first indices (``drop_last=False``) or drops the tail
    (``drop_last=True``) so each rank gets ``len(self)`` indices, then takes every
    ``world_size``-th index starting at ``rank``.

    Args:
        dataset: a sized dataset (only ``len()`` is used).
        rank, world_size: this process's place; ``None`` reads them from an initialised
            ``torch.distributed`` (without one: rank 0 of 1).
        shuffle: permute each epoch (``False``: ``0..n-1`` in order, still sharded).
        seed: base seed, the same on every rank. Default 0, as in ``DistributedSampler``.
        drop_last: drop the tail that does not divide evenly (``True``: every sample at most once,
            some never) or pad it with repeats (``False``: every sample at least once, a few
            twice). Either way every rank gets the same count, which DDP needs.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        rank, world_size, _ = resolve_world(rank, world_size)
        super().__init__(dataset, num_replicas=world_size, rank=rank,  # type: ignore[arg-type]
                         shuffle=shuffle, seed=seed, drop_last=drop_last)

    def _order(self, epoch: int) -> torch.Tensor:
        n = len(self.dataset)  # type: ignore[arg-type]
        order = _permutation(n, self.seed, epoch) if self.shuffle else torch.arange(n)
        if self.drop_last:
            order = order[: self.total_size]
        elif n:
            order = order.repeat(math.ceil(self.total_size / n))[: self.total_size]
        return order[self.rank :: self.num_replicas]

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
            "world_size": self.num_replicas,
            "rank": self.rank,
        }


class SeededRandomSampler(_Resumable, RandomSampler):
    """A ``RandomSampler`` (no replacement) whose order depends only on ``(seed, epoch)``.

    The permutation of epoch ``e`` is ``torch.randperm(n)`` from a generator seeded with
    ``seed + e`` -- the order a one-rank :class:`ShardedSampler` gives.
    """

    def __init__(self, data_source: Sized, *, seed: int) -> None:
        super().__init__(data_source)
        self.seed = seed

    def _order(self, epoch: int) -> torch.Tensor:
        return _permutation(len(self.data_source), self.seed, epoch)

    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "dataset_len": len(self.data_source), "world_size": 1}


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator)


def build_sampler(
    dataset: Any,
    *,
    shuffle: bool | None,
    sampler: Sampler[Any] | Iterable[Any] | None,
    batch_sampler: Sampler[Any] | Iterable[Any] | None = None,
    seed: int | None,
    rank: int | None,
    world_size: int | None,
    drop_last: bool,
    shard: bool,
) -> Sampler[int] | Iterable[Any] | None:
    """Choose the loader's sampler; ``None`` means "let torch build its stock default".

    - a user ``sampler`` is kept as is, and a user ``batch_sampler`` gives ``None`` (with explicit
      ``rank``/``world_size`` either is an error);
    - iterable datasets get ``None`` (they are sharded inside the workers: :func:`shard_for`);
    - with ``shard`` (explicit ``rank``/``world_size``, or a ``seed`` and an initialised
      ``torch.distributed``): a :class:`ShardedSampler` (``shuffle`` defaults to false as in
      the stock loader; ``seed`` None means 0, as in ``DistributedSampler``);
    - otherwise, with ``shuffle`` and a ``seed``: a :class:`SeededRandomSampler`; without a
      seed, torch's own ``RandomSampler``/``SequentialSampler`` (the stock order, bit for bit).
    """
    explicit = rank is not None or world_size is not None
    user, name = (sampler, "sampler") if sampler is not None else (batch_sampler, "batch_sampler")
    if user is not None:
        if explicit:
            raise ValueError(
                f"rank={rank!r}/world_size={world_size!r} cannot be combined with {name}="
                f"{type(user).__name__}: gpufeed only shards its own sampler; drop the {name} "
                "(pass shuffle=...) or shard inside it and drop rank/world_size"
            )
        return sampler
    if isinstance(dataset, IterableDataset):
        return None
    if shard:
        return ShardedSampler(dataset, rank=rank, world_size=world_size, shuffle=bool(shuffle),
                              seed=seed or 0, drop_last=drop_last)
    if shuffle and seed is not None:
        return SeededRandomSampler(dataset, seed=seed)
    return None
