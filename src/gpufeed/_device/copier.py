"""The copy of one batch's leaves to the device (NOTE [ Device stage: streams, events and
slots ] in ``prefetch.py``): rule (1)'s copies, rule (9)'s device-resident leaves left in place,
and what the stage notes about them (bytes sent, host addresses read, the first leaf whose copy
is staged through pageable memory: rule (7))."""

from __future__ import annotations

from typing import Any

import torch

from .._base.tree import tree_leaves
from .pageable import staged_reason

__all__ = ["Copier"]


class Copier:
    """``copier(t)``: ``t`` copied by ``backend`` on the current (side) stream, or ``t`` itself
    when it already lives on the device; made once per batch, before its copies (rule (9))."""

    def __init__(self, backend: Any, side: Any, host: Any) -> None:
        self.backend = backend
        self.sent = 0
        self.addresses: list[int] = []
        self.staged: tuple[torch.Tensor, str] | None = None
        self.resident = {id(t): t for t in tree_leaves(host)
                         if isinstance(t, torch.Tensor) and backend.on_device(t)}
        if self.resident:  # rule (9)
            backend.wait_event(side, backend.record_event(backend.current_stream()))
            for t in self.resident.values():
                backend.record_stream(t, side)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self.resident:
            return t  # what .to(device) would return: the tensor itself
        backend = self.backend
        self.sent += t.numel() * t.element_size()
        self.addresses.append(t.data_ptr())
        if backend.needs_pinned and t.device.type == "cpu" and self.staged is None:
            reason = staged_reason(t, backend.is_pinned(t))
            if reason is not None:
                self.staged = (t, reason)
        return backend.copy(t)
