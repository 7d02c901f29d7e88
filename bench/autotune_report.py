"""The verdicts of ``python -m bench autotune`` and its Markdown report.

Targets, per workload and phase, for each ``"auto"`` run against the grid's static runs:

- **throughput**: its steady rate (after its last change) within 10% of the best static rate;
- **converged**: its last change within ``CONVERGE_S`` seconds or ``CONVERGE_BATCHES`` batches
  of the phase's start;
- **input-bound**: under 5% wherever the best static setting is;
- **budgets**: never more workers than ``max_workers``, the tree's PSS growth within the
  memory budget, the CPU the tree used within the CPU budget (10% slack for the reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .summary import write_documents

__all__ = ["render_markdown", "summarize", "write_results"]

THROUGHPUT = 0.9
CONVERGE_S = 10.0
CONVERGE_BATCHES = 200
INPUT_BOUND = 0.05
CPU_SLACK = 1.1


def _cfg(run: dict[str, Any]) -> str:
    return f"{run['worker_type']} {run['num_workers']}"


def summarize(workload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (phase, auto run): its figures next to the best static run's, and the
    targets it met (True/False; None where a target does not apply)."""
    runs = workload["runs"]
    statics = [r for r in runs if r["num_workers"] != "auto"]
    rows = []
    for p in range(len(workload["steps"])):
        best = max(statics, key=lambda r: r["phases"][p]["rate"])
        b = best["phases"][p]
        for auto in (r for r in runs if r["num_workers"] == "auto"):
            a = auto["phases"][p]
            same = max((r for r in statics if r["worker_type"] == auto["worker_type"]),
                       key=lambda r: r["phases"][p]["rate"])
            ratio = a["rate"] / b["rate"] if b["rate"] else None
            rows.append({
                "phase": p, "step_s": workload["steps"][p], "auto": auto["worker_type"],
                "best": _cfg(best), "best_rate": b["rate"], "best_input_bound": b["input_bound"],
                "best_same_type": _cfg(same), "best_same_type_rate": same["phases"][p]["rate"],
                "rate": a["rate"], "rate_whole": a["rate_whole"], "ratio": ratio,
                "ratio_same_type": a["rate"] / same["phases"][p]["rate"]
                if same["phases"][p]["rate"] else None,
                "input_bound": a["input_bound"], "converged_s": a["converged_s"],
                "converged_batches": a["converged_batches"], "workers_end": a["workers_end"],
                "workers_max": a["workers_max"], "pss_growth_bytes": a["pss_growth_bytes"],
                "best_pss_growth_bytes": b["pss_growth_bytes"], "cpu_cores": a["cpu_cores"],
                "best_cpu_cores": b["cpu_cores"],
                "throughput_ok": ratio is not None and ratio >= THROUGHPUT,
                "converged_ok": a["converged_s"] <= CONVERGE_S
                or a["converged_batches"] <= CONVERGE_BATCHES,
                "input_bound_ok": None if (b["input_bound"] or 1) >= INPUT_BOUND
                else (a["input_bound"] or 0) < INPUT_BOUND,
                "budgets_ok": a["workers_max"] <= auto["max_workers"]
                and a["pss_growth_bytes"] <= auto["budget_memory_bytes"]
                and a["cpu_cores"] <= auto["budget_cpu_cores"] * CPU_SLACK,
            })
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ok(x: bool | None) -> str:
    return "n/a" if x is None else ("pass" if x else "**miss**")


def _tuned(workload: dict[str, Any], t: dict[str, Any], phase: int) -> str:
    rec = t["recommended"]
    n, kind = rec["num_workers"], rec.get("worker_type")
    found = [r for r in workload["runs"] if r["num_workers"] == n and r["worker_type"] == kind]
    rate = f"{found[0]['phases'][phase]['rate']:,.0f} batches/s in the grid" if found else (
        "not in the grid")
    return (f"{kind or 'main process'} {n} ({rate}; {t['trials']} trials, "
            f"{t['seconds']:.0f} s)")


def render_markdown(doc: dict[str, Any]) -> str:
    env, s = doc["environment"], doc["settings"]
    lines = [
        "# gpufeed autotuning benchmark", "",
        f"{env['date']} on `{env['hostname']}`: {env['cpu_model']}, {env['cpu_affinity']} usable "
        f"cores, {env['memory_bytes'] / 2**30:.0f} GiB; Python {env['python']}, torch "
        f"{env['torch']}, gpufeed {env['gpufeed']} ({(env.get('git_commit') or '?')[:10]}); "
        f"load average {env['loadavg_start'][0]:.2f} at start, "
        f"{env.get('loadavg_end', [float('nan')])[0]:.2f} at end"
        + (" (**a loaded machine: other jobs ran meanwhile**)" if max(
            env["loadavg_start"][0], env.get("loadavg_end", [0])[0]) > 1.5 * (
            env["cpu_affinity"] or 1) else "") + ".", "",
        f"Each configuration is a fresh loader in a training loop whose step is a sleep: static "
        f"settings {s['seconds_static']:g} s per phase (the first {s['warm_s']:g} s not "
        f"counted), `num_workers=\"auto\"` {s['seconds_auto']:g} s per phase from its default; "
        "one run each, configurations in rotating order." + (
            " **Quick mode: figures mean nothing.**" if s.get("quick") else ""), "",
        "Rate: batches/s (auto: after its last change in the phase, its steady rate; whole: "
        "the whole phase). Input-bound: the loop's time blocked in next() over wait + step. "
        "Converged: seconds (batches) from the phase's start to auto's last change. PSS: "
        "growth of the process tree's PSS over the loader's start (MiB). CPU: cores the tree "
        "used.", ""]
    for w in doc["workloads"]:
        lines += [f"## {w['name']}: {w['describe']}", "",
                  f"One sample takes {w['sample_s'] * 1e3:.2f} ms in the main process here.", "",
                  "| phase | auto | batches/s (whole) | best static | vs best | vs best of its "
                  "type | input-bound (best) | converged | workers end/max | PSS MiB (best) | "
                  "CPU (best) | throughput | converged | input-bound | budgets |",
                  "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
                  "--- | --- | --- | --- |"]
        for r in w["summary"]:
            lines.append(
                f"| {r['phase'] + 1} (step {r['step_s'] * 1e3:g} ms) | {r['auto']} | "
                f"{r['rate']:,.0f} ({r['rate_whole']:,.0f}) | {r['best']}: "
                f"{r['best_rate']:,.0f} | {r['ratio'] or 0:.2f} | "
                f"{r['ratio_same_type'] or 0:.2f} ({r['best_same_type']}) | "
                f"{_pct(r['input_bound'])} ({_pct(r['best_input_bound'])}) | "
                f"{r['converged_s']:.1f} s ({r['converged_batches']}) | "
                f"{r['workers_end']}/{r['workers_max']} | {_mib(r['pss_growth_bytes'])} "
                f"({_mib(r['best_pss_growth_bytes'])}) | {r['cpu_cores']:.2f} "
                f"({r['best_cpu_cores']:.2f}) | {_ok(r['throughput_ok'])} | "
                f"{_ok(r['converged_ok'])} | {_ok(r['input_bound_ok'])} | "
                f"{_ok(r['budgets_ok'])} |")
        for p, t in enumerate(w.get("tune", [])):
            lines.append(f"\n`gpufeed tune` with the phase {p + 1} step: "
                         f"{_tuned(w, t, p)}.")
        lines += ["", "<details><summary>every configuration</summary>", "",
                  "| config | phase | batches/s | input-bound | workers end | PSS MiB | CPU |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for run in w["runs"]:
            for p, ph in enumerate(run["phases"]):
                lines.append(f"| {_cfg(run)} | {p + 1} | {ph['rate']:,.0f} | "
                             f"{_pct(ph['input_bound'])} | {ph['workers_end']} | "
                             f"{_mib(ph['pss_growth_bytes'])} | {ph['cpu_cores']:.2f} |")
        autos = [r for r in w["runs"] if r["num_workers"] == "auto"]
        for run in autos:
            lines += ["", f"Decisions of auto ({run['worker_type']}), {run['decided']} in all, "
                      "the last ones:", ""]
            lines += [f"- {d}" for d in run["decisions"][-12:]]
        lines += ["", "</details>", ""]
    return "\n".join(lines) + "\n"


def write_results(doc: dict[str, Any], out: Path, stem: str = "autotune") -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out`` (created if needed)."""
    return write_documents(doc, out, stem, render_markdown(doc))
