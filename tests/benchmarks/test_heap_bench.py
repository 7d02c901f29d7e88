"""``python -m gpufeed.benchmarks.heap``: the worker heap's A/B, each run a new interpreter."""

import json

import pytest

from gpufeed._memory import heap
from gpufeed.benchmarks.heap import SIDES, main, one_run, summarize


def test_quick_run_writes_every_side_and_the_ratios(tmp_path, capsys):
    assert main(["--quick", "--rounds", "1", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "heap-image-array-per-sample.json").read_text())
    (run,) = doc["rounds"]
    assert set(run) == set(SIDES)
    assert all(r["samples_per_s"] > 0 and r["batches"] > 0 for r in run.values())
    assert set(doc["summary"]["ratios"]) == {"gpufeed / stock",
                                             "gpufeed / gpufeed, heap left alone"}
    md = (tmp_path / "heap-image-array-per-sample.md").read_text()
    assert "| gpufeed, heap left alone |" in md and doc["environment"]["git_commit"] is not None
    assert "gpufeed / stock" in capsys.readouterr().out


def test_the_left_alone_side_turns_the_follower_off(monkeypatch):
    monkeypatch.setattr(heap, "FOLLOW", True)
    one_run("gpufeed, heap left alone", "image-array", "per-sample", quick=True)
    assert heap.FOLLOW is False and not heap.HeapFollower().active
    one_run("gpufeed", "image-array", "per-sample", quick=True)
    assert heap.FOLLOW is True


def test_summary_ratios_are_per_round():
    def side(rate):
        return {"samples_per_s": rate, "worker_faults_per_batch": 1.0, "batches": 1}

    rounds = [{"stock": side(10), "gpufeed, heap left alone": side(20), "gpufeed": side(40)},
              {"stock": side(20), "gpufeed, heap left alone": side(20), "gpufeed": side(30)}]
    ratios = summarize(rounds)["ratios"]
    assert ratios["gpufeed / stock"] == {"median": 2.75, "min": 1.5, "max": 4.0}
    assert ratios["gpufeed / gpufeed, heap left alone"]["max"] == pytest.approx(2.0)


def test_rounds_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        main(["--quick", "--rounds", "0", "--out", str(tmp_path)])
