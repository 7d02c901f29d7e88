"""Copies that cannot overlap: detecting a ``non_blocking`` copy that is really synchronous.

``t.to("cuda", non_blocking=True)`` overlaps with compute only when the DMA engine can read
``t``'s bytes where they are. Otherwise the copy is staged through host memory and the call
returns only once the host bytes are read (CUDA runtime API, "API synchronization behavior"):

* pageable: ``t``'s bytes are not page-locked (no ``pin_memory()``, not in a registered ring);
* layout: ``t`` is not dense (e.g. ``x[:, ::2]``): torch's copy first makes a contiguous, and
  pageable, temporary on the CPU (``copy_requires_temporaries`` in ATen's Copy.cu).

``to_device`` counts such batches (``DeviceStats.pageable_batches``) and warns once per
iterator with :class:`PageableCopyWarning`.
"""

from __future__ import annotations

import warnings

import torch


class PageableCopyWarning(UserWarning):
    """A batch was copied to the GPU from pageable memory, so the copy could not overlap."""


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers one gap-free, non-overlapping block (in some dimension order)."""
    if t.is_contiguous():
        return True
    expected = 1  # innermost stride first; size-1 dims have no stride that matters
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True)
                               if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def staged_reason(t: torch.Tensor, is_pinned: bool) -> str | None:
    """Why a host-to-device copy of CPU tensor ``t`` cannot be asynchronous, or None."""
    if t.numel() == 0:
        return None
    if not is_pinned:
        return "pageable (non-pinned) host memory"
    if not is_dense(t):
        return "a non-dense layout (torch stages it through a pageable contiguous copy)"
    return None


def warn_staged(t: torch.Tensor, reason: str, device: torch.device, stacklevel: int) -> None:
    warnings.warn(
        f"to_device: a batch has a tensor (shape {tuple(t.shape)}, {t.dtype}) in {reason}, so "
        f"its non_blocking copy to {device} is synchronous and does not overlap with compute. "
        "Fix: pass pin_memory=True to the DataLoader, use gpufeed.DataLoader(..., "
        "pin_memory=True, device=...) whose ring is page-locked, or call .pin_memory() (and "
        ".contiguous() for strided views) on the batch. (Counted in stats().pageable_batches.)",
        PageableCopyWarning,
        stacklevel=stacklevel + 1,
    )
