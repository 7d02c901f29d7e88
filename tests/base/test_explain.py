import re
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed._base.explain import MEANINGS, explain, ring_findings
from gpufeed._base.stats import LoaderStats, StageStats
from gpufeed._tools.profiler import profile

SRC = Path(gpufeed.__file__).parent
README = SRC.parents[1] / "docs" / "guides" / "stats.md"  # "Reading loader.stats()"


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
    lines = explain(snapshot(fallback=0))
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
