"""Slots bound when a task starts (NOTE [ Slots bound when a task starts ] in
``_host/late_slots.py``): the worker asks when it first needs slot memory, the main process
answers, and neither a stop, a restarted epoch nor a full ring loses a slot or a batch."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections import deque
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed._host import late_slots, workahead
from gpufeed._host.collate import unpack
from gpufeed._host.messages import (
    LATE,
    Done,
    Dropped,
    Fetched,
    NeedSlot,
    Reseed,
    Slot,
    SlotFor,
    Task,
    Tasks,
    WorkerSpec,
)
from support.worker_thread import WorkerThread

REGION = 1 << 16


class Rows(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), i, dtype=torch.int64)


def _worker(**spec: Any) -> WorkerThread:
    """A thread worker over a region of its own (``worker.region``)."""
    region = torch.zeros(REGION, dtype=torch.uint8)
    args: dict[str, Any] = dict(
        num_workers=1, dataset=Rows(), is_iterable=False, auto_collation=True,
        collate_fn=None, drop_last=False, region=region, base_seed=7, init_fn=None,
        sample_seed=None, rank=0, world_size=1)
    args.update(spec)
    worker = WorkerThread(WorkerSpec(**args))
    worker.region = region  # type: ignore[attr-defined]
    return worker


def _asked(worker: WorkerThread, gen: int, batch: int) -> None:
    msg = worker.answer()
    assert type(msg) is NeedSlot and msg[:2] == (gen, batch)
    assert 0 < time.perf_counter() - msg.asked_at < 30  # on the main process's clock


def test_a_late_task_asks_for_its_slot_and_collates_into_it():
    worker = _worker()
    worker.send(Tasks(1, [Task(0, False, [1, 2, 3], LATE)], 0))
    _asked(worker, 1, 0)
    worker.send(SlotFor(1, 0, Slot(5, 4096, 4096)))
    done = worker.answer()
    worker.stop()
    (fetched,) = done.results
    assert isinstance(fetched, Fetched) and fetched.slot_id == 5
    base = worker.region.numpy()[4096:8192]
    batch = unpack(fetched.packed, base)
    assert torch.equal(batch, torch.tensor([[1] * 4, [2] * 4, [3] * 4]))
    assert batch.data_ptr() == worker.region.data_ptr() + 4096  # in the slot: not a copy


def test_a_late_task_told_no_slot_goes_the_ordinary_way():
    worker = _worker()
    worker.send(Tasks(1, [Task(0, False, [7, 8], LATE)], 0))
    _asked(worker, 1, 0)
    worker.send(SlotFor(1, 0, None))
    (fetched,) = worker.answer().results
    worker.stop()
    assert fetched.slot_id == -1
    assert torch.equal(unpack(fetched.packed, None), torch.tensor([[7] * 4, [8] * 4]))
    assert not worker.region.any()


def test_the_wait_for_a_slot_is_not_counted_as_work():
    worker = _worker()
    worker.send(Tasks(1, [Task(0, False, [1], LATE)], 0))
    _asked(worker, 1, 0)
    time.sleep(0.3)
    worker.send(SlotFor(1, 0, Slot(0, 0, 4096)))
    (fetched,) = worker.answer().results
    worker.stop()
    assert fetched.fetch_s + fetched.collate_s < 0.15  # the stall profiler's stages


@pytest.mark.parametrize("then", ["stop", "newer generation"])
def test_a_worker_waiting_for_its_slot_obeys(then):
    """Rule (c): a stop or a restarted epoch while the worker waits drops the task, unrun,
    and the message's tasks after it."""
    worker = _worker()
    worker.send(Tasks(1, [Task(0, False, [1], LATE), Task(1, False, [2], Slot(3, 0, 4096))], 0))
    _asked(worker, 1, 0)
    worker.send(None if then == "stop" else Reseed(2, None))
    assert worker.answer() == Done(1, [Dropped(0, -1), Dropped(1, 3)])
    if then == "stop":
        worker.thread.join(30)
        assert not worker.thread.is_alive()
        return
    worker.send(Tasks(2, [Task(0, False, [2], None)], 0))  # the new epoch runs
    (fetched,) = worker.answer().results
    assert torch.equal(unpack(fetched.packed, None), torch.tensor([[2] * 4]))
    worker.stop()


def test_a_slot_that_comes_after_its_task_ended_is_ignored():
    """A task that never asked (its batch has nothing for the slot): a stray SlotFor for it
    changes nothing."""
    worker = _worker(collate_fn=lambda rows: [int(r[0]) for r in rows] if len(rows) == 2
                     else torch.stack(rows))
    worker.send(Tasks(1, [Task(0, False, [3, 4], LATE)], 0))
    (fetched,) = worker.answer().results
    assert fetched.slot_id == -1 and unpack(fetched.packed, None) == [3, 4]
    worker.send(SlotFor(1, 0, Slot(2, 0, 4096)))
    worker.send(Tasks(1, [Task(1, False, [5], LATE)], 0))
    _asked(worker, 1, 1)
    worker.send(SlotFor(1, 1, None))
    (fetched,) = worker.answer().results
    worker.stop()
    assert torch.equal(unpack(fetched.packed, None), torch.tensor([[5] * 4]))


class _Chan:
    def __init__(self, *msgs: Any) -> None:
        self.sent: list[Any] = []
        self.msgs = deque(msgs)

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def recv(self, timeout: float) -> Any:
        if not self.msgs:
            raise TimeoutError
        return self.msgs.popleft()


def test_a_waiting_worker_whose_parent_died_stops():
    chan = _Chan()
    with pytest.raises(late_slots.Abandoned):  # parent 0: never this process's parent
        late_slots.wait_for_slot(chan, deque(), 0, 0.01, 1, 3)
    (asked,) = chan.sent
    assert type(asked) is NeedSlot and asked[:2] == (1, 3)


def test_a_slot_read_ahead_is_found_and_other_messages_wait():
    """The SlotFor may already sit in the worker's inbox (read while looking for a newer
    generation); messages for the loop stay there, in order."""
    later = Tasks(1, [Task(4, False, [0], None)], 0)
    inbox: deque[Any] = deque([later, SlotFor(1, 3, Slot(1, 0, 64))])
    chan = _Chan(SlotFor(1, 4, None))
    assert late_slots.wait_for_slot(chan, inbox, -1, 0.01, 1, 3) == Slot(1, 0, 64)
    assert list(inbox) == [later] and chan.msgs  # nothing more was read


# -- the main process's side ------------------------------------------------------------------
class _Ring:
    def __init__(self, free: int) -> None:
        self.free, self.acquired, self.released = free, 0, []

    def acquire(self) -> tuple[int, int, int] | None:
        if not self.free:
            return None
        self.free -= 1
        self.acquired += 1
        return (self.acquired, 4096 * self.acquired, 4096)

    def release(self, sid: int) -> None:
        self.released.append(sid)


def _main(free: int = 4) -> tuple[late_slots.LateSlots, _Ring, list[tuple[int, Any]]]:
    ring, sent = _Ring(free), []
    slots = late_slots.LateSlots(lambda w, m: sent.append((w, m)), ring.acquire, ring.release)
    return slots, ring, sent


def test_a_request_gets_a_slot_and_a_result_settles_it():
    """Rule (a): the slot the result names is leased as usual; one it does not name (the
    worker stopped waiting) goes back."""
    slots, ring, sent = _main()
    slots.answer(1, NeedSlot(3, 10, 0.0), True, 0.0)
    slots.answer(0, NeedSlot(3, 11, 0.0), True, 0.0)
    assert sent == [(1, SlotFor(3, 10, Slot(1, 4096, 4096))),
                    (0, SlotFor(3, 11, Slot(2, 8192, 4096)))]
    slots.settle(3, 10, 1)
    slots.settle(3, 11, -1)
    slots.settle(3, 12, -1)  # a task that never asked
    assert ring.released == [2] and not slots.sent


def test_a_request_of_an_older_generation_gets_no_slot():
    """Rule (b)."""
    slots, ring, sent = _main()
    slots.answer(0, NeedSlot(2, 5, 0.0), False, 0.0)
    assert sent == [(0, SlotFor(2, 5, None))] and ring.acquired == 0 and not slots.sent


def test_a_full_ring_answers_no_slot():
    """Rule (d)."""
    slots, _, sent = _main(free=0)
    slots.answer(0, NeedSlot(1, 0, 0.0), True, 0.0)
    assert sent == [(0, SlotFor(1, 0, None))] and not slots.sent


# -- the loader ---------------------------------------------------------------------------------
class Gated(Dataset[torch.Tensor]):
    """Expensive batches (a sleep at each batch's first sample), that wait for ``gate``."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 8 * 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i % 8 == 0:
            assert self.gate.wait(30)
            time.sleep(0.03)
        return torch.full((1024,), i, dtype=torch.int32)


@pytest.mark.skipif(os.name != "posix", reason="fork start method")
def test_queued_expensive_tasks_hold_no_slot(worker_type, monkeypatch):
    """The memory the change is for: tasks in flight, samples being fetched, no slot held.
    Bound at dispatch, the four tasks in flight would hold four slots from ``iter()`` on."""
    monkeypatch.setattr(late_slots, "LATE_DELAY_MAX", 1e9)  # a loaded machine's slow answers
    gate = multiprocessing.get_context("fork").Event()
    gate.set()
    loader = gpufeed.DataLoader(Gated(gate), batch_size=8, num_workers=2,
                                worker_type=worker_type, persistent_workers=True,
                                multiprocessing_context="fork" if worker_type == "process"
                                else None)
    expected = torch.arange(128, dtype=torch.int32).repeat_interleave(1024).view(16, 8, 1024)
    for epoch in range(3):
        if epoch:
            gate.clear()
        it = iter(loader)
        if epoch:  # the ring knows its slot size from epoch 0
            assert it._ring.slot_bytes and len(it._tasks) == 4
            time.sleep(0.2)
            assert it._ring.in_use == 0
            gate.set()
        for k, batch in enumerate(it):
            assert torch.equal(batch, expected[k])
            del batch
        assert it._ring.in_use == 0 and not it._late.sent


def test_late_slots_keep_every_batch_across_restarted_epochs(worker_type, monkeypatch):
    """Epochs abandoned mid-way while tasks wait for slots: every later epoch is whole, and
    every slot comes back."""
    monkeypatch.setattr(late_slots, "LATE_DELAY_MAX", 1e9)
    gate = threading.Event()
    gate.set()
    loader = gpufeed.DataLoader(Gated(gate), batch_size=8, num_workers=2, shuffle=True,
                                worker_type=worker_type, persistent_workers=True)
    for stop_after in (1, 3, 0, None):
        it = iter(loader)
        seen = []
        for k, batch in enumerate(it):
            seen += batch[:, 0].tolist()
            del batch
            if stop_after is not None and k == stop_after:
                break
        if stop_after is None:
            assert sorted(seen) == list(range(128))
    # a worker answers in order: the abandoned epochs' answers all came before the last one's
    assert it._ring.in_use == 0 and not it._late.sent


def test_cheap_batches_keep_slots_bound_at_dispatch():
    """Below LATE_BIND_S a message may carry many batches: slots go with the tasks."""
    assert workahead.LATE_BIND_S >= 0.01  # a worker's wait for its slot, against the work
    loader = gpufeed.DataLoader(Rows(), batch_size=2, num_workers=2, worker_type="thread")
    it = iter(loader)
    for _ in it:
        pass
    assert not it._late.on and it._work_ahead.chunk > 1


def test_late_answers_turn_the_mode_off():
    """Rule (e): requests that wait a good part of a batch's time for the loop's steps (the
    times are made up: only the requests' and the steps' count)."""
    slots, _, _ = _main(free=100)
    for k in range(late_slots.LATE_DELAYS):  # short steps, one long one among them
        t = 100.0 + k
        slots.away(t - (0.02 if k == 3 else 0.0001), t)
        slots.answer(0, NeedSlot(1, k, t - 0.03), True, 0.05)
    assert not slots.verdict.slow
    t = 200.0  # one more: two in the last eight
    slots.away(t - 0.01, t)
    slots.answer(0, NeedSlot(1, 10, t - 0.01), True, 0.05)
    assert slots.verdict.slow


def test_only_the_loops_steps_make_an_answer_late():
    """Rule (e) counts the part of a request's wait spent in the loop's steps, not a slow
    wake-up of a main thread that was in the loader when the request came."""
    slots, _, _ = _main(free=100)
    for k in range(late_slots.LATE_DELAYS):  # answered 20 ms on, the step ended before
        t = 100.0 + k
        slots.away(t - 0.5, t - 0.03)
        slots.answer(0, NeedSlot(1, k, t - 0.02), True, 0.05)
    assert not slots.verdict.slow
    for k in range(late_slots.LATE_SLOW):  # a step of 10 ms after the request
        t = 200.0 + k
        slots.away(t - 0.01, t)
        slots.answer(0, NeedSlot(1, 20 + k, t - 0.02), True, 0.05)
    assert slots.verdict.slow


def test_a_late_wake_up_keeps_slots_bound_when_written(worker_type):
    """A busy machine wakes the waiting main thread late (here: 10 ms after every message,
    a third of a batch's worker time): that is no loop slower than its workers, so tasks
    keep going out LATE."""
    gate = threading.Event()
    gate.set()
    loader = gpufeed.DataLoader(Gated(gate), batch_size=8, num_workers=2,
                                worker_type=worker_type)
    it = iter(loader)
    poll = it._pool.poll

    def late_poll(timeout: float | None) -> Any:
        msgs, dead = poll(timeout)
        if msgs:
            time.sleep(0.01)
        return msgs, dead

    it._pool.poll = late_poll  # type: ignore[method-assign]
    assert [int(b[0, 0]) for b in it] == [8 * k for k in range(16)]
    assert not it._late.verdict.slow and it._late.on


def test_a_loop_slower_than_its_workers_gets_slots_at_dispatch(worker_type):
    """The loop's steps delay every answer: the iterator goes back to binding at dispatch,
    so its workers finish their batches while the loop runs."""
    gate = threading.Event()
    gate.set()
    loader = gpufeed.DataLoader(Gated(gate), batch_size=8, num_workers=2,
                                worker_type=worker_type)
    it = iter(loader)
    for k, batch in enumerate(it):
        assert int(batch[0, 0]) == 8 * k
        del batch
        time.sleep(0.1)  # a training step, longer than a batch's 30 ms of worker time
    assert it._late.verdict.slow and not it._late.on
    again = iter(loader)  # the verdict is the loader's: the next epoch binds at dispatch
    assert not again._late.on and again._late.verdict is it._late.verdict
    assert len(list(again)) == 16 and not again._late.on


def _itself(batch: Any) -> Any:
    """The collate_fn of a dataset whose ``__getitems__`` returns the batch."""
    return batch


class StuckAfterAsking(Dataset[torch.Tensor]):
    """Every batch takes 40 ms before it asks for its slot (``batch_empty``); from batch 1 on,
    0.6 s, and then it never finishes."""

    def __len__(self) -> int:
        return 8 * 4

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        stuck = indices[0] >= 8
        time.sleep(0.6 if stuck else 0.04)
        # NeedSlot: LATE tasks
        out = gpufeed.sources.batch_empty(len(indices), 4, dtype=torch.int64)
        if stuck:
            time.sleep(60)
        out[:] = torch.as_tensor(indices).unsqueeze(1)
        return out

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.__getitems__([i])[0]


def test_a_request_does_not_restart_the_timeout(monkeypatch):
    """Rule (f): batch 1 asks for its slot 0.6 s in and then hangs; ``timeout=1`` raises 1 s
    after ``next()`` began waiting, as stock's would, not 1 s after the request (1.6 s)."""
    monkeypatch.setattr(late_slots, "LATE_DELAY_MAX", 1e9)
    loader = gpufeed.DataLoader(StuckAfterAsking(), batch_size=8, num_workers=1, timeout=1,
                                collate_fn=_itself)
    it = iter(loader)
    assert torch.equal(next(it)[:, 0], torch.arange(8))
    assert it._late.on  # the tasks went out LATE: batch 1 sends a NeedSlot
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="DataLoader timed out after 1 seconds"):
        next(it)
    waited = time.monotonic() - start
    assert 0.9 <= waited < 1.45, f"timeout=1 raised after {waited:.2f} s"
