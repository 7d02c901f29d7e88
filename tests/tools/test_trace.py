"""gpufeed.trace: the timeline's structure, its clock, its bounds, and the torch.profiler ranges
(NOTE [ Timeline ] in _base/timeline.py)."""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import time

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import gpufeed
from gpufeed._base import timeline as _timeline
from support.trace_format import check_trace

N_BATCHES = 24
WAITS = ("startup", "wait")  # the loop waiting for a batch: the first of an iterator, the rest


class Sleepy(Dataset):
    """16 floats per sample; fetching a batch takes ~1 ms, so workers interleave."""

    def __len__(self) -> int:
        return 8 * N_BATCHES

    def __getitem__(self, i: int) -> torch.Tensor:
        if i % 8 == 0:
            time.sleep(0.001)
        return torch.full((16,), float(i))


def _run(loader, *, step_s: float = 0.0005, **trace_kw):
    with gpufeed.trace(**trace_kw) as tr:
        n = 0
        for _ in loader:
            time.sleep(step_s)
            n += 1
    return tr, n


WORKERS = [(0, "process", None), (2, "process", None), (2, "thread", None),
           (2, "process", "spawn")]


@pytest.mark.parametrize(("num_workers", "kind", "context"), WORKERS,
                         ids=["main", "process", "thread", "process-spawn"])
def test_every_batch_through_every_stage_is_a_well_formed_span(num_workers, kind, context):
    loader = gpufeed.DataLoader(Sleepy(), batch_size=8, num_workers=num_workers,
                                worker_type=kind, multiprocessing_context=context,
                                device="cpu")
    tr, n = _run(loader)
    assert n == N_BATCHES
    read = check_trace(tr.to_dict())
    pid = read.pid("gpufeed.DataLoader")
    everything = list(range(N_BATCHES))
    # the main thread: every batch waited for and handed out once, in order; steps between
    assert read.batches(pid, "main", WAITS) == everything
    assert read.batches(pid, "main", "hand out") == everything
    assert read.batches(pid, "main", "step") == everything[1:]
    # the device stage copied each batch once
    assert read.batches(pid, "device", "copy") == everything
    # workers (or the main thread, without workers) fetched and collated each batch once
    where = "main thread: fetch" if num_workers == 0 else "worker"
    for stage in ("fetch", "collate"):
        assert sorted(read.batches(pid, where, stage)) == everything, stage
    if num_workers:
        names = {name for (p, name) in read.spans if p == pid and name.startswith("worker")}
        assert len(names) == 2
        if kind == "process":
            assert all("(pid " in name for name in names), names
        assert all(e["args"]["bytes"] == 8 * 16 * 4 for e in read.track(pid, "worker", "fetch"))
        # one clock (NOTE [ Timeline ] (2)): each batch's worker spans end before the main
        # thread stops waiting for it, also in spawned processes
        ready = {e["args"]["batch"]: e["ts"] + e["dur"] for e in read.track(pid, "main", WAITS)}
        for e in read.track(pid, "worker", "collate"):
            assert e["ts"] + e["dur"] <= ready[e["args"]["batch"]] + 1e-3, e
        for counter in ("ring slots", "batches in flight", "workers"):  # sampled, <= 1/batch
            assert 1 <= len(read.counters[(pid, counter)]) <= N_BATCHES, counter
        ring = read.counters[(pid, "ring slots")]
        assert all(e["args"]["fenced"] == 0 <= min(e["args"].values()) for e in ring)  # no CUDA
        assert max(e["args"]["in use"] for e in ring) >= 1
        assert {e["args"]["in force"] for e in read.counters[(pid, "workers")]} == {2}
        assert read.track(pid, "main", "start workers")  # the pool's start, before batch 0
    delivered = [e["args"]["delivered"] for e in read.counters[(pid, "batches delivered")]]
    assert delivered == list(range(1, N_BATCHES + 1))  # monotone, one per batch


def test_the_stats_are_the_sums_of_the_spans():
    """NOTE [ Timeline ] (3): stats() and the trace never disagree."""
    loader = gpufeed.DataLoader(Sleepy(), batch_size=8, num_workers=2, device="cpu")
    with gpufeed.trace() as tr:
        for _ in loader:
            time.sleep(0.0005)
    read = check_trace(tr.to_dict())
    pid = read.pid("gpufeed.DataLoader")
    stats = loader.stats().stages
    sums = {
        "fetch": read.track(pid, "worker", "fetch"),
        "collate": read.track(pid, "worker", "collate"),
        "wait": read.track(pid, "main", "wait"), "step": read.track(pid, "main", "step"),
        "startup": read.track(pid, "main", "startup"),
        "transfer": read.track(pid, "device"),
    }
    for stage, spans in sums.items():
        total_s = sum(e["dur"] for e in spans) / 1e6
        st = stats[stage]
        assert st.batches == len(spans), stage
        assert total_s == pytest.approx(st.busy_s + st.blocked_s, abs=1e-6 * len(spans)), stage


def test_persistent_epochs_and_instants_of_the_ring():
    loader = gpufeed.DataLoader(Sleepy(), batch_size=8, num_workers=2, persistent_workers=True,
                                ring_bytes=1)  # no slot fits: every batch falls back
    with gpufeed.trace() as tr:
        for _ in range(2):
            for _ in loader:
                pass
    read = check_trace(tr.to_dict())
    pid = read.pid("gpufeed.DataLoader")
    waits = read.track(pid, "main", WAITS)
    for epoch in (0, 1):
        assert [e["args"]["batch"] for e in waits if e["args"]["epoch"] == epoch] == \
            list(range(N_BATCHES))
        assert sorted(e["args"]["batch"] for e in read.track(pid, "worker", "fetch")
                      if e["args"]["epoch"] == epoch) == list(range(N_BATCHES))
    names = {e["name"] for e in read.instants}
    assert "ring fallback: fresh allocation" in names
    assert "spill to a memory file" in names  # process workers: each batch in a memory file
    spills = [e for e in read.instants if e["name"] == "spill to a memory file"]
    assert all(read.threads[(e["pid"], e["tid"])].startswith("worker") for e in spills)
    fallbacks = sum(e["args"]["batches"] for e in read.instants
                    if e["name"] == "ring fallback: fresh allocation")
    assert fallbacks == loader.stats().counters["ring_fallback"]


def test_a_bounded_trace_keeps_the_last_batches():
    ds = TensorDataset(torch.arange(4000.0).reshape(-1, 2))
    loader = gpufeed.DataLoader(ds, batch_size=4, num_workers=2, worker_type="thread")
    tr, n = _run(loader, step_s=0.0, last_batches=5)
    assert n == 500
    read = check_trace(tr.to_dict())
    pid = read.pid("gpufeed.DataLoader")
    assert read.batches(pid, "main", WAITS) == list(range(495, 500))
    assert len(tr.timeline) < 200  # dropped as it went, not only when written
    assert tr.to_dict()["otherData"]["bounds"]["last_batches"] == 5


def test_a_trace_bounded_in_time_keeps_the_last_seconds():
    ds = TensorDataset(torch.arange(400.0))
    loader = gpufeed.DataLoader(ds, batch_size=2, num_workers=0)
    tr, n = _run(loader, step_s=0.002, last_seconds=0.05)
    doc = tr.to_dict()
    read = check_trace(doc)
    pid = read.pid("gpufeed.DataLoader")
    waits = read.track(pid, "main", WAITS)
    assert 0 < len(waits) < n
    start = doc["otherData"]["window_start_us"]
    last = read.track(pid, "main", "hand out")[-1]
    assert last["ts"] + last["dur"] - start == pytest.approx(0.05e6, abs=0.01)
    assert all(e["ts"] >= start for e in waits)
    assert waits[-1]["args"]["batch"] == n - 1


# torch's own advice, given by some builds (2.11 with CUDA) to any profile without a schedule
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_torch_profiler_shows_the_waits_as_ranges():
    loader = gpufeed.DataLoader(Sleepy(), batch_size=8, num_workers=2, worker_type="thread",
                                device="cpu")
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        n = sum(1 for _ in loader)
    counts = {e.key: e.count for e in prof.key_averages()}
    # one range per next(), the last one (StopIteration) included
    assert counts.get(_timeline.WAIT_RANGE) == n + 1
    assert counts.get("gpufeed: next batch on device") == n + 1
    # the ranges nest: the device stage's next() holds the host iterator's
    events = [e for e in prof.events() if e.name.startswith("gpufeed:")]
    outer = [e for e in events if e.name == "gpufeed: next batch on device"]
    inner = [e for e in events if e.name == _timeline.WAIT_RANGE]
    assert all(any(o.time_range.start <= i.time_range.start and
                   i.time_range.end <= o.time_range.end for o in outer) for i in inner)


def test_without_a_profiler_or_a_trace_nothing_is_recorded(monkeypatch):
    """The off path: a check per batch, no range opened, no record written."""

    def boom(*a, **k):
        raise AssertionError("called while off")

    monkeypatch.setattr(_timeline, "torch_range", boom)
    for name in ("span", "counter", "instant", "handout", "worker_batch", "sample", "label"):
        monkeypatch.setattr(_timeline.Timeline, name, boom)
    loader = gpufeed.DataLoader(Sleepy(), batch_size=8, num_workers=2, device="cpu")
    assert sum(1 for _ in loader) == N_BATCHES
    assert sum(1 for _ in gpufeed.DataLoader(Sleepy(), batch_size=8)) == N_BATCHES


def test_a_stock_loader_shows_its_loop_through_the_profiler():
    stock = torch.utils.data.DataLoader(Sleepy(), batch_size=8, num_workers=2)
    ours = gpufeed.DataLoader(Sleepy(), batch_size=8, num_workers=2)
    with gpufeed.trace() as tr:
        prof = gpufeed.tools.Profiler()
        for _ in prof.wrap(stock):
            time.sleep(0.0005)
        for _ in gpufeed.tools.Profiler().wrap(ours):  # gpufeed's loader records itself, once
            pass
    read = check_trace(tr.to_dict())
    assert sorted(read.processes.values()) == [
        "gpufeed.DataLoader (2 process workers)", "your loop (gpufeed.tools.Profiler)"]
    loop = read.pid("your loop")
    assert read.batches(loop, "main", WAITS) == list(range(N_BATCHES))
    assert len(read.track(loop, "main", "step")) == N_BATCHES - 1
    assert not read.track(loop, "worker")
    waited = sum(e["dur"] for e in read.track(loop, "main", WAITS)[1:]) / 1e6
    assert waited == pytest.approx(prof.report().wait_s, abs=1e-5)


def test_other_stages_record_instants_through_the_generic_api(tmp_path):
    loader = gpufeed.DataLoader(Sleepy(), batch_size=8, num_workers=0)
    _timeline.instant(loader._recorder, "not recorded: no trace")  # off: a no-op
    path = tmp_path / "run.json.gz"
    with gpufeed.trace(path):
        for k, _ in enumerate(loader):
            if k == 3:
                _timeline.instant(loader._recorder, "autotune: 2 -> 3 workers",
                                  args={"reason": "the loop waited 31%"})
    read = check_trace(json.loads(gzip.decompress(path.read_bytes())))
    (event,) = read.instants
    assert event["name"] == "autotune: 2 -> 3 workers" and event["args"]["reason"]
    assert event["pid"] == read.pid("gpufeed.DataLoader")
    assert read.threads[(event["pid"], event["tid"])].startswith("main")


def test_trace_misuse_gets_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="last_batches=0"):
        gpufeed.trace(last_batches=0)
    with pytest.raises(ValueError, match="last_seconds=-1"):
        gpufeed.trace(last_seconds=-1)
    with pytest.raises(TypeError, match="trace path"):
        gpufeed.trace(42)  # type: ignore[arg-type]
    path = tmp_path / "t.json"
    with pytest.raises(KeyError), gpufeed.trace(path) as outer:
        with pytest.raises(RuntimeError, match="already recording"), gpufeed.trace():
            pass
        assert _timeline.active is outer.timeline
        raise KeyError("the user's error")
    assert _timeline.active is None
    assert json.loads(path.read_text())["traceEvents"] == []  # written all the same
    with pytest.raises(RuntimeError, match="already stopped"):
        outer.start()


# The child's code, run by a builtin: a spawned child unpickles it without importing this
# module (and torch and gpufeed with it), which was most of the test's time.
CHILD_CLOCK = "import time; q.put(time.perf_counter())"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_processes_read_the_main_process_clock(method):
    """NOTE [ Timeline ] (2): perf_counter is one clock for the machine."""
    ctx = mp.get_context(method)
    q = ctx.Queue()
    proc = ctx.Process(target=exec, args=(CHILD_CLOCK, {"q": q}))
    before = time.perf_counter()
    proc.start()
    child = q.get(timeout=60)
    after = time.perf_counter()
    proc.join(60)
    assert before <= child <= after


class _GpuEvent:
    """A timed event of :class:`_SerialGpu`: the GPU reaches it at ``t`` (host clock)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return time.perf_counter() >= self.t

    def synchronize(self) -> None:
        time.sleep(max(self.t - time.perf_counter(), 0.0))


class _SerialGpu(gpufeed._device.streams.SyncBackend):  # type: ignore[name-defined]
    """The synchronous backend, plus a simulated GPU clock: the stream runs its work in order,
    2 ms of it before each event after the first, so it falls behind a host that issues
    faster; ``events`` keeps when each event ran, for the test to compare."""

    gpu_clock = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.busy_until = 0.0
        self.events: list[_GpuEvent] = []

    def timed_event(self, stream):
        cost = 0.002 if self.events else 0.0
        event = _GpuEvent(max(time.perf_counter(), self.busy_until) + cost)
        self.busy_until = event.t
        self.events.append(event)
        return event

    def elapsed_ms(self, start, end):
        return (end.t - start.t) * 1e3


def test_gpu_times_are_placed_on_the_host_clock():
    """_device/timing.py: the copy stream's events land where the GPU ran them (up to the
    anchor's launch latency, here the few microseconds between two host reads), not where the
    host issued them, and are recorded only once they have completed."""
    from gpufeed._device.streams import SyncBackend

    assert SyncBackend.gpu_clock is False
    batches = [torch.full((4,), float(i)) for i in range(12)]
    backend = _SerialGpu(torch.device("cpu"))
    with gpufeed.trace() as tr:
        it = gpufeed.to_device(batches, "cpu", backend=backend, transform=lambda b: b * 2)
        first = next(it)
        pending = len(it._trace.pending)
        rest = list(it)
    assert len(rest) == 11 and torch.equal(first, batches[0] * 2)
    assert pending > 0  # not complete yet: not recorded yet, and next() did not block
    doc = tr.to_dict()
    read = check_trace(doc)
    pid = read.pid("gpufeed.to_device")
    assert read.threads[(pid, 2)] == "device stage (host side: issuing copies)"
    gpu = read.track(pid, "GPU", "copy")
    assert [e["args"]["batch"] for e in gpu] == read.batches(pid, "device", "copy") == \
        list(range(12))
    assert read.batches(pid, "GPU", "transform") == list(range(12))
    origin = tr.timeline.started
    truth = [(e.t - origin) * 1e6 for e in backend.events[1:]]  # 3 marks a batch
    placed = [x for c, t in zip(gpu, read.track(pid, "GPU", "transform"), strict=True)
              for x in (c["ts"], t["ts"], t["ts"] + t["dur"])]
    assert placed == pytest.approx(truth, abs=1000.0)  # microseconds
    assert truth[-1] - truth[0] > 12 * 3 * 2000 * 0.9  # the GPU fell behind: not host times


def test_the_cli_writes_the_trace_and_the_picture(tmp_path, monkeypatch, capsys):
    from gpufeed._cli.main import main

    (tmp_path / "traced_loop.py").write_text(
        "import time, torch, gpufeed\n"
        "class Squares(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 400\n"
        "    def __getitem__(self, i): return torch.full((4,), float(i))\n"
        "def pair():\n"
        "    loader = gpufeed.DataLoader(Squares(), batch_size=8, num_workers=2)\n"
        "    return loader, lambda batch: time.sleep(0.001)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    assert main(["profile", "traced_loop:pair", "--trace", str(out), "--timeline", str(png),
                 "--timeline-seconds", "0.5", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"wrote {png}" in printed
    read = check_trace(json.loads(out.read_text()))
    pid = read.pid("gpufeed.DataLoader")
    assert read.batches(pid, "main", WAITS) == list(range(50))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["profile", "traced_loop:pair", "--trace-last", "0"]) == 2  # a usage error
    # A picture's window past the run's end: a usage error naming the option, not a traceback.
    assert main(["profile", "traced_loop:pair", "--timeline", str(png), "--timeline-start",
                 "3600", "--no-progress"]) == 2
    assert "--timeline-start 3600: start_s=3600.0: the window holds no span" in (
        capsys.readouterr().err)


def test_the_picture_marks_the_stalls(tmp_path):
    from gpufeed._tools.gantt import render, stalls

    class OneSlowBatch(Sleepy):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 8 * 10:
                time.sleep(0.2)
            return super().__getitem__(i)

    # prefetch_factor: one batch per message (unset, cheap batches travel several to a
    # message, and the loop would stall on the first batch of the slow one's message)
    loader = gpufeed.DataLoader(OneSlowBatch(), batch_size=8, num_workers=2,
                                worker_type="thread", prefetch_factor=2)
    tr, _ = _run(loader, step_s=0.002)
    doc = tr.to_dict()
    slow = [e["args"]["batch"] for e in stalls(doc, stall_ms=100)]
    assert 10 in slow and len(slow) <= 2  # the slow batch (and perhaps the first one)
    path = tr.plot(tmp_path / "t.png", seconds=None, stall_ms=100)
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="seconds=0"):
        render(doc, tmp_path / "x.png", seconds=0)
    with pytest.raises(ValueError, match=r"start_s=3600.0: .* start it earlier"):
        render(doc, tmp_path / "x.png", start_s=3600.0)  # past the trace's end
    # A window with spans of no kind the legend knows (under load, a short first window may
    # hold only start-up) draws them, without a legend.
    lone = {"traceEvents": [{"ph": "X", "name": "user span", "pid": 1, "tid": 1, "ts": 0.0,
                             "dur": 500.0}]}
    assert render(lone, tmp_path / "lone.png").read_bytes()[:4] == b"\x89PNG"
