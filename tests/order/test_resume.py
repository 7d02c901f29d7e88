"""Resume (``_state``, ``_delivery``, ``_resume``): the state format and its checks, skipping,
delivery tracking; end to end below."""

from __future__ import annotations

import inspect
import io
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

import gpufeed
from gpufeed._order import resume as _resume
from gpufeed._order.delivery import Delivered, DeliveryTracker, ResumePoint, WorkerStates, numbered
from gpufeed._order.resume import LoaderPosition, prepare_resume, sampler_state_of
from gpufeed._order.sampler import SeededRandomSampler, ShardedSampler
from gpufeed._order.state import capture_state, check_state, make_state, unresumable
from support.resume_checker import Case, RandomTransformDataset, ShardedStream, check_many, leaves

CURRENT = dict(dataset_len=10, world_size=2, rank=1, batch_size=4, num_workers=2)


def _state(**changes):
    fields = dict(
        epoch=1, batches_delivered=3, batch_size=4, seed=5, dataset_len=10, world_size=2,
        rank=1, num_workers=2,
    )
    fields.update(changes)
    return make_state(**fields)


def test_state_round_trips_through_torch_save_weights_only():
    state = _state(delivered_ahead=[7, 5], sampler_state={"pos": 3}, dataset_state=None)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded == state and loaded["delivered_ahead"] == [5, 7]
    assert check_state(loaded, **CURRENT) == state


@pytest.mark.parametrize(("key", "value", "message"), [
    ("dataset_len", 11, "saved with dataset_len=10 but this loader has dataset_len=11"),
    ("world_size", 4, "saved with world_size=2 but this loader has world_size=4"),
    ("batch_size", 8, "saved with batch_size=4 but this loader has batch_size=8"),
])
def test_check_state_names_both_values(key, value, message):
    with pytest.raises(ValueError, match=message):
        check_state(_state(), **{**CURRENT, key: value})


@pytest.mark.parametrize(("changes", "reason"), [
    (dict(dataset_state={"num_workers": 2, "workers": [None, None]}),
     "iterable dataset's per-worker stream positions"),
    (dict(delivered_ahead=[5]), r"out of order \(in_order=False\)"),
    (dict(sampler_state={"epoch_seed": 3}), "shuffle seed this rank drew"),
    (dict(sampler_state={"generator_state": [1, 2]}), "sampler's own state"),
])
def test_another_ranks_state_loads_only_when_it_does_not_depend_on_the_rank(changes, reason):
    """Frameworks save rank 0's loader state only and every rank loads it."""
    assert check_state(_state(), **{**CURRENT, "rank": 0})["rank"] == 1  # map-style, seeded
    assert check_state(_state(sampler_state={"unrewindable": "x"}), **{**CURRENT, "rank": 0})
    with pytest.raises(ValueError, match=f"this loader is rank 0 but the state was saved by "
                                         f"rank 1, and it .*{reason}"):
        check_state(_state(**changes), **{**CURRENT, "rank": 0})


def test_check_state_num_workers_binds_only_iterable_datasets():
    check_state(_state(), **{**CURRENT, "num_workers": 0})
    iterable = _state(dataset_state={"num_workers": 2, "workers": [None, None]})
    with pytest.raises(ValueError, match="num_workers=2 but this loader has num_workers=3"):
        check_state(iterable, **{**CURRENT, "num_workers": 3})


def test_check_state_checks_the_dataset_state():
    good = {"num_workers": 2, "workers": [None, {"at": 1}], "next_worker": 1}
    check_state(_state(dataset_state=good), **CURRENT)
    old = {"num_workers": 2, "workers": [None, None]}  # saved before next_worker existed
    check_state(_state(dataset_state=old), **CURRENT)
    with pytest.raises(ValueError, match="next_worker must be an int in \\[0, 1\\], got 2"):
        check_state(_state(dataset_state={**good, "next_worker": 2}), **CURRENT)
    with pytest.raises(ValueError, match="dataset_state must be"):
        check_state(_state(dataset_state={**good, "workers": [None]}), **CURRENT)


def test_resume_module_reexports_its_parts():
    for name in _resume.__all__:
        assert hasattr(_resume, name), name
    assert _resume.DeliveryTracker is DeliveryTracker and _resume.check_state is check_state


def test_check_state_rejects_malformed():
    with pytest.raises(TypeError, match="state must be a dict"):
        check_state([1], **CURRENT)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported loader state version 99"):
        check_state({**_state(), "version": 99}, **CURRENT)
    broken = dict(_state())
    del broken["seed"]
    with pytest.raises(ValueError, match=r"missing keys \['seed'\]"):
        check_state(broken, **CURRENT)
    with pytest.raises(ValueError, match="batches_delivered must be an int >= 0, got -1"):
        check_state({**_state(), "batches_delivered": -1}, **CURRENT)


def test_numbered_skips_and_numbers():
    plan = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(numbered(plan, ResumePoint(0, 1))) == [(1, [2, 3]), (2, [4, 5]), (3, [6, 7])]
    assert list(numbered(plan, ResumePoint(0, 1, (2,)))) == [(1, [2, 3]), (3, [6, 7])]
    seeked = ResumePoint(0, 2, (), seeked=True)
    assert list(numbered(plan[2:], seeked)) == [(2, [4, 5]), (3, [6, 7])]
    assert list(numbered(plan, ResumePoint(0, 4))) == []
    with pytest.raises(ValueError, match="cannot skip 5 batches: the batch plan ended after 4"):
        list(numbered(plan, ResumePoint(0, 5)))


def test_numbered_draws_indices_lazily():
    drawn = []

    def plan():
        for k in range(100):
            drawn.append(k)
            yield k

    it = numbered(plan(), ResumePoint(0, 3))
    assert drawn == []
    assert next(it) == (3, 3) and drawn == [0, 1, 2, 3]


def test_prepare_resume_seeks_gpufeeds_sampler():
    sampler = SeededRandomSampler(range(10), seed=5)
    batches = BatchSampler(sampler, 4, drop_last=False)
    point = prepare_resume(_state(batches_delivered=1), index_sampler=batches, num_batches=3)
    assert point == ResumePoint(1, 1, (), True)
    reference = SeededRandomSampler(range(10), seed=5)
    reference.set_epoch(1)
    full = list(BatchSampler(reference, 4, drop_last=False))
    assert list(numbered(batches, point)) == [(1, full[1]), (2, full[2])]


def test_prepare_resume_without_batching_and_with_ahead():
    sampler = ShardedSampler(range(10), rank=0, world_size=2, seed=1)
    point = prepare_resume(_state(batches_delivered=2, delivered_ahead=[3]),
                           index_sampler=sampler, num_batches=5)
    reference = ShardedSampler(range(10), rank=0, world_size=2, seed=1)
    reference.set_epoch(1)
    order = list(reference)
    assert list(numbered(sampler, point)) == [(2, order[2]), (4, order[4])]


class _CountingSampler(SequentialSampler):
    def __init__(self, data):
        super().__init__(data)
        self.epochs: list[int] = []
        self.loaded = None

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def state_dict(self):
        return {"n": 1}

    def load_state_dict(self, state):
        self.loaded = state


def test_prepare_resume_user_sampler_skips_in_the_plan():
    sampler = _CountingSampler(range(10))
    batches = BatchSampler(sampler, 4, drop_last=False)
    state = _state(batches_delivered=2, sampler_state=sampler_state_of(sampler))
    point = prepare_resume(state, index_sampler=batches, num_batches=3)
    assert point == ResumePoint(1, 2, (), False, sampler_state={"n": 1})
    # the sampler's state is put back when the epoch starts (LoaderPosition.begin_epoch)
    assert sampler.epochs == [1] and sampler.loaded is None
    assert list(numbered(batches, point)) == [(2, [8, 9])]
    assert sampler_state_of(SeededRandomSampler(range(3), seed=0)) is None
    assert sampler_state_of(SequentialSampler(range(3))) is None
    assert sampler_state_of(RandomSampler(range(3))) is None  # its seed is recorded when drawn


def test_stock_random_sampler_with_a_generator_resumes():
    def make():
        g = torch.Generator()
        g.manual_seed(3)
        return BatchSampler(RandomSampler(range(10), generator=g), 3, drop_last=False)

    reference = list(make())
    batches = make()
    state = _state(batches_delivered=2, sampler_state=sampler_state_of(batches.sampler))
    list(batches)  # the generator moves on
    point = prepare_resume(state, index_sampler=batches, num_batches=4)
    assert point == ResumePoint(1, 2, (), False, sampler_state=state["sampler_state"])
    progress = LoaderPosition()
    progress.pending = point  # as load_state_dict leaves it; the epoch's start restores
    tracker = progress.begin_epoch(batches, iterable=False, direct=True)
    assert list(tracker.indices) == reference[2:]


def test_prepare_resume_rolls_over_and_rejects_overrun():
    sampler = SeededRandomSampler(range(10), seed=5)
    batches = BatchSampler(sampler, 4, drop_last=False)
    point = prepare_resume(_state(batches_delivered=3), index_sampler=batches, num_batches=3)
    assert point == ResumePoint(2, 0, (), True, rolled=True)
    with pytest.raises(ValueError, match="3 batches of epoch 1 were delivered but this loader's "
                                         "epoch has only 2"):
        prepare_resume(_state(batches_delivered=3), index_sampler=batches, num_batches=2)
    iterable = prepare_resume(_state(), index_sampler=None, num_batches=None, iterable=True)
    assert iterable == ResumePoint(1, 3, (), True)


def test_tracker_in_order_and_out_of_order():
    tracker = DeliveryTracker(ResumePoint(4))
    for n in (0, 1):
        tracker.produced(n)
    assert tracker.position() == (4, 2, [])
    for n in (3, 5, 2):
        tracker.produced(n)
    assert tracker.position() == (4, 4, [5])
    tracker.host_exhausted()
    assert tracker.position() == (5, 0, [])


def test_tracker_resumed_and_worker_states():
    tracker = DeliveryTracker(ResumePoint(2, 3, (4, 9)))
    assert tracker.position() == (2, 3, [4, 9])
    tracker.produced(3, (1, {"offset": 8}))
    tracker.produced(5, (0, {"offset": 2}))
    assert tracker.position() == (2, 6, [9])
    assert tracker.dataset_states(2) == WorkerStates([{"offset": 2}, {"offset": 8}], 1)
    assert tracker.dataset_states(1) == WorkerStates([{"offset": 2}], 0)
    tracker.host_exhausted()
    assert tracker.dataset_states(2) == WorkerStates([None, None], 0)


def test_tracker_of_an_iterable_dataset_counts_and_knows_whose_turn():
    resumed = WorkerStates([{"at": 4}, None, {"at": 1}], 2)
    tracker = DeliveryTracker(ResumePoint(0, 5, seeked=True), iterable=True, resumed=resumed)
    assert tracker.dataset_states(3) == resumed  # nothing delivered yet: the loaded position
    tracker.produced(7, (2, {"at": 2}))  # numbers 5 and 6 were "stop" answers
    assert tracker.position() == (0, 6, [])
    assert tracker.dataset_states(3) == WorkerStates([{"at": 4}, None, {"at": 2}], 0)
    tracker.produced(8, (0, {"at": 5}))
    assert tracker.dataset_states(3) == WorkerStates([{"at": 5}, None, {"at": 2}], 1)
    assert tracker.position() == (0, 7, [])


def test_delivered_counts_what_the_user_receives():
    tracker = DeliveryTracker(ResumePoint(0), direct=False)

    class Stage:
        """A device stage stand-in: runs two batches ahead of the user."""

        def __init__(self):
            self.host = iter(range(5))
            self.closed = False
            self.depth = 2

        def __iter__(self):
            return self

        def __next__(self):
            n = next(self.host)
            tracker.produced(n)
            return n

        def __len__(self):
            return 5

        def close(self):
            self.closed = True

    stage = Stage()
    wrapped = Delivered(stage, tracker)
    for _ in range(2):
        tracker.produced(next(stage.host))  # prefetched, not delivered
    assert tracker.position() == (0, 0, [])
    assert next(wrapped) == 2 and tracker.position() == (0, 1, [])
    tracker.host_exhausted()
    assert not tracker.finished
    assert len(wrapped) == 5 and wrapped.depth == 2
    assert list(wrapped) == [3, 4] and tracker.position() == (1, 0, [])
    wrapped.close()
    assert stage.closed


class _Plain(IterableDataset):
    def __iter__(self):
        return iter(range(3))


class _Stateful(_Plain):
    def state_dict(self):
        return {"at": 0}

    def load_state_dict(self, state):
        pass


def test_iterable_dataset_state_helpers():
    assert capture_state([1, 2]) is None
    assert capture_state(_Plain()) is None
    assert capture_state(_Stateful()) == {"at": 0}
    assert unresumable([1, 2]) is None and unresumable(_Stateful()) is None
    assert re.match(r"_Plain is an IterableDataset without its own state_dict\(\) and "
                    r"load_state_dict\(state\)", unresumable(_Plain()))


def _fake_loader(dataset, sampler, batch_size=4, num_workers=0):
    batches = BatchSampler(sampler, batch_size, drop_last=False)
    return SimpleNamespace(
        dataset=dataset, sampler=sampler, batch_sampler=batches, _index_sampler=batches,
        batch_size=batch_size, num_workers=num_workers, seed=getattr(sampler, "seed", 0),
        deterministic=True, rank=0, world_size=1, _next_base_seed_generator=lambda: None,
    )


def test_progress_counts_epochs_and_resumes():
    loader = _fake_loader(list(range(10)), SeededRandomSampler(range(10), seed=8))
    progress = LoaderPosition()
    assert progress.state_dict(loader)["epoch"] == 0
    tracker = progress.begin_epoch(loader._index_sampler, iterable=False, direct=True)
    epoch0 = list(tracker.indices)
    for k in range(2):
        tracker.produced_nth(k)
    state = progress.state_dict(loader)
    assert (state["epoch"], state["batches_delivered"], state["seed"]) == (0, 2, 8)

    other = _fake_loader(list(range(10)), SeededRandomSampler(range(10), seed=99))
    resumed = LoaderPosition()
    other.seed = resumed.load_state_dict(other, state)  # the loader takes the seed
    assert other.seed == 8 and resumed.state_dict(other)["batches_delivered"] == 2
    tracker = resumed.begin_epoch(other._index_sampler, iterable=False, direct=True)
    assert tracker.epoch == 0 and list(tracker.indices) == epoch0[2:]
    tracker.produced_nth(0)
    assert resumed.state_dict(other)["batches_delivered"] == 3
    tracker.host_exhausted()
    assert resumed.state_dict(other)["epoch"] == 1
    assert resumed.begin_epoch(other._index_sampler, iterable=False, direct=True).epoch == 1


def test_progress_sampler_set_epoch_after_load_wins():
    loader = _fake_loader(list(range(10)), SeededRandomSampler(range(10), seed=8))
    progress = LoaderPosition()
    progress.load_state_dict(loader, _state(epoch=1, batches_delivered=1, seed=8, world_size=1,
                                            rank=0, num_workers=0))
    loader.sampler.set_epoch(1)  # the DistributedSampler idiom, same epoch: resume kept
    tracker = progress.begin_epoch(loader._index_sampler, iterable=False, direct=True)
    assert (tracker.epoch, len(list(tracker.indices))) == (1, 2)
    progress.load_state_dict(loader, _state(epoch=1, batches_delivered=1, seed=8, world_size=1,
                                            rank=0, num_workers=0))
    loader.sampler.set_epoch(4)  # another epoch: it starts from its beginning
    tracker = progress.begin_epoch(loader._index_sampler, iterable=False, direct=True)
    assert (tracker.epoch, len(list(tracker.indices))) == (4, 3)


def test_progress_set_epoch_and_user_sampler():
    loader = _fake_loader(list(range(10)), _CountingSampler(range(10)))
    progress = LoaderPosition()
    progress.set_epoch(loader, 5)
    assert progress.begin_epoch(loader._index_sampler, iterable=False, direct=True).epoch == 5
    assert progress.state_dict(loader)["sampler_state"] == {"n": 1}
    assert progress.begin_epoch(loader._index_sampler, iterable=False, direct=True).epoch == 6
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -2"):
        progress.set_epoch(loader, -2)


def test_progress_iterable_dataset_states():
    dataset = _Stateful()
    loader = SimpleNamespace(
        dataset=dataset, sampler=None, batch_sampler=None, _index_sampler=iter([[None]] * 5),
        batch_size=None, num_workers=2, seed=1, deterministic=True, rank=0, world_size=1,
    )
    progress = LoaderPosition()
    tracker = progress.begin_epoch(loader._index_sampler, iterable=True, direct=True)
    next(tracker.indices)
    tracker.produced_nth(0, (1, {"at": 3}))
    state = progress.state_dict(loader)
    assert state["dataset_state"] == {
        "num_workers": 2, "workers": [None, {"at": 3}], "next_worker": 0,
    }
    resumed = LoaderPosition()
    resumed.load_state_dict(loader, state)
    assert resumed.state_dict(loader)["dataset_state"] == state["dataset_state"]
    tracker = resumed.begin_epoch(loader._index_sampler, iterable=True, direct=True)
    assert resumed.take_dataset_states() == WorkerStates([None, {"at": 3}], 0)
    assert resumed.take_dataset_states() is None
    # saved again before worker 1 delivers anything: its loaded position is kept
    next(tracker.indices)
    tracker.produced_nth(0, (0, {"at": 1}))
    assert resumed.state_dict(loader)["dataset_state"] == {
        "num_workers": 2, "workers": [{"at": 1}, {"at": 3}], "next_worker": 1,
    }
    plain = SimpleNamespace(**{**vars(loader), "dataset": _Plain()})
    state = LoaderPosition().state_dict(plain)  # between epochs: nothing to warn of
    assert state["dataset_state"] is None and "_Plain" in state["sampler_state"]["unrewindable"]


# -- end to end, through gpufeed.DataLoader --------------------------------------------------

integrated = pytest.mark.skipif(
    "seed" not in inspect.signature(gpufeed.DataLoader.__init__).parameters
    or not hasattr(gpufeed.DataLoader, "load_state_dict"),
    reason="the loader has no seed=/state_dict yet (integration of issue 5 pending)",
)

# 22 samples in batches of 4: 6 batches an epoch (5 with drop_last).
CASES = [
    Case(),
    Case(num_workers=2, stop=8, resume_workers=0),
    Case(num_workers=2, worker_type="thread", shuffle=False, drop_last=True, stop=4,
         resume_workers=1, resume_worker_type="process"),
    Case(num_workers=1, stop=6, resume_workers=2, resume_worker_type="thread"),
    Case(num_workers=2, worker_type="thread", in_order=False, stop=5),
    Case(num_workers=2, in_order=False, stop=2, epochs=3, resume_workers=1),
    Case(stop=0, epochs=1),
    Case(num_workers=2, worker_type="thread", drop_last=True, epochs=3, stop=12),
    Case(num_workers=2, persistent=True, epochs=3, stop=9, resume_workers=2,
         resume_worker_type="thread"),
    Case(num_workers=2, device="cpu", stop=4),
    Case(batch_size=None, n=9, num_workers=2, worker_type="thread", stop=4),
    # iterable datasets (ShardedStream: uneven shards, so workers run dry at different times;
    # 22 samples in batches of 4 give 6 batches an epoch for 2 or 3 workers, 4 with drop_last
    # and 2 workers). The stop falls mid-turn with every worker busy (nw=2 stop=1, 7), mid-turn
    # right after a worker ran dry (nw=3 stop=2), after several ran dry, on an epoch boundary.
    Case(iterable=True, stop=4),
    Case(iterable=True, num_workers=2, stop=1),
    Case(iterable=True, num_workers=3, worker_type="thread", stop=2,
         resume_worker_type="process"),
    Case(iterable=True, num_workers=3, stop=4, resume_worker_type="thread"),
    Case(iterable=True, num_workers=2, stop=6),
    Case(iterable=True, num_workers=2, worker_type="thread", drop_last=True, epochs=3, stop=3),
    Case(iterable=True, num_workers=2, persistent=True, epochs=3, stop=7,
         resume_worker_type="thread"),
    Case(iterable=True, num_workers=2, in_order=False, stop=3),
    Case(iterable=True, num_workers=2, device="cpu", stop=1),
    Case(iterable=True, batch_size=None, n=9, num_workers=3, worker_type="thread", stop=4),
    # load_state_dict onto persistent workers already running (mid-epoch) with another seed
    Case(num_workers=2, persistent=True, warm=True, stop=8),
    Case(num_workers=2, worker_type="thread", persistent=True, warm=True, epochs=3, stop=3),
]


@pytest.fixture(scope="module")
def resume_results(tmp_path_factory):
    return check_many(CASES, tmp_path_factory.mktemp("resume"))


@integrated
@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_resume_in_a_fresh_process_matches_an_uninterrupted_run(case, resume_results):
    assert resume_results[case] is None, resume_results[case]


@integrated
def test_loader_state_is_plain_and_checked(tmp_path):
    loader = Case(n=10).loader()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_delivered"], state["seed"]) == (0, 1, 1234)
    torch.save(state, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    with pytest.raises(ValueError, match="dataset_len=10 but this loader has dataset_len=11"):
        Case(n=11).loader().load_state_dict(loaded)
    del it


@integrated
def test_world_size_change_is_reported():
    def make(world_size):
        return gpufeed.DataLoader(RandomTransformDataset(10), batch_size=2, seed=0, rank=0,
                                  world_size=world_size)

    state = make(2).state_dict()
    with pytest.raises(ValueError, match="world_size=2 but this loader has world_size=4"):
        make(4).load_state_dict(state)


class _Counter(IterableDataset):
    """An iterable dataset that can say where it stands (one worker, or num_workers=0)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0
        self.at = 0

    def __iter__(self):
        self.at = self.start
        self.start = 0
        while self.at < self.n:
            self.at += 1
            yield torch.tensor([self.at - 1])

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.start = state["at"]


@integrated
def test_iterable_dataset_resumes_through_its_state():
    loader = gpufeed.DataLoader(_Counter(10), batch_size=3, seed=0)
    it = iter(loader)
    head = [next(it), next(it)]
    state = loader.state_dict()
    fresh = gpufeed.DataLoader(_Counter(10), batch_size=3, seed=0)
    fresh.load_state_dict(state)
    rest = list(fresh)
    assert torch.cat(head + rest).flatten().tolist() == list(range(10))


@integrated
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_dataset_without_state_restarts_its_epoch_with_a_warning(num_workers):
    """Frameworks checkpoint every loader that has a state_dict (Lightning's default
    ModelCheckpoint does): one over a stream gpufeed cannot position must not stop training.
    The state says so, a mid-epoch one warns once, and loading it restarts that epoch, as the
    stock loader, which has no state, would."""
    loader = gpufeed.DataLoader(_Plain(), batch_size=2, seed=0, num_workers=num_workers,
                                worker_type="thread")
    whole = [b.tolist() for b in loader]
    assert loader.state_dict()["dataset_state"] is None  # between epochs: no warning
    it = iter(loader)
    next(it)
    with pytest.warns(UserWarning, match=r"at batch 1 of epoch 1 cannot be resumed exactly: "
                      r"_Plain is an IterableDataset without its own state_dict\(\)"):
        state = loader.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # once per loader
    fresh = gpufeed.DataLoader(_Plain(), batch_size=2, seed=0, num_workers=num_workers,
                               worker_type="thread")
    with pytest.warns(UserWarning, match=r"cannot resume epoch 1 at batch 1: _Plain"):
        fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == whole


class _ShardedCounter(IterableDataset):
    """Each worker counts through its own shard and can say how far it got."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.done = 0
        self.loaded = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        self.done, self.loaded = self.loaded, 0
        for i in list(range(wid, self.n, nw))[self.done:]:
            self.done += 1
            yield torch.tensor([i])

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.loaded = state["done"]


@integrated
def test_iterable_dataset_with_process_workers_resumes_per_worker(tmp_path):
    def make():
        return gpufeed.DataLoader(_ShardedCounter(23), batch_size=2, num_workers=2, seed=0)

    reference = [b.flatten().tolist() for b in make()]
    loader = make()
    it = iter(loader)
    head = [next(it).flatten().tolist() for _ in range(3)]
    torch.save(loader.state_dict(), tmp_path / "s.pt")
    del it
    fresh = make()
    fresh.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert head + [b.flatten().tolist() for b in fresh] == reference  # the order too
    with pytest.raises(ValueError, match="num_workers=2 but this loader has num_workers=1"):
        gpufeed.DataLoader(_ShardedCounter(23), batch_size=2, num_workers=1).load_state_dict(
            torch.load(tmp_path / "s.pt", weights_only=True)
        )


@integrated
def test_iterable_dataset_resumes_again_before_every_worker_delivered(worker_type):
    """A chain of resumes, one batch each: a worker that has not delivered since the last
    resume keeps the position that resume loaded (NOTE [ Iterable resume ])."""

    def make():
        return gpufeed.DataLoader(ShardedStream(22), batch_size=3, num_workers=2,
                                  worker_type=worker_type)

    reference = [leaves(b) for b in make()]
    got, state = [], None
    while len(got) < len(reference):
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        got.append(leaves(next(it)))
        state = loader.state_dict()
        del it
    assert got == reference
    assert state["dataset_state"]["next_worker"] in (0, 1)


@integrated
def test_load_state_dict_reseeds_persistent_workers(worker_type):
    def make(seed):
        return gpufeed.DataLoader(RandomTransformDataset(12), batch_size=4, shuffle=True,
                                  num_workers=2, worker_type=worker_type, seed=seed,
                                  persistent_workers=True)

    source = make(7)
    list(source)  # epoch 0
    state = source.state_dict()
    want = [leaves(b) for b in source]  # epoch 1 of seed 7
    loader = make(8)
    list(loader)  # its workers run with seed 8
    loader.load_state_dict(state)
    assert [leaves(b) for b in loader] == want


@integrated
@pytest.mark.parametrize("kind", [dict(), dict(num_workers=2, worker_type="thread"),
                                  dict(num_workers=2, in_order=False),
                                  dict(num_workers=1, persistent_workers=True),
                                  dict(batch_size=None)],
                         ids=["single", "threads", "processes-any-order", "persistent",
                              "unbatched"])
def test_stock_shuffle_without_seed_resumes_exactly(kind, tmp_path):
    """shuffle=True without seed= (torch's RandomSampler on the global generator): the order
    (compared by sample index) is stock's, and the seed the epoch drew is saved, so a resume
    in another global-RNG state delivers exactly the rest of the epoch (NOTE [ Rewinding
    samplers ])."""
    kind = {"batch_size": 3, **kind}
    dataset = RandomTransformDataset(14)
    torch.manual_seed(21)
    stock = [b[0].flatten().tolist() for b in torch.utils.data.DataLoader(
        dataset, shuffle=True, **{k: v for k, v in kind.items() if k != "worker_type"})]
    torch.manual_seed(21)
    loader = gpufeed.DataLoader(dataset, shuffle=True, **kind)
    it = iter(loader)
    head = [next(it)[0].flatten().tolist() for _ in range(2)]
    state = loader.state_dict()
    assert set(state["sampler_state"]) == {"epoch_seed"}
    torch.save(state, tmp_path / "s.pt")
    rest_of_run = [b[0].flatten().tolist() for b in it]
    del it
    torch.manual_seed(99)  # another run: its global generator is elsewhere
    fresh = gpufeed.DataLoader(dataset, shuffle=True, **kind)
    fresh.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    rest = [b[0].flatten().tolist() for b in fresh]
    if kind.get("in_order", True):
        assert head + rest_of_run == stock and rest == rest_of_run
    else:
        assert sorted(head + rest) == sorted(stock)


@integrated
def test_stock_shuffle_without_seed_keeps_a_loaded_epoch_seed_before_the_first_batch():
    """A state taken after a resume's iter() but before its first batch still holds the
    loaded epoch seed, so resuming from it gives the same rest of the epoch."""
    dataset = RandomTransformDataset(14)
    torch.manual_seed(21)
    loader = gpufeed.DataLoader(dataset, batch_size=3, shuffle=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    torch.manual_seed(99)
    resumed = gpufeed.DataLoader(dataset, batch_size=3, shuffle=True)
    resumed.load_state_dict(state)
    it = iter(resumed)
    again = resumed.state_dict()
    assert again["sampler_state"] == state["sampler_state"]
    rest = [b[0].flatten().tolist() for b in it]
    torch.manual_seed(7)
    fresh = gpufeed.DataLoader(dataset, batch_size=3, shuffle=True)
    fresh.load_state_dict(again)
    assert [b[0].flatten().tolist() for b in fresh] == rest


@integrated
@pytest.mark.filterwarnings("ignore::gpufeed.random.RandomStateWarning")  # no seed=: said too
def test_unrewindable_sampler_state_warns_once_and_restarts_the_epoch():
    order = [5, 3, 0, 4, 1, 2]
    sampler = iter(order)  # a one-shot iterable: nothing can replay it
    loader = gpufeed.DataLoader(RandomTransformDataset(6), batch_size=2, sampler=sampler)
    it = iter(loader)
    next(it)
    with pytest.warns(UserWarning, match="cannot be resumed exactly: its sampler list_iterator"):
        state = loader.state_dict()
    assert state["sampler_state"]["unrewindable"].startswith("its sampler list_iterator")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # once per loader
    fresh = gpufeed.DataLoader(RandomTransformDataset(6), batch_size=2, sampler=order)
    with pytest.warns(UserWarning, match=r"cannot resume epoch 0 at batch 1: .* The epoch "
                                         r"restarts from its first batch, so the batches "
                                         r"already delivered \(1\) come again"):
        fresh.load_state_dict(state)
    assert [b[0].flatten().tolist() for b in fresh] == [[5, 3], [0, 4], [1, 2]]
    del it


@integrated
def test_stock_shuffle_without_seed_resumes_in_a_later_epoch_of_persistent_workers():
    def make():
        return gpufeed.DataLoader(RandomTransformDataset(10), batch_size=3, shuffle=True,
                                  num_workers=1, persistent_workers=True)

    loader = make()
    list(loader)  # epoch 0
    it = iter(loader)  # epoch 1 on the same workers (the iterator's _reset)
    head = next(it)[0].flatten().tolist()
    state = loader.state_dict()
    rest_of_run = [b[0].flatten().tolist() for b in it]
    fresh = make()
    fresh.load_state_dict(state)
    rest = [b[0].flatten().tolist() for b in fresh]
    assert state["epoch"] == 1 and rest == rest_of_run
    assert sorted(head + [i for b in rest for i in b]) == list(range(10))
    del it


def test_a_state_that_cannot_be_resumed_changes_nothing():
    data = torch.arange(10)
    saved = gpufeed.DataLoader(data, batch_size=2, shuffle=True, seed=2).state_dict()
    forged = {**saved, "batches_delivered": 9}  # more batches than the epoch has
    loader = gpufeed.DataLoader(data, batch_size=2, shuffle=True, seed=1)
    with pytest.raises(ValueError, match="this loader's epoch has only 5"):
        loader.load_state_dict(forged)
    assert loader.seed == 1 and loader.sampler.seed == 1
    fresh = gpufeed.DataLoader(data, batch_size=2, shuffle=True, seed=1)
    assert [b.tolist() for b in loader] == [b.tolist() for b in fresh]


def _random_state_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if w.category is gpufeed.random.RandomStateWarning]


@integrated
def test_a_state_without_seed_says_once_that_random_transforms_are_not_replayed(caplog):
    """The order resumes exactly without seed=, the random transforms do not: one
    RandomStateWarning per loader, saying whether the state was taken or loaded; none with
    seed= or for iterable datasets (seed= does not cover them); where warnings are errors, a
    log record instead, so that checkpointing inside a framework keeps working."""

    def make(**kwargs):
        return gpufeed.DataLoader(RandomTransformDataset(12), batch_size=3, shuffle=True,
                                  num_workers=1, **kwargs)

    loader = make()
    it = iter(loader)
    next(it)
    taken = _random_state_warnings(loader.state_dict)
    assert len(taken) == 1 and taken[0].startswith("loader.state_dict() was taken without seed=")
    assert "replays the order of the batches exactly, but not the random transforms" in taken[0]
    assert "Pass seed= to gpufeed.DataLoader" in taken[0]
    assert _random_state_warnings(loader.state_dict) == []  # once per loader
    state = loader.state_dict()
    del it
    loaded = _random_state_warnings(lambda: make().load_state_dict(state))
    assert len(loaded) == 1, loaded
    assert loaded[0].startswith("loader.load_state_dict() got a state saved without seed=")

    seeded = make(seed=3)
    assert _random_state_warnings(lambda: make(seed=3).load_state_dict(seeded.state_dict())) == []
    stream = gpufeed.DataLoader(ShardedStream(8), batch_size=2)
    assert _random_state_warnings(stream.state_dict) == []

    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="gpufeed"):
        warnings.simplefilter("error")
        make().state_dict()  # does not raise
    assert "loader.state_dict() was taken without seed=" in caplog.text


def _generated(seed=0):
    return torch.Generator().manual_seed(seed)


ORDERS = {  # each loads its own state; none loads another's (some samples would come twice)
    "global shuffle": lambda: dict(shuffle=True),
    "seed": lambda: dict(shuffle=True, seed=1),
    "sequential": dict,
    "generator": lambda: dict(sampler=RandomSampler(range(10), generator=_generated())),
    "2 replicas": lambda: dict(sampler=torch.utils.data.distributed.DistributedSampler(
        range(10), num_replicas=2, rank=0, seed=0)),
    "3 replicas": lambda: dict(sampler=torch.utils.data.distributed.DistributedSampler(
        range(10), num_replicas=3, rank=0, seed=0)),
}


@pytest.mark.filterwarnings("ignore::gpufeed.random.RandomStateWarning")
@pytest.mark.parametrize("saved", ORDERS)
def test_a_state_loads_only_under_the_order_it_was_saved_with(saved):
    def make(name):
        return gpufeed.DataLoader(list(range(10)), batch_size=2, **ORDERS[name]())

    loader = make(saved)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    make(saved).load_state_dict(state)  # its own order: fine
    for other in ORDERS:
        if other != saved:
            with pytest.raises(ValueError, match=r"cannot resume: the state was saved by a "
                                                 r"loader ordered by .* but this one is ordered"):
                make(other).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "order"}  # a state from before "order"
    make(saved).load_state_dict(older)


@pytest.mark.parametrize("key, value", [("batches_delivered", True), ("epoch", False),
                                        ("seed", "x"), ("seed", 1.0),
                                        ("delivered_ahead", [True]), ("delivered_ahead", "3")])
def test_edited_state_fields_of_the_wrong_type_are_refused_by_name(key, value):
    loader = gpufeed.DataLoader(list(range(10)), batch_size=2, seed=3)
    state = {**loader.state_dict(), key: value}
    with pytest.raises(ValueError, match=f"loader state {key} must be"):
        gpufeed.DataLoader(list(range(10)), batch_size=2, seed=3).load_state_dict(state)


@pytest.mark.filterwarnings("ignore::gpufeed.random.RandomStateWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_taken_before_the_first_batch_of_a_stock_shuffle_resumes_its_order(
        num_workers):
    """Between ``iter()`` and the first batch the epoch has not drawn its seed yet (in the main
    process it draws at the first batch, as torch's sampler does): the state draws it then."""
    def make():
        return gpufeed.DataLoader(list(range(8)), batch_size=2, shuffle=True,
                                  num_workers=num_workers)

    torch.manual_seed(5)
    loader = make()
    it = iter(loader)
    state = loader.state_dict()
    uninterrupted = [b.tolist() for b in it]
    torch.manual_seed(999)  # the resuming process's own global generator
    fresh = make()
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == uninterrupted


class _Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 22

    def __getitem__(self, i):
        return i


@integrated
@pytest.mark.parametrize("workers", [(0, "process"), (2, "process"), (2, "thread")])
@pytest.mark.parametrize("sampler", ["seed", "DistributedSampler"])
def test_set_epoch_after_iter_of_a_resumed_loader(workers, sampler):
    """Lightning resumes with load_state_dict(), iter(), then the sampler's set_epoch(): after
    an epoch cut short (limit_train_batches), to the next epoch, which must then run whole, as
    from an iterator made after the call. set_epoch to the saved epoch keeps its rest."""
    num_workers, worker_type = workers

    def make():
        kw = dict(batch_size=4, num_workers=num_workers, worker_type=worker_type)
        if sampler == "seed":
            return gpufeed.DataLoader(_Ids(), shuffle=True, seed=5, **kw)
        return gpufeed.DataLoader(_Ids(), sampler=torch.utils.data.DistributedSampler(
            _Ids(), num_replicas=1, rank=0, seed=5), **kw)

    reference = make()
    epochs = []
    for epoch in range(2):
        reference.sampler.set_epoch(epoch)
        epochs.append([b.tolist() for b in reference])
    loader = make()
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    del it
    for chosen, want in ((1, epochs[1]), (0, epochs[0][4:])):
        resumed = make()
        resumed.load_state_dict(state)
        it = iter(resumed)
        resumed.sampler.set_epoch(chosen)
        assert [b.tolist() for b in it] == want, chosen


class _EveryOther(BatchSampler):
    """A ``BatchSampler`` subclass that keeps no ``sampler`` (as Accelerate's
    ``SkipBatchSampler``): torch never reads it, so gpufeed must not either."""

    def __init__(self, n: int) -> None:  # no super().__init__: no .sampler
        self.n = n

    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, self.n, 4)])

    def __len__(self) -> int:
        return len(range(0, self.n, 4))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_batch_sampler_without_a_sampler_gives_stock_batches_and_a_state(num_workers):
    data = list(range(10))
    stock = torch.utils.data.DataLoader(data, batch_sampler=_EveryOther(10))
    loader = gpufeed.DataLoader(data, batch_sampler=_EveryOther(10), num_workers=num_workers,
                                worker_type="thread", seed=3)
    it = iter(loader)
    first = next(it)
    with pytest.warns(UserWarning, match="its sampler _EveryOther has no state_dict"):
        state = loader.state_dict()  # an order nobody can replay: said, as for any sampler
    assert [b.tolist() for b in [first, *it]] == [b.tolist() for b in stock]
    assert state["batches_delivered"] == 1
