import pickle
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed._base.stats import (
    MEANINGS,
    LoaderStats,
    StageStats,
    StatsRecorder,
    format_table,
    percentile,
    ring_findings,
)
from gpufeed._tools.profiler import profile

SRC = Path(gpufeed.__file__).parent
README = SRC.parents[1] / "docs" / "guides" / "stats.md"  # "Reading loader.stats()"


def test_percentile_interpolates_and_handles_edges():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    values = [float(i) for i in range(101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile([0.0, 1.0], 50) == pytest.approx(0.5)


def test_stage_totals_percentiles_and_counters():
    rec = StatsRecorder()
    for i in range(100):
        rec.add("fetch", busy_s=(i + 1) / 1000)
    rec.add("wait", blocked_s=0.25)
    rec.add("step", busy_s=0.75)
    rec.count("ring_fallback")
    rec.count("samples", 64)
    rec.count("samples", 64)
    snap = rec.snapshot()
    fetch = snap.stages["fetch"]
    assert fetch.batches == 100
    assert fetch.busy_s == pytest.approx(sum(range(1, 101)) / 1000)
    assert fetch.blocked_s == 0.0
    assert fetch.p50_s == pytest.approx(0.0505)
    assert fetch.p99_s == pytest.approx(0.09901)
    assert fetch.mean_s == pytest.approx(0.0505)
    assert snap.counters == {"ring_fallback": 1, "samples": 128}
    assert snap.input_bound == pytest.approx(0.25)
    assert snap.wall_s > 0


def test_ring_window_keeps_only_recent_batches():
    rec = StatsRecorder(window=10)
    for _ in range(50):
        rec.add("fetch", busy_s=1.0)
    for _ in range(10):
        rec.add("fetch", busy_s=0.001)
    s = rec.snapshot().stages["fetch"]
    assert s.batches == 60
    assert s.busy_s == pytest.approx(50.01)
    assert s.p99_s == pytest.approx(0.001)  # the slow batches fell out of the window


def test_occupancy_mean_max_capacity():
    rec = StatsRecorder()
    for used in (1, 3, 2):
        rec.occupancy("ring", used, 4)
    s = rec.snapshot().stages["ring"]
    assert (s.occupancy_mean, s.occupancy_max, s.capacity, s.batches) == (2.0, 3, 4, 0)


def test_handout_records_what_add_count_occupancy_and_gauge_record():
    """``handout`` is one lock round trip for what a batch handed out records, and records
    exactly what the separate calls would."""
    one, many = StatsRecorder(window=3), StatsRecorder(window=3)
    for k, (step, wait) in enumerate([(None, 0.5), (0.25, 0.125), (0.75, 0.0625),
                                      (0.5, 0.25), (1.0, 0.375)]):
        occupancy = [("ring", k % 3, 4), ("prefetch", 5 - k, 6)]
        gauges = [("ring_slots", k), ("ring_bytes", 4096 * k)]
        one.handout(step, wait, 8 if k else None, occupancy, gauges)
        if step is None:
            many.add("startup", blocked_s=wait)
        else:
            many.add("step", busy_s=step)
            many.add("wait", blocked_s=wait)
        many.count("batches")
        if k:
            many.count("samples", 8)
        for o in occupancy:
            many.occupancy(*o)
        for g in gauges:
            many.gauge(*g)
    a, b = one.snapshot().to_dict(), many.snapshot().to_dict()
    del a["wall_s"], b["wall_s"]
    assert a == b
    assert a["stages"]["wait"]["batches"] == 4 and a["counters"]["ring_slots"] == 4


def test_snapshot_is_frozen_picklable_and_renders():
    rec = StatsRecorder()
    rec.add("wait", blocked_s=0.1)
    rec.add("step", busy_s=0.3)
    rec.occupancy("ring", 2, 8)
    rec.count("batches")
    snap = rec.snapshot()
    with pytest.raises(AttributeError):
        snap.wall_s = 1.0  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(snap))
    assert again == snap
    text = str(snap)
    assert "input-bound: 25%" in text and "wait" in text and "2.0/8" in text
    d = snap.to_dict()
    assert d["stages"]["step"]["busy_s"] == pytest.approx(0.3)
    assert d["counters"] == {"batches": 1}


def test_input_bound_none():
    rec = StatsRecorder()
    rec.add("fetch", busy_s=1.0)
    assert rec.snapshot().input_bound is None
    assert LoaderStats(wall_s=0.0).input_bound is None
    assert StageStats("x", 0, 0.0, 0.0, 0.0, 0.0, 0.0).mean_s == 0.0


def test_bad_window_names_the_value():
    with pytest.raises(ValueError, match=r"window must be a positive int.*0"):
        StatsRecorder(window=0)


def test_threads_do_not_lose_updates():
    rec = StatsRecorder(window=64)

    def work():
        for _ in range(2000):
            rec.add("fetch", busy_s=0.001)
            rec.count("batches")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = rec.snapshot()
    assert snap.stages["fetch"].batches == 8000
    assert snap.counters["batches"] == 8000


def test_add_is_cheap():
    rec = StatsRecorder()
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        rec.add("fetch", 0.001, 0.0)
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 20e-6  # contract: a few microseconds; generous for a loaded 2-core box


def test_format_table_aligns():
    text = format_table(["a", "bb"], [["x", 1], ["yyy", 22]])
    lines = text.splitlines()
    assert lines[0] == "a    bb"
    assert lines[2] == "x     1"
    assert lines[3] == "yyy  22"


def test_every_stat_the_core_reports_has_a_meaning():
    reported = set()
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        reported |= set(re.findall(r"\.(?:add|add_many|count|gauge|occupancy)\(\s*\"([a-z_]+)\"",
                                   text))
        # handout's stages and counters (step, wait, startup, batches, samples) and the
        # (stage, ...) tuples passed to it, on lines that build them: occupancy = [("ring", ...)],
        # occupancy.append(("prefetch", ...)), return occupancy, (("ring_slots", ...), ...)
        reported |= set(re.findall(r"_stage\(\"([a-z_]+)\"\)", text))
        reported |= set(re.findall(r"counters\[\"([a-z_]+)\"\]", text))
        for line in text.splitlines():
            if "occupancy" in line:
                reported |= set(re.findall(r"\(\"([a-z_]+)\", ", line))
    assert {"fetch", "collate", "startup", "wait", "step", "ring", "prefetch", "ring_fallback",
            "samples", "ring_slots", "ring_bytes", "ring_fenced"} <= reported
    assert reported <= set(MEANINGS), reported - set(MEANINGS)


def test_readme_gives_every_meaning():
    # the README's list, or a guide of the docs site (a figure added since the README's list)
    guides = sorted((SRC.parents[1] / "docs").rglob("*.md"))
    text = "\n".join(p.read_text() for p in [README, *guides])
    for name, meaning in MEANINGS.items():
        assert f"- `{name}`: {meaning}" in text, name


def stage(name, batches=0, occ_mean=0.0, occ_max=0, cap=0):
    return StageStats(name, batches, 0.0, 0.0, 0.0, 0.0, 0.0, occ_mean, occ_max, cap)


def snapshot(fallback, batches=157, ring=(140.0, 157, 157), flight=(20.0, 40, 150),
             grows=157):
    return LoaderStats(1.0, {"wait": stage("wait", batches), "ring": stage("ring", 0, *ring),
                             "prefetch": stage("prefetch", 0, *flight)},
                       {"batches": batches, "ring_grow": grows, "ring_fallback": fallback})


def test_held_batches_are_named_with_the_fix():
    # the loop: it kept every batch's labels; the ring (room for the 150 batches
    # allowed in flight) was full and 10 of 157 batches fell back
    lines = ring_findings(snapshot(fallback=20))
    assert lines[0].startswith("ring_fallback: 20 of 157 batches (13%)")
    assert "batches held by your loop" in lines[1] and "t.clone()" in lines[1]
    assert len(lines) == 2


def test_held_batches_seen_below_a_full_ring():
    # measured with an adaptive prefetch: the ring grew, so its sampled occupancy stayed
    # under the last capacity, but it held 32 slots more than the batches in flight
    held = ring_findings(snapshot(fallback=38, batches=128, ring=(67.9, 86, 122),
                                  flight=(35.5, 64, 120), grows=86))
    assert "batches held by your loop" in held[1]
    # the same ring in a loop that keeps nothing: 2 slots beyond the batches in flight
    assert "cause not visible" in ring_findings(
        snapshot(fallback=38, batches=128, ring=(37.5, 86, 122), flight=(35.5, 64, 120),
                 grows=86))[1]


def test_small_budget_and_variable_shapes():
    small = ring_findings(snapshot(fallback=100, ring=(8.0, 8, 8), flight=(10.0, 20, 40),
                                   grows=8))
    assert "ring budget is too small: 8 slots for up to 40" in small[1]
    assert "ring_bytes= of at least 42 batches" in small[1]
    varying = ring_findings(snapshot(fallback=60, ring=(30.0, 50, 157), grows=900))
    assert len(varying) == 2 and "variable batch shapes: 900 slots carved" in varying[1]
    assert "pad to fixed shapes" in varying[1]


def test_low_fallback_share_or_no_ring_says_nothing():
    assert ring_findings(snapshot(fallback=5)) == []  # 3%: the ring was growing
    assert ring_findings(LoaderStats(1.0, {}, {"batches": 10})) == []


def test_explain_covers_what_the_snapshot_shows():
    lines = snapshot(fallback=0).explain().splitlines()
    names = [line.split(":")[0] for line in lines]
    assert {"wait", "ring", "prefetch", "batches", "ring_grow", "ring_fallback",
            "occupancy"} <= set(names)
    assert "fetch" not in names  # not in this snapshot: not explained


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("prefetch", [None, 2])  # adaptive (the ring grows) or fixed
def test_a_loop_that_keeps_labels_is_diagnosed(keep, prefetch):
    # 512 batches: twice the most an adaptive loader keeps in flight with 2 workers (its ring
    # grows to that), so kept labels fill the ring however fast the machine is
    ds = gpufeed.sources.ArrayDataset(np.zeros((8192, 16), np.float32), np.arange(8192))
    loader = gpufeed.DataLoader(ds, batch_size=16, num_workers=2, prefetch_factor=prefetch)
    kept = []
    report = profile(loader, (lambda b: kept.append(b[1])) if keep else (lambda b: None))
    text = str(report)
    assert "what the figures mean:" in text and "ring_fallback: batches that found" in text
    assert ("cause: batches held by your loop" in text) is keep
    assert report.to_dict()["loader_stats"]["counters"]["batches"] == 512
