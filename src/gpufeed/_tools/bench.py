"""``gpufeed bench``: the stock DataLoader and gpufeed's, like for like, measured repeatedly.

Every *fetch path* (how a batch's samples are read: ``PATHS``) is run by both loaders on the
same dataset object, so each ratio compares loaders, not ways of reading data. Then the gain of
the batched path is a row of its own: gpufeed on ``array`` (or ``getitems``) against gpufeed on
``per-sample``, the part of the speed-up that comes from changing the dataset rather than the
loader. Runs follow NOTE [ Repeated measurement ] in ``_tools/repeat.py``.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from .._base.stats import format_table, human_bytes
from .._host.config import WorkerType
from .._loader import DataLoader
from .measure import measure_loader, one_intra_op_thread
from .output import require_matplotlib
from .repeat import (
    BOOTSTRAP_RESAMPLES,
    VERDICT_RUNS,
    LoadMonitor,
    MachineLoad,
    Ratio,
    Spread,
    spreads_text,
)

#: what each fetch path means, printed under the table.
PATHS = {
    "per-sample": "dataset[i] per sample, then the default collate",
    "getitems": "__getitems__ returns the stacked batch, pass-through collate",
    "array": ("gpufeed.sources.ArrayDataset: gpufeed gathers into its ring; stock reads rows "
              "and stacks"),
    "yours": "your dataset as given (its __getitems__ when it has one)",
}


@dataclass
class BenchConfig:
    """One row: a loader on one fetch path at one ``num_workers``; ``make`` builds it."""

    loader: str  # "torch" or "gpufeed"
    path: str
    num_workers: int
    make: Callable[[], Any]
    rates: list[float] = field(default_factory=list)
    peak_pss_bytes: int = 0
    peak_held_bytes: int = 0  # PSS plus shared memory mapped nowhere (``_tools/measure.py``)
    first_batch_s: list[float] = field(default_factory=list)

    @property
    def spread(self) -> Spread:
        return Spread(tuple(self.rates))

    def to_dict(self) -> dict[str, Any]:
        s = self.spread
        return {"loader": self.loader, "path": self.path, "num_workers": self.num_workers,
                "samples_per_s": s.median, "spread": s.to_dict(),
                "peak_pss_bytes": self.peak_pss_bytes, "peak_held_bytes": self.peak_held_bytes,
                "first_batch_s": statistics.median_high(self.first_batch_s or [0.0])}


@dataclass(frozen=True)
class Comparison:
    """``a / b`` of two configurations, with what it compares in words."""

    what: str
    a: BenchConfig
    b: BenchConfig

    @property
    def ratio(self) -> Ratio:
        """``a / b`` with its 95% interval and verdict (NOTE [ Repeated measurement ] (3))."""
        return self.a.spread.ratio(self.b.spread)

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "num_workers": self.a.num_workers, **self.ratio.to_dict()}


def configs(variants: dict[str, tuple[Any, Any]], workers: Sequence[int], batch_size: int,
            worker_type: WorkerType = "process") -> list[BenchConfig]:
    """Both loaders on every fetch path at every ``num_workers`` (see the module docstring)."""
    out = []
    for n in workers:
        common: dict[str, Any] = {"batch_size": batch_size, "num_workers": n}
        if n:  # NOTE [ Measuring honestly ] (2) in ``_tools/measure.py``
            common["worker_init_fn"] = one_intra_op_thread
        for path, (ds, collate) in variants.items():
            common_path = {**common, "collate_fn": collate} if collate is not None else common
            out.append(BenchConfig("torch", path, n, partial(
                torch.utils.data.DataLoader, ds, **common_path)))
            kind: dict[str, Any] = {"worker_type": worker_type} if n else {}
            out.append(BenchConfig("gpufeed", path, n, partial(
                DataLoader, ds, **common_path, **kind)))
    return out


def run_bench(rows: list[BenchConfig], *, seconds: float, runs: int, target_spread: float,
              step: Callable[[str], None] | None = None) -> MachineLoad:
    """Measure every row round-robin until each is done (NOTE [ Repeated measurement ])."""
    monitor = LoadMonitor()
    while True:
        todo = [r for r in rows if not r.spread.done(runs, target_spread)]
        if not todo:
            break
        for r in todo:
            m = measure_loader(r.make, max_seconds=seconds, warmup_batches=3)
            r.rates.append(m.samples_per_s)
            r.first_batch_s.append(m.first_batch_s)
            r.peak_pss_bytes = max(r.peak_pss_bytes, m.peak_pss_bytes)
            r.peak_held_bytes = max(r.peak_held_bytes, m.peak_held_bytes)
            if step is not None:
                step(f"{r.loader} {r.path} {r.num_workers}w: {m.samples_per_s:,.0f}/s")
    return monitor.stop()


def compare(rows: Sequence[BenchConfig]) -> list[Comparison]:
    """gpufeed vs stock on each fetch path, then gpufeed's batched-path gain, per workers."""
    by = {(r.loader, r.path, r.num_workers): r for r in rows}
    out = []
    for n in dict.fromkeys(r.num_workers for r in rows):
        for path in dict.fromkeys(r.path for r in rows):
            ours, stock = by.get(("gpufeed", path, n)), by.get(("torch", path, n))
            if ours and stock:
                out.append(Comparison(f"gpufeed vs stock, both {path}", ours, stock))
        base = by.get(("gpufeed", "per-sample", n))
        for path in ("array", "getitems"):
            batched = by.get(("gpufeed", path, n))
            if base and batched:
                out.append(Comparison(f"batched-path gain: gpufeed {path} vs gpufeed "
                                      "per-sample", batched, base))
    return out


def render(title: str, rows: Sequence[BenchConfig], comparisons: Sequence[Comparison],
           load: MachineLoad, seconds: float) -> str:
    """The tables ``gpufeed bench`` prints."""
    spreads = [r.spread for r in rows]
    head = (f"gpufeed bench: {title}\n{seconds:g} s per run, {spreads_text(spreads)} per row "
            "(interleaved); samples/s as median (slowest-fastest run)")
    table = format_table(
        ["loader", "fetch path", "workers", "samples/s (range)", "spread", "peak PSS",
         "peak held", "first batch"],
        [[r.loader, r.path, r.num_workers, r.spread.text(), f"{r.spread.rel_spread:.0%}",
          human_bytes(r.peak_pss_bytes), human_bytes(r.peak_held_bytes),
          f"{r.to_dict()['first_batch_s'] * 1e3:.0f} ms"]
         for r in rows], left=2)
    ratios = [c.ratio for c in comparisons]
    cmp = format_table(
        ["comparison", "workers", "ratio (95% interval)", "verdict"],
        [[c.what, c.a.num_workers, r.text(), f"{r.verdict}: {r.why}"]
         for c, r in zip(comparisons, ratios, strict=True)], left=1)
    legend = "\n".join(f"  {p}: {PATHS[p]}" for p in dict.fromkeys(r.path for r in rows)
                       if p in PATHS)
    notes = ["samples/s: the median of a row's runs, and in brackets its slowest and fastest "
             "run; spread: (fastest - slowest) / median, how much the runs of one row "
             "disagree (the machine's noise)",
             "ratio: the first row's samples/s over the second's, taken between their faster "
             "halves of runs (a busy machine only ever slows a run down); in brackets its 95% "
             f"interval, from {BOOTSTRAP_RESAMPLES} bootstrap resamples of the runs: other "
             "draws of the same noise give a ratio in it 19 times in 20",
             "verdict: faster when the whole interval is above 1x, slower when it is below "
             "1x, cannot tell when it holds 1x (the rows may differ, but not by more than "
             f"the noise shows; more --runs narrow it) or a row has fewer than {VERDICT_RUNS} "
             "runs",
             "peak held: peak PSS plus shared memory the loader "
             "holds but no process maps (the stock loader's queued batches, in no PSS)",
             load.summary]
    if not torch.cuda.is_available():
        notes.append("pin_memory=True and the device-stage transfer figures need CUDA: "
                     "not measured")
    notes = [textwrap.fill(n, width=100, subsequent_indent="  ") for n in notes]
    return "\n".join([head, table, "fetch paths:", legend, "", cmp, "", *notes])


def plot(rows: Sequence[BenchConfig], path: str) -> None:
    """Horizontal bars of the median samples/s per row, with the range as error bars."""
    fig = require_matplotlib()(figsize=(7, 0.4 * len(rows) + 1.2))
    ax = fig.subplots()
    labels = [f"{r.loader} {r.path} w{r.num_workers}" for r in rows]
    med = [r.spread.median for r in rows]
    err = [[m - r.spread.lo for m, r in zip(med, rows, strict=True)],
           [r.spread.hi - m for m, r in zip(med, rows, strict=True)]]
    colors = ["tab:gray" if r.loader == "torch" else "tab:blue" for r in rows]
    ax.barh(labels, med, xerr=err, color=colors, capsize=3)
    ax.invert_yaxis()
    ax.set(xlabel="samples/s (median, range of runs)", title="gpufeed bench")
    fig.savefig(path, bbox_inches="tight", dpi=100)
