"""What a device stage holds until CUDA is done with it: FIFOs of ``(event, ...)`` entries,
popped once their event has completed, and the host batches dropped then (NOTE [ Device stage:
streams, events and slots ] rules (3) and (10) in ``_device/prefetch.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .._base import cuda as _cuda
from .._base.tree import tree_leaves, tree_map

__all__ = ["drop_copied", "event_of", "map_tensors", "pop_completed", "tensor_bytes"]


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to each tensor leaf; other leaves pass through."""
    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, batch)


def tensor_bytes(batch: Any) -> int:
    leaves = tree_leaves(batch)
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def pop_completed(fifo: deque[Any]) -> list[Any]:
    """Pop entries (events, or tuples starting with one) from the left once complete."""
    done = []
    while fifo and event_of(fifo[0]).query():
        done.append(fifo.popleft())
    return done


def drop_copied(entries: list[tuple[Any, Any, tuple[int, ...]]]) -> None:
    """Drop host batches whose copies have completed (rule 10): their ring slots need no
    release fence, and only theirs: the addresses of their leaves say which (a collection
    that runs meanwhile may drop another loader's batch, which must still be fenced)."""
    with _cuda.copies_complete([p for entry in entries for p in entry[2]]):
        entries.clear()


def event_of(entry: Any) -> Any:
    return entry[0] if isinstance(entry, tuple) else entry
