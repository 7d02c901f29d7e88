"""The documentation's benchmark charts and headline table, drawn from the committed results.

    python -m bench.charts                 # writes docs/assets/charts/*.png
    python -m bench.charts --table         # prints the pages' tables (Markdown)

Nothing is measured here: every figure comes from the results JSON the benchmarks wrote
(``cpu.json``: stock vs gpufeed vs the no-loader ceiling per workload; ``autotune.json``: the
worker count ``num_workers="auto"`` chose over time). The results folder is ``bench/results``,
or ``benchmarks/results`` in a checkout that has not moved them yet; ``--results`` names another.
A share of the ceiling is the median over rounds of each round's share (a round runs both
sides back to back, so a pair shares its machine's conditions), as the CPU benchmark reports it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = (ROOT / "bench" / "results", ROOT / "benchmarks" / "results")
CHARTS = ROOT / "docs" / "assets" / "charts"


def results_dir() -> Path:
    """The committed results folder: the first of :data:`RESULTS` that holds ``cpu.json``."""
    for folder in RESULTS:
        if (folder / "cpu.json").is_file():
            return folder
    raise FileNotFoundError("no cpu.json under " + " or ".join(str(f) for f in RESULTS))


def _row(workload: dict[str, Any], loader: str, variant: str) -> dict[str, Any]:
    for row in workload["results"]:
        if row["loader"] == loader and row["variant"] == variant:
            return row
    raise KeyError(f"{workload['name']}: no {loader} row for the {variant} variant")


def _ceiling(workload: dict[str, Any], variant: str) -> dict[str, Any]:
    for row in workload["ceiling"]:
        if row["variant"] == variant:
            return row
    raise KeyError(f"{workload['name']}: no no-loader ceiling for the {variant} variant")


def _share(row: dict[str, Any], ceiling: dict[str, Any]) -> float:
    """The median over rounds of ``row``'s rate over the ceiling's in the same round."""
    ceil_of = {r["repeat"]: r["samples_per_s"] for r in ceiling["runs"] if "repeat" in r}
    shares = [r["samples_per_s"] / ceil_of[r["repeat"]] for r in row["runs"]
              if r.get("repeat") in ceil_of and r.get("samples_per_s")]
    if not shares:  # runs without round numbers: the medians' ratio
        return float(row["median"]["samples_per_s"] / ceiling["median"]["samples_per_s"])
    return float(statistics.median(shares))


def headline(cpu: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload: stock's best and gpufeed's best (samples/s, with their fetch variants),
    their ratio, and each as a share of its own variant's no-loader ceiling."""
    rows = []
    for w in cpu["workloads"]:
        s = w["summary"]
        stock, ours = s["stock_best"], s["gpufeed_best"]
        stock_row = _row(w, stock["loader"], stock["variant"])
        ours_row = _row(w, ours["loader"], ours["variant"])
        ours_ceiling = _ceiling(w, ours["variant"])
        rows.append({
            "workload": w["name"], "description": w["description"],
            "stock": stock["samples_per_s"], "stock_variant": stock["variant"],
            "gpufeed": ours["samples_per_s"], "gpufeed_variant": ours["variant"],
            "ratio": ours["samples_per_s"] / stock["samples_per_s"],
            "ceiling": ours_ceiling["median"]["samples_per_s"],
            "gpufeed_of_ceiling": _share(ours_row, ours_ceiling),
            "stock_of_ceiling": _share(stock_row, _ceiling(w, stock["variant"])),
        })
    return rows


def headline_table(cpu: dict[str, Any]) -> str:
    """:func:`headline` as the Markdown table the README and the benchmarks page show."""
    lines = ["| workload | stock (samples/s) | gpufeed (samples/s) | ratio "
             "| gpufeed, share of the no-loader ceiling |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in headline(cpu):
        lines.append(f"| {r['workload']} | {r['stock']:,.0f} | {r['gpufeed']:,.0f} "
                     f"| {r['ratio']:.2f}x | {r['gpufeed_of_ceiling']:.0%} |")
    return "\n".join(lines)


def _spread(s: dict[str, float], spec: str = ",.0f", unit: str = "") -> str:
    return f"{s['median']:{spec}}{unit} ({s['min']:{spec}}-{s['max']:{spec}}{unit})"


#: peers.json's sides, as the benchmarks page names them
PEER_SIDES = {
    "stock-process": "stock loader, process workers",
    "gpufeed-process": "gpufeed, process workers",
    "gpufeed-thread": "gpufeed, thread workers",
    "nodes-thread": "torchdata.nodes, thread `ParallelMapper`",
    "spdl-thread": "SPDL pipeline, threads",
}


def peers_table(peers: dict[str, Any]) -> str:
    """The per-sample side-by-side run (``peers.json``) as the benchmarks page shows it: each
    side's samples/s and CPU per sample, medians (min-max) over the rounds, and the thread
    workers over torchdata.nodes' threads, round by round."""
    lines = ["| side | samples/s | CPU us per sample |", "| --- | ---: | ---: |"]
    for side in peers["sides"]:
        r = peers["results"][side]
        lines.append(f"| {PEER_SIDES[side]} | {_spread(r['rate'])} | {_spread(r['cpu_us'])} |")
    if "thread_vs_nodes" in peers:
        lines += ["", "gpufeed's thread workers over torchdata.nodes' thread pipeline, round by "
                  f"round: {_spread(peers['thread_vs_nodes'], '.2f', 'x')} the samples/s, "
                  f"{_spread(peers['thread_cpu_vs_nodes'], '.2f', 'x')} the CPU per sample."]
    return "\n".join(lines)


def ray_table(ray: dict[str, Any]) -> str:
    """The Ray Data hand-off (``ray.json``'s part (a)) as the benchmarks page shows it: gpufeed
    against Ray's ``iter_torch_batches`` on the same materialized dataset, medians (min-max)
    over the rounds."""
    a = ray["handoff"]
    names = {"gpufeed": "gpufeed.DataLoader over the dataset",
             "ray iter_torch_batches": "Ray's `iter_torch_batches`"}
    lines = ["| side | samples/s | trainer CPU ms per batch |", "| --- | ---: | ---: |"]
    for side, name in names.items():
        lines.append(f"| {name} | {_spread(a['samples_per_s'][side])} "
                     f"| {_spread(a['cpu_ms_per_batch'][side], '.2f')} |")
    return "\n".join(lines)


def throughput_chart(cpu: dict[str, Any], path: Path) -> None:
    """Samples/s per workload, stock's best vs gpufeed's best vs gpufeed's variant's no-loader
    ceiling, on a log scale (the workloads span four orders of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = headline(cpu)
    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=120)
    width = 0.27
    sides = (("stock DataLoader", "stock", "#9e9e9e"), ("gpufeed", "gpufeed", "#1e88e5"),
             ("no-loader ceiling", "ceiling", "#43a047"))
    for k, (label, key, color) in enumerate(sides):
        xs = [i + (k - 1) * width for i in range(len(rows))]
        bars = ax.bar(xs, [r[key] for r in rows], width, label=label, color=color)
        if key == "gpufeed":
            for bar, r in zip(bars, rows, strict=True):
                ax.annotate(f"{r['ratio']:.1f}x", (bar.get_x() + width / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["workload"] for r in rows])
    ax.set_ylabel("samples/s (log scale)")
    env = cpu["environment"]
    ax.set_title(f"CPU benchmark: {cpu['settings']['num_workers']} workers, "
                 f"{env['cpu_affinity']} cores, torch {env['torch']} (median of "
                 f"{cpu['settings']['repeats']})", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _start_workers(decisions: list[str], fallback: int) -> int:
    """The worker count before the first decision (``"2 -> 4 workers ..."``)."""
    for d in decisions:
        m = re.match(r"(\d+) -> \d+ workers", d)
        if m:
            return int(m.group(1))
    return fallback


def trajectories(autotune: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload, the worker count of ``num_workers="auto"`` (process workers) over time:
    ``(seconds, workers)`` points across its phases, and where each phase began."""
    out = []
    for w in autotune["workloads"]:
        run = next((r for r in w["runs"] if r["num_workers"] == "auto"
                    and r["worker_type"] == "process"), None)
        if run is None:
            continue
        workers = _start_workers(run.get("decisions", []), run["phases"][0]["workers_end"])
        points, starts, t0 = [(0.0, workers)], [], 0.0
        for phase in run["phases"]:
            starts.append(t0)
            for at, _batch, count in phase["changes"]:
                points.append((t0 + at, points[-1][1]))
                points.append((t0 + at, count))
            t0 += phase["seconds"]
        points.append((t0, points[-1][1]))
        out.append({"workload": w["name"], "describe": w["describe"], "points": points,
                    "phase_starts": starts[1:]})
    return out


def autotune_chart(autotune: dict[str, Any], path: Path) -> None:
    """The worker count ``num_workers="auto"`` ran over time, one line per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=120)
    for k, t in enumerate(trajectories(autotune)):
        xs, ys = zip(*t["points"], strict=True)
        # lines a little apart, so that two workloads at the same count both show
        line = ax.plot(xs, [y + 0.12 * k for y in ys], label=t["workload"], linewidth=1.8)[0]
        for start in t["phase_starts"]:
            ax.axvline(start, color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("seconds since the loader started (dotted: the step changed)")
    ax.set_ylabel("process workers")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title('num_workers="auto": the worker count over time', fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.charts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, help="the results folder (default: the "
                        "committed one, bench/results or benchmarks/results)")
    parser.add_argument("--out", type=Path, default=CHARTS, help="where the PNGs go")
    parser.add_argument("--table", action="store_true",
                        help="print the headline table instead of drawing")
    args = parser.parse_args(argv)
    folder = args.results or results_dir()
    cpu = json.loads((folder / "cpu.json").read_text())
    if args.table:
        print(headline_table(cpu))
        for name, table in (("peers", peers_table), ("ray", ray_table)):
            path = folder / f"{name}.json"
            if path.is_file():
                print(f"\n{name}.json:\n" + table(json.loads(path.read_text())))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    throughput_chart(cpu, args.out / "throughput.png")
    autotune_chart(json.loads((folder / "autotune.json").read_text()),
                   args.out / "autotune.png")
    print(f"wrote {args.out / 'throughput.png'} and {args.out / 'autotune.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
