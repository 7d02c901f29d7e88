"""python -m bench.timeline: runs and writes its results (not its figures)."""

import json

from bench.timeline import MODES, main


def test_the_timeline_benchmark_writes_its_results(tmp_path, capsys):
    assert main(["--quick", "--repeats", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "timeline.json").read_text())
    assert set(doc["modes"]) == set(MODES)
    assert all(len(doc["modes"][m]["runs"]) == 2 for m in MODES)
    for mode in ("on", "on-last"):
        assert doc["modes"][mode]["throughput_ratio"]["median"] > 0
    assert doc["main_thread"]["phase_pairs"] >= 1 and doc["recorder"]["per_batch_ns"] > 0
    text = (tmp_path / "timeline.md").read_text()
    assert "| on |" in text and "switched on and off" in text
    assert text in capsys.readouterr().out
