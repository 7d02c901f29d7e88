"""What the frameworks that rebuild a loader read of it, and what they get back.

Lightning rebuilds a loader from its attributes to inject a ``DistributedSampler``, passing back
every value that differs from the signature's default; Accelerate's ``prepare`` rebuilds every
loader as a stock one. ``gpufeed.DataLoader`` answers both through this module: a
``prefetch_factor`` left unset reads torch's 2 and stays unset when passed back
(:class:`DefaultPrefetch`), and ``prepare`` is refused or warned of (:func:`before_prepare`), as
is ``skip_first_batches``, which rebuilds a stock loader too (:class:`AccelerateHooks`), unless
``gpufeed.hf`` is the one rebuilding (:func:`adopting`): it puts a gpufeed loader back under
Accelerate's wrapper. Tested in ``tests/integration/test_frameworks.py`` and ``tests/test_hf.py``.
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

__all__ = [
    "AccelerateHooks", "DefaultPrefetch", "adopting", "before_prepare", "refuse_double_shard",
]


class DefaultPrefetch(int):
    """torch's default ``prefetch_factor`` (2 with workers), the value ``loader.prefetch_factor``
    reads when it was left unset, marked as not chosen. It is an ``int`` equal to stock's; a
    framework that rebuilds a loader from its attributes (Lightning's sampler injection,
    ``copy`` of the arguments) passes it back, and the new loader takes it as unset: gpufeed
    keeps sizing its work-ahead itself instead of holding to a bound nobody chose (NOTE
    [ Messages ] in ``_host/messages.py``)."""

    __slots__ = ()


_adopting = threading.local()


@contextmanager
def adopting() -> Iterator[None]:
    """While ``gpufeed.hf`` lets Accelerate rebuild a loader (``prepare``, ``skip_first_batches``)
    and then puts a gpufeed loader back in place of the stock one it built: the warnings that
    gpufeed's loader is dropped do not apply then, so they are not given."""
    depth = getattr(_adopting, "depth", 0)
    _adopting.depth = depth + 1
    try:
        yield
    finally:
        _adopting.depth = depth


def _is_adopting() -> bool:
    return getattr(_adopting, "depth", 0) > 0


def refuse_double_shard(rank: int, world_size: int, iterable: bool) -> None:
    """Raise when Accelerate would split again a loader that already reads one rank's share.

    A loader that shards by rank itself (``world_size`` > 1, map-style: NOTE [ Sharding by
    rank ] in ``_order/shards.py``) would be sharded a second time by ``prepare``, so most
    samples would never be seen, whether Accelerate or ``gpufeed.hf`` builds what it iterates.
    """
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


def before_prepare(rank: int, world_size: int, iterable: bool) -> None:
    """Called when ``accelerate.Accelerator.prepare_data_loader`` first reads a loader's
    ``_is_accelerate_prepared``, before it rebuilds the loader.

    Accelerate (1.x) rebuilds every ``torch.utils.data.DataLoader`` it prepares as a stock one,
    from the batch sampler and the stock arguments, and offers no hook to build another class.
    A loader that shards by rank itself is refused (:func:`refuse_double_shard`). Otherwise
    gpufeed's ring, thread workers, device stage, seed, stats and state would be gone silently:
    a warning names ``gpufeed.hf.Accelerator``, whose ``prepare`` keeps them. Under
    ``gpufeed.hf`` (:func:`adopting`) only the refusal applies.
    """
    refuse_double_shard(rank, world_size, iterable)
    if _is_adopting():
        return
    warnings.warn(
        "accelerator.prepare(loader) rebuilds a gpufeed.DataLoader as a stock "
        "torch.utils.data.DataLoader: gpufeed's ring, thread workers, device stage, seed, stats "
        "and state_dict are dropped. To keep them, build the Accelerator from gpufeed.hf "
        "(from gpufeed.hf import Accelerator): its prepare() keeps gpufeed's loader under "
        "Accelerate's sharding, device placement and end-of-loader tracking",
        stacklevel=_user_level(),
    )


def _user_level() -> int:
    """``stacklevel`` of the first frame above the caller outside gpufeed and Accelerate: the
    user's ``prepare`` call, however many of Accelerate's own calls lead to the loader."""
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
    """Whether an attribute read comes from ``accelerate.data_loader.skip_first_batches``
    (directly, or from a comprehension in it): the frames above the property's."""
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
    rebuild it as a stock loader, which Accelerate offers no hook to avoid.

    ``prepare`` reads ``_is_accelerate_prepared`` first (:func:`before_prepare`);
    ``skip_first_batches`` reads every stock argument back, ``multiprocessing_context`` among
    them, and is warned of once per loader.
    """

    _rank: int
    _world_size: int
    _prepared = False
    _skip_warned = False
    dataset: Any

    @property
    def _is_accelerate_prepared(self) -> bool:
        """Read by ``accelerate.Accelerator.prepare_data_loader`` before it rebuilds a loader:
        refused for a loader sharded by rank, else warned of."""
        if not self._prepared:
            before_prepare(self._rank, self._world_size, isinstance(self.dataset, IterableDataset))
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
