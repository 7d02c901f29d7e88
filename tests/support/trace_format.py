"""Checks of a trace against the Trace Event Format, and its reading by track.

``check_trace(doc)`` asserts what every viewer relies on (Perfetto, chrome://tracing): the
document is JSON; every complete event ("X") has ``ph``, ``name``, ``ts``, ``dur`` >= 0,
``pid`` and ``tid``; counters ("C") have numeric series; instants ("i") a scope; every
process and thread that has events is named by metadata ("M"); the complete events of one
track never overlap; everything lies within the recorded run. It returns a :class:`Read`
of the document, by track name, for the tests' own checks.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

TOL_US = 1e-6  # float slack of ts + dur sums (microseconds)


@dataclass
class Read:
    """A checked trace, by process name and track name."""

    doc: dict[str, Any]
    processes: dict[int, str] = field(default_factory=dict)
    threads: dict[tuple[int, int], str] = field(default_factory=dict)
    spans: dict[tuple[int, str], list[dict[str, Any]]] = field(default_factory=dict)
    counters: dict[tuple[int, str], list[dict[str, Any]]] = field(default_factory=dict)
    instants: list[dict[str, Any]] = field(default_factory=list)

    def pid(self, prefix: str) -> int:
        """The one process whose name starts with ``prefix``."""
        found = [p for p, name in self.processes.items() if name.startswith(prefix)]
        assert len(found) == 1, (prefix, self.processes)
        return found[0]

    def track(self, pid: int, prefix: str,
              name: str | tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        """Spans (named ``name``, or one of the names, or all) of ``pid``'s tracks whose name
        starts with ``prefix``, in time order."""
        names = (name,) if isinstance(name, str) else name
        out = [e for (p, track), evs in self.spans.items() if p == pid
               and track.startswith(prefix) for e in evs if names is None or e["name"] in names]
        return sorted(out, key=lambda e: e["ts"])

    def batches(self, pid: int, prefix: str, name: str | tuple[str, ...]) -> list[int]:
        return [e["args"]["batch"] for e in self.track(pid, prefix, name)]


def check_trace(doc: dict[str, Any]) -> Read:
    """Assert ``doc`` is a well-formed trace of one run (see the module's text)."""
    doc = json.loads(json.dumps(doc))  # JSON, and what a viewer reads back
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    read = Read(doc)
    for e in events:
        assert {"ph", "name", "pid"} <= set(e), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index",
                                 "thread_sort_index"), e
            if e["name"] == "process_name":
                read.processes[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                read.threads[(e["pid"], e["tid"])] = e["args"]["name"]
    duration = doc["otherData"]["duration_us"]
    spans: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        ph = e["ph"]
        if ph == "M":
            continue
        assert isinstance(e["ts"], int | float) and isinstance(e["pid"], int), e
        assert e["pid"] in read.processes, f"process {e['pid']} has no process_name: {e}"
        assert -TOL_US <= e["ts"] <= duration + TOL_US, f"outside the run (0, {duration}): {e}"
        if ph == "X":
            assert {"ts", "dur", "tid", "name"} <= set(e), e
            assert isinstance(e["tid"], int) and e["dur"] >= 0, e
            assert e["ts"] + e["dur"] <= duration + TOL_US, f"ends after the run: {e}"
            assert (e["pid"], e["tid"]) in read.threads, f"unnamed track: {e}"
            spans[(e["pid"], e["tid"])].append(e)
        elif ph == "C":
            assert e.get("args") and all(isinstance(v, int | float)
                                         for v in e["args"].values()), e
            read.counters.setdefault((e["pid"], e["name"]), []).append(e)
        elif ph == "i":
            assert e.get("s") in ("t", "p", "g") and isinstance(e["tid"], int), e
            assert (e["pid"], e["tid"]) in read.threads, f"unnamed track: {e}"
            read.instants.append(e)
        else:
            raise AssertionError(f"unexpected phase {ph!r}: {e}")
    for key, evs in spans.items():
        evs.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(evs):
            assert a["ts"] + a["dur"] <= b["ts"] + TOL_US, \
                f"spans overlap on {read.threads[key]}: {a} and {b}"
        read.spans[(key[0], read.threads[key])] = evs
    for evs in read.counters.values():
        evs.sort(key=lambda e: e["ts"])
    return read
