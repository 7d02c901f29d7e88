"""``gpufeed.sources.batch_empty``: user code that builds a whole batch builds it in its slot.

NOTE [ Batches built in the slot ]
----------------------------------
A dataset's ``__getitems__`` (or a ``collate_fn``) that makes its own batch array and fills it
(a crop per row of one ``np.empty``) hands the loader a batch in ordinary memory, which the
worker then copies into the batch's slot: on 7 MB image batches, a fifth of a worker's time.
``batch_empty`` gives such code the slot's memory itself, so nothing is copied. Outside a
gpufeed worker building a batch (the stock loader, ``num_workers=0``, a notebook) it is
``torch.empty``, so the same dataset works with any loader.

It answers with slot memory while a worker runs user code whose result is the batch:
``__getitems__``, ``collate_fn``, and ``__getitem__`` or an iterable's ``__next__`` when
``batch_size=None`` (the dataset batches itself). Not while ``__getitem__`` fetches one sample
of a batch the loader collates: the samples are stacked into the slot anyway. The writer is
per thread, so thread workers each see their own slot. Each call carves a view of its own:
the views gpufeed's collation reuses (NOTE [ Carved views ] in ``_host/writer.py``) never
reach user code, which may reshape what it gets in place.

The memory is the batch's until the batch is returned: a tensor kept past that (a buffer
cached on ``self``) would be writing into a slot the loop may be reading. ``pack``
(``_host/collate.py``) refuses a leaf that lies in the ring outside the batch's own slot, with
an error naming the cause. A request the slot cannot hold (the first batch, before the ring
knows the batch's size; a batch larger than its slot) gets ordinary memory, which is then
copied: never a wrong byte, only the copy there would have been anyway.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .writer import SlotWriter

_local = threading.local()


def building(writer: SlotWriter | None) -> SlotWriter | None:
    """User code running now builds the batch of ``writer``'s slot (None: it does not, or no
    slot); the writer it replaces, for ``building(previous)`` afterwards."""
    previous = getattr(_local, "writer", None)
    _local.writer = writer
    return previous


def batch_empty(*size: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor for the batch being built: memory of the batch's slot when
    called from a gpufeed worker's ``__getitems__`` or ``collate_fn`` (see NOTE [ Batches
    built in the slot ]), ``torch.empty`` anywhere else.

    Fill it and return it (or views of it) as part of the batch; the loader then hands it out
    without copying it. Do not keep it past the batch: each batch gets fresh memory.

    Args:
        size: the shape, as integers or one sequence of them (as ``torch.empty`` takes).
        dtype: the element type; None for torch's default dtype.

    Example::

        def __getitems__(self, indices):
            out = gpufeed.sources.batch_empty(len(indices), 3, 224, 224, dtype=torch.uint8)
            for k, i in enumerate(indices):
                out[k] = self.crop(i)
            return out, torch.as_tensor(self.labels[indices])
    """
    shape = _shape(size)
    if dtype is None:
        dtype = torch.get_default_dtype()
    elif not isinstance(dtype, torch.dtype):
        raise TypeError(f"batch_empty: dtype must be a torch.dtype such as torch.uint8, "
                        f"got {dtype!r}")
    writer = getattr(_local, "writer", None)
    if writer is not None:
        out = writer.alloc_fresh(shape, dtype)  # a view of its own: user code may alter it
        if out is not None:
            return out
    return torch.empty(shape, dtype=dtype)


def _shape(size: tuple[Any, ...]) -> tuple[int, ...]:
    # One sequence of sizes (torch.Size is a tuple), else the sizes themselves.
    dims: Any = size[0] if len(size) == 1 and isinstance(size[0], Sequence) else size
    shape = []
    for d in dims:
        try:
            n = operator.index(d)  # ints, numpy integers, one-element integer tensors
        except TypeError:
            raise TypeError(
                f"batch_empty: sizes must be integers, got {d!r} in {tuple(dims)!r}") from None
        if n < 0:
            raise ValueError(f"batch_empty: sizes must be >= 0, got {n} in {tuple(dims)!r}")
        shape.append(n)
    return tuple(shape)


