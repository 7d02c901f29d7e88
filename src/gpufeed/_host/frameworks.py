"""What the frameworks that rebuild a loader read of it, and what they get back.

Lightning rebuilds a loader from its attributes (to inject a ``DistributedSampler``), passing
back every value that differs from the signature's default: an unset ``prefetch_factor`` reads
torch's 2 and stays unset when passed back (:class:`DefaultPrefetch`). Accelerate's ``prepare``
and ``skip_first_batches`` rebuild every loader as a stock one: refused or warned of
(:class:`AccelerateHooks`), unless ``gpufeed.hf`` is rebuilding (:func:`adopting`). Tested in
``tests/integration/test_frameworks.py`` and ``tests/test_hf.py``.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader as _TorchDataLoader
from torch.utils.data import IterableDataset


class DefaultPrefetch(int):
    """torch's default ``prefetch_factor`` (2 with workers), read from a loader that left it
    unset, marked as not chosen: passed back by a framework that rebuilds the loader, it is
    taken as unset, so gpufeed keeps sizing its work-ahead instead of holding to a bound nobody
    chose (NOTE [ Messages ] in ``_host/messages.py``)."""

    __slots__ = ()


_adopting = threading.local()


@contextmanager
def adopting() -> Iterator[None]:
    """While ``gpufeed.hf`` lets Accelerate rebuild a loader and puts a gpufeed loader back in
    place of the stock one: no warning that gpufeed's loader is dropped."""
    depth = getattr(_adopting, "depth", 0)
    _adopting.depth = depth + 1
    try:
        yield
    finally:
        _adopting.depth = depth


def _is_adopting() -> bool:
    return getattr(_adopting, "depth", 0) > 0


def refuse_double_shard(rank: int, world_size: int, iterable: bool) -> None:
    """Raise when ``prepare`` would shard again a loader that already reads one rank's share
    (map-style, ``world_size`` > 1: NOTE [ Sharding by rank ] in ``_order/shards.py``)."""
    if world_size > 1 and not iterable:
        raise ValueError(
            f"accelerator.prepare(loader) would shard this gpufeed.DataLoader a second time: it "
            f"already reads only rank {rank}'s share of the dataset (seed= under "
            f"torch.distributed, or rank=/world_size=), and Accelerate splits that share again "
            f"among {world_size} processes, so most samples would never be seen. Either keep "
            "gpufeed's loader out of prepare() (build it after Accelerator() with "
            "device=accelerator.device), or build it without seed=, rank= and world_size= so "
            "that Accelerate shards it (use_seedable_sampler=True in its "
            "DataLoaderConfiguration for a shuffle seeded alike on every rank)")


_PREPARE_WARNING = (
    "accelerator.prepare(loader) rebuilds a gpufeed.DataLoader as a stock "
    "torch.utils.data.DataLoader: gpufeed's ring, thread workers, device stage, seed, stats "
    "and state_dict are dropped. To keep them, build the Accelerator from gpufeed.hf "
    "(from gpufeed.hf import Accelerator): its prepare() keeps gpufeed's loader under "
    "Accelerate's sharding, device placement and end-of-loader tracking")


def _user_level() -> int:
    """``stacklevel`` of the first frame outside gpufeed and Accelerate: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
            "gpufeed", "accelerate"):
        frame, level = frame.f_back, level + 1
    return level


_SKIP_WARNING = (
    "accelerator.skip_first_batches(loader) rebuilds a gpufeed.DataLoader as a stock "
    "torch.utils.data.DataLoader: gpufeed's ring, thread workers, device stage, stats and "
    "state_dict are dropped, and the stock loader takes its order from the gpufeed loader's "
    "sampler, which starts a new epoch: not the position that load_state restored, which it "
    "uses up. gpufeed.hf.Accelerator's skip_first_batches keeps the gpufeed loader; or, to "
    "resume mid-epoch, accelerator.register_for_checkpointing(loader) before save_state, and "
    "after load_state iterate the loader itself (it goes on right after the saved batch)")


def _in_skip_first_batches() -> bool:
    """Whether the property's caller is ``accelerate.data_loader.skip_first_batches`` (or a
    comprehension in it)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(2):
        if frame is None:
            return False
        if (frame.f_code.co_name == "skip_first_batches"
                and frame.f_globals.get("__name__") == "accelerate.data_loader"):
            return True
        frame = frame.f_back
    return False


class AccelerateHooks:
    """The attribute reads by which ``gpufeed.DataLoader`` learns that Accelerate is about to
    rebuild it: ``prepare`` reads ``_is_accelerate_prepared`` first, ``skip_first_batches``
    reads ``multiprocessing_context`` back (warned of once per loader)."""

    _rank: int
    _world_size: int
    _prepared = False
    _skip_warned = False
    dataset: Any

    @property
    def _is_accelerate_prepared(self) -> bool:
        """Read by ``prepare_data_loader`` first, before Accelerate (1.x) rebuilds the loader as a
        stock one (it offers no hook to build another class): a loader sharded by rank is
        refused, else warned of, naming ``gpufeed.hf.Accelerator`` (not under :func:`adopting`)."""
        if not self._prepared:
            iterable = isinstance(self.dataset, IterableDataset)
            refuse_double_shard(self._rank, self._world_size, iterable)
            if not _is_adopting():
                warnings.warn(_PREPARE_WARNING, stacklevel=_user_level())
        return self._prepared

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self._prepared = bool(value)

    @property
    def multiprocessing_context(self) -> Any:
        """torch's ``multiprocessing_context`` (read back by Accelerate's rebuilds)."""
        if not self._skip_warned and not _is_adopting() and _in_skip_first_batches():
            self._skip_warned = True
            warnings.warn(_SKIP_WARNING, stacklevel=_user_level())
        return _TorchDataLoader.multiprocessing_context.fget(self)  # type: ignore[attr-defined]

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: Any) -> None:
        _TorchDataLoader.multiprocessing_context.fset(self, value)  # type: ignore[attr-defined]
