"""How far ahead of the consumer the workers run, and in messages of how many batches.

``WorkerIter`` keeps at most :attr:`WorkAhead.in_flight_bound` batches dispatched and not yet
delivered (NOTE [ Messages ] in ``_host/messages.py``), hands them out ``chunk`` per worker
per message, and sizes the ring for the bound plus the batches the consumer holds
(:attr:`WorkAhead.slots_hint`).

NOTE [ Fresh slots ]
--------------------
A chunked loader keeps two chunks per worker in flight, each batch in a ring slot of its own,
so the longest chunk (``CHUNK_MAX``) sizes the ring of cheap batches. A slot's pages cost their
first touch: shared memory is allocated and zeroed page by page as a worker first writes it,
and each other worker that writes the slot later maps the page again. A new ring pays that in
its first epoch, and a loader without persistent workers has a new ring every epoch. A cap of
32 rather than 64 halves the ring of cheap batches and the collections of Python's collector
(a message's results are unpickled at once), at no measurable cost in messages.
Measurements: docs/how-it-works/measurements/engine.md#fresh-slots.

NOTE [ Balanced dispatch ]
--------------------------
Thread workers on a map-style dataset fetch any batch alike: no worker has a stream or random
state of its own (the global generators are shared, the per-sample ones follow the sample:
NOTE [ Seeding and threads ] in ``_order/seeding.py``), so which worker fetches a batch
changes nothing in it. There (``balanced``), while batches go one per message (``chunk`` 1),
a batch is dispatched as soon as one fits under the bound, not once ``num_workers`` fit, and
to the active worker holding the fewest tasks, the turn's worker first among equals
(``WorkerIter._dispatch``): dealt in turn, a worker that fell behind (a core taken by another
process, a slow sample) kept its queued batch while the other waited for the in-order head.
Process workers, iterable datasets (each worker its own stream) and chunked cheap batches keep
the turn, as the stock loader deals them.
Measurements: docs/how-it-works/measurements/engine.md#balanced-dispatch.
"""

from __future__ import annotations

CHUNK_TARGET_S = 0.03  # worker seconds of work per task message (see _host/worker.py)
CHUNK_MAX = 32  # batches per message at most: NOTE [ Fresh slots ]
CHUNK_BYTES = 64 << 20  # never prefetch more than this in extra chunked batches
LATE_BIND_S = 0.02  # worker seconds per batch from which queued tasks get slots as they start
FENCE_SLACK = 2  # slots of a pinned ring waiting for the user's copies (a GPU 2 steps behind)


class WorkAhead:
    """The in-flight bound and the chunk size of one worker iterator.

    Args:
        prefetch_factor: batches in flight per worker, as torch's; None: torch's default, 2.
        adaptive: chunk cheap batches (:meth:`adapt`): only when ``prefetch_factor`` was left
            unset (an explicit one is a strict bound, as in torch), and not with ``timeout=``
            (a worker answers once per message, and the timeout is per batch).
        device_depth: the device stage's depth; None: batches are delivered on host.
        pin: the ring is page-locked (its slots wait for release fences).
        balanced: thread workers on a map-style dataset (NOTE [ Balanced dispatch ]).
    """

    def __init__(
        self, *, num_workers: int, prefetch_factor: int | None, adaptive: bool,
        device_depth: int | None, pin: bool, balanced: bool = False,
    ) -> None:
        self.num_workers = num_workers
        self.adaptive = adaptive
        self.balanced = balanced
        # Batches the consumer holds besides those in flight: the loop's current and previous
        # batch, and a device stage's depth + 1; pinned without a device stage, FENCE_SLACK
        # more, whose release fence waits for the user's copies.
        if device_depth is not None:
            self.held = 2 + device_depth + 1
        else:
            self.held = 2 + (FENCE_SLACK if pin else 0)
        self.depth = prefetch_factor or 2  # batches in flight per worker, unchunked
        # what the stock loader keeps in flight; its sampler pulls follow it (plan.pull_as_stock)
        self.stock_in_flight = self.depth * num_workers
        self.chunk = 1  # batches per worker per task message
        self.batch_s = 0.0  # worker seconds per batch, a moving average (0 before the first)
        self._bound()

    def window(self, first: bool, in_flight: int) -> int:
        """How many batches to hand out now, with ``in_flight`` dispatched and not delivered:
        :attr:`share` once that many fit under the bound (else 0), or whatever fits when
        nothing is in flight. An epoch's ``first`` window is one batch per worker, so that its
        first batch waits for one batch of work, not a whole chunk. Past it, a window opens
        only while ``in_flight`` is at most ``refill_at`` or 0: callers skip the call otherwise."""
        full = self.num_workers if first else self.share
        window = min(full, self.in_flight_bound - in_flight)
        if window <= 0 or (window < full and in_flight):
            return 0
        return window

    @property
    def share(self) -> int:
        """Batches per window past an epoch's first: a chunk per worker; one while a balanced
        pool's batches go one per message (NOTE [ Balanced dispatch ])."""
        if self.balanced and self.chunk == 1:
            return 1
        return self.chunk * self.num_workers

    @property
    def slots_hint(self) -> int:
        """Default ring size: in-flight batches plus those the consumer holds (``held``; NOTE
        [ Slot lifetime ] in ``_memory/ring.py``). More would only raise peak memory; a consumer
        that keeps more batches, or a GPU further behind, gets ordinary allocations."""
        return self.in_flight_bound + self.held

    @property
    def late_bind(self) -> bool:
        """Queued tasks get their slots when they start (NOTE [ Slots bound when a task
        starts ] in ``_host/late_slots.py``), also before the first batch's cost is known: the
        ring learns its slot size from the first batch, so a task bound at dispatch before then
        gets no slot at all, and one that asks later can."""
        return self.chunk == 1 and (self.batch_s >= LATE_BIND_S or not self.batch_s)

    def adapt(self, batch_s: float, slot_bytes: int) -> bool:
        """Size task messages so each carries about CHUNK_TARGET_S of worker time, given the
        last message's worker seconds per batch; True when the in-flight bound changed (the
        ring's slots hint with it)."""
        self.batch_s = batch_s if not self.batch_s else 0.8 * self.batch_s + 0.2 * batch_s
        if not self.adaptive:
            return False
        chunk = min(int(CHUNK_TARGET_S / max(self.batch_s, 1e-6)), CHUNK_MAX)
        if slot_bytes:
            chunk = min(chunk, CHUNK_BYTES // (slot_bytes * 2 * self.num_workers))
        chunk = max(chunk, 1)
        if chunk == self.chunk:
            return False
        self.chunk = chunk
        self._bound()
        return True

    def resize(self, num_workers: int, depth: int) -> None:
        """The autotuner moved the worker count or ``depth`` (the prefetch factor): a new
        in-flight bound (the stock sampler pulls keep following ``stock_in_flight``)."""
        self.num_workers, self.depth = num_workers, depth
        self._bound()

    def _bound(self) -> None:
        chunked = 2 * self.chunk if self.chunk > 1 else 0
        self.in_flight_bound = max(self.depth, chunked) * self.num_workers
        self.refill_at = self.in_flight_bound - self.share
