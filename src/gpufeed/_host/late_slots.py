"""Slots bound when a task starts, not when it is queued: both sides of it.

NOTE [ Slots bound when a task starts ]
---------------------------------------
Each worker keeps ``prefetch_factor`` tasks (2 by default) in flight, so that it never waits
for the main process between batches. Bound at dispatch, each task holds a slot of the ring
while it is queued and while its samples are decoded, and every slot ever held at once stays
mapped (a recycled slot keeps its pages): two workers on 9.6 MB batches held six, 55 MiB of
the process tree's peak, where the stock loader's queued tasks hold nothing and its workers
take fresh shared memory only to collate a finished batch.

On expensive batches (one task per message, at least ``LATE_BIND_S`` of worker time each:
``WorkAhead.late_bind``; also before the first batch's cost is known) tasks go out ``LATE``
(``_host/messages.py``): no slot yet. The worker asks for it at its first request for slot
memory, that is when it collates the samples (after the first sample, when they are
collated as they come: NOTE [ Streamed collation ] in ``_host/streaming.py``), or when a
batch source asks for ``batch_empty``, with a ``NeedSlot`` message; the main process
acquires one and answers with ``SlotFor`` when it next reads its workers' messages, and the
worker waits for that. Slots in use are then the batches being collated, those answered and
not yet handed out, and those the loop holds.

    main: Tasks([Task(b, ..., LATE)]) ─> worker: fetches b's samples
    worker: first request for slot memory ─ NeedSlot(gen, b) ─> main: acquire()
    main: SlotFor(gen, b, slot) ─> worker: collates into the slot, answers Done([b])

The cost: one more message to the main process per batch, and a worker that waits for the
answer: on the CPU benchmark's jpeg workload (two process workers on two cores, 64 Pillow
decodes, about 130 ms of worker time per batch) a median of 0.5 ms per batch (0.4%; at most
4 ms), for two to four slots where binding at dispatch carved six. The main process reads
its workers' messages only while it waits for a batch, so while the loop runs a training step
(a consumer slower than the workers) a request waits up to a step: a worker then idles, with
its batch unfinished (a batch source's request comes first, before any decoding). Rule (e)
turns the mode off for such a loop, after a few batches' waits: up to 5% of a 40-batch first
epoch with steps of 12-20 ms, nothing after (``python -m bench.slots``, which
also has the figures above). Cheap batches never use it.

Rules (each has a test in tests/host/test_late_slots.py):
(a) A result settles the slot sent for its task: the result names it, or the worker stopped
    waiting before it came (rule (c)), and then the main process takes it back.
(b) A request of an older generation (a restarted epoch) is answered with no slot: the task,
    if it runs at all, runs in ordinary memory and its answer is dropped as the
    generation's others are.
(c) A waiting worker still obeys a stop, a newer generation and its parent's death: the task
    is dropped as if it had not run.
(d) No slot free within the budget: the ``SlotFor`` names none and the batch goes the
    ordinary way, as a task bound at dispatch would.
(e) Answers must be prompt: once ``LATE_SLOW`` of the last ``LATE_DELAYS`` requests waited
    more than ``LATE_DELAY_MAX`` of a batch's worker time while the loop ran its step (the
    main thread away from the loader: ``away``), slots are bound at dispatch again, by this
    iterator and by every later one of the same loader (the verdict is the loader's,
    ``LateVerdict``: a loop that was slower than its workers once likely still is, and a
    new epoch's first answers would pay for finding it out again). Only the steps count: a
    request that comes while the main thread is in the loader is answered at its next read
    of messages, and a late wake-up then is the machine's. While the whole delay counted,
    loops with no training step on two busy cores went back to dispatch now and then: 1
    loader in 8 here (5 slots carved instead of 3), and likely 3 of 5 runs of one
    data-source benchmark row (their shared memory: 46 MiB against 28). Two, not one: a
    step can be long once (a first step that compiles, a checkpoint).
(f) A request is no answer: ``timeout=``'s clock runs on through it (``WorkerIter._wait``),
    so a batch stuck after asking for its slot raises when the timeout has passed since
    the last batch came, as with the stock loader, not a timeout after the request.
"""

from __future__ import annotations

import collections
import os
import queue
import time
from collections.abc import Callable
from typing import Any

from .messages import LATE, NeedSlot, Slot, SlotFor, ToWorker

__all__ = ["Abandoned", "LateSlots", "LateVerdict", "late_slot", "wait_for_slot"]

LATE_ROW = (*LATE,)
# Rule (e) looks at the last LATE_DELAYS answers; LATE_SLOW late ones among them turn the
# mode off; an answer is late when a worker waited for it more than LATE_DELAY_MAX of a
# batch's worker time.
LATE_DELAYS = 8
LATE_SLOW = 2
LATE_DELAY_MAX = 0.05


class LateVerdict:
    """A loader's verdict, shared by its iterators: its loop kept workers waiting for their
    slots (rule (e))."""

    slow = False


def late_slot() -> tuple[int, int, int]:
    """Dispatch's ``acquire`` while tasks go out ``LATE``: the ``LATE`` slot."""
    return LATE_ROW


class LateSlots:
    """The main process's side: whether tasks go out ``LATE``, and the answers to workers'
    requests for their slots.

    Args:
        send: ``pool.send``. acquire, release: ``SlotRing``'s. verdict: the loader's.
    """

    def __init__(self, send: Callable[[int, ToWorker], None],
                 acquire: Callable[[], tuple[int, int, int] | None],
                 release: Callable[[int], None], verdict: LateVerdict | None = None) -> None:
        self._send, self._acquire, self._release = send, acquire, release
        self.verdict = verdict if verdict is not None else LateVerdict()
        # New tasks go out LATE.
        self.on = False
        self._late: collections.deque[bool] = collections.deque(maxlen=LATE_DELAYS)
        self._away: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=LATE_DELAYS)  # the loop's last steps (away)
        # (gen, batch) -> slot id sent in a SlotFor.
        self.sent: dict[tuple[int, int], int] = {}

    @property
    def slow(self) -> bool:
        """Answers came too late: rule (e)."""
        return self.verdict.slow

    def decide(self, late_bind: bool) -> None:
        """Tasks go out ``LATE`` from now on if their batches are worth it
        (``WorkAhead.late_bind``) and answers have been prompt (rule (e))."""
        self.on = late_bind and not self.slow

    def away(self, left: float, back: float) -> None:
        """The loop ran its step from ``left`` to ``back`` (``perf_counter``), away from the
        loader: the time rule (e) counts against a request."""
        self._away.append((left, back))

    def answer(self, w: int, request: NeedSlot, current: bool, batch_s: float) -> None:
        """Worker ``w``'s request for its task's slot; ``current``: of this generation (else
        rule (b)); none free: rule (d); ``batch_s``: worker seconds per batch (rule (e))."""
        if current and batch_s > 0:
            # The loop's steps since the request are the wait that counts.
            asked = request.asked_at
            waited = sum(back - max(left, asked) for left, back in self._away if back > asked)
            self._late.append(waited > LATE_DELAY_MAX * batch_s)
            if sum(self._late) >= LATE_SLOW:
                self.verdict.slow = True
        got = self._acquire() if current else None
        slot = None
        if got is not None:
            slot = Slot(*got)
            self.sent[(request.gen, request.batch)] = slot.id
        self._send(w, SlotFor(request.gen, request.batch, slot))

    def settle(self, gen: int, batch: int, slot_id: int) -> None:
        """A result for ``batch`` of ``gen`` came with ``slot_id``: release the slot sent for
        it if the worker did not use it (rule (a))."""
        sid = self.sent.pop((gen, batch), None)
        if sid is not None and sid != slot_id:
            self._release(sid)


class Abandoned(BaseException):
    """A worker waiting for its slot saw a stop, a newer generation or its parent's death
    (rule (c)). Not an ``Exception``: a dataset's ``except Exception`` must not swallow it."""


def wait_for_slot(chan: Any, inbox: collections.deque[ToWorker], parent: int, poll_s: float,
                  gen: int, batch: int) -> tuple[int, int, int] | None:
    """The worker's side: ask for the slot of ``batch`` of ``gen`` and wait for the
    ``SlotFor`` that names it (None: use ordinary memory); messages that come meanwhile wait
    in ``inbox`` (messages read ahead) for the worker's loop. Raises ``Abandoned`` (rule
    (c))."""
    try:
        chan.send(NeedSlot(gen, batch, time.perf_counter()))
    except (BrokenPipeError, EOFError, OSError):
        # The main process is gone or closing.
        inbox.append(None)
        raise Abandoned from None
    while True:
        for i, msg in enumerate(inbox):
            if msg is None or msg.gen > gen:
                raise Abandoned
            if type(msg) is SlotFor and msg.batch == batch and msg.gen == gen:
                del inbox[i]
                return msg.slot
        try:
            msg = chan.recv(poll_s)
        except (queue.Empty, TimeoutError):
            if parent != -1 and os.getppid() != parent:
                raise Abandoned from None
            continue
        except (EOFError, OSError):
            inbox.append(None)
            raise Abandoned from None
        inbox.append(msg)
