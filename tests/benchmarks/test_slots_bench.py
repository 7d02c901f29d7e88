"""``python -m gpufeed.benchmarks.slots``: slots bound when a task starts against at
dispatch, side by side with the stock loader."""

import json

import pytest

from gpufeed._host import late_slots
from gpufeed.benchmarks.slots import SIDES, main, run_step


def test_quick_run_writes_every_side_and_both_parts(tmp_path, capsys):
    assert main(["--quick", "--rounds", "1", "--batches", "6", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "slots.json").read_text())
    assert set(doc["jpeg"]) == set(SIDES)
    assert all(r["samples_per_s"] > 0 and r["peak_pss_mib"] > 0 for runs in doc["jpeg"].values()
               for r in runs)
    assert doc["jpeg"]["stock"][0]["slots"] is None
    assert [(row["source"], row["step_s"]) for row in doc["steps"]] == [
        (False, 0.0), (False, 0.03), (True, 0.0), (True, 0.03)]
    md = (tmp_path / "slots.md").read_text()
    assert "| gpufeed, slots at dispatch |" in md and "| batch source | 30 |" in md
    assert doc["environment"]["git_commit"] is not None and late_slots.ENABLED
    assert "samples/s" in capsys.readouterr().out


def test_the_dispatch_side_binds_every_slot_at_dispatch(monkeypatch):
    """The A side is the old behaviour: tasks never go out LATE; the B side's do. How many
    slots each carves depends on how the workers and the main process share the cores, so
    that comparison is the benchmark's figure, not this test's (which queued tasks hold no
    slot is tested without timing in tests/host/test_late_slots.py)."""
    monkeypatch.setattr(late_slots, "LATE_DELAY_MAX", 1e9)  # rule (e) is not this test's
    eager = run_step("gpufeed, slots at dispatch", False, 0.0, batches=6, num_workers=2)
    late = run_step("gpufeed", False, 0.0, batches=6, num_workers=2)
    assert not eager["late_at_end"] and late["late_at_end"]
    assert late_slots.ENABLED
    assert eager["slots"] >= 1 and late["slots"] >= 1 and eager["seconds"] > 0


def test_rounds_and_batches_must_be_positive(tmp_path):
    for bad in (["--rounds", "0"], ["--batches", "2"]):
        with pytest.raises(SystemExit):
            main(["--quick", *bad, "--out", str(tmp_path)])
