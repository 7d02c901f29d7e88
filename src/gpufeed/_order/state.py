"""The loader's ``state_dict()``: its format, its checks against the loader that loads it, and
what an iterable dataset must provide to be resumed.

The state counts batches *delivered to the user*, never those fetched ahead, so a resume
continues with exactly the next batch the user would have seen, whatever ``num_workers``,
``worker_type`` or prefetch depth either run used. Its plain Python values round-trip through
``torch.save`` / ``torch.load(weights_only=True)``::

    {"version": 1,
     "epoch": 3,                 # epoch in progress (the next one if the last was exhausted)
     "batches_delivered": 17,    # batches 0..16 of that epoch's plan were handed to the user
                                 # (iterable datasets: how many batches were handed out)
     "delivered_ahead": [19],    # later batch numbers already handed out (in_order=False only)
     "batch_size": 8,            # None without automatic batching
     "seed": 1234,               # base seed of shuffles and per-sample random state
     "dataset_len": 1000,        # None for iterable datasets
     "world_size": 2, "rank": 0,
     "num_workers": 2,           # only binding for iterable datasets (their shards depend on it)
     "sampler_state": None,      # what replays the epoch's order: a sampler's own state_dict(),
                                 # {"generator_state": [...]}, {"epoch_seed": S} or
                                 # {"unrewindable": why} (NOTE [ Rewinding samplers ],
                                 # _order/rewind.py)
     "dataset_state": None,      # iterable datasets, see below
     "order": "RandomSampler(replacement=False, generator=global)"}
                                 # what ordered the epochs (map-style; rewind.order_of): a
                                 # state loads only under the same (absent in older states)

``dataset_state`` of an iterable dataset: ``{"num_workers": W, "workers": [state | None] * W,
"next_worker": w}``, its ``WorkerStates`` (NOTE [ Iterable resume ] in ``_order/delivery.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from torch.utils.data import IterableDataset

from .rewind import rank_bound

STATE_VERSION = 1


class _Since(TypedDict, total=False):
    """Keys later versions of the state added: a state without them still loads."""

    order: str | None


class LoaderState(_Since):
    """The loader's ``state_dict()`` (see the module docstring for each field)."""

    version: int
    epoch: int
    batches_delivered: int
    delivered_ahead: list[int]
    batch_size: int | None
    seed: int | None
    dataset_len: int | None
    world_size: int
    rank: int
    num_workers: int
    sampler_state: Any
    dataset_state: Any


def make_state(
    *,
    epoch: int,
    batches_delivered: int,
    delivered_ahead: Iterable[int] = (),
    batch_size: int | None,
    seed: int | None,
    dataset_len: int | None,
    world_size: int,
    rank: int,
    num_workers: int,
    sampler_state: Any = None,
    dataset_state: Any = None,
    order: str | None = None,
) -> LoaderState:
    """Build a state dict of plain Python values."""
    return {
        "version": STATE_VERSION,
        "epoch": int(epoch),
        "batches_delivered": int(batches_delivered),
        "delivered_ahead": sorted(int(n) for n in delivered_ahead),
        "batch_size": batch_size,
        "seed": seed,
        "dataset_len": dataset_len,
        "world_size": int(world_size),
        "rank": int(rank),
        "num_workers": int(num_workers),
        "sampler_state": sampler_state,
        "dataset_state": dataset_state,
        "order": order,
    }


def _check_same(state: Mapping[str, Any], key: str, now: Any, fix: str) -> None:
    if state[key] != now:
        raise ValueError(
            f"cannot resume: the state was saved with {key}={state[key]!r} but this loader has "
            f"{key}={now!r}; {fix}"
        )


def check_state(
    state: Mapping[str, Any],
    *,
    dataset_len: int | None,
    world_size: int,
    rank: int,
    batch_size: int | None,
    num_workers: int,
    order: str | None = None,
) -> LoaderState:
    """Validate a state against the loader that loads it; return it as a :class:`LoaderState`.

    A ``ValueError`` names the saved and the current value when the version, dataset length,
    world size, batch size or order differ (and ``num_workers`` for iterable datasets, whose
    shards depend on it): resuming across those would silently mix up samples. Another rank's
    state loads when it does not depend on the rank (``rewind.rank_bound``)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict from loader.state_dict(), got {type(state)!r}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"unsupported loader state version {state.get('version')!r} (this gpufeed reads "
            f"version {STATE_VERSION}); pass a dict made by gpufeed's loader.state_dict()"
        )
    missing = sorted(LoaderState.__required_keys__ - set(state))
    if missing:
        raise ValueError(f"loader state is missing keys {missing}; was it edited or truncated?")
    for key in ("epoch", "batches_delivered"):
        if type(state[key]) is not int or state[key] < 0:
            raise ValueError(f"loader state {key} must be an int >= 0, got {state[key]!r}")
    if state["seed"] is not None and type(state["seed"]) is not int:
        raise ValueError(f"loader state seed must be an int or None, got {state['seed']!r}")
    ahead = state["delivered_ahead"]
    if not isinstance(ahead, list | tuple) or any(type(n) is not int or n < 0 for n in ahead):
        raise ValueError("loader state delivered_ahead must be a list of ints >= 0, got "
                         f"{ahead!r}")
    fix = "resume with the same dataset and loader settings, or start without the state"
    _check_same(state, "dataset_len", dataset_len, fix)
    _check_same(state, "world_size", world_size,
                "launch the same number of ranks (each rank loads the state it saved)")
    if state["rank"] != rank and (reason := rank_bound(state)) is not None:
        raise ValueError(
            f"cannot resume: this loader is rank {rank} but the state was saved by rank "
            f"{state['rank']}, and {reason}; save loader.state_dict() on every rank and load "
            "each rank's own (only map-style loaders ordered by seed=<int> share one state)"
        )
    _check_same(state, "batch_size", batch_size, fix)
    saved_order = state.get("order")
    if saved_order is not None and order is not None and saved_order != order:
        raise ValueError(
            f"cannot resume: the state was saved by a loader ordered by {saved_order}, but this "
            f"one is ordered by {order}, so its delivered batches would name other samples; "
            "resume with the same shuffle, sampler, generator and seed arguments, or start "
            "without the state")
    if state["dataset_state"] is not None:
        _check_same(state, "num_workers", num_workers,
                    "an iterable dataset is sharded per worker, so resume it with the same "
                    "num_workers")
        _check_dataset_state(state["dataset_state"])
    return dict(state)  # type: ignore[return-value]


def _check_dataset_state(dataset_state: Any) -> None:
    workers = dataset_state.get("workers") if isinstance(dataset_state, Mapping) else None
    count = dataset_state.get("num_workers") if isinstance(dataset_state, Mapping) else None
    if not isinstance(workers, list) or not isinstance(count, int) or len(workers) != count:
        raise ValueError(
            "loader state dataset_state must be {'num_workers': W, 'workers': [W states], "
            f"'next_worker': w}}, got {dataset_state!r}; was it edited or truncated?"
        )
    nxt = dataset_state.get("next_worker", 0)  # states saved before it existed: worker 0
    if not isinstance(nxt, int) or not 0 <= nxt < count:
        raise ValueError(
            f"loader state dataset_state next_worker must be an int in [0, {count - 1}], "
            f"got {nxt!r}"
        )


def unresumable(dataset: Any) -> str | None:
    """Why gpufeed cannot know where an iterable dataset's stream stood (it lacks its own
    ``state_dict`` and ``load_state_dict``), or None. The state says so, as for a sampler it
    cannot rewind: frameworks checkpoint every loader with a ``state_dict``, and must go on."""
    if isinstance(dataset, IterableDataset) and not (
        stateful(dataset) and hasattr(dataset, "load_state_dict")
    ):
        return (
            f"{type(dataset).__name__} is an IterableDataset without its own state_dict() and "
            "load_state_dict(state) (or its state_dict needs arguments, as litdata's, made for "
            "its own loader), so gpufeed cannot know where its stream stood; add them "
            "(returning plain Python values), or use a map-style Dataset"
        )
    return None


def capture_state(dataset: Any) -> Any:
    """Worker side, after each batch: the iterable dataset's ``state_dict()``, else ``None``.

    Once per batch, so it must be cheap (a few counters). Thread workers each iterate a shallow
    copy of the dataset (NOTE [ Iterable datasets in thread workers ] in ``_host/fetch.py``):
    attributes rebound per worker are the worker's own; a nested object mutated in place is
    shared, so its state must be kept per worker (keyed by ``get_worker_info().id``), and
    ``load_state_dict`` (called in each worker with its state) sets only the caller's.
    """
    if isinstance(dataset, IterableDataset) and stateful(dataset):
        return dataset.state_dict()  # type: ignore[attr-defined]
    return None


_STATEFUL: dict[type, bool] = {}


def stateful(dataset: Any) -> bool:
    """Whether ``dataset.state_dict()`` can be called without arguments (cached per class)."""
    cls = type(dataset)
    known = _STATEFUL.get(cls)
    if known is None:
        method = getattr(dataset, "state_dict", None)
        try:
            known = method is not None and (inspect.signature(method).bind() is not None)
        except TypeError:  # required arguments
            known = False
        except ValueError:  # no signature (a builtin): assume the protocol
            known = True
        _STATEFUL[cls] = known
    return known
