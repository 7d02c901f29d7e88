"""A trace as a picture: a Gantt chart per track, stalls marked (needs matplotlib).

``render(doc, "run.png")``, called by ``gpufeed profile ... --timeline FILE.png`` and
``Trace.plot``, draws any Trace Event Format document gpufeed wrote (``Trace.to_dict()``, or a
saved file loaded with ``json.load``): one row per track (the loop's main thread, each worker,
the device stage), one bar per span, coloured by stage; a *stall* (the loop waited
``stall_ms`` or longer for a batch) is drawn red and shaded across every row, so the worker or
copy that was late stands out; below, the ring's slots in use and the batches in flight.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .output import require_matplotlib

COLORS = {
    "fetch": "#4C72B0", "collate": "#8FB7E0", "wait": "#F2A93B", "startup": "#FCE3B8",
    "hand out": "#55A868",
    "step": "#E3E3E3", "copy": "#8172B2", "transform": "#C4B3E8", "wait for a copy": "#C44E52",
    "stall": "#D62728",
}
OTHER = "#999999"


def stalls(doc: Mapping[str, Any], *, stall_ms: float = 1.0) -> list[dict[str, Any]]:
    """The main-thread waits of ``stall_ms`` or longer: the loop stood still for data."""
    names = _thread_names(doc)
    return [e for e in doc["traceEvents"]
            if e.get("ph") == "X" and e["name"] == "wait" and e["dur"] >= stall_ms * 1e3
            and names.get((e["pid"], e["tid"]), "").startswith("main")]


def _thread_names(doc: Mapping[str, Any]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "thread_name"}


def render(doc: Mapping[str, Any], path: str | os.PathLike[str], *,
           seconds: float | None = 1.0, start_s: float = 0.0, stall_ms: float = 1.0) -> Path:
    """Draw ``seconds`` (None: all) of the trace ``doc`` from ``start_s`` into ``path``.

    Args:
        seconds: the window's length. A second shows a few hundred batches of 1-10 ms
            readably; shorten it for faster loaders.
        start_s: where the window starts, in seconds from the start of the trace (0: the
            start, worker start-up included).
        stall_ms: a wait of the loop this long or longer is a stall (red, shaded).
    """
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds={seconds!r} must be positive (or None for the whole trace)")
    if not start_s >= 0 or not stall_ms >= 0:
        raise ValueError(f"start_s={start_s!r} and stall_ms={stall_ms!r} must be >= 0")
    figure_cls = require_matplotlib("timeline pictures", "--timeline")
    lo = start_s * 1e6
    hi = float("inf") if seconds is None else lo + seconds * 1e6
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    names = _thread_names(doc)
    spans: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    instants: list[dict[str, Any]] = []
    counters: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    end_us = 0.0
    for e in events:
        ph = e.get("ph")
        if ph == "X":
            end_us = max(end_us, e["ts"] + e["dur"])
            if e["ts"] + e["dur"] >= lo and e["ts"] <= hi:
                spans[(e["pid"], e["tid"])].append(e)
        elif ph == "i" and lo <= e["ts"] <= hi:
            instants.append(e)
        elif ph == "C" and lo <= e["ts"] <= hi:
            for series, value in e.get("args", {}).items():
                counters[(e["pid"], f"{e['name']}: {series}")].append((e["ts"], value))
    hi = min(hi, max(end_us, lo + 1.0))
    rows = sorted(spans)
    if not rows:
        raise ValueError(f"start_s={start_s!r}: the window holds no span of the trace "
                         f"({end_us / 1e6:.3g} s long); start it earlier")
    stalled = [s for s in stalls(doc, stall_ms=stall_ms) if s["ts"] + s["dur"] >= lo
               and s["ts"] <= hi]
    shown = [name for name in ("ring slots: in use", "ring slots: fenced",
                               "batches in flight: in flight")
             if any(k[1] == name and any(v for _, v in pts) for k, pts in counters.items())]
    height = 1.9 + 0.42 * max(len(rows), 1) + (1.6 if shown else 0.0)
    fig = figure_cls(figsize=(12, height), dpi=110, layout="constrained")
    if shown:
        gantt, low = fig.subplots(2, 1, sharex=True, height_ratios=[max(len(rows), 1), 3.5])
    else:
        gantt, low = fig.subplots(1, 1), None

    def ms(us: float) -> float:
        return (us - lo) / 1e3

    multi = len({pid for pid, _ in rows}) > 1
    late = {(s["pid"], s["args"].get("batch"), s["args"].get("epoch")) for s in stalled
            if "args" in s}  # the batches the loop stalled for: outlined where they were made
    thin = (hi - lo) / 1e3 / 300  # bars narrower than this get no white border
    labels = []
    stall_ids = {id(s) for s in stalled}
    for y, key in enumerate(rows):
        styles: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
        for e in spans[key]:
            x0, x1 = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            width = (x1 - x0) / 1e3
            color = COLORS["stall"] if id(e) in stall_ids else COLORS.get(e["name"], OTHER)
            culprit = (e["name"] in ("fetch", "collate") and "args" in e and (
                e["pid"], e["args"].get("batch"), e["args"].get("epoch")) in late)
            edge = "culprit" if culprit else "white" if width > thin else color
            styles[(color, edge)].append((ms(x0), width))
        for (color, edge), bars in styles.items():  # one collection per style: fast
            gantt.broken_barh(bars, (y - 0.38, 0.76), facecolors=color,
                              edgecolors=COLORS["stall"] if edge == "culprit" else edge,
                              linewidth=1.6 if edge == "culprit" else 0.5,
                              zorder=3 if edge == "culprit" else 2)
        label = names.get(key, f"tid {key[1]}")
        labels.append(f"{procs.get(key[0], key[0])} · {label}" if multi else label)
    for s in stalled:
        for ax in (gantt,) if low is None else (gantt, low):
            ax.axvspan(ms(max(s["ts"], lo)), ms(min(s["ts"] + s["dur"], hi)),
                       color=COLORS["stall"], alpha=0.12, linewidth=0, zorder=0)
    for e in instants:
        key = (e["pid"], e.get("tid", 1))
        if key in spans:
            gantt.plot([ms(e["ts"])], [rows.index(key) - 0.45], marker="v", color="black",
                       markersize=5, linestyle="none", zorder=5)
    gantt.set_yticks(range(len(rows)), labels)
    gantt.set_ylim(len(rows) - 0.5, -0.5)
    gantt.set_xlim(0, ms(hi))
    gantt.grid(axis="x", alpha=0.3)
    used = {e["name"] for key in rows for e in spans[key]}
    handles = [_patch(COLORS[n], n) for n in COLORS if n in used]
    if stalled:
        handles.append(_patch(COLORS["stall"], f"stall (loop waited >= {stall_ms:g} ms)"))
        handles.append(_patch("white", "the batch it waited for", edge=COLORS["stall"]))
    if instants:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], marker="v", color="black", linestyle="none",
                              label="event (ring grew or fell back, spill, ...)"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 6),
                   fontsize=8, frameon=False)
    total_stall = sum(min(s["ts"] + s["dur"], hi) - max(s["ts"], lo) for s in stalled) / 1e3
    gantt.set_title(
        f"gpufeed timeline, {start_s * 1e3:.0f}-{start_s * 1e3 + ms(hi):.0f} ms of the trace: "
        f"{len(stalled)} stall{'s' if len(stalled) != 1 else ''} of the loop "
        f"(waits >= {stall_ms:g} ms, {total_stall:.0f} ms in all)", fontsize=11, loc="left")
    if low is not None:
        for (pid, name), points in sorted(counters.items()):
            if name in shown:
                points.sort()
                who = f"{procs.get(pid, pid)}: " if multi else ""
                low.step([ms(t) for t, _ in points], [v for _, v in points], where="post",
                         label=who + name)
        low.set_ylabel("count", fontsize=9)
        low.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        low.grid(alpha=0.3)
    (gantt if low is None else low).set_xlabel(f"ms from {start_s:.3f} s into the trace")
    out = Path(path)
    fig.savefig(out)
    return out


def _patch(color: str, label: str, *, edge: str | None = None) -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=color, edgecolor=edge or color, label=label,
                 linewidth=1.6 if edge else 0.5)
