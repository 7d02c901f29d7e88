"""The messages between the main process and its workers: they pickle, and the worker loop
answers typed tasks with typed results (NOTE [ Messages ] in ``_host/messages.py``)."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, SequentialSampler

import gpufeed
from gpufeed._base.errors import RemoteError, capture
from gpufeed._host.collate import unpack
from gpufeed._host.messages import (
    Done,
    Dropped,
    Exhausted,
    Failed,
    Fetched,
    Reseed,
    ResetStream,
    Slot,
    StartFailed,
    Task,
    Tasks,
    UsePlan,
    WorkerSpec,
    WorkerState,
)
from gpufeed._order.plan import make_plan
from support.worker_thread import WorkerThread


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 13:
            raise ValueError("thirteen")
        return torch.tensor([i * i])


class Count(IterableDataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return (torch.tensor([i]) for i in range(self.n))


def _error() -> RemoteError:
    try:
        raise KeyError("boom")
    except KeyError:
        return capture("in a test")


def _spec(dataset: Any, **kw: Any) -> WorkerSpec:
    args: dict[str, Any] = dict(
        num_workers=1, dataset=dataset, is_iterable=isinstance(dataset, IterableDataset),
        auto_collation=True, collate_fn=None, drop_last=False, region=None, base_seed=7,
        init_fn=None, sample_seed=None, rank=0, world_size=1,
    )
    args.update(kw)
    return WorkerSpec(**args)


def _messages() -> list[Any]:
    slot = Slot(3, 4096, 512)
    plan = make_plan(BatchSampler(SequentialSampler(range(10)), 4, False), shared=False)
    return [
        slot,
        Task(0, False, [1, 2, 3], slot),
        Tasks(2, [Task(0, False, [1, 2], None), Task(1, True, None, slot)], 5),
        UsePlan(1, plan),
        ResetStream(1, {"pos": 3}),
        ResetStream(1, None),
        Reseed(1, 1234),
        Reseed(1, None),
        Fetched(4, 3, 128, 256, {"x": 1}, 0.5, 0.25, {"pos": 9}, None, False, 12.5),
        Dropped(5, -1),
        Exhausted(6, 2),
        Failed(7, 1, _error()),
        Done(2, [Dropped(5, -1), Exhausted(6, 2)]),
        Done(3, [Fetched(4, 3, 128, 256, ({"x": 1}, []), 0.5, 0.25, None, None, False),
                 Failed(7, 1, _error())]),
        StartFailed(_error()),
        WorkerState(1, {"pos": 9}),
        _spec(Squares()),
    ]


@pytest.mark.parametrize("dumps", [pickle.dumps, ForkingPickler.dumps],
                         ids=["pickle", "ForkingPickler"])
def test_every_message_survives_a_pickle_round_trip(dumps):
    for msg in _messages():
        back = pickle.loads(dumps(msg))
        assert type(back) is type(msg)
        for name, value in vars(msg).items() if isinstance(msg, WorkerSpec) else \
                msg._asdict().items():
            got = getattr(back, name)
            if isinstance(value, RemoteError):
                assert (got.type_name, got.where, got.text) == \
                    (value.type_name, value.where, value.text)
            elif name == "results" and any(isinstance(r, Failed) for r in value):
                assert [type(r) for r in got] == [type(r) for r in value]
                assert got[0] == value[0] and got[1][:2] == value[1][:2]
            elif name == "plan":
                assert torch.equal(got.batch(1), value.batch(1))
            elif name == "dataset":
                assert type(got) is type(value)
            else:
                assert got == value, name


def test_messages_are_read_by_name():
    """Named fields, in the order the worker and the iterator build them."""
    assert Slot._fields == ("id", "offset", "size")
    assert Task._fields == ("batch", "planned", "indices", "slot")
    assert Tasks._fields == ("gen", "tasks", "epoch")
    assert Fetched._fields == ("batch", "slot_id", "used", "need", "packed", "fetch_s",
                               "collate_s", "dataset_state", "spill", "unsupported", "started")
    for result in (Dropped, Exhausted, Failed):
        assert result._fields[:2] == ("batch", "slot_id")
    with pytest.raises(AttributeError):
        _spec(Squares()).rank = 1  # type: ignore[misc]


def _batch(result: Fetched) -> Any:
    """The batch a worker without a ring answered (no slot, nothing to view)."""
    return unpack(result.packed, None)


def test_a_thread_worker_answers_typed_tasks():
    plan = make_plan(BatchSampler(SequentialSampler(range(16)), 4, False), shared=False)
    worker = WorkerThread(_spec(Squares()))
    worker.send(UsePlan(1, plan))
    worker.send(Tasks(1, [Task(0, False, [1, 2], None), Task(1, True, None, None),
                          Task(2, False, [12, 13], None)], 0))
    done = worker.answer()
    worker.stop()
    assert isinstance(done, Done) and done.gen == 1
    ok, planned, failed = done.results
    assert isinstance(ok, Fetched) and (ok.batch, ok.slot_id, ok.dataset_state) == (0, -1, None)
    assert torch.equal(_batch(ok), torch.tensor([[1], [4]]))
    assert ok.fetch_s >= 0 and ok.collate_s >= 0 and ok.spill is None and not ok.unsupported
    assert isinstance(planned, Fetched)
    assert torch.equal(_batch(planned), torch.tensor([[16], [25], [36], [49]]))
    assert isinstance(failed, Failed) and (failed.batch, failed.slot_id) == (2, -1)
    assert failed.error.type_name == "ValueError" and "sample index 13" in failed.error.where


def test_tasks_of_an_abandoned_generation_are_dropped_with_their_slots():
    """A newer generation waiting on the channel: the older tasks go back unrun, slots too."""
    old = Tasks(1, [Task(0, False, [0], Slot(4, 0, 64)), Task(1, False, [1], None)], 0)
    worker = WorkerThread(_spec(Squares()), old, Reseed(2, None))
    assert worker.answer() == Done(1, [Dropped(0, 4), Dropped(1, -1)])
    worker.send(Tasks(2, [Task(0, False, [2], None)], 0))
    done = worker.answer()
    assert done.gen == 2 and isinstance(done.results[0], Fetched)
    worker.send(Tasks(1, [Task(1, False, [3], None)], 0))  # late: generation 2 was seen
    assert worker.answer() == Done(1, [Dropped(1, -1)])
    worker.stop()


def test_a_waiting_stop_drops_the_tasks_left():
    worker = WorkerThread(_spec(Squares()), Tasks(1, [Task(0, False, [0], Slot(2, 0, 64))], 0),
                          None)
    assert worker.answer() == Done(1, [Dropped(0, 2)])
    worker.thread.join(30)
    assert not worker.thread.is_alive()


def test_iterable_streams_reset_and_run_dry():
    worker = WorkerThread(_spec(Count(3)))
    worker.send(Tasks(1, [Task(0, False, 2, None), Task(1, False, 2, None),
                          Task(2, False, 2, None)], 0))
    a, b, c = worker.answer().results
    assert torch.equal(_batch(a), torch.tensor([[0], [1]]))
    assert torch.equal(_batch(b), torch.tensor([[2]]))
    assert c == Exhausted(2, -1)
    worker.send(ResetStream(2, None))
    worker.send(Tasks(2, [Task(0, False, 4, None)], 0))
    (again,) = worker.answer().results
    worker.stop()
    assert torch.equal(_batch(again), torch.tensor([[0], [1], [2]]))


class Noisy(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(1, generator=gpufeed.random.sample_generator())


def test_reseed_and_epoch_reach_the_fetcher():
    worker = WorkerThread(_spec(Noisy(), sample_seed=5))

    def batch(epoch: int) -> torch.Tensor:
        worker.send(Tasks(1, [Task(0, False, [0, 1], None)], epoch))
        return _batch(worker.answer().results[0])

    a, b = batch(0), batch(1)
    worker.send(Reseed(1, 6))
    c = batch(0)
    worker.send(Reseed(1, 5))
    d = batch(0)
    worker.stop()
    assert torch.equal(a, d)
    assert not torch.equal(a, b) and not torch.equal(a, c)


def _failing_init(worker_id: int) -> None:
    raise RuntimeError(f"init {worker_id}")


def test_a_failed_start_answers_start_failed():
    worker = WorkerThread(_spec(Squares(), init_fn=_failing_init))
    msg = worker.answer()
    worker.thread.join(30)
    assert isinstance(msg, StartFailed) and not worker.thread.is_alive()
    assert msg.error.type_name == "RuntimeError" and "during start-up" in msg.error.where


class Later(NamedTuple):
    """A result type the fast pickling of ``Done`` does not list."""

    batch: int
    slot_id: int


def test_done_carries_a_result_type_it_does_not_list():
    done = Done(4, [Later(1, 2), Dropped(3, -1)])
    back = pickle.loads(ForkingPickler.dumps(done))
    assert back == done and [type(r) for r in back.results] == [Later, Dropped]
