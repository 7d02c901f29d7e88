"""The measuring helpers (gpufeed._measure) and the benchmark harness (gpufeed.benchmarks)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from gpufeed._measure import batch_samples_and_bytes, measure_loader, process_tree_pss
from gpufeed.benchmarks import build
from gpufeed.benchmarks.__main__ import main, render_markdown
from gpufeed.benchmarks.cpu import summarize

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
        time.sleep(0.1)  # building the loader is not timed
        built.append(1)
        return _paced(10, first_s=0.05, step_s=0.02)

    m = measure_loader(make, warmup_batches=2, sample_memory=False)
    assert built == [1]
    assert (m.batches, m.samples, m.warmup_batches) == (8, 80, 2)
    assert 0.05 <= m.first_batch_s < 0.05 + 0.09  # slack for a busy machine
    assert 8 * 0.02 <= m.seconds < 8 * 0.02 + 0.12  # the warm-up batches' time is excluded
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


def test_sampler_catches_a_short_peak() -> None:
    def spike() -> Iterator[torch.Tensor]:
        for k in range(6):
            if k == 3:
                block = np.ones(128 * MiB, dtype=np.uint8)  # touched: resident
                time.sleep(0.6)  # a slow sample (big process) stretches the interval
                del block
            yield torch.zeros(2)

    m = measure_loader(spike, warmup_batches=1)
    assert m.memory_samples >= 4
    assert m.pss_growth_bytes >= 100 * MiB


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
    def row(loader: str, variant: str, rate: float, pss: float) -> dict[str, object]:
        return {"loader": loader, "variant": variant,
                "median": {"samples_per_s": rate, "bytes_per_s": 0.0, "peak_pss_bytes": pss,
                           "pss_growth_bytes": 0.0, "first_batch_s": 0.0}}

    rows = [row("torch", "per-sample", 100.0, 10.0), row("torch", "getitems", 300.0, 20.0),
            row("gpufeed", "getitems", 900.0, 19.0), row("gpufeed-thread", "array", 3300.0, 9.0)]
    sm = summarize("image-array", rows)
    assert sm["stock_best"]["variant"] == "getitems"
    assert sm["gpufeed_best"]["loader"] == "gpufeed-thread"
    assert sm["ratio"] == pytest.approx(11.0) and sm["ratio_pass"] is True
    assert sm["gpufeed_process_best"]["samples_per_s"] == 900.0
    sm = summarize("tabular", rows[:3])
    assert sm["ratio"] == pytest.approx(3.0) and sm["ratio_pass"] is False
    assert sm["pss_ratio"] == pytest.approx(19.0 / 20.0) and sm["pss_pass"] is True
    assert "misses the 15x target by 80%" in sm["notes"][0]


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
    assert "wrote" in capsys.readouterr().out
    assert not psutil.Process().children()  # every worker is gone


def test_gpu_subcommand_is_handed_its_arguments(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib
    import types

    seen: list[list[str]] = []
    fake = types.ModuleType("gpufeed.benchmarks.gpu")
    fake.main = lambda argv: seen.append(list(argv)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gpufeed.benchmarks.gpu", fake)
    assert main(["gpu", "--out", "x"]) == 0 and seen == [["--out", "x"]]

    def missing(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert main(["gpu"]) == 2
    assert "not part of this checkout" in capsys.readouterr().err
