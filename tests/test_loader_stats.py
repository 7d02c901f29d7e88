"""``loader.stats()``: every figure the docs document is recorded by a real loader, with
the value it documents; the input-bound share leaves start-up out."""

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import gpufeed
from support.fakes import IndexDataset, SleepDataset
from support.sim_cuda import SimCuda
from support.trace_format import check_trace

README = Path(__file__).parents[1] / "docs" / "guides" / "stats.md"
#: columns and derived figures the stats guide explains next to the stages and counters
COLUMNS = {"busy s", "blocked s", "p50/p90/p99 ms", "occupancy", "input-bound"}


def documented() -> list[str]:
    """The stage and counter names under the stats guide's "Reading `loader.stats()`"."""
    text = README.read_text().split("## Reading `loader.stats()`", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^- `([^`]+)`: ", text, flags=re.M)
    assert len(names) > 15, names
    return [n for n in names if n not in COLUMNS]


class Ragged(torch.utils.data.Dataset):
    """Samples of 1-4 values, padded per batch by ``pad``: batch shapes vary."""

    def __len__(self):
        return 61

    def __getitem__(self, i):
        return torch.full((1 + i % 4,), float(i))


def pad(samples):
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True), len(samples)


class Sparse(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.eye(3).to_sparse() * i


def stack_sparse(samples):
    return {"sparse": torch.stack(samples), "plain": torch.arange(len(samples))}


def run_epochs(loader, epochs=1, keep=False, step_s=0.0):
    kept = []
    for _ in range(epochs):
        for batch in loader:
            time.sleep(step_s)
            if keep:
                kept.append(batch)
    return kept


def test_every_documented_stat_is_recorded(monkeypatch):
    """Each figure in the stats guide's list shows up, with a value that is not trivially zero, in
    the stats of a loader that does what the figure counts (an epoch on workers; batches
    kept past a small ring; a sparse leaf; a device stage on the simulated GPU)."""
    seen: dict[str, float] = {}

    def collect(stats):
        for name, s in stats.stages.items():
            seen[name] = max(seen.get(name, 0), s.batches, s.capacity)
        for name, v in stats.counters.items():
            seen[name] = max(seen.get(name, 0), v)
        if stats.autotune is not None:
            seen["autotune"] = max(seen.get("autotune", 0), stats.autotune.workers)

    # an epoch on two workers, with a training step
    plain = gpufeed.DataLoader(SleepDataset(61, slow_from=0, seconds=0.0005, once=False),
                               batch_size=8, num_workers=2, worker_type="thread")
    run_epochs(plain, step_s=0.002)
    stats = plain.stats()
    collect(stats)
    assert stats.counters["samples"] == 61 and stats.counters["batches"] == 8
    assert stats.stages["startup"].batches == 1 and stats.stages["wait"].batches == 7
    slots = stats.counters["ring_slots"]
    assert 0 < slots <= stats.stages["ring"].capacity and slots == stats.counters["ring_grow"]
    assert stats.counters["ring_bytes"] > 0 and stats.counters["ring_bytes"] % 4096 == 0
    # the autotuner: num_workers="auto"
    tuned = gpufeed.DataLoader(SleepDataset(61, slow_from=0, seconds=0.0005, once=False),
                               batch_size=8, num_workers="auto", worker_type="thread")
    run_epochs(tuned)
    auto = tuned.stats()
    collect(auto)
    # the same handout figures as a static count (they were once left out under "auto")
    assert auto.counters["samples"] == 61 and auto.stages["ring"].capacity > 0
    assert auto.stages["prefetch"].occupancy_max > 0 and auto.counters["ring_slots"] > 0
    # batches kept past a one-batch ring: fallbacks; varying shapes: more slots carved
    small = gpufeed.DataLoader(Ragged(), batch_size=8, num_workers=2, worker_type="thread",
                               collate_fn=pad, ring_bytes=4096)
    kept = run_epochs(small, keep=True)
    collect(small.stats())
    assert small.stats().counters["samples"] == 61 == sum(n for _, n in kept)
    # process workers at a lower priority (NOTE [ Worker priority ]): asked for here
    niced = gpufeed.DataLoader(IndexDataset(16), batch_size=4, num_workers=2, worker_nice=2)
    run_epochs(niced)
    collect(niced.stats())
    assert niced.stats().counters["worker_nice"] == 2
    # a leaf the ring cannot hold
    sparse = gpufeed.DataLoader(Sparse(), batch_size=2, num_workers=2, worker_type="thread",
                                collate_fn=stack_sparse)
    run_epochs(sparse)
    collect(sparse.stats())
    # the device stage, on the simulated GPU: a consumer far behind, copies from pageable
    # memory (ring_bytes=0: no page-locked ring)
    sim = SimCuda(0, max_steps=1, copy_cost=(1, 2))
    sim.install(monkeypatch)
    monkeypatch.setattr(sim, "needs_pinned", True)
    monkeypatch.setattr(sim, "is_pinned", lambda t: False)
    gpu = gpufeed.DataLoader(IndexDataset(64), batch_size=4, num_workers=2,
                             worker_type="thread", device="cuda", device_depth=1,
                             ring_bytes=0)
    with pytest.warns(gpufeed.errors.PageableCopyWarning):
        for i, batch in enumerate(gpu):
            sim.launch(sim.consumer, lambda x: None, batch["x"], cost=8)
            if i == 3:  # mid-epoch: the stage holds a batch ahead ("device_ahead")
                collect(gpu.stats())
    sim.drain()
    collect(gpu.stats())
    # a pinned ring under the user's own copies, the GPU behind: slots wait for their fences
    monkeypatch.setattr(sim, "is_pinned", lambda t: True)
    pinned = gpufeed.DataLoader(IndexDataset(64), batch_size=4, num_workers=2,
                                worker_type="thread", pin_memory=True)
    sim.launch(sim.consumer, lambda: None, cost=10_000)  # the GPU stalls meanwhile
    for batch in pinned:
        x = batch["x"].cuda(non_blocking=True)
        del batch, x
    sim.drain()
    collect(pinned.stats())

    missing = [n for n in documented() if not seen.get(n)]
    assert not missing, f"documented but never recorded (or always 0): {missing}; saw {seen}"


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize(("batch", "n"), [
    (torch.zeros(5, 3), 5),
    ({"x": [torch.tensor(1.0), torch.zeros(7, 2)], "y": torch.zeros(7)}, 7),
    ((["a", "b", "c"], torch.zeros(3)), 3),  # the default collate's strings come first
    ({"text": ["a", "b"]}, 2),
    (torch.tensor(3.0), None),
    ("nested", 2),  # built in the test: making one warns
    ((np.zeros((4, 2)), "x"), 4),
    ((1.5, "x"), None),
    ([torch.zeros(4, 2), torch.zeros(4)], 4),  # the flat (x, y) batch, measured first
    ((torch.tensor(2.0), torch.zeros(6)), 6),  # a 0-d first leaf: the next one counts
    ((), None),
])
def test_batch_len_counts_samples(batch, n):
    from gpufeed._base.tree import batch_len

    if isinstance(batch, str):  # "nested", no shape at all; size(0) is the count of its tensors
        batch = [torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), torch.zeros(5)]

    assert batch_len(batch) == n


def test_samples_count_one_per_item_without_batching():
    loader = gpufeed.DataLoader(IndexDataset(5), batch_size=None)
    assert len(list(loader)) == 5 and loader.stats().counters["samples"] == 5


def slow_start(worker_id):
    time.sleep(0.5)


def test_input_bound_leaves_start_up_out():
    """Workers that take 0.5 s to start, then keep ahead of a 10 ms step: the loop is not
    input-bound, as the profiler says of it too; the start-up is its own stage."""
    loader = gpufeed.DataLoader(IndexDataset(80), batch_size=4, num_workers=2, prefetch_factor=8,
                                worker_type="thread", worker_init_fn=slow_start)
    with gpufeed.tools.Profiler() as prof:
        for _ in prof.wrap(loader):
            time.sleep(0.01)
    report, stats = prof.report(), loader.stats()
    assert stats.input_bound < 0.5 and report.input_bound < 0.5, (stats, report)
    assert stats.stages["startup"].blocked_s > 0.4 and stats.stages["wait"].batches == 19


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_device_stage_counts_the_batches_the_loop_received(monkeypatch, device, num_workers):
    """With ``device=``, "batches", "samples" and the loop's waits count what the loop
    received, not what the device stage took ahead of it (``device_ahead`` says that); the
    trace's handovers and its "batches delivered" counter agree (the simulated GPU for
    "cuda")."""
    if device == "cuda":
        sim = SimCuda(0, max_steps=1, copy_cost=(1, 2))
        sim.install(monkeypatch)
    loader = gpufeed.DataLoader(IndexDataset(64), batch_size=4, num_workers=num_workers,
                                worker_type="thread", device=device, device_depth=4)
    with gpufeed.trace() as tr:
        it = iter(loader)
        next(it)
        first = loader.stats()
        for _ in range(5):
            next(it)
    taken = loader.stats()
    assert (first.counters["batches"], first.counters["samples"]) == (1, 4)
    assert first.counters["device_ahead"] == 4  # device_depth, held apart
    assert first.stages["startup"].batches == 1 and "wait" not in first.stages
    assert first.stages["transfer"].batches == 5  # the stage did copy five
    assert (taken.counters["batches"], taken.counters["samples"]) == (6, 24)
    assert taken.stages["wait"].batches == taken.stages["step"].batches == 5
    read = check_trace(tr.to_dict())
    pid = read.pid("gpufeed.DataLoader")
    assert read.batches(pid, "main", ("startup", "wait")) == list(range(6))
    delivered = [e["args"]["delivered"] for e in read.counters[(pid, "batches delivered")]]
    assert delivered == list(range(1, 7))
    rest = sum(1 for _ in it)
    end = loader.stats()
    assert rest == 10 and end.counters["batches"] == 16 and end.counters["samples"] == 64
    assert end.counters["device_ahead"] == 0 and end.stages["wait"].batches == 15
    if device == "cuda":
        sim.drain()
        assert not sim.violations


def test_a_device_stage_counts_items_without_batching():
    loader = gpufeed.DataLoader(IndexDataset(5), batch_size=None, device="cpu")
    assert len(list(loader)) == 5
    assert loader.stats().counters["samples"] == 5 == loader.stats().counters["batches"]
