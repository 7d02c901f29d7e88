"""Slots bound when a task starts, not when it is queued: both sides of it.

NOTE [ Slots bound when a task starts ]
---------------------------------------
Each worker keeps ``prefetch_factor`` tasks in flight, so that it never waits for the main
process between batches. Bound at dispatch, each task holds a slot while it is queued and
decoded, and every slot ever held at once stays mapped, where the stock loader's queued tasks
hold nothing. So on expensive batches (one task per message, at least ``LATE_BIND_S`` of worker
time each: ``WorkAhead.late_bind``; also before the first batch's cost is known) tasks go out
``LATE`` (``_host/messages.py``): no slot yet. At its first request for slot memory (when it
collates, after the first sample when streaming: NOTE [ Streamed collation ] in
``_host/streaming.py``, or at ``batch_empty``) the worker sends ``NeedSlot`` and waits; the
main process answers ``SlotFor`` when it next reads its workers' messages.

    main: Tasks([Task(b, ..., LATE)]) ─> worker: fetches b's samples
    worker: first request for slot memory ─ NeedSlot(gen, b) ─> main: acquire()
    main: SlotFor(gen, b, slot) ─> worker: collates into the slot, answers Done([b])

The cost is one more message per batch and a short wait, under 1% of an expensive batch. The
main process reads messages only while it waits for a batch, so while a slower loop runs its
step a request waits up to a step and the worker idles: rule (e) turns the mode off for such a
loop. Measurements: docs/how-it-works/measurements/host.md#late-slots.

Rules (each has a test in tests/host/test_late_slots.py):
(a) A result settles the slot sent for its task: the result names it, or the worker stopped
    waiting before it came (rule (c)), and then the main process takes it back.
(b) A request of an older generation (a restarted epoch) is answered with no slot: the task,
    if it runs at all, runs in ordinary memory and its answer is dropped with the others.
(c) A waiting worker still obeys a stop, a newer generation and its parent's death: the task
    is dropped as if it had not run.
(d) No slot free within the budget: the ``SlotFor`` names none and the batch goes the
    ordinary way, as a task bound at dispatch would.
(e) Answers must be prompt: once ``LATE_SLOW`` of the last ``LATE_DELAYS`` requests waited
    more than ``LATE_DELAY_MAX`` of a batch's worker time while the loop ran its step
    (``away``), slots are bound at dispatch again, by this and every later iterator of the
    loader (``LateVerdict``: a loop slower than its workers once likely still is). Only the
    steps count: a request that comes while the main thread is in the loader is answered at
    its next read, and a late wake-up then is the machine's. Two, not one: a step can be
    long once (a first step that compiles, a checkpoint).
(f) A request is no answer: ``timeout=``'s clock runs on through it (``WorkerIter._wait``),
    so a batch stuck after asking for its slot raises ``timeout`` after the last batch came,
    as with the stock loader.
"""

from __future__ import annotations

import collections
import os
import queue
import time
from collections.abc import Callable
from typing import Any

from .messages import NeedSlot, Slot, SlotFor, ToWorker

# Rule (e).
LATE_DELAYS = 8
LATE_SLOW = 2
LATE_DELAY_MAX = 0.05


class LateVerdict:
    """A loader's verdict, shared by its iterators: its loop kept workers waiting (rule (e))."""

    slow = False


class LateSlots:
    """The main process's side: whether tasks go out ``LATE``, and the answers to workers'
    requests (``send``: the pool's; ``acquire``, ``release``: the ring's)."""

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

    def decide(self, late_bind: bool) -> None:
        """Tasks go out ``LATE`` if their batches are worth it and answers were prompt (e)."""
        self.on = late_bind and not self.verdict.slow

    def away(self, left: float, back: float) -> None:
        """The loop ran its step from ``left`` to ``back``: what rule (e) counts."""
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
        """A result came with ``slot_id``: release the slot sent for it if unused (rule (a))."""
        sid = self.sent.pop((gen, batch), None)
        if sid is not None and sid != slot_id:
            self._release(sid)


class Abandoned(BaseException):
    """A worker waiting for its slot saw a stop, a newer generation or its parent's death
    (rule (c)). Not an ``Exception``: a dataset's ``except Exception`` must not swallow it."""


def wait_for_slot(chan: Any, inbox: collections.deque[ToWorker], parent: int, poll_s: float,
                  gen: int, batch: int) -> tuple[int, int, int] | None:
    """The worker's side: ask for the slot of ``batch`` and wait for its ``SlotFor`` (None:
    ordinary memory); other messages wait in ``inbox`` for the worker's loop. Rule (c):
    ``Abandoned``."""
    try:
        chan.send(NeedSlot(gen, batch, time.perf_counter()))
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
            inbox.append(msg)
    except (EOFError, OSError):
        # The main process is gone or closing (BrokenPipeError is an OSError).
        inbox.append(None)
        raise Abandoned from None
