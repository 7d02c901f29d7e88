"""``python -m bench autotune``: its verdicts on a made-up run, and a tiny real run
through the harness (figures mean nothing at this size)."""

from __future__ import annotations

import json

from bench import autotune as bench
from bench.autotune_report import render_markdown, summarize, write_results
from gpufeed._tools.environment import environment


def phase(rate, *, input_bound=0.02, converged_s=0.0, converged_batches=0, workers=1,
          pss=0, cpu=0.1):
    return {"rate": rate, "rate_whole": rate, "input_bound": input_bound, "cpu_cores": cpu,
            "pss_growth_bytes": pss, "workers_end": workers, "workers_max": workers,
            "converged_s": converged_s, "converged_batches": converged_batches}


def run(n, wt, *phases, **extra):
    return {"num_workers": n, "worker_type": wt, "phases": list(phases), **extra}


AUTO = dict(max_workers=16, budget_memory_bytes=1 << 30, budget_cpu_cores=2.0,
            decisions=["2 -> 4 workers at batch 9 (grow): ..."], decided=1)


def test_the_verdicts_judge_auto_against_the_best_static_setting():
    w = {"name": "x", "describe": "d", "sample_s": 0.001, "steps": [0.02, 0.002], "runs": [
        run(1, "process", phase(40), phase(60, input_bound=0.7)),
        run(8, "thread", phase(45, input_bound=0.01), phase(400, input_bound=0.03)),
        run("auto", "process", phase(43, converged_s=1.0, converged_batches=40),
            phase(350, input_bound=0.08, converged_s=12.0, converged_batches=250, workers=8),
            **AUTO),
        run("auto", "thread", phase(30, pss=2 << 30), phase(390, converged_s=3.0), **AUTO),
    ]}
    rows = {(r["phase"], r["auto"]): r for r in summarize(w)}
    p1 = rows[(0, "process")]
    assert p1["best"] == "thread 8" and p1["best_same_type"] == "process 1"
    assert p1["throughput_ok"] and p1["converged_ok"] and p1["input_bound_ok"]
    p2 = rows[(1, "process")]  # 350/400 < 0.9, converged after 12 s and 250 batches
    assert not p2["throughput_ok"] and not p2["converged_ok"] and not p2["input_bound_ok"]
    t1 = rows[(0, "thread")]
    assert not t1["throughput_ok"] and not t1["budgets_ok"]  # 2 GiB over a 1 GiB budget
    assert rows[(1, "thread")]["throughput_ok"]
    doc = {"environment": environment(), "settings": {"seconds_static": 3, "seconds_auto": 12,
                                                       "warm_s": 0.5, "quick": False},
           "workloads": [{**w, "summary": summarize(w), "tune": []}]}
    text = render_markdown(doc)
    assert "| 2 (step 2 ms) | process | 350 (350) | thread 8: 400 | 0.88 |" in text
    assert "**miss**" in text and "2 -> 4 workers at batch 9" in text


def test_a_tiny_run_through_the_harness(tmp_path):
    grid = [(1, "thread"), ("auto", "thread")]
    workloads = bench.run_autotune(["step"], seconds_static=0.6, seconds_auto=0.8, grid=grid,
                                   with_tune=False)
    (w,) = workloads
    assert [(r["num_workers"], r["worker_type"]) for r in w["runs"]] == grid
    auto = w["runs"][1]
    assert auto["max_workers"] >= 2 and auto["phases"][0]["batches"] > 0
    w["summary"] = summarize(w)
    doc = {"environment": environment(), "settings": {"seconds_static": 0.6,
                                                      "seconds_auto": 0.8, "warm_s": 0.5,
                                                      "quick": True}, "workloads": workloads}
    output_path, md_path = write_results(doc, tmp_path)
    assert json.loads(output_path.read_text())["workloads"][0]["name"] == "step"
    assert "## step:" in md_path.read_text()
