"""``python -m bench.lane``: a worker's cost per gathered batch, three ways."""

from __future__ import annotations

import json

import pytest

from bench import lane as bench
from gpufeed._host.lane import GatherLane


def test_quick_run_writes_every_way(tmp_path, capsys):
    out = tmp_path / "lane.json"
    assert bench.main(["--rows", "4096", "--batches", "12", "--slots", "4", "--repeats", "1",
                       "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    best = doc["us_per_batch_best"]
    assert set(best) == {"bare gather", "general way", "gather lane"}
    assert all(0 < us < 1e6 for us in best.values())
    assert {"date", "torch"} <= set(doc["environment"])
    assert "beside the bare gather" in capsys.readouterr().out


def test_a_lane_giving_other_bytes_is_caught(monkeypatch):
    """The tool checks the lane against the general way before timing either."""
    run = GatherLane.run

    def off_by_one_row(self, fetcher, k, slot, writer):
        return run(self, fetcher, k + 1, slot, writer)

    monkeypatch.setattr(GatherLane, "run", off_by_one_row)
    with pytest.raises(RuntimeError, match="differs"):
        bench.measure(rows=4096, batches=12, slots=4, repeats=1)
