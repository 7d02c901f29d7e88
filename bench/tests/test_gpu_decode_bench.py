"""The GPU decode benchmark (bench/gpu_decode.py) without a GPU: it skips cleanly, and its
logic (sides alternating, CPU cores idle, the pixel comparison, the result files) runs on the
CPU with tiny sizes (``--cpu-check``: the GPU side then falls back to the CPU decode)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("simplejpeg")
pytest.importorskip("PIL")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(REPO))
    sys.modules.pop("bench.gpu_decode", None)
    import bench.gpu_decode as module

    return module


def test_without_cuda_it_skips_and_writes_nothing(bench, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out", str(tmp_path / "out")]) == 0
    assert "skipped" in capsys.readouterr().out and not (tmp_path / "out").exists()


def test_cpu_check_runs_every_side_and_writes_results(bench, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench.main(["--cpu-check", "--images", "16", "--batch-size", "8", "--workers", "0",
                       "--rounds", "2", "--pixel-images", "8", "--out", str(out),
                       "--cache", str(tmp_path / "cache")]) == 0
    doc = json.loads((out / "gpu_decode.json").read_text())
    assert doc["schema"] == "gpufeed-bench-gpu-decode/1"
    assert set(doc["sides"]) == {"gpu", "cpu", "stock-pillow"}
    for side in doc["sides"].values():
        assert len(side["runs"]) == 2 and side["images_per_s"] > 0
        assert side["spread"][0] <= side["images_per_s"] <= side["spread"][1]
    assert doc["pixels_gpu_vs_cpu"]["max"] == 0  # (the CPU decodes both sides here)
    assert "| gpu |" in (out / "gpu_decode.md").read_text()
