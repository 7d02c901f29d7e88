"""Autotuning as data: each decision as a record (made, logged and kept as NOTE [ Autotuning
decisions ] in ``_host/autotune.py`` says), and what ``loader.stats().autotune`` shows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .stats import human_bytes

#: what a decision does: ``grow``/``shrink`` change the worker count (``trim``: shrink to what
#: busy cores can run), ``deepen``/``shallow`` the batches each worker works ahead; ``kept``
#: says a change paid off, ``revert`` undoes one that did not; ``hold`` changes nothing and
#: says why (a budget, the noise, the bound)
KINDS = ("grow", "shrink", "trim", "deepen", "shallow", "kept", "revert", "hold")


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def _rate(x: float | None) -> str:
    return "?" if x is None else f"{x:,.0f}"


@dataclass(frozen=True)
class TuningDecision:
    """One autotuning decision.

    Fields:
        kind: one of :data:`KINDS`.
        batch: batches the loader had delivered when it was made (since it was built).
        at_s: seconds since the loader's first batch, when it was made.
        workers: the worker count (before, after).
        depth: batches in flight per worker (before, after).
        input_bound: share (0-1) of the loop spent waiting for workers (before, after): the
            window that led to the decision and, for ``kept``/``revert``, the one after it.
        rate: batches/s delivered (before, after), as ``input_bound``.
        reason: what the figures said, in words.
    """

    kind: str
    batch: int
    at_s: float
    workers: tuple[int, int]
    depth: tuple[int, int]
    input_bound: tuple[float | None, float | None]
    rate: tuple[float | None, float | None]
    reason: str

    def as_args(self) -> dict[str, object]:
        """The decision as a trace event's arguments."""
        (w0, w1), (d0, d1) = self.workers, self.depth
        return {"workers": f"{w0} -> {w1}", "depth": f"{d0} -> {d1}", "batch": self.batch,
                "reason": self.reason}

    @property
    def changes(self) -> bool:
        """Whether the decision changed the workers or their work-ahead."""
        return self.workers[0] != self.workers[1] or self.depth[0] != self.depth[1]

    def __str__(self) -> str:
        (w0, w1), (d0, d1) = self.workers, self.depth
        figures = (f"input-bound {_pct(self.input_bound[0])} -> {_pct(self.input_bound[1])}, "
                   f"{_rate(self.rate[0])} -> {_rate(self.rate[1])} batches/s")
        if self.kind == "kept":
            return f"{w0} -> {w1} workers kept at batch {self.batch}: {figures}"
        if self.kind == "hold":
            return f"held at {w1} workers at batch {self.batch}: {self.reason}"
        what = (f"{w0} -> {w1} workers" if w0 != w1 else
                f"{w1} workers, work-ahead {d0} -> {d1} batches each")
        return f"{what} at batch {self.batch} ({self.kind}): {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AutotuneStats:
    """Where the autotuner stands (``loader.stats().autotune``; None without ``"auto"``).

    Fields:
        workers: the worker count in force (``loader.num_workers``).
        max_workers: its upper bound.
        worker_type: "process" or "thread".
        depth: batches in flight per worker.
        cpu_budget: cores the process tree may use; cpu_used: cores it used in the last
            measured window (None before one).
        memory_budget: bytes the loader may hold; memory_used: what it holds by the last
            estimate (its workers' private memory plus the ring).
        state: one line: "measuring", "steady", "verifying ..." or why it holds.
        decisions: the latest decisions, oldest first (at most ``KEEP``).
        decided: decisions made in all.
    """

    workers: int
    max_workers: int
    worker_type: str
    depth: int
    cpu_budget: float
    cpu_used: float | None
    memory_budget: int
    memory_used: int
    state: str
    decisions: tuple[TuningDecision, ...] = field(default=())
    decided: int = 0

    KEEP = 100

    @property
    def last(self) -> TuningDecision | None:
        """The latest decision, None before the first."""
        return self.decisions[-1] if self.decisions else None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "decisions": [d.to_dict() for d in self.decisions]}

    def __str__(self) -> str:
        cpu = "?" if self.cpu_used is None else f"{self.cpu_used:.1f}"
        lines = [f"autotune: {self.workers} {self.worker_type} workers (max {self.max_workers}),"
                 f" {self.depth} batches ahead each; CPU {cpu} of {self.cpu_budget:g} cores, "
                 f"memory {human_bytes(self.memory_used)} of {human_bytes(self.memory_budget)};"
                 f" {self.state}"]
        lines += [f"  {d}" for d in self.decisions[-5:]]
        return "\n".join(lines)
