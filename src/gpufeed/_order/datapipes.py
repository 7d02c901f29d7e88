"""DataPipes in the loader: their shufflers seeded and their sharding filters set as torch's are.

NOTE [ DataPipes ]
------------------
``torch.utils.data.IterDataPipe`` and ``MapDataPipe`` graphs carry their own order: a
``shuffle()`` datapipe draws from a generator the loader seeds, and a ``sharding_filter()``
keeps the part of the stream the loader says is this process's. Left alone, a graph reads its
whole stream in every worker (each sample once per worker, silently) and shuffles from its own
default generator. gpufeed sets both by torch's rules: the same samples, in the same order,
from the same ``torch.manual_seed``:

1. Seeds (``IterDataPipe`` only). Each iterator draws a *shared seed*, one int64 from the
   loader's ``generator`` (the global generator when None), before its base seed; under an
   initialised ``torch.distributed`` it is broadcast from rank 0 over a gloo group the iterator
   creates, so that every rank shuffles alike before sharding. ``graph_settings.
   apply_random_seed`` seeds the graph from it in the main process and in every worker,
   before ``worker_init_fn``. An iterator with workers draws a second seed at its start (torch
   resets it there) that reaches no worker, and a persistent pool's next epoch draws one and
   sends it to the workers, which reseed their graph before the epoch's first sample.
2. Sharding (both kinds). A worker applies ``graph_settings.apply_sharding(graph,
   world_size * num_workers, worker_id * world_size + rank)`` before ``worker_init_fn``: ranks
   first, then workers within a rank. Without workers, each iterator applies
   ``apply_sharding(graph, world_size, rank)``.

Rank and world size are the process group's (``(0, 1)`` without one), as torch reads them,
whatever ``rank=`` or ``world_size=`` the loader was given: those shard samplers and
iterable datasets (NOTE [ Sharding by rank ]), and a datapipe graph's sharding is its own.
Thread workers each apply the rules to their own copy of the graph (NOTE [ Iterable datasets
in thread workers ] in ``_host/fetch.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import IterDataPipe, MapDataPipe, graph_settings

from .shards import resolve_world


class PipeSetup(NamedTuple):
    """What a worker applies to its copy of a datapipe graph (NOTE [ DataPipes ]): the shared
    seed (None for a ``MapDataPipe``) and the process group's size and rank."""

    seed: int | None
    world_size: int
    rank: int


def is_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def _seed_graph(dataset: Any, seed: int) -> None:
    rng = torch.Generator()
    rng.manual_seed(seed)
    graph_settings.apply_random_seed(dataset, rng)


class PipeSeeds:
    """An iterator's shared seeds for an ``IterDataPipe`` (NOTE [ DataPipes ] (1)); for any
    other dataset, a no-op that draws nothing."""

    def __init__(self, dataset: Any, generator: torch.Generator | None) -> None:
        self.on = isinstance(dataset, IterDataPipe)
        self._dataset, self._generator = dataset, generator
        self._group: Any = None
        if self.on and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # (collective: every rank makes it)
        self.seed: int | None = None

    def draw(self) -> int | None:
        """Draw the next shared seed and seed the main process's graph with it (not an
        ``IterDataPipe``: None, no draw)."""
        if not self.on:
            return None
        seed = torch.empty((), dtype=torch.int64).random_(generator=self._generator)
        if self._group is not None:
            dist.broadcast(seed, src=0, group=self._group)
        self.seed = int(seed.item())
        _seed_graph(self._dataset, self.seed)
        return self.seed

    def setup(self) -> PipeSetup | None:
        """What the workers apply to their graphs (the seed drawn last); None if not a datapipe."""
        if not is_datapipe(self._dataset):
            return None
        rank, world_size, _ = resolve_world(None, None)
        return PipeSetup(self.seed, world_size, rank)


def shard_here(dataset: Any) -> None:
    """Without workers: shard a datapipe graph by the process group's rank (NOTE (2))."""
    if is_datapipe(dataset):
        rank, world_size, _ = resolve_world(None, None)
        graph_settings.apply_sharding(dataset, world_size, rank)


def set_up_in_worker(dataset: Any, setup: PipeSetup, num_workers: int, worker_id: int) -> None:
    """In worker ``worker_id``, before ``worker_init_fn``: seed and shard its graph."""
    reseed_in_worker(dataset, setup.seed)
    graph_settings.apply_sharding(dataset, setup.world_size * num_workers,
                                  worker_id * setup.world_size + setup.rank)


def reseed_in_worker(dataset: Any, seed: int | None) -> None:
    """Seed a worker's ``IterDataPipe`` graph with a shared seed (None: leave it), at its start
    and at each next epoch of a persistent pool."""
    if seed is not None and isinstance(dataset, IterDataPipe):
        _seed_graph(dataset, seed)
