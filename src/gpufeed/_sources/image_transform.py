"""``transform=`` of the image sources: the user's function on each decoded image, in the worker.

NOTE [ Image transforms ]
-------------------------
``ImageFolder(..., transform=t)`` and ``ImageShards`` call ``t`` once per sample on the image
gpufeed decoded, cropped, resized and flipped: a uint8 ``(3, h, w)`` tensor (a view of HWC
memory with ``memory_format=torch.channels_last``), as ``torchvision.transforms.v2`` takes it.
What ``t`` returns is the sample's image.

1. Randomness. Each call runs in the sample's scope (``_order/sample_rng.py``), so
   ``gpufeed.random.sample_generator()`` inside ``t`` is that sample's generator: the same
   draws for any number or kind of workers, after a resume, under the stock loader's seeding
   outside gpufeed. Torch's, numpy's and Python's global generators (torchvision's random
   transforms draw from torch's) are seeded from the sample before the call wherever the fetch
   may seed them (process workers and ``num_workers=0``, with ``seed=`` or
   ``deterministic=True``), as for ``__getitem__`` (NOTE [ Seeding and threads ] in
   ``_order/seeding.py``). Thread workers share them with the training loop and never seed
   them: such draws are not reproducible there, and ``_host/random_watch.py`` warns once
   (``RandomStateWarning``) with the fix.
2. Batches. With the default collation the first sample's output sets the batch's shape and
   dtype, and every output is copied into the slot (``(B, *shape)``; channels-last memory for
   a 3-D output when the source was asked for it); a tensor of another shape or dtype in the
   same batch is refused with torch's ``stack`` words and the fix, a non-tensor output with a
   TypeError. With a ``collate_fn`` (or ``dataset[i]``) the outputs are passed as they are.
3. Cost. The image is decoded into a buffer of its own (one per batch with the default
   collation, one per sample otherwise), then the output copied into the slot: one more copy
   than without a transform, plus the transform (the sources benchmark's ``transform=`` row).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .._order.sample_rng import current_scope
from .._order.seeding import seeded
from .arrays import allocate


def check_transform(transform: Any, owner: str) -> Callable[[torch.Tensor], Any] | None:
    """``transform`` if it is None or callable, else a TypeError naming it."""
    if transform is not None and not callable(transform):
        raise TypeError(f"{owner}(transform={transform!r}): transform must be a callable that "
                        "takes a uint8 (3, h, w) tensor, such as a torchvision.transforms.v2 "
                        "transform, or None")
    return transform


@contextlib.contextmanager
def transform_calls(transform: Callable[[torch.Tensor], Any], *, seed: int | None,
                    epoch: int) -> Iterator[Callable[[int, torch.Tensor], Any]]:
    """``call(index, image)``: ``transform(image)`` run as sample ``index``'s code (rule (1) of
    NOTE [ Image transforms ]), for the samples of one batch."""
    scope = current_scope()
    if scope is None:  # the stock loader, or dataset[i] by hand: the global generators as they are
        yield lambda index, image: transform(image)
        return
    fn = transform if scope.probe is None else scope.probe.wrap(transform)
    at = scope.at
    try:
        # the global generators reseeded per sample where the fetch may seed them (rule (1))
        with (seeded(seed, epoch) if seed is not None and scope.seed_globals
              else contextlib.nullcontext()) as reseed:

            def call(index: int, image: torch.Tensor) -> Any:
                at(index)
                if reseed is not None:
                    reseed(index)
                return fn(image)

            yield call
    finally:
        at(None)  # back to the batch: a later draw without index is the batch's


def stack_outputs(outputs: Sequence[Any], idx: np.ndarray, alloc: Any, *,
                  channels_last: bool, owner: str) -> torch.Tensor:
    """The transform's outputs of one batch stacked into ``alloc``'s memory (rule (2))."""
    tensors: list[torch.Tensor] = []
    for k, out in enumerate(outputs):
        if isinstance(out, np.ndarray):
            out = torch.from_numpy(out)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{owner}'s transform returned {type(out).__name__} for sample "
                f"{int(idx[k])}, and a batch is stacked from tensors: end the transform with "
                "a tensor (e.g. torchvision.transforms.v2.ToImage() or PILToTensor()), or "
                "pass gpufeed.DataLoader(..., collate_fn=...) that takes the list")
        first = tensors[0] if tensors else out
        if out.shape != first.shape or out.dtype != first.dtype:
            raise RuntimeError(
                f"stack expects each tensor to be equal size, but got {list(first.shape)} "
                f"({first.dtype}) at entry 0 and {list(out.shape)} ({out.dtype}) at entry {k}: "
                f"{owner}'s transform gave sample {int(idx[k])} another shape or dtype than "
                f"sample {int(idx[0])} of its batch. Make its output one shape and dtype (a "
                "fixed-size crop or resize, a dtype conversion at its end), or pass "
                "gpufeed.DataLoader(..., collate_fn=...) that takes images of several shapes")
        tensors.append(out)
    batch = allocate_images(alloc, len(tensors), tuple(tensors[0].shape), tensors[0].dtype,
                            channels_last=channels_last)
    for k, out in enumerate(tensors):
        batch[k].copy_(out)
    return batch


def allocate_images(alloc: Any, n: int, shape: tuple[int, ...], dtype: torch.dtype, *,
                    channels_last: bool) -> torch.Tensor:
    """``(n, *shape)`` from ``alloc``; for a 3-D ``shape`` with ``channels_last``, ``(n, h, w,
    c)`` memory seen as ``(n, c, h, w)``."""
    if channels_last and len(shape) == 3:
        return allocate(alloc, (n, shape[1], shape[2], shape[0]), dtype).permute(0, 3, 1, 2)
    return allocate(alloc, (n, *shape), dtype)
