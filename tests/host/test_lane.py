"""The gather lane (NOTE [ Gather lane ] in ``_host/lane.py``): a planned batch of gpufeed's own
gather in one step, which must give what the general way gives, and leave to it what it
cannot give so."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import gpufeed
from gpufeed._host import worker as worker_mod
from gpufeed._host.collate import unpack
from gpufeed._host.fetch import make_fetcher
from gpufeed._host.lane import GatherLane
from gpufeed._host.messages import Slot, Task
from gpufeed._host.writer import SlotWriter
from gpufeed._order.plan import make_plan

SLOT = 64 << 10
N = 203  # 12 full batches of 16 and a last one of 11


def _datasets(tmp_path):
    rng = np.random.default_rng(0)
    records = np.zeros(N, dtype=[("x", "<f4", (4,)), ("y", "<i8")])  # 24-byte records
    records["x"] = rng.standard_normal((N, 4))
    records["y"] = rng.integers(0, 9, N)
    mm = np.lib.format.open_memmap(tmp_path / "m.npy", mode="w+", dtype=np.uint8,
                                   shape=(N, 3, 4))
    mm[:] = rng.integers(0, 255, (N, 3, 4), dtype=np.uint8)
    mm.flush()
    readonly = np.load(tmp_path / "m.npy", mmap_mode="r")
    return {
        "floats-and-labels": gpufeed.sources.ArrayDataset(
            rng.standard_normal((N, 7)).astype(np.float32), np.arange(N)),
        "structured-fields": gpufeed.sources.ArrayDataset(records["x"], records["y"]),
        "read-only-memmap": gpufeed.sources.ArrayDataset(readonly),
        "dtypes": gpufeed.sources.ArrayDataset(
            rng.integers(0, 2, N).astype(bool), rng.standard_normal(N).astype(np.float16),
            (rng.standard_normal((N, 2)) + 1j).astype(np.complex64),
            rng.integers(0, 60000, (N, 2)).astype(np.uint16)),
        "tensors": tud.TensorDataset(torch.randn(N, 2, 3), torch.arange(N, dtype=torch.int32)),
    }


def _parts(dataset, shuffle: bool):
    fetcher = make_fetcher(dataset, is_iterable=False, auto_collation=True,
                           collate_fn=tud.default_collate, drop_last=False, sample_seed=None,
                           base_seed=0, worker_id=0)
    sampler = (tud.RandomSampler(range(N), generator=torch.Generator().manual_seed(3))
               if shuffle else tud.SequentialSampler(range(N)))
    fetcher.plan = make_plan(tud.BatchSampler(sampler, 16, False), shared=False)
    region = torch.zeros(8 * SLOT, dtype=torch.uint8)
    return fetcher, SlotWriter(region, shared_fallback=False), region


def _batch(result, region, slot):
    return [t.clone() for t in unpack(result.packed, region.numpy()[slot.offset:])]


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in-order"])
@pytest.mark.parametrize("kind", ["floats-and-labels", "structured-fields", "read-only-memmap",
                                  "dtypes", "tensors"])
def test_the_lane_gives_what_the_general_way_gives(tmp_path, kind, shuffle):
    dataset = _datasets(tmp_path)[kind]
    fetcher, writer, region = _parts(dataset, shuffle)
    lane = GatherLane.make(fetcher.arrays)
    assert fetcher.gathers and lane is not None
    for k in range(12):  # the full batches, into slots the lane sees once or twice
        slot = Slot(k % 5, (k % 5) * SLOT, SLOT)
        general = worker_mod._run_task(0, "w", fetcher, writer, Task(k, True, None, slot), 1, 0,
                                       [], None, None)
        expected = _batch(general, region, slot)
        ours = lane.run(fetcher, k, slot, writer)
        assert ours is not None and lane.on
        got = _batch(ours, region, slot)
        assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in expected]
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), k
        assert (ours.batch, ours.slot_id, ours.used, ours.need) == (
            general.batch, general.slot_id, general.used, general.need)
        assert type(ours.packed[0]) is type(general.packed[0])  # a list, as collated
        stock = tud.default_collate([dataset[int(i)] for i in fetcher.plan.batch(k)])
        assert all(torch.equal(a, b) for a, b in zip(got, stock, strict=True)), k


def test_the_lane_leaves_what_it_cannot_give_to_the_general_way(tmp_path):
    dataset = _datasets(tmp_path)["floats-and-labels"]
    fetcher, writer, _ = _parts(dataset, shuffle=True)
    lane = GatherLane.make(fetcher.arrays)
    assert lane is not None
    assert lane.run(fetcher, 12, Slot(0, 0, SLOT), writer) is None  # the last, partial batch
    assert lane.run(fetcher, 0, Slot(0, 0, 16 * 7 * 4), writer) is None  # labels do not fit
    assert lane.on
    # arrays it cannot index as they are
    assert GatherLane.make([torch.zeros(4, 2, requires_grad=True)]) is None
    assert GatherLane.make([np.zeros((4, 2), dtype=">f4")]) is None  # big-endian
    assert GatherLane.make([np.zeros((4, 6), dtype=np.float32)[:, ::2]]) is None
    assert GatherLane.make([np.zeros((0, 2), dtype=np.float32)]) is None
    odd = np.zeros(4, dtype=[("x", "<f4", (5,)), ("y", "<i8")])["y"]  # 28-byte strides
    assert GatherLane.make([odd]) is None
    u16 = torch.zeros(4, dtype=torch.uint16)
    try:
        torch.index_select(u16, 0, torch.tensor([1]))
    except RuntimeError:  # a dtype index_select lacks (1-D uint16, torch 2.13)
        assert GatherLane.make([u16.numpy()]) is None
    # an error other than IndexError turns the lane off for good
    lane.sources = [object(), *lane.sources[1:]]  # type: ignore[list-item]
    assert lane.run(fetcher, 1, Slot(1, SLOT, SLOT), writer) is None
    assert not lane.on


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_loader_takes_the_lane_and_gives_stocks_batches(monkeypatch, worker_type):
    """Through the loader: the lane carries most batches (slots are bound at dispatch once
    the first batches say they are cheap), and every epoch equals the stock loader's."""
    count = multiprocessing.get_context("fork").Value("i", 0)  # seen by forked workers
    run = GatherLane.run

    def counted(self, *args):
        result = run(self, *args)
        if result is not None:
            with count.get_lock():
                count.value += 1
        return result

    monkeypatch.setattr(GatherLane, "run", counted)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4000, 6)).astype(np.float32)
    y = rng.integers(0, 10, 4000)
    kw = dict(batch_size=32, shuffle=True)
    ours = gpufeed.DataLoader(gpufeed.sources.ArrayDataset(x, y), num_workers=2,
                              worker_type=worker_type, generator=torch.Generator().manual_seed(5),
                              multiprocessing_context="fork" if worker_type == "process" else None,
                              **kw)
    stock = tud.DataLoader(tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                           generator=torch.Generator().manual_seed(5), **kw)
    for _ in range(2):
        got, expected = list(ours), list(stock)
        assert len(got) == len(expected) == 125
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert count.value > 125, count.value  # most of the 250 batches


def test_workers_the_autotuner_adds_take_the_lane_too():
    """num_workers="auto": workers started mid-epoch build their own lane, and the epoch still
    equals the stock loader's."""
    counts = multiprocessing.get_context("fork").Array("i", 4)  # per worker, seen when forked
    run = GatherLane.run

    def counted(self, *args):
        result = run(self, *args)
        if result is not None:
            counts[tud.get_worker_info().id] += 1
        return result

    rng = np.random.default_rng(2)
    x = rng.standard_normal((4000, 6)).astype(np.float32)
    y = rng.integers(0, 10, 4000)
    kw = dict(batch_size=16, shuffle=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GatherLane, "run", counted)
        ours = gpufeed.DataLoader(gpufeed.sources.ArrayDataset(x, y), num_workers="auto",
                                  generator=torch.Generator().manual_seed(5),
                                  multiprocessing_context="fork", **kw)
        ours._autotune.schedule = lambda k: 1 if k < 40 else 3  # (the autotuner's test seam)
        got = list(ours)
    stock = list(tud.DataLoader(tud.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                                generator=torch.Generator().manual_seed(5), **kw))
    assert len(got) == len(stock) == 250
    for a, b in zip(got, stock, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert counts[1] > 0 and counts[2] > 0, list(counts)  # the workers started mid-epoch


def _random_gather_config(seed: int) -> tuple[tud.TensorDataset, dict, dict, int | None]:
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 5, 37, 100, 257]))
    dtypes = [torch.float32, torch.int64, torch.uint8, torch.float16, torch.bool, torch.int32]
    tensors = []
    for _ in range(int(rng.integers(1, 4))):
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        shape = (n, *[int(d) for d in rng.integers(1, 5, int(rng.integers(0, 3)))])
        tensors.append(torch.from_numpy(rng.integers(0, 2, shape) if dtype is torch.bool
                                        else rng.integers(0, 200, shape)).to(dtype))
    kw: dict = {"num_workers": int(rng.integers(1, 3)),
                "batch_size": int(rng.choice([1, 3, 16, 64])),
                "drop_last": bool(rng.random() < 0.3)}
    order = rng.random()
    if order < 0.4:
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(seed))
    elif order < 0.6:
        kw["sampler"] = tud.RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
    if rng.random() < 0.3:
        kw["persistent_workers"] = True
    if rng.random() < 0.3:
        kw["prefetch_factor"] = int(rng.choice([1, 4]))
    extra = {"worker_type": "thread"} if rng.random() < 0.4 else {}
    if rng.random() < 0.25:
        extra["device"] = "cpu"
    stop = int(rng.choice([1, 2])) if rng.random() < 0.3 else None
    return tud.TensorDataset(*tensors), kw, extra, stop


@pytest.mark.parametrize("seed", range(10))
def test_random_gathers_match_stock(seed):
    """TensorDataset batches (the lane's, and the general way's for what it leaves) against
    the stock loader's: every batch, dtype and shape, two epochs, a break in the first one at
    times, and where the user's generator is left."""
    def run(cls, gpufeed_only):
        torch.manual_seed(seed)
        dataset, kw, extra, stop = _random_gather_config(seed)  # fresh generators
        loader = cls(dataset, **kw, **(extra if gpufeed_only else {}))
        epochs = []
        for epoch in range(2):
            got = []
            for batch in loader:
                got.append([(t.dtype, tuple(t.shape), t.tolist()) for t in batch])
                if epoch == 0 and stop is not None and len(got) == stop:
                    break
            epochs.append(got)
        generator = kw.get("generator")
        return epochs, (generator.get_state() if generator is not None else None), (kw, extra)

    (ours, g1, label), (stock, g2, _) = run(gpufeed.DataLoader, True), run(tud.DataLoader, False)
    assert ours == stock, label
    assert (g1 is None) == (g2 is None) and (g1 is None or torch.equal(g1, g2))
