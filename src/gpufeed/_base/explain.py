"""What every loader statistic means, and why the ring fell back when it did.

``MEANINGS`` has one line per stage, counter and column of :class:`~gpufeed.stats.LoaderStats`
(docs/guides/stats.md, "Reading loader.stats()", lists the same lines; a test keeps them in step).
:func:`ring_findings` reads a snapshot and, when a large share of batches missed the slot ring
(``ring_fallback``), names the cause it sees and the fix:

NOTE [ Ring fallback causes ]: the ring's slots in use (``ring`` occupancy) are the batches in
flight that got a slot (at most the ``prefetch`` occupancy) plus the batches the loop still
holds. So, over a snapshot:
1. **held by the loop**: the ring has more slots than batches may be in flight, yet it was
   full (sampled occupancy reached ``RING_FULL`` of the capacity) or held on average
   ``HELD_MIN`` (or ``HELD_SHARE`` of the capacity) slots more than the batches in flight:
   batches, or single tensors of them, that the loop kept (one label tensor keeps its whole
   slot), so new batches found it full. Fix: copy what you keep (``t.clone()``), or raise
   ``ring_bytes=`` to cover it.
2. **budget too small**: the ring has no more slots than batches in flight, so it cannot even
   hold the prefetch. Fix: ``ring_bytes=`` of at least (in flight + 2) batches.
3. **variable shapes**: slots were carved many times over (``ring_grow`` well above the
   capacity): batches change size, so slots sized for small batches are retired and re-carved.
   Fix: pad to fixed shapes in ``collate_fn``, or a ``ring_bytes=`` sized for the largest.
More than one cause can hold at once; with none of them visible the finding says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["FALLBACK_HIGH", "MEANINGS", "StageView", "StatsView", "explain", "ring_findings"]

#: a fallback share above this gets a finding (a few fall-backs while the ring grows are normal)
FALLBACK_HIGH = 0.1
#: ring occupancy (sampled at handovers, so it can miss the very top) at or above this share of
#: the capacity counts as full; a loop that keeps nothing stays well below, near the batches
#: in flight
RING_FULL = 0.75
#: slots in use beyond the batches in flight, on average, that count as held by the loop (a
#: loop that keeps nothing holds one or two: the batch it works on and the one just handed over)
HELD_MIN = 4
HELD_SHARE = 0.1


class StageView(Protocol):
    """What the findings read of one stage (a ``StageStats``)."""

    @property
    def batches(self) -> int: ...
    @property
    def occupancy_mean(self) -> float: ...
    @property
    def occupancy_max(self) -> int: ...
    @property
    def capacity(self) -> int: ...


class StatsView(Protocol):
    """What :func:`explain` and :func:`ring_findings` read of a snapshot (a ``LoaderStats``)."""

    @property
    def stages(self) -> Mapping[str, StageView]: ...
    @property
    def counters(self) -> Mapping[str, int]: ...
    @property
    def input_bound(self) -> float | None: ...


MEANINGS: dict[str, str] = {
    # stages (seconds per batch)
    "fetch": "worker time reading the samples of a batch (your `dataset[i]` or `__getitems__`)",
    "collate": "worker time building the batch from its samples (into a ring slot if one "
               "was free)",
    "startup": "time your loop waited for the first batch of each iter() (worker start-up), "
               "left out of wait and input-bound",
    "wait": "time your loop was blocked waiting for the next batch (input-bound when large; "
            "without workers it includes the main thread's own fetch and collate)",
    "step": "time your loop spent between two batches (your training step)",
    "transfer": "device stage: host-to-device copy and device transform per batch",
    "ring": "occupancy only: slots of the shared ring in use (in flight plus held by your "
            "loop) / slots the ring budget allows",
    "ring_fenced": "occupancy only, pinned rings: slots your loop released whose copies the "
                   "GPU has not finished yet (free again once it has) / slots the ring budget "
                   "allows",
    "prefetch": "occupancy only: batches in flight (sent to workers or ready, not yet handed "
                "to your loop) / the most allowed in flight",
    # counters
    "batches": "batches handed to your loop",
    "samples": "samples handed to your loop (each batch's first tensor's first dimension; one "
               "per item with batch_size=None)",
    "ring_grow": "ring slots carved (grows with the prefetch; keeps growing if batch sizes vary)",
    "ring_fallback": "batches that found no free ring slot and got memory of their own (a "
                     "per-batch memory file with process workers): one allocation and page "
                     "faults per batch instead of a recycled slot",
    "ring_unsupported": "batches with a tensor the ring cannot hold (nested, sparse, quantized, "
                        "a tensor subclass), sent torch's own way (through /dev/shm)",
    "ring_slots": "slots the ring has carved and holds (in use, fenced or free), at the last "
                  "batch handed over",
    "ring_bytes": "memory the ring's slots take (in use or free), at the last batch handed over",
    "worker_nice": "how much lower than the main process's the process workers' CPU priority "
                   "is (nice; worker_nice=None lowers it by 5 once the loop is main-bound on "
                   "oversubscribed cores)",
    "device_ahead": "device stage: batches copied ahead of your loop (taken from the loader, "
                    "not yet handed to you; device_depth once it is full), at the last batch "
                    "handed over; not counted in batches or samples",
    "consumer_waits": "device stage: times your loop waited for a batch on the device",
    "pageable_batches": "device stage: batches copied from unpinned memory (slower copies)",
    # columns
    "busy s": "total seconds the stage worked",
    "blocked s": "total seconds the stage was blocked (on a queue, a slot, the next batch)",
    "p50/p90/p99 ms": "per-batch time (busy + blocked) percentiles over recent batches",
    "occupancy": "mean/capacity (max) of slots or queue entries in use, sampled per batch",
    "input-bound": "wait / (wait + step): share of your loop spent waiting for data, "
                   "start-up left out",
    "autotune": "with num_workers=\"auto\": the worker count in force, the CPU and memory "
                "budgets and what it uses of them, and its latest decisions",
}


def explain(stats: StatsView) -> list[str]:
    """One line per stage, counter and column present in ``stats``: "name: meaning"."""
    names = [*stats.stages, *stats.counters, "busy s", "blocked s", "p50/p90/p99 ms"]
    if any(s.capacity for s in stats.stages.values()):
        names.append("occupancy")
    if stats.input_bound is not None:
        names.append("input-bound")
    if getattr(stats, "autotune", None) is not None:
        names.append("autotune")
    return [f"{n}: {MEANINGS[n]}" for n in dict.fromkeys(names) if n in MEANINGS]


def ring_findings(stats: StatsView) -> list[str]:
    """Causes and fixes of a high ring fallback share (NOTE [ Ring fallback causes ]); empty
    when the share is low or the loader has no ring."""
    fallbacks = stats.counters.get("ring_fallback", 0)
    batches = stats.counters.get("batches", 0) or (
        stats.stages["wait"].batches if "wait" in stats.stages else 0)
    if not fallbacks or not batches or fallbacks / batches <= FALLBACK_HIGH:
        return []
    share = fallbacks / batches
    head = (f"ring_fallback: {fallbacks} of {batches} batches ({share:.0%}) found no ring slot "
            "and took the slower stock path")
    ring, flight = stats.stages.get("ring"), stats.stages.get("prefetch")
    cap = ring.capacity if ring else 0
    in_flight = flight.capacity if flight else 0  # the most batches in flight at once
    held_mean = (ring.occupancy_mean - flight.occupancy_mean) if ring and flight else 0.0
    found = []
    if cap and in_flight and cap <= in_flight:
        found.append(f"cause: the ring budget is too small: {cap} slots for up to {in_flight} "
                     f"batches in flight; fix: ring_bytes= of at least {in_flight + 2} "
                     "batches")
    elif ring and cap and in_flight < cap and (
            ring.occupancy_max >= RING_FULL * cap
            or held_mean >= max(HELD_MIN, HELD_SHARE * cap)):
        found.append(f"cause: batches held by your loop: up to {ring.occupancy_max} of {cap} "
                     f"ring slots were in use ({ring.occupancy_mean:.0f} on average, with "
                     f"{flight.occupancy_mean if flight else 0:.0f} batches in flight), though "
                     "the ring has room for the "
                     f"{in_flight} batches allowed in flight; a slot stays taken while your "
                     "loop holds any tensor of its batch (a kept label tensor keeps the whole "
                     "slot); fix: copy what you keep (t.clone()) or raise ring_bytes= to "
                     "cover it")
    grows = stats.counters.get("ring_grow", 0)
    if cap and grows > 2 * cap:
        found.append(f"cause: variable batch shapes: {grows} slots carved for a ring of {cap}; "
                     "slots sized for smaller batches are retired and re-carved; fix: pad to "
                     "fixed shapes in collate_fn, or ring_bytes= sized for the largest batch")
    if not found:
        found.append("cause not visible in these stats; fix: raise ring_bytes=, or run "
                     "gpufeed profile on the loop to see the ring and prefetch occupancy")
    return [head, *found]
