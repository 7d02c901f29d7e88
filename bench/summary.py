"""The verdict of one workload of the CPU benchmark: the best stock and gpufeed figures, their
ratio against the target, peak PSS on equal work (NOTE [ Equal work for memory ] in
``bench/cpu.py``), and each best as a share of its variant's no-loader ceiling.

NOTE [ Main-process bound ]
---------------------------
A loader's share of the no-loader ceiling is bounded by what its main process spends per batch.
The ceiling's ``W`` processes spend ``c`` core-seconds per batch (their seconds over the
batches: they do nothing but the work, so their wall time is CPU time), and the loader's
workers spend about that on the same batches (the same work: their messages add to it, and
less contention for memory can take from it); the loader's main process adds ``m`` CPU
seconds per batch (``main_process_cpu_s_per_batch``; the iterating thread's alone with thread
workers, whose fetch is in the same process and counts in ``c``). On ``P`` usable cores the
loader then hands out at most ``min(P / (c + m), 1 / m, W / c)`` batches per second, whatever
its hand-off does: all the work on every core, the main thread's on one, the workers' on
theirs (as far as its workers cost what the ceiling's processes do). Over the ceiling's rate
this is the **main-process bound**, computed round by round: with two workers on two cores,
``c / (c + m)``. Where a loader's share sits at its bound, the
main process's CPU per batch is what is left to cut; a bound below a target says the target
needs a cheaper main process first. ``python -m bench.mainproc --step-us N``
adds N us of CPU per batch to the loop, to see how a rate answers that cost
(``bench/results/main-process.md``, round 17).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

__all__ = ["PSS_TOLERANCE", "TARGETS", "commit_label", "environment_line", "main_bound",
           "paired_ratio", "per_round", "summarize", "write_documents"]

#: Minimum ratio of samples/s, gpufeed's best over the stock loader's best (issue 2, item 6).
TARGETS: dict[str, float] = {"tabular": 15.0, "image-array": 3.0, "jpeg": 1.15}
#: Peak PSS passes when gpufeed's is at most the stock loader's times (1 + this): sampling noise.
PSS_TOLERANCE = 0.02


def per_round(runs: Sequence[dict[str, Any]], ref_runs: Sequence[dict[str, Any]],
              figure: Callable[[dict[str, Any], dict[str, Any]], float | None]) -> list[float]:
    """``figure(run, ref_run)`` for each round that has a run on both sides, where it is not
    None: the runs of one ``repeat`` (a run that failed in a round leaves that round out), or,
    for runs without the number, run ``k`` of each side."""
    if all("repeat" in r for r in (*runs, *ref_runs)):
        ref_of = {r["repeat"]: r for r in ref_runs}
        pairs = [(a, ref_of[a["repeat"]]) for a in runs if a["repeat"] in ref_of]
    else:
        pairs = list(zip(runs, ref_runs, strict=False))
    out = [figure(a, b) for a, b in pairs]
    return [x for x in out if x is not None]


def _ratio_of(key: str) -> Callable[[dict[str, Any], dict[str, Any]], float | None]:
    """A :func:`per_round` figure: ``run[key] / ref_run[key]``, None unless both have it."""
    return lambda a, b: a[key] / b[key] if a.get(key) and b.get(key) else None


def paired_ratio(runs: Sequence[dict[str, Any]], ref_runs: Sequence[dict[str, Any]],
                 key: str) -> float | None:
    """The median over rounds (:func:`per_round`) of each round's ``run[key] / ref_run[key]``;
    None without a pair that has the figure. Memory is compared this way:
    the sides alternate within a round, so a pair shares its round's conditions, while the
    process's PSS at a run's start moves by 10-50 MiB from round to round on these machines,
    which a ratio of the sides' medians takes from different rounds."""
    ratios = per_round(runs, ref_runs, _ratio_of(key))
    return statistics.median(ratios) if ratios else None


def summarize(name: str, rows: Sequence[dict[str, Any]],
              ceiling: Sequence[dict[str, Any]] = (), cores: int | None = None) -> dict[str, Any]:
    """Best stock figure, best gpufeed figure, their ratio and the targets' pass/miss, and each
    best as a share of the no-loader ceiling of its variant, with its main-process bound
    (NOTE [ Main-process bound ]; needs ``cores``, the usable cores).

    ``rows`` are the result rows of one workload (``loader``, ``variant``, ``median``, and
    ``runs`` in round order), ``ceiling`` its no-loader rows (the same, per variant)."""
    def best(loaders: Sequence[str]) -> dict[str, Any] | None:
        cands = [r for r in rows if r["loader"] in loaders]
        return max(cands, key=lambda r: r["median"]["samples_per_s"], default=None)

    def same_variant(loader: str, variant: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["loader"] == loader and r["variant"] == variant), None)

    def brief(r: dict[str, Any] | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {"loader": r["loader"], "variant": r["variant"], **r["median"]}

    stock, ours = best(["torch"]), best(["gpufeed", "gpufeed-thread"])
    out: dict[str, Any] = {"stock_best": brief(stock), "gpufeed_best": brief(ours),
                           "gpufeed_process_best": brief(best(["gpufeed"])),
                           "nodes_best": brief(best(["torchdata.nodes"])),
                           "target_ratio": TARGETS.get(name), "ratio": None, "ratio_pass": None,
                           "pss_ratio": None, "pss_pass": None, "pss_ratio_process": None,
                           "held_ratio": None,
                           "notes": [], "also": [],
                           "ceiling": _ceiling_summary(stock, ours, ceiling, cores)}
    if stock is None or ours is None:
        out["notes"].append("no comparison: the stock loader or gpufeed did not run")
        return out
    ratio = ours["median"]["samples_per_s"] / stock["median"]["samples_per_s"]
    out["ratio"] = ratio
    target = TARGETS.get(name)
    if target is not None:
        out["ratio_pass"] = ratio >= target
        if ratio < target:
            out["notes"].append(f"samples/s ratio {ratio:.2f}x misses the {target:g}x target "
                                f"by {100 * (1 - ratio / target):.0f}%")

    def pss_vs_stock(r: dict[str, Any]) -> tuple[float, dict[str, Any], bool]:
        """(peak PSS ratio to the stock loader on r's variant, that stock row, equal work)"""
        ref = same_variant("torch", r["variant"]) or stock
        n, ref_n = r["median"].get("samples"), ref["median"].get("samples")
        ratio = paired_ratio(r.get("runs", ()), ref.get("runs", ()), "peak_pss_bytes")
        if ratio is None:  # (rows without their runs)
            ratio = r["median"]["peak_pss_bytes"] / max(ref["median"]["peak_pss_bytes"], 1.0)
        return ratio, ref, n is None or ref_n is None or n == ref_n

    pss_ratio, ref, equal = pss_vs_stock(ours)
    out["pss_ratio"] = pss_ratio
    out["held_ratio"] = paired_ratio(ours.get("runs", ()), ref.get("runs", ()),
                                     "peak_held_bytes")
    out["pss_reference"] = {"loader": "torch", "variant": ref["variant"]}
    if not equal:  # NOTE [ Equal work for memory ]: no verdict on runs that read different data
        out["notes"].append(
            f"peak PSS not judged: the runs did unequal work ({ours['median']['samples']:,.0f} "
            f"vs {ref['median']['samples']:,.0f} samples timed); run whole epochs (no "
            "max_seconds)")
        return out
    out["pss_pass"] = pss_ratio <= 1 + PSS_TOLERANCE
    if not out["pss_pass"]:
        out["notes"].append(f"peak PSS {pss_ratio:.2f}x the stock loader's on the same variant")
    proc = best(["gpufeed"])  # the judged row may be the thread loader: show the process one too
    if proc is not None and proc is not ours:
        ratio, _, equal = pss_vs_stock(proc)
        out["pss_ratio_process"] = ratio
        if equal and ratio > 1 + PSS_TOLERANCE:
            out["also"].append(f"gpufeed with process workers (its fastest variant, "
                               f"{proc['variant']}): peak PSS {ratio:.2f}x the stock loader's")
    return out


def _ceiling_summary(stock: dict[str, Any] | None, ours: dict[str, Any] | None,
                     ceiling: Sequence[dict[str, Any]], cores: int | None) -> dict[str, Any] | None:
    """Each best row's variant, that variant's no-loader ceiling, and the best as a share of it:
    the median over rounds of each round's share where the rows have their runs (the sides
    alternate within a round, so a pair shares its conditions), with the rounds' lowest and
    highest share and the main-process bound (NOTE [ Main-process bound ]); else the medians'
    ratio. None where no ceiling was measured."""
    if not ceiling:
        return None
    out: dict[str, Any] = {}
    for side, r in (("gpufeed", ours), ("stock", stock)):
        c = None if r is None else next((c for c in ceiling if c["variant"] == r["variant"]),
                                        None)
        rate = None if c is None else c["median"]["samples_per_s"]
        out[f"{side}_variant"] = None if r is None else r["variant"]
        out[f"{side}_variant_ceiling"] = rate
        out[f"{side}_of_ceiling"] = (None if r is None or not rate
                                     else r["median"]["samples_per_s"] / rate)
        if r is None or c is None:
            continue
        runs, c_runs = r.get("runs", ()), c.get("runs", ())
        shares = per_round(runs, c_runs, _ratio_of("samples_per_s"))
        if shares:
            out[f"{side}_of_ceiling"] = statistics.median(shares)
            out[f"{side}_of_ceiling_range"] = [min(shares), max(shares)]
        if cores:
            thread = r["loader"].endswith("-thread")
            bounds = per_round(runs, c_runs,
                               partial(main_bound, cores=cores, thread_workers=thread))
            if bounds:
                out[f"{side}_main_bound"] = statistics.median(bounds)
                out[f"{side}_main_us"] = 1e6 * statistics.median(
                    m for a in runs if (m := _main_cpu(a, thread)))
    return out


def _main_cpu(run: dict[str, Any], thread_workers: bool) -> float | None:
    return run.get("main_thread_cpu_s_per_batch" if thread_workers
                   else "main_process_cpu_s_per_batch")


def main_bound(run: dict[str, Any], ceiling_run: dict[str, Any], cores: int,
               thread_workers: bool = False) -> float | None:
    """The most of the ceiling run's rate (at most all of it) a loader whose main process
    spends what ``run``'s did per batch can reach on ``cores`` cores (NOTE [ Main-process
    bound ]); None without the figures."""
    m = _main_cpu(run, thread_workers)
    batches, seconds = ceiling_run.get("batches"), ceiling_run.get("seconds")
    each = ceiling_run.get("process_seconds")
    if not m or not batches or not seconds or not each:
        return None
    c = sum(each) / batches  # the ceiling's core-seconds per batch
    rate = min(cores / (c + m), 1 / m, len(each) / c)
    return min(rate / (batches / seconds), 1.0)


def machine_shared(env: dict[str, Any]) -> bool:
    """Whether other work ran as a benchmark started: the load average over the last minute,
    read at the start, at 1 or more."""
    return bool(env["loadavg_start"][0] >= 1.0)


def shared_machine_note(env: dict[str, Any]) -> str:
    """A sentence for a results file taken while other work ran (``machine_shared``), else an
    empty string."""
    load = env["loadavg_start"][0]
    if not machine_shared(env):
        return ""
    return (f"**The machine was shared with other work while this ran** (load average "
            f"{load:.2f} at start on {env['cpu_count']} cores): sides alternate within each "
            "round and the spread over rounds is given; compare sides within a row, not with "
            "other files.")


def paragraph(text: str) -> list[str]:
    """A markdown paragraph's lines: the text and a blank line, or none for no text."""
    return [text, ""] if text else []


# --- results files' header and writing --------------------------------------------------------

def commit_label(env: dict[str, Any]) -> str:
    """`` (<commit>[, dirty])`` of an ``environment()`` record (``gpufeed._tools.environment``),
    for a results header; "" outside a git checkout."""
    commit = env.get("git_commit")
    return f" ({commit[:10]}{', dirty' if env.get('git_dirty') else ''})" if commit else ""


def environment_line(env: dict[str, Any]) -> str:
    """The one-line header of a results file: date, machine, Python, torch, gpufeed and its
    commit, the load average at the start (of an ``environment()`` record)."""
    return (f"{env['date']} on `{env['hostname']}`: {env['cpu_model']}, {env['cpu_affinity']} "
            f"usable cores; Python {env['python']}, torch {env['torch']}, gpufeed "
            f"{env['gpufeed']}{commit_label(env)}; load average {env['loadavg_start'][0]:.2f} "
            "at start.")


def write_documents(doc: dict[str, Any], out: Path, stem: str,
                    markdown: str) -> tuple[Path, Path]:
    """Write ``doc`` as ``<stem>.json`` and ``markdown`` as ``<stem>.md`` into ``out``
    (created if needed)."""
    out.mkdir(parents=True, exist_ok=True)
    output_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    output_path.write_text(json.dumps(doc, indent=1) + "\n")
    md_path.write_text(markdown)
    return output_path, md_path
