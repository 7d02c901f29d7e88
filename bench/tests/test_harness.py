"""The measuring helpers (gpufeed._tools.measure) and the benchmark harness (bench)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from bench import Settings, Workload, build
from bench.__main__ import main, render_markdown
from bench.ceiling import measure_no_loader
from bench.cpu import (
    CEILING,
    _run_workload,
    _wait_for_children,
    main_cpu_s_per_batch,
    pss_growth_bytes,
    summarize,
)
from bench.summary import main_bound, paired_ratio
from bench.tests.fresh import in_a_fresh_interpreter
from bench.workloads import Variant
from gpufeed._tools.measure import batch_samples_and_bytes, measure_loader
from gpufeed._tools.probe import (
    descendants,
    process_tree_memory,
    process_tree_pss,
    unmapped_shared_bytes,
)

MiB = 1 << 20


def _paced(n: int, *, first_s: float, step_s: float, rows: int = 10) -> Iterator[torch.Tensor]:
    time.sleep(first_s)
    for k in range(n):
        if k:
            time.sleep(step_s)
        yield torch.zeros(rows, 4)  # 160 bytes


def test_measure_loader_timing_of_a_paced_iterable() -> None:
    built = []

    def make() -> Iterator[torch.Tensor]:
        time.sleep(0.5)  # building the loader is not timed
        built.append(1)
        return _paced(10, first_s=0.5, step_s=0.02)

    # Each upper bound sits 0.4 s above the truth and below what the timing would be if it
    # counted what it must not (a busy machine's stalls fit in the 0.4 s).
    m = measure_loader(make, warmup_batches=2, sample_memory=False)
    assert built == [1]
    assert (m.batches, m.samples, m.warmup_batches) == (8, 80, 2)
    assert 0.5 <= m.first_batch_s < 0.5 + 0.4  # the build's 0.5 s is excluded (>= 1.0 if not)
    # the warm-up batches' 0.52 s is excluded (>= 0.68 if not)
    assert 8 * 0.02 <= m.seconds < 8 * 0.02 + 0.4
    assert m.samples_per_s == pytest.approx(m.samples / m.seconds)
    assert m.bytes_per_s == pytest.approx(80 * 16 / m.seconds)
    assert (m.peak_pss_bytes, m.memory_samples) == (0, 0)


def test_measure_loader_stops_and_consumes() -> None:
    seen: list[int] = []
    m = measure_loader(lambda: _paced(100, first_s=0, step_s=0), max_batches=5,
                       warmup_batches=1, consume=lambda b: seen.append(len(b)),
                       sample_memory=False)
    assert (m.batches, seen) == (4, [10] * 5)
    m = measure_loader(lambda: _paced(10_000, first_s=0, step_s=0.01), max_seconds=0.1,
                       warmup_batches=1, sample_memory=False)
    assert 2 <= m.batches <= 12 and 0.1 <= m.seconds < 0.3


def _busy(s: float) -> None:
    end = time.thread_time() + s
    while time.thread_time() < end:
        pass


def _burning(n: int, *, cpu_s: float, sleep_s: float) -> Iterator[torch.Tensor]:
    """Batches that cost the iterating thread ``cpu_s`` of CPU and ``sleep_s`` of waiting."""
    for _ in range(n):
        _busy(cpu_s)
        time.sleep(sleep_s)
        yield torch.zeros(10, 4)


def test_measure_loader_reads_the_main_process_cpu() -> None:
    # 2 warm-up batches burn 0.1 s each: excluded; 8 counted batches burn 10 ms and sleep 10 ms
    def make() -> Iterator[torch.Tensor]:
        yield from _burning(2, cpu_s=0.1, sleep_s=0)
        yield from _burning(8, cpu_s=0.01, sleep_s=0.01)

    m = measure_loader(make, warmup_batches=2, sample_memory=True, sample_interval_s=0.005)
    assert m.batches == 8
    # CPU, not wall time (0.16 s): the sleeps are not in it, nor the warm-up's 0.2 s
    assert 0.08 <= m.main_thread_cpu_s < 0.08 + 0.05
    assert main_cpu_s_per_batch(m)[0] == pytest.approx(m.main_thread_cpu_s / 8)
    # the process figure leaves the PSS sampler's thread out; a helper thread counts
    assert m.main_thread_cpu_s <= m.main_process_cpu_s + 0.005 < 0.08 + 0.06

    def with_helper() -> Iterator[torch.Tensor]:
        yield from _burning(1, cpu_s=0, sleep_s=0)
        helper = threading.Thread(target=_busy, args=(0.1,))
        helper.start()
        yield from _burning(5, cpu_s=0, sleep_s=0.05)
        helper.join()

    m = measure_loader(with_helper, warmup_batches=1, sample_memory=False)
    assert m.main_thread_cpu_s < 0.03 and m.main_process_cpu_s >= 0.1


def test_the_process_cpu_is_never_below_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process clock may lag the PSS sampler's own clock by a scheduler tick, which once
    made a quick pass's process figure smaller than its main thread's: the thread's figure is
    the floor."""
    import gpufeed._tools.measure as measure

    readings = iter([(1.0, 1.0), (1.3, 1.1)])  # (thread, process without the sampler)
    monkeypatch.setattr(measure, "_cpu_now", lambda sampler: next(readings))
    m = measure_loader(lambda: iter([torch.zeros(2)] * 3), warmup_batches=0, sample_memory=False)
    assert m.main_thread_cpu_s == pytest.approx(0.3)
    assert m.main_process_cpu_s == pytest.approx(0.3)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"warmup_batches": -1}, "warmup_batches=-1"),
    ({"max_batches": 2, "warmup_batches": 2}, "max_batches=2"),
    ({"max_seconds": 0}, "max_seconds=0"),
])
def test_measure_loader_rejects_bad_knobs(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        measure_loader(lambda: [torch.zeros(1)] * 4, sample_memory=False, **kwargs)  # type: ignore[arg-type]


def test_measure_loader_needs_a_batch_after_warmup() -> None:
    with pytest.raises(ValueError, match="gave 2 batches"):
        measure_loader(lambda: [torch.zeros(1)] * 2, warmup_batches=2, sample_memory=False)


def test_batch_samples_and_bytes_walks_nested_batches() -> None:
    batch = {"x": torch.zeros(8, 3, dtype=torch.float64), "meta": [np.zeros((8, 2), np.int32), "s"]}
    assert batch_samples_and_bytes(batch) == (8, 8 * 3 * 8 + 8 * 2 * 4)
    assert batch_samples_and_bytes([1, 2, 3]) == (3, 0)


@in_a_fresh_interpreter
def test_sampler_catches_a_short_peak() -> None:
    def spike() -> Iterator[torch.Tensor]:
        for k in range(6):
            if k == 3:
                block = np.ones(192 * MiB, dtype=np.uint8)  # touched: resident
                time.sleep(0.6)  # a slow sample (big process) stretches the interval
                del block
            yield torch.zeros(2)

    m = measure_loader(spike, warmup_batches=1)
    assert m.memory_samples >= 4
    assert pss_growth_bytes(m) >= 128 * MiB, m


class _Growing:
    """A pass of known length whose memory only grows, and is freed when the pass ends (as a
    loader's workers unmap a memory-mapped dataset when they exit)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.blocks: list[np.ndarray] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[torch.Tensor]:
        for k in range(self.n):
            if k == self.n - 1:
                self.blocks.append(np.ones(96 * MiB, dtype=np.uint8))  # touched: resident
            yield torch.zeros(2)
        self.blocks.clear()


@in_a_fresh_interpreter
def test_peak_includes_the_end_of_the_pass() -> None:
    """The sampler may be asleep when the last batch arrives: the end-of-pass sample is not."""
    m = measure_loader(lambda: _Growing(4), warmup_batches=1, sample_interval_s=60.0)
    assert pss_growth_bytes(m) >= 90 * MiB
    assert m.memory_samples == 3  # start, end of the pass, stop


def test_process_tree_pss_counts_a_child() -> None:
    code = ("import sys, time; b = bytes(range(256)) * (96 << 12); "
            "print('ready', flush=True); time.sleep(30)")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            own = psutil.Process().memory_full_info().pss
            assert process_tree_pss() - own >= 90 * MiB
            assert process_tree_pss(child.pid) >= 90 * MiB
        finally:
            child.kill()


@in_a_fresh_interpreter
def test_process_tree_memory_splits_by_kind(tmp_path: Path) -> None:
    import mmap
    import os

    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("needs /proc/<pid>/smaps_rollup")
    before = process_tree_memory()
    if before.anon == 0:
        pytest.skip("this kernel's smaps_rollup has no Pss_Anon/Pss_File/Pss_Shmem split")
    assert before.anon + before.file + before.shmem == pytest.approx(before.pss, abs=64 << 10)
    path = tmp_path / "data.bin"
    path.write_bytes(b"\x01" * (48 * MiB))
    fd = os.memfd_create("test-shmem")
    try:
        os.ftruncate(fd, 48 * MiB)
        shm = mmap.mmap(fd, 48 * MiB)
        shm.write(b"\x02" * (48 * MiB))  # touched: resident shared memory
        anon = np.ones(48 * MiB, dtype=np.uint8)
        data = np.memmap(path, dtype=np.uint8, mode="r")
        assert int(data.sum(dtype=np.int64)) == 48 * MiB  # every page of the file mapped in
        after = process_tree_memory()
        assert after.anon - before.anon >= 40 * MiB
        assert after.file - before.file >= 40 * MiB
        assert after.shmem - before.shmem >= 40 * MiB
        del anon, data
        shm.close()
    finally:
        os.close(fd)


def test_shared_memory_held_but_mapped_nowhere_is_counted() -> None:
    """A memfd a child holds open, written but not mapped, is in no PSS: ``unmapped`` counts
    it, and stops counting it once a process of the tree maps it."""
    import os

    if not Path("/proc/self/fd").exists():
        pytest.skip("needs /proc")
    code = ("import os, sys, time; fd = os.memfd_create('held'); "
            "os.write(fd, b'\\x03' * (24 << 20)); "
            "print(os.getpid(), fd, flush=True); time.sleep(30)")
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          text=True) as child:
        try:
            assert child.stdout is not None
            pid, fd = map(int, child.stdout.readline().split())
            assert unmapped_shared_bytes([pid]) >= 24 * MiB
            tree = process_tree_memory(unmapped=True)
            assert tree.unmapped >= 24 * MiB and tree.held == tree.pss + tree.unmapped
            import mmap

            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)  # the same file, mapped here
            try:
                view = mmap.mmap(mine, 24 * MiB, prot=mmap.PROT_READ)
                assert unmapped_shared_bytes([os.getpid(), pid]) < 24 * MiB
                assert unmapped_shared_bytes([pid]) >= 24 * MiB  # mapped outside those pids
                view.close()
            finally:
                os.close(mine)
        finally:
            child.kill()


class _Big(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2 << 20,), i, dtype=torch.uint8)  # 2 MiB: 8 MiB batches of 4


@in_a_fresh_interpreter
def test_stock_loader_queued_batches_count_as_held() -> None:
    """The stock loader's workers pass collated batches as /dev/shm descriptors: while a slow
    loop lets them queue, they are in no PSS but in ``peak_held_bytes``."""
    from torch.utils.data import DataLoader

    # The pass is cut at 10 of its 100 batches, so the workers always have batches to queue: at
    # the end of a whole pass they queue none, and the workers' heaps, grown by then, may put
    # the tree's PSS peak there.
    m = measure_loader(lambda: DataLoader(_Big(), batch_size=4, num_workers=2,
                                          prefetch_factor=2),
                       max_batches=10, warmup_batches=1, consume=lambda b: time.sleep(0.25),
                       sample_interval_s=0.02)
    # two workers, two batches each in flight, one in the loop: about 3 queued (24 MiB)
    assert m.peak_held_bytes >= m.peak_pss_bytes + 8 * MiB, m


def test_each_run_gets_a_fresh_dataset(tmp_path: Path) -> None:
    """A thread-worker run opens image-array's memory map in the main process; the workload's
    own dataset object must not keep it (and its pages) for the runs after it."""
    work = build("image-array", cache_dir=tmp_path, quick=True)
    loaders = ["torch", "gpufeed-thread"]
    rows, ceiling = _run_workload(work, loaders, Settings(repeats=1, warmup_batches=1,
                                                          quick=True), lambda line: None)
    for v in work.variants:
        assert v.dataset._map is None  # the ceiling's processes open it, not this one
    timed = len(work.variants[0].dataset) - work.batch_size  # one epoch less the warm-up batch
    assert {r["median"]["samples"] for r in rows} == {timed}
    assert all(r["median"]["peak_pss_bytes"] > 0 for r in rows)
    assert {c["median"]["samples"] for c in ceiling} == {len(work.variants[0].dataset)}


class _Sleepy(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample costs ``sleep_s`` of wall time and no CPU."""

    def __init__(self, n: int, sleep_s: float) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return torch.full((4,), float(i))


def test_ceiling_of_a_sleeping_dataset() -> None:
    """Two processes that each sleep 4 ms a sample cannot beat 2 / 4 ms = 500 samples/s and,
    sleeping rather than computing, should come close to it."""
    work = Workload("sleepy", "sleeps", batch_size=8, samples=96,
                    variants=(Variant("per-sample", _Sleepy(96, 0.004)),))
    lines: list[str] = []
    rows, ceiling = _run_workload(work, [], Settings(num_workers=2, repeats=2), lines.append)
    assert rows == [] and len(lines) == 2 and CEILING in lines[0]
    (c,) = ceiling
    assert (c["loader"], c["variant"], c["fetch"], len(c["runs"])) == (
        CEILING, "per-sample", "__getitem__", 2)
    assert c["median"]["samples"] == 96
    assert all(r["batches"] == 12 and len(r["process_seconds"]) == 2 for r in c["runs"])
    assert 0.5 * 500 < c["median"]["samples_per_s"] <= 500
    assert not descendants()


def _fail_on_seven(indices: list[int]) -> torch.Tensor:
    if 7 in indices:
        raise KeyError("no sample 7")
    return torch.zeros(len(indices))


def test_waiting_for_workers_ignores_multiprocessing_helpers() -> None:
    """Once anything started multiprocessing's resource tracker (a spawn context, a
    shared_memory segment), it is a child to the end; the wait before each benchmark run
    counted it as a worker and sat out its timeout every time."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker._pid
    assert tracker in {p.pid for p in psutil.Process().children()}
    assert descendants() == [] and _wait_for_children(timeout_s=2.0) == 0


def test_no_loader_reports_a_failing_process() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)no-loader process 1 failed:.*no sample 7"):
        measure_no_loader(_fail_on_seven, [[0, 1], [6, 7]], processes=2)
    with pytest.raises(ValueError, match="processes=0"):
        measure_no_loader(_fail_on_seven, [[0]], processes=0)
    assert not descendants()


def _slow_rows(indices: list[int]) -> torch.Tensor:
    time.sleep(0.01)
    return torch.zeros(len(indices), 4)


def test_the_ceiling_can_bear_the_loaders_memory_sampler() -> None:
    """The benchmark's ceiling runs beside the same PSS sampler as a loader's run, so that the
    sampler's CPU is not counted against the loaders alone; without it, no sample is taken."""
    batches = [[i, i + 1] for i in range(0, 40, 2)]  # 20 batches, 10 per process, 0.1 s
    sampled = measure_no_loader(_slow_rows, batches, processes=2, sample_memory=True,
                                sample_interval_s=0.01)
    assert sampled.samples == 40 and sampled.memory_samples >= 2
    assert sampled.peak_pss_bytes > 0
    plain = measure_no_loader(_slow_rows, batches, processes=2)
    assert plain.samples == 40 and (plain.memory_samples, plain.peak_pss_bytes) == (0, 0)
    assert not descendants()


def test_workload_variants_give_the_same_batches(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    for name in ("tabular", "image-array", "jpeg"):
        work = build(name, cache_dir=tmp_path, quick=True)
        again = build(name, cache_dir=tmp_path, quick=True)  # reuses the files
        idx = [5, 0, 17, 3]
        ref = torch.utils.data.default_collate([work.variants[0].dataset[i] for i in idx])
        for v in (*work.variants[1:], *again.variants):
            getitems = getattr(v.dataset, "__getitems__", None)
            got = getitems(idx) if getitems else [v.dataset[i] for i in idx]
            got = v.collate_fn(got) if v.collate_fn else torch.utils.data.default_collate(got)
            for a, b in zip(ref, got, strict=True):
                assert torch.equal(a, b), (name, v.name)


def test_summary_ratio_comes_from_the_figures() -> None:
    def row(loader: str, variant: str, rate: float, pss: float,
            samples: float = 1000.0) -> dict[str, object]:
        return {"loader": loader, "variant": variant,
                "median": {"samples_per_s": rate, "bytes_per_s": 0.0, "peak_pss_bytes": pss,
                           "pss_growth_bytes": 0.0, "first_batch_s": 0.0, "samples": samples}}

    rows = [row("torch", "per-sample", 100.0, 10.0), row("torch", "getitems", 300.0, 20.0),
            row("gpufeed", "getitems", 900.0, 19.0), row("gpufeed-thread", "array", 3300.0, 9.0)]
    ceiling = [{"variant": v, "median": {"samples_per_s": rate, "bytes_per_s": 0.0}}
               for v, rate in (("per-sample", 400.0), ("getitems", 1000.0), ("array", 4000.0))]
    sm = summarize("image-array", rows, ceiling)
    assert sm["ceiling"] == {"gpufeed_variant": "array", "gpufeed_variant_ceiling": 4000.0,
                             "gpufeed_of_ceiling": pytest.approx(3300.0 / 4000.0),
                             "stock_variant": "getitems", "stock_variant_ceiling": 1000.0,
                             "stock_of_ceiling": pytest.approx(300.0 / 1000.0)}
    assert "| 4,000 (array) | 82% | 30% of 1,000 (getitems) |" in render_markdown(
        {"environment": {"date": "d", "hostname": "h", "cpu_model": "c", "cpu_affinity": 2,
                         "memory_bytes": 2**30, "python": "p", "torch": "t", "numpy": "n",
                         "torchdata": None, "gpufeed": "g", "loadavg_start": [0.0]},
         "settings": {**Settings().__dict__}, "loaders": {},
         "workloads": [{"name": "image-array", "summary": sm, "results": rows,
                        "ceiling": ceiling}]})
    assert summarize("image-array", rows)["ceiling"] is None
    assert sm["stock_best"]["variant"] == "getitems"
    assert sm["gpufeed_best"]["loader"] == "gpufeed-thread"
    assert sm["ratio"] == pytest.approx(11.0) and sm["ratio_pass"] is True
    assert sm["gpufeed_process_best"]["samples_per_s"] == 900.0
    assert sm["pss_pass"] is True and sm["pss_ratio_process"] == pytest.approx(19.0 / 20.0)
    sm = summarize("image-array", [*rows[:2], row("gpufeed", "getitems", 900.0, 25.0), rows[3]])
    assert sm["pss_pass"] is True and "process workers (its fastest variant, getitems): " \
        "peak PSS 1.25x" in sm["also"][0]
    sm = summarize("tabular", rows[:3])
    assert sm["ratio"] == pytest.approx(3.0) and sm["ratio_pass"] is False
    assert sm["pss_ratio"] == pytest.approx(19.0 / 20.0) and sm["pss_pass"] is True
    assert "misses the 15x target by 80%" in sm["notes"][0]
    # unequal work (a time cap): the PSS ratio is shown but not judged
    sm = summarize("tabular", [row("torch", "getitems", 300.0, 20.0, samples=600.0),
                               row("gpufeed", "getitems", 900.0, 30.0, samples=1800.0)])
    assert sm["pss_ratio"] == pytest.approx(1.5) and sm["pss_pass"] is None
    assert "not judged" in sm["notes"][-1] and "1,800 vs 600 samples" in sm["notes"][-1]


def test_ceiling_share_is_paired_by_round_and_bounded_by_the_main_process() -> None:
    """The share of the ceiling is the median of each round's (the sides of a round share its
    conditions), with the rounds' spread; the main-process bound (NOTE [ Main-process bound ])
    is what the main process's CPU per batch leaves of the ceiling on these cores."""
    def runs(rates: list[float], main_s: float) -> list[dict[str, float]]:
        return [{"samples_per_s": r, "main_process_cpu_s_per_batch": main_s,
                 "main_thread_cpu_s_per_batch": main_s / 10} for r in rates]

    def row(loader: str, rates: list[float], main_s: float) -> dict[str, object]:
        return {"loader": loader, "variant": "array", "runs": runs(rates, main_s),
                "median": {"samples_per_s": statistics.median(rates), "bytes_per_s": 0.0,
                           "peak_pss_bytes": 1.0, "pss_growth_bytes": 0.0,
                           "first_batch_s": 0.0, "samples": 1000.0}}

    # the ceiling's 2 processes take 1 s each for 100 batches: 0.02 core-s per batch, and its
    # rate halves in round 2 (a slower machine), where gpufeed's halves too
    ceiling = [{"variant": "array", "median": {"samples_per_s": 750.0, "bytes_per_s": 0.0},
                "runs": [{"samples_per_s": 1000.0, "batches": 100, "seconds": 1.0,
                          "process_seconds": [1.0, 1.0]},
                         {"samples_per_s": 500.0, "batches": 100, "seconds": 2.0,
                          "process_seconds": [2.0, 2.0]},
                         {"samples_per_s": 1000.0, "batches": 100, "seconds": 1.0,
                          "process_seconds": [1.0, 1.0]}]}]
    rows = [row("torch", [100.0, 50.0, 100.0], 0.05),
            row("gpufeed", [700.0, 400.0, 750.0], 0.005)]
    c = summarize("tabular", rows, ceiling, cores=2)["ceiling"]
    assert c["gpufeed_of_ceiling"] == pytest.approx(0.75)  # rounds: 0.70, 0.80, 0.75
    assert c["gpufeed_of_ceiling_range"] == pytest.approx([0.70, 0.80])
    # (a ratio of medians would say 700 / 1000 = 70%: round 2's slow ceiling left out)
    assert c["gpufeed_main_bound"] == pytest.approx(0.02 / (0.02 + 0.005))
    assert c["gpufeed_main_us"] == pytest.approx(5000.0)
    assert c["stock_main_bound"] == pytest.approx((1 / 0.05) / 100)  # its main thread alone
    # rounds pair by their number: a run missing from round 1 leaves that round out
    for k, r in enumerate(ceiling[0]["runs"]):
        r["repeat"] = k
    ours = rows[1]["runs"]
    ours[0]["repeat"], ours[2]["repeat"] = 0, 2
    rows[1]["runs"] = [ours[0], ours[2]]
    c = summarize("tabular", rows, ceiling, cores=2)["ceiling"]
    assert c["gpufeed_of_ceiling_range"] == pytest.approx([0.70, 0.75])
    rows[1]["runs"] = ours
    del ours[0]["repeat"], ours[2]["repeat"]
    # thread workers fetch in the main process: the iterating thread's CPU is the main's own
    rows[1]["loader"] = "gpufeed-thread"
    c = summarize("tabular", rows, ceiling, cores=2)["ceiling"]
    assert c["gpufeed_main_bound"] == pytest.approx(0.02 / (0.02 + 0.0005))
    # more cores than workers: the main process has a core of its own; at most all of it
    assert main_bound(runs([1.0], 0.005)[0], ceiling[0]["runs"][0], 4) == 1.0
    assert main_bound(runs([1.0], 0.015)[0], ceiling[0]["runs"][0], 4) == pytest.approx(
        (1 / 0.015) / 100)
    assert main_bound({"samples_per_s": 1.0}, ceiling[0]["runs"][0], 2) is None
    md = render_markdown(
        {"environment": {"date": "d", "hostname": "h", "cpu_model": "c", "cpu_affinity": 2,
                         "memory_bytes": 2**30, "python": "p", "torch": "t", "numpy": "n",
                         "torchdata": None, "gpufeed": "g", "loadavg_start": [0.0]},
         "settings": {**Settings().__dict__}, "loaders": {},
         "workloads": [{"name": "tabular", "results": rows, "ceiling": ceiling,
                        "summary": summarize("tabular", rows, ceiling, cores=2)}]})
    assert "| 75% (70-80%) | 10% (10-10%) |" in md
    assert ("- tabular: gpufeed 98% (main process 500 us per batch), stock 20% (main process "
            "50,000 us per batch)") in md


def test_memory_is_compared_round_by_round() -> None:
    """Each round's runs share its conditions. The CPU benchmark's jpeg peaks at 12:41 (MiB;
    the rounds started at 301, 287 and 288): the sides' medians come from different rounds
    and make 1.04x of what is 1.00x, 1.01x and 1.04x round by round."""
    stock = [{"peak_pss_bytes": p * MiB} for p in (356.9, 342.5, 344.0)]
    ours = [{"peak_pss_bytes": p * MiB} for p in (357.2, 344.5, 358.9)]
    assert statistics.median(r["peak_pss_bytes"] for r in ours) / statistics.median(
        r["peak_pss_bytes"] for r in stock) == pytest.approx(1.038, abs=1e-3)
    assert paired_ratio(ours, stock, "peak_pss_bytes") == pytest.approx(344.5 / 342.5)
    assert paired_ratio([{}], stock, "peak_pss_bytes") is None


@pytest.mark.filterwarnings("ignore::gpufeed.errors.CopyOnWriteWarning")  # python-list: on purpose
def test_quick_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    workloads = ["tabular", "image-array", "python-list", "synthetic"]
    rc = main(["cpu", "--quick", "--workloads", *workloads, "--loaders", "torch", "gpufeed",
               "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    doc = json.loads((out / "cpu.json").read_text())
    assert doc["schema"] == "gpufeed-bench-cpu/1" and doc["settings"]["quick"] is True
    env = doc["environment"]
    for key in ("date", "hostname", "cpu_model", "cpu_count", "torch", "numpy", "python",
                "gpufeed", "git_commit", "loadavg_end"):
        assert key in env
    assert [w["name"] for w in doc["workloads"]] == workloads
    for w in doc["workloads"]:
        assert {r["loader"] for r in w["results"]} == {"torch", "gpufeed"}
        for r in w["results"]:
            runs = r["runs"]
            assert len(runs) == 1 and runs[0]["samples"] > 0
            for key in ("samples_per_s", "peak_pss_bytes", "first_batch_s"):
                assert r["median"][key] == statistics.median(x[key] for x in runs)
            assert r["median"]["peak_pss_bytes"] > 0
            cpu = r["median"]["main_thread_cpu_s_per_batch"]
            assert 0 < cpu <= r["median"]["main_process_cpu_s_per_batch"] + 1e-4
            assert cpu == statistics.median(x["main_thread_cpu_s_per_batch"] for x in runs)
            kinds = sum(r["median"][f"peak_pss_{k}_bytes"] for k in ("anon", "file", "shmem"))
            assert kinds == 0 or kinds == pytest.approx(r["median"]["peak_pss_bytes"], rel=0.05)
        # equal work: every loader delivered the same samples (one epoch)
        assert len({r["median"]["samples"] for r in w["results"]}) == 1
        # the no-loader ceiling of every variant, over the whole epoch
        assert {c["variant"] for c in w["ceiling"]} == {r["variant"] for r in w["results"]}
        for c in w["ceiling"]:
            assert c["loader"] == CEILING and len(c["runs"]) == 1
            assert c["fetch"] == {"per-sample": "__getitem__", "getitems": "__getitems__",
                                  "getitems-slot": "__getitems__",
                                  "array": "gather"}[c["variant"]]  # the fastest fetch of each
            assert c["median"]["samples"] == w["samples"] and c["median"]["samples_per_s"] > 0
        ceil = w["summary"]["ceiling"]
        assert ceil["gpufeed_variant"] == w["summary"]["gpufeed_best"]["variant"]
        assert ceil["gpufeed_of_ceiling"] > 0 and ceil["stock_of_ceiling"] > 0
        sm = w["summary"]
        stock = max((r for r in w["results"] if r["loader"] == "torch"),
                    key=lambda r: r["median"]["samples_per_s"])
        ours = max((r for r in w["results"] if r["loader"] == "gpufeed"),
                   key=lambda r: r["median"]["samples_per_s"])
        assert sm["ratio"] == pytest.approx(
            ours["median"]["samples_per_s"] / stock["median"]["samples_per_s"])
        if sm["target_ratio"] is not None:
            assert sm["ratio_pass"] == (sm["ratio"] >= sm["target_ratio"])
    md = (out / "cpu.md").read_text()
    assert md == render_markdown(doc) and "| workload | stock best |" in md
    assert "| gpufeed % of ceiling |" in md and "No-loader ceiling: 2 plain forked" in md
    assert "| main CPU us/batch: thread / process |" in md
    for w in doc["workloads"]:
        for c in w["ceiling"]:
            assert f"| {w['name']} | {c['variant']} | {CEILING} | " in md
    assert "wrote" in capsys.readouterr().out
    assert not descendants()  # every worker is gone


def test_gpu_subcommand_is_handed_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    seen: list[list[str]] = []
    fake = types.ModuleType("bench.gpu")
    fake.main = lambda argv: seen.append(list(argv)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bench.gpu", fake)
    assert main(["gpu", "--out", "x"]) == 0 and seen == [["--out", "x"]]


def test_gpu_benchmark_skips_cleanly_without_cuda(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    assert main(["gpu", "--out", str(tmp_path)]) == 0
    assert "no CUDA device: GPU benchmark skipped" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # committed figures are never overwritten


def test_per_sample_profile_and_compare_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from bench import persample

    monkeypatch.setenv("GPUFEED_BENCH_CACHE", str(tmp_path))
    out = tmp_path / "persample.json"
    assert persample.main(["both", "--quick", "--seconds", "0.05", "--runs", "1",
                           "--batches", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gpufeed vs stock, both per-sample" in text and "wake-ups per batch" in text
    doc = json.loads(out.read_text())
    for name in ("stock", "gpufeed"):
        w, r = doc["worker"][name], doc["loaders"][name]
        assert w["cpu_us_per_batch"] > 0 and w["top"][0]["own_share"] > 0
        assert r["worker_processes"] == 2 and r["worker_cpu_ms_per_batch"] >= 0
    assert doc["loaders"]["gpufeed_main_top"]


@pytest.mark.parametrize("argv", [["cpu", "--out", "-"], ["sources", "--out", "-"]])
def test_out_dash_is_refused_naming_the_fix(argv: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``--out`` is a folder of result files: ``-`` (stdout) cannot take them, and no folder
    named ``-`` is made."""
    from bench.__main__ import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert "give a folder, e.g. bench/results" in capsys.readouterr().err


def test_per_sample_json_dash_is_stdout(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from bench import persample

    monkeypatch.setattr(persample, "_run", lambda args: {"workload": "stand-in"})
    assert persample.main(["compare", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"workload": "stand-in"} and "wrote" not in out + err
