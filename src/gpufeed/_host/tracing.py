"""What the worker-pool iterator records as results arrive and its ring changes, in the stats
and, while a trace records, the trace (NOTE [ Timeline ] in ``_base/timeline.py``: what is
recorded, and on which clock). Its counters and its tracks' names are ``WorkerIter``'s own
(``_sample_counters``, ``_label``); the handovers are ``BaseIter``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._base import timeline as _timeline
from .._memory.ring import SlotRing


def record_fetched(recorder: Any, w: int, epoch: int, fetched: Sequence[Any]) -> float:
    """Record the fetch and collate times of one message's ``Fetched`` results, one recorder
    call per stage and message (not per batch), and worker ``w``'s spans for them, of
    ``epoch`` (-1: an abandoned one's), while a trace records (NOTE [ Timeline ] (4)); their
    worker seconds in all."""
    fetch_s, collate_s = [r.fetch_s for r in fetched], [r.collate_s for r in fetched]
    recorder.add_many("fetch", fetch_s)
    recorder.add_many("collate", collate_s)
    tl = _timeline.active
    if tl is not None:
        for r in fetched:
            tl.worker_batch(recorder, w, r.batch, epoch, r.started, r.fetch_s, r.collate_s,
                            r.need, r.spill is not None)
    return sum(fetch_s) + sum(collate_s)


def record_ring(recorder: Any, ring: SlotRing, seen: tuple[int, int]) -> tuple[int, int]:
    """Count the slots the ring carved and the batches that fell back to a fresh allocation
    since ``seen`` (its grows and fallbacks counted so far), in the stats and, while a trace
    records, as instants; the counts now."""
    grown, fell_back = ring.grows - seen[0], ring.fallbacks - seen[1]
    recorder.count("ring_grow", grown)
    recorder.count("ring_fallback", fell_back)
    tl = _timeline.active
    if tl is None:
        return ring.grows, ring.fallbacks
    if grown > 0:
        tl.instant(recorder, "ring grew", args={"slots": grown, "slot_bytes": ring.slot_bytes})
    if fell_back > 0:
        tl.instant(recorder, "ring fallback: fresh allocation",
                   args={"batches": fell_back, "ring_slots_in_use": ring.in_use})
    return ring.grows, ring.fallbacks
