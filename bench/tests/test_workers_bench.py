"""``python -m bench.workers``: a worker's epoch split into its parts."""

import json

import pytest

from bench.workers import PARTS, main, worker_budget


def _trace(spans):
    """A ``Trace.to_dict()`` with one worker track per entry of ``spans`` (name -> list of
    (start us, fetch us, collate us)) and a main-thread track that must be left out."""
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 0,
               "args": {"name": "main thread (your loop)"}},
              {"ph": "X", "name": "wait", "pid": 1, "tid": 0, "ts": 0, "dur": 10_000}]
    for tid, (name, batches) in enumerate(spans.items(), 1):
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
                       "args": {"name": name}})
        for start, fetch, collate in batches:
            events.append({"ph": "X", "name": "fetch", "pid": 1, "tid": tid, "ts": start,
                           "dur": fetch})
            events.append({"ph": "X", "name": "collate", "pid": 1, "tid": tid,
                           "ts": start + fetch, "dur": collate})
    return {"traceEvents": events}


def test_worker_budget_splits_each_workers_span():
    rows = worker_budget(_trace({
        "worker 1 (pid 8)": [(0, 4000, 100), (4300, 4000, 100), (8500, 9000, 100)],
        "worker 0 (pid 7)": [(1000, 2000, 0), (3000, 2000, 0)],
    }))
    assert [r["worker"] for r in rows] == ["worker 0 (pid 7)", "worker 1 (pid 8)"]
    w1 = rows[1]
    assert w1["batches"] == 3 and w1["span_ms"] == pytest.approx(17.6)
    assert w1["median_fetch_ms"] == pytest.approx(4.0)
    assert w1["parts_ms"] == pytest.approx({
        "fetch at the median": 12.0, "fetch above the median": 5.0, "pack": 0.3,
        "between batches": 0.3})
    assert list(w1["parts_ms"]) == list(PARTS)
    assert sum(w1["parts_ms"].values()) == pytest.approx(w1["span_ms"])
    assert rows[0]["parts_ms"]["between batches"] == pytest.approx(0.0)


def test_quick_run_writes_rounds(tmp_path, capsys):
    out = tmp_path / "w.json"
    assert main(["--quick", "--workload", "tabular", "--variant", "array", "--rounds", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["environment"]["torch"] and doc["environment"]["date"]
    (r,) = doc["rounds"]
    assert r["loader"]["samples_per_s"] > 0 and r["ceiling"]["samples_per_s"] > 0
    assert len(r["loader"]["workers"]) == 2
    for w in r["loader"]["workers"]:
        assert w["batches"] > 0 and w["parts_ms"]["fetch at the median"] > 0
    assert "no-loader ceiling" in capsys.readouterr().out
