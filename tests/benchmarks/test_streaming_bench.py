"""``python -m gpufeed.benchmarks.streaming``: per-sample batches collated as the samples come
against at the end, side by side with the stock loader."""

import json

import pytest

from gpufeed._host import streaming
from gpufeed.benchmarks.streaming import SIDES, WORKLOADS, main


def test_quick_run_writes_every_workload_and_side(tmp_path, capsys):
    assert main(["--quick", "--rounds", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "streaming.json").read_text())
    assert list(doc["results"]) == list(WORKLOADS)
    for sides in doc["results"].values():
        assert set(sides) == set(SIDES)
        assert all(r["samples_per_s"] > 0 and r["peak_pss_mib"] > 0
                   for runs in sides.values() for r in runs)
    md = (tmp_path / "streaming.md").read_text()
    assert "| pillow-crop | gpufeed, collated at the end |" in md
    assert streaming.ENABLED and "samples/s" in capsys.readouterr().out


def test_rounds_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        main(["--quick", "--rounds", "0", "--out", str(tmp_path)])
