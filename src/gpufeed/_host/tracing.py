"""What the worker-pool iterator writes into a trace, besides the handovers ``BaseIter``
records: its workers' spans as results arrive and its ring's instants (and counts); its
counters and its tracks' names are ``WorkerIter``'s own (``_sample_counters``, ``_label``).

Called by ``WorkerIter`` only while a trace records (NOTE [ Timeline ] in
``_base/timeline.py``); the rules of what is recorded, and on which clock, are there.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from .._base import timeline as _timeline
from .._memory.ring import SlotRing

__all__ = ["record_fetched", "record_ring", "trace_fetched", "trace_ring"]


def record_fetched(recorder: Any, w: int, epoch: int, fetched: Sequence[Any]) -> float:
    """Record the fetch and collate times of one message's ``Fetched`` results, one recorder
    call per stage and message (not per batch), and their spans while a trace records;
    their worker seconds in all."""
    fetch_s, collate_s = [r.fetch_s for r in fetched], [r.collate_s for r in fetched]
    recorder.add_many("fetch", fetch_s)
    recorder.add_many("collate", collate_s)
    if _timeline.active is not None:
        trace_fetched(recorder, w, epoch, fetched)
    return sum(fetch_s) + sum(collate_s)


def trace_fetched(owner: Hashable, w: int, epoch: int, fetched: Sequence[Any]) -> None:
    """Worker ``w``'s spans for the ``Fetched`` results of one message, of ``epoch`` (-1: an
    abandoned one's): NOTE [ Timeline ] (4)."""
    tl = _timeline.active
    if tl is None:
        return
    for r in fetched:
        tl.worker_batch(owner, w, r.batch, epoch, r.started, r.fetch_s, r.collate_s, r.need,
                        r.spill is not None)


def record_ring(recorder: Any, ring: SlotRing, seen: tuple[int, int]) -> tuple[int, int]:
    """Count the slots the ring carved and the batches that fell back to a fresh allocation
    since ``seen`` (its grows and fallbacks counted so far), in the stats and (while one
    records) the trace; the counts now."""
    recorder.count("ring_grow", ring.grows - seen[0])
    recorder.count("ring_fallback", ring.fallbacks - seen[1])
    trace_ring(recorder, ring, *seen)
    return ring.grows, ring.fallbacks


def trace_ring(owner: Hashable, ring: SlotRing, seen_grows: int, seen_fallbacks: int) -> None:
    """Instants for slots the ring carved and batches that fell back to a fresh allocation
    since the counts seen last (called when they changed)."""
    tl = _timeline.active
    if tl is None:
        return
    if ring.grows > seen_grows:
        tl.instant(owner, "ring grew", args={"slots": ring.grows - seen_grows,
                                             "slot_bytes": ring.slot_bytes})
    if ring.fallbacks > seen_fallbacks:
        tl.instant(owner, "ring fallback: fresh allocation",
                   args={"batches": ring.fallbacks - seen_fallbacks,
                         "ring_slots_in_use": ring.in_use})
