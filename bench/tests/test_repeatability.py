"""Shorter ``gpufeed bench`` invocations replayed from long ones (bench/repeatability.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.repeatability import ESTIMATORS, agreement, comparisons, load, main

OURS = ESTIMATORS["faster halves (gpufeed bench)"]


def _bench_json(path: Path, runs: dict[tuple[str, str, int], list[float]]) -> Path:
    rows = [{"loader": k[0], "path": k[1], "num_workers": k[2], "spread": {"runs": v}}
            for k, v in runs.items()]
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_comparisons_are_the_rows_bench_prints() -> None:
    keys = [("torch", "per-sample", 2), ("gpufeed", "per-sample", 2), ("torch", "array", 2),
            ("gpufeed", "array", 2)]
    assert [name for name, _, _ in comparisons(keys)] == [
        "gpufeed vs stock, per-sample, 2 workers", "gpufeed vs stock, array, 2 workers",
        "batched-path gain, array, 2 workers"]


def test_windows_of_consecutive_rounds_against_the_next_invocation() -> None:
    steady = {("torch", "array", 0): [1.0] * 10, ("gpufeed", "array", 0): [3.0] * 10}
    slower = {("torch", "array", 0): [1.0] * 10, ("gpufeed", "array", 0): [2.0] * 10}
    a = agreement([steady, steady, slower], OURS, n=7)
    # 4 windows of 7 in 10 rounds: 16 window pairs per invocation pair, one row each
    assert (a.pairs, a.rows) == (32, 32)
    assert a.pairs_agreed == 16 and a.row_share == 0.5  # 3x then 2x: a third off
    assert a.worst == pytest.approx(1 / 3)


def test_faster_halves_ignore_slowdowns_that_move_the_median() -> None:
    """Runs that are only ever slowed down: the faster halves hold, the medians do not."""
    quiet = {("torch", "getitems", 2): [10, 10, 10, 10, 10],
             ("gpufeed", "getitems", 2): [40, 40, 40, 40, 40]}
    noisy = {("torch", "getitems", 2): [10, 6, 10, 6, 6],
             ("gpufeed", "getitems", 2): [40, 40, 40, 40, 40]}
    assert agreement([quiet, noisy], OURS, n=5).pair_share == 1.0
    assert agreement([quiet, noisy], ESTIMATORS["ratio of medians"], n=5).pair_share == 0.0


def test_bad_input_is_named(tmp_path: Path) -> None:
    inv = {("torch", "array", 0): [1.0] * 3, ("gpufeed", "array", 0): [2.0] * 3}
    with pytest.raises(ValueError, match="at least two"):
        agreement([inv], OURS, n=3)
    with pytest.raises(ValueError, match=r"n=4 runs per row.*from 1 to 3"):
        agreement([inv, inv], OURS, n=4)


def test_main_reads_bench_json_and_prints_the_table(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    runs = {("torch", "array", 0): [1.0, 1.1, 0.9, 1.0], ("gpufeed", "array", 0): [5.0] * 4}
    files = [_bench_json(tmp_path / f"b{i}.json", runs) for i in range(3)]
    assert load(files)[0] == runs
    assert main([*map(str, files), "--runs", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | faster halves (gpufeed bench) | 100.0% | 100.0% of 8 |" in out
    assert main([*map(str, files), "--runs", "9"]) == 2
    assert "from 1 to 4" in capsys.readouterr().err


def test_invocations_without_comparisons_or_rows_are_named() -> None:
    only_stock = {("torch", "array", 0): [1.0] * 3}
    with pytest.raises(ValueError, match="no comparison in the first invocation"):
        agreement([only_stock, only_stock], OURS, n=3)
    both = {("torch", "array", 0): [1.0] * 3, ("gpufeed", "array", 0): [2.0] * 3}
    with pytest.raises(ValueError, match=r"invocation 2 has no row \('gpufeed', 'array', 0\)"):
        agreement([both, only_stock], OURS, n=3)
