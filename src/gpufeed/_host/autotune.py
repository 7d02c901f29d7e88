"""The autotuner: ``num_workers="auto"`` moves the worker count and work-ahead while the loop runs.

NOTE [ Autotuning decisions ]
-----------------------------
The loader measures *windows* of at least ``WINDOW_BATCHES`` batches and ``WINDOW_S`` seconds
(what one holds: ``_host/auto_iter.py``; ``input_bound`` is the time blocked with no batch ready
over wait + step). Between two batches, :meth:`AutoTuner.decide` reads a window and may return
a :class:`Move`, applied without restarting the epoch (NOTE [ Resizing the pool ] in
``_host/elastic.py``). With the model of NOTE [ What a worker costs ] (``_host/cost.py``):

1. **Settle.** The window after any change (and an iterator's first) is not judged: new
   workers start, the pipeline refills.
2. **Verify.** A growth (more workers, or more work-ahead) is *kept* only if it paid off against
   the better of the two windows before it (``pays_off``: the rate rose beyond ``TOLERANCE`` and
   the noise, or the loop, which waited at least twice ``GROW_AT``, stopped waiting with no fall
   in the rate), in two windows when it gained less than ``CONFIRM`` times; else it is
   *reverted*, and counts at or above it are not tried again until the step changes ``PHASE``
   times over for two windows in a row (a new phase) or ``MEMO_S`` pass. A shrink is kept only
   while the loop still does not wait; else reverted, and counts below are not tried again under
   the same terms.
3. **Grow** while the loop waits (``input_bound >= GROW_AT``): to the count the model says
   keeps up with the step with ``HEADROOM``, at most doubling, within ``max_workers``, the
   CPU budget (CPU *used*: workers waiting on I/O may far outnumber cores) and the memory
   budget, and never while the workers are *crowded* (more would only queue for a core);
   crowded workers beyond what their cores can run are *trimmed* (kept if the rate holds).
   When the model says the workers keep up on average, the waits come from their work-ahead
   running dry: each gets twice as many batches ahead (up to ``MAX_DEPTH``), or one worker
   more, after two such windows in a row (one may be noise).
4. **Shrink** after ``CALM_WINDOWS`` windows in a row without waiting (``< CALM_AT``): to the
   count the model says delivers the rate the loop takes with ``HEADROOM``, at most halving.
   Over a budget (memory, or CPU by more than ``TOLERANCE``), shrink to fit.
5. **Hold** otherwise, and say why once: a budget, ``max_workers``, a count that gave no gain,
   or a machine too noisy to decide (the rate varies by more than ``NOISY`` between windows at
   unchanged settings and step). The worker type never changes: ``held_back`` in
   ``_host/auto_iter.py``.

Every decision, forced ones included (the test seam :attr:`AutoTuner.schedule`), goes through
:meth:`AutoTuner._record`: one ``TuningDecision``, logged at INFO, kept for
``loader.stats().autotune`` and, inside ``gpufeed.trace``, an instant of the timeline.
``max_workers`` and the memory budget are enforced in :meth:`AutoTuner._move` alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from .._base import timeline as _timeline
from .._base.stats import human_bytes
from .._base.tuning import AutotuneStats, TuningDecision
from .cost import Budgets, pays_off
from .window import Change, Gauges, Memo, Move, Window, ms, pct, ratio

log = logging.getLogger("gpufeed")

WINDOW_BATCHES = 8
WINDOW_S = 0.4
GROW_AT = 0.03
CALM_AT = 0.01
CALM_WINDOWS = 2
HEADROOM = 0.25
TOLERANCE = 0.05
CONFIRM = 1.5  # a growth that gains less than this is judged on two windows
NOISE0 = 0.05
NOISY = 0.25
MAX_DEPTH = 8
MEMO_S = 60.0
PHASE = 2.0  # a step per batch this many times longer or shorter than a memo's: a new phase
STEADY = 1.5  # windows whose steps differ less than this judge the noise


class AutoTuner:
    """One loader's autotuner (it pickles with the loader): the count in force, which
    ``loader.num_workers`` reads, the policy's memory and its decisions. ``depth``: batches in
    flight per worker, a strict bound with ``depth_fixed`` (the user set ``prefetch_factor``).
    """

    def __init__(self, *, max_workers: int, worker_type: str, budgets: Budgets, depth: int,
                 depth_fixed: bool, initial: int | None = None) -> None:
        self.max_workers, self.worker_type, self.budgets = max_workers, worker_type, budgets
        self.depth = self.default_depth = depth
        self.depth_fixed = depth_fixed
        self.workers = max(1, min(max_workers, initial or int(budgets.cpu_cores) or 1))
        #: test seam replacing the policy: batches delivered -> a Move, a count, or None
        self.schedule: Callable[[int], Move | int | None] | None = None
        self.window_batches, self.window_s = WINDOW_BATCHES, WINDOW_S  # a window's least size
        self.delivered = self._owner = 0
        self._t0: float | None = None
        self.trace_owner: object | None = None  # the loader's stats: its timeline track
        self._decisions: list[TuningDecision] = []
        self._decided = 0
        self._phase = "settle"
        self._trial: Change | None = None
        self._prev: Window | None = None
        self._last: Window | None = None
        self._noise = NOISE0
        self._calm = self._waits = 0  # windows in a row the loop did not wait, or waited
        # workers, and work-ahead, that gave no gain ("ceiling", "deep_ceiling") or the loop
        # needed ("floor", "deep_floor")
        self._memos: dict[str, Memo] = {}
        self._holding: str | None = None  # the reason last recorded for holding
        self._held = False  # the last window held
        self._baseline = 0.0  # the rate a growth decided now must beat

    # -- the iterator's side ----------------------------------------------------------------
    def begin(self) -> int:
        """An iterator starts feeding windows; its token makes an older one's ignored."""
        self._owner += 1
        self._phase = "settle"
        self._trial = self._prev = None
        return self._owner

    def delivered_one(self) -> None:
        """Count a batch handed to the loop (decisions are stamped with it)."""
        if self._t0 is None:
            self._t0 = time.monotonic()
        self.delivered += 1

    def scheduled(self, gauges: Gauges) -> Move | None:
        """The test seam's move for now, through :meth:`_move` (None: no change)."""
        if self.schedule is None:
            return None
        move = self.schedule(self.delivered)
        if not isinstance(move, Move):
            move = Move(self.workers if move is None else int(move), self.depth)
        reason, cap = "forced (test schedule)", self._fits(gauges, move.depth)
        if move.workers > cap:  # the memory budget binds even where the schedule holds
            move, reason = Move(cap, move.depth), f"{reason}; held to {cap} by the memory budget"
        if move == (self.workers, self.depth):
            return None
        kind = "grow" if move.workers > self.workers else "shrink" if (
            move.workers < self.workers) else "deepen" if move.depth > self.depth else "shallow"
        return self._move(kind, None, move.workers, move.depth, reason, gauges)

    def cannot_start(self, w: int, error: BaseException) -> None:
        """Worker ``w`` could not be started (fork or thread start failed): stay below it."""
        self.max_workers = max(1, w)
        self._trial = None
        self._hold(self._last, "start", f"could not start worker {w} ({error}): max_workers "
                   f"is {self.max_workers} from now on")

    def decide(self, token: int, win: Window) -> Move | None:
        """Judge a finished window (NOTE [ Autotuning decisions ]); a move to apply, or None."""
        if token != self._owner:
            return None
        self._last = win
        if self.schedule is not None:
            return None
        if self._phase == "settle":
            self._phase = "verify" if self._trial is not None else "measure"
            return None
        if self._phase == "verify":
            self._phase = "measure"
            move = self._verify(win)
            if move is not None or self._phase == "verify":  # decided, or one more window
                return move
        return self._measure(win)

    # -- the policy -------------------------------------------------------------------------
    def _verify(self, win: Window) -> Move | None:
        trial, self._trial = self._trial, None
        assert trial is not None
        before, (n0, n1), (d0, d1) = trial.before, trial.workers, trial.depth
        step, self._prev = win.step_per_batch, None
        if trial.kind in ("grow", "deepen"):
            noise, base = self._noise, max(trial.baseline, before.rate)
            paid = pays_off(base, win.rate, tolerance=TOLERANCE,
                            before_hi=base * (1 + noise), after_lo=win.rate * (1 - noise))
            # the loop clearly waited, and no longer does at no cost in rate: a slower step
            # (thread workers holding the GIL slow the loop too) is no stop
            stopped = win.input_bound < GROW_AT <= before.input_bound / 2 and win.rate >= base
            until = time.monotonic() + MEMO_S
            if (paid or stopped) and win.rate < CONFIRM * base and not trial.confirmed:
                self._trial, self._phase = trial._replace(confirmed=1), "verify"
                return None  # a small gain: seen in one more window before it counts
            if paid or stopped:
                if trial.kind == "deepen":
                    self._memos["deep_floor"] = Memo(d1, step, until)
                self._record("kept", before, win, (n0, n1), (d0, d1), "paid off")
                return None
            key, value = ("ceiling", n1) if trial.kind == "grow" else ("deep_ceiling", d1)
            self._memos[key] = Memo(value, step, until)
            what = f"{n1} workers" if n0 != n1 else f"{d1} batches ahead"
            return self._move("revert", win, n0, d0, f"{what} gave no gain: "
                              f"{base:,.0f} -> {win.rate:,.0f} batches/s (noise "
                              f"±{noise:.0%})", before=before)
        if trial.kind == "trim" and win.rate >= before.rate * (1 - TOLERANCE - self._noise):
            self._record("kept", before, win, (n0, n1), (d0, d1), "no slower with fewer")
            return None
        if trial.kind != "trim" and win.input_bound < GROW_AT:
            self._record("kept", before, win, (n0, n1), (d0, d1), "the loop still does not wait")
            return None
        if trial.kind in ("shrink", "trim"):
            self._memos["floor"] = Memo(n0, step, time.monotonic() + MEMO_S)
        return self._move("revert", win, n0, d0, f"{n1} workers, {d1} ahead, made the loop wait "
                          f"more (input-bound {pct(win.input_bound)}, {before.rate:,.0f} -> "
                          f"{win.rate:,.0f} batches/s)", before=before)

    def _measure(self, win: Window) -> Move | None:
        self._held = False
        prev, self._prev = self._prev, win
        now, step = time.monotonic(), win.step_per_batch
        self._baseline = win.rate
        if prev is not None and (prev.workers, prev.depth) == (win.workers, win.depth) and (
                ratio(prev.step_per_batch, step) < STEADY) and prev.rate + win.rate > 0:
            sample = abs(prev.rate - win.rate) / (prev.rate + win.rate)
            self._noise = 0.7 * self._noise + 0.3 * sample
            self._baseline = max(prev.rate, win.rate)
        # a new phase (for two windows in a row: one noisy step is none), or time: what
        # held may not now
        before = prev.step_per_batch if prev is not None else 0.0
        self._memos = {key: m for key, m in self._memos.items() if now <= m.until
                       and min(ratio(m.step_s, step), ratio(m.step_s, before)) <= PHASE}
        over = self._over_budget(win)
        if over is not None:
            return over
        if self._noise > NOISY:
            self._hold(win, "noise", f"the machine is too noisy to decide: the rate varies "
                       f"±{self._noise:.0%} between windows at the same settings")
            return None
        self._waits = self._waits + 1 if win.input_bound >= GROW_AT else 0
        if self._waits:
            self._calm = 0
            return self._grow(win)
        self._calm = self._calm + 1 if win.input_bound < CALM_AT else 0
        if self._calm >= CALM_WINDOWS:
            return self._shrink(win)
        return None

    def _memo(self, key: str, default: int) -> int:
        """The value remembered under ``key`` ("ceiling", "deep_ceiling", "floor",
        "deep_floor") while it holds, else ``default``."""
        memo = self._memos.get(key)
        return default if memo is None else memo.value

    def _caps(self, win: Window, depth: int) -> list[tuple[int, str, str]]:
        """(most workers, what holds them there, why in words) of each limit on growth."""
        b, budget = self.budgets, human_bytes(self.budgets.memory_bytes)
        caps = [(self.max_workers, "max", f"max_workers={self.max_workers}"),
                (self._fits(win.gauges, depth), "memory", f"the memory budget ({budget})")]
        cores, cost = win.cpu_cores, win.cost()
        if cores is not None:
            caps.append((cost.cpu_limit(b.cpu_cores), "cpu",
                         f"the CPU budget ({cores:.1f} of {b.cpu_cores:g} cores used)"))
        if cost.crowded:
            waited = cost.queued_s / (cost.queued_s + cost.worker_cpu_s)
            caps.append((self.workers, "crowded", "the cores are busy (the workers waited "
                         f"for one {waited:.0%} of the time they could run)"))
        if "ceiling" in self._memos:
            ceiling = self._memos["ceiling"].value
            caps.append((ceiling - 1, "ceiling", f"{ceiling} workers gave no gain"))
        return caps

    def _grow(self, win: Window) -> Move | None:
        n, d = self.workers, self.depth
        cost, step = win.cost(), win.step_per_batch
        want = cost.workers_for((1 + HEADROOM) / step) if step > 0 else 2 * n
        bound = f"input-bound {pct(win.input_bound)}"
        if want <= n and self._waits < 2:
            return None  # the model says they keep up: wait for a second window to be sure
        deep = self._memo("deep_ceiling", 2 * MAX_DEPTH)
        if want <= n and not self.depth_fixed and d < MAX_DEPTH and 2 * d < deep and (
                g := win.gauges).memory(n, 2 * d) <= self.budgets.memory_bytes:
            self._trial = Change("deepen", win, (n, n), (d, min(2 * d, MAX_DEPTH)),
                                 self._baseline)
            return self._move("deepen", win, n, min(2 * d, MAX_DEPTH),
                              f"{bound}, yet {n} workers keep up on average ({ms(cost.batch_s)}"
                              f" a batch each, a {ms(step)} step): more work ahead", g)
        cap, key, why = min(self._caps(win, d))
        target = min(max(want, n + 1), 2 * n, cap)
        if target <= n:
            trim = max(math.ceil(win.worker_cpu_s / max(win.seconds, 1e-9) * (1 + HEADROOM)),
                       (n + 1) // 2)
            if key == "crowded" and trim < n and (win.cpu_cores or 0) >= (
                    (1 - TOLERANCE) * self.budgets.cpu_cores):
                # our own workers crowd each other: fewer get the same cores
                self._trial = Change("trim", win, (n, trim), (d, d))
                return self._move("trim", win, trim, d, f"{bound}, but {why}: {trim} workers "
                                  "run as fast on the cores the budget gives", win.gauges)
            self._hold(win, key, f"{bound}, but {why}")
            return None
        self._trial = Change("grow", win, (n, target), (d, d), self._baseline)
        return self._move("grow", win, target, d, f"{bound}: at {ms(cost.batch_s)} a batch per "
                          f"worker and a {ms(step)} step, {want} workers keep up", win.gauges)

    def _shrink(self, win: Window) -> Move | None:
        n, d = self.workers, self.depth
        cost = win.cost()
        need = cost.workers_for(win.rate * (1 + HEADROOM))
        floor = self._memo("floor", 1)
        target = max(need, (n + 1) // 2, floor, 1)
        calm = f"the loop does not wait (input-bound {pct(win.input_bound)})"
        if target < n:
            self._trial = Change("shrink", win, (n, target), (d, d))
            return self._move("shrink", win, target, d, f"{calm}: {need} workers at "
                              f"{ms(cost.batch_s)} a batch deliver its {win.rate:,.0f} "
                              "batches/s", win.gauges)
        needed = self._memo("deep_floor", self.default_depth)
        if d > self.default_depth and d // 2 >= needed and not self.depth_fixed:
            self._trial = Change("shallow", win, (n, n), (d, d // 2))
            return self._move("shallow", win, n, d // 2, f"{calm}: less work ahead", win.gauges)
        return None

    def _over_budget(self, win: Window) -> Move | None:
        n, d = self.workers, self.depth
        used, budget = win.memory_used(), self.budgets.memory_bytes
        if n > 1 and used > budget:
            fit = min(self._fits(win.gauges, d), n - 1)
            return self._move("shrink", win, fit, d, f"over the memory budget: "
                              f"{human_bytes(used)} > {human_bytes(budget)}", win.gauges)
        cores, limit = win.cpu_cores, self.budgets.cpu_cores
        if n > 1 and cores is not None and cores > limit * (1 + TOLERANCE):
            fit = max(1, min(win.cost().cpu_limit(limit), n - 1))
            return self._move("shrink", win, fit, d, f"over the CPU budget: {cores:.1f} > "
                              f"{limit:g} cores", win.gauges)
        return None

    def _fits(self, g: Gauges, depth: int) -> int:
        """The most workers, 1 to ``max_workers``, whose memory at ``depth`` fits the budget."""
        n = self.max_workers
        while n > 1 and g.memory(n, depth) > self.budgets.memory_bytes:
            n -= 1
        return n

    def _hold(self, win: Window | None, key: str, reason: str) -> None:
        """Say once why nothing changes (again after a change, or for another reason)."""
        self._held = True
        if self._holding != key:
            self._holding = key
            self._record("hold", win, None, (self.workers,) * 2, (self.depth,) * 2, reason)

    # -- the one place a decision is made and recorded --------------------------------------
    def _move(self, kind: str, win: Window | None, workers: int, depth: int, reason: str,
              gauges: Gauges | None = None, *, before: Window | None = None) -> Move:
        """Apply the hard limits (``max_workers``, memory), record and return the move."""
        workers = max(1, min(workers, self.max_workers))
        g = gauges or (win.gauges if win is not None else Gauges())
        if workers > 1 and g.memory(workers, depth) > self.budgets.memory_bytes:
            workers = min(workers, self._fits(g, depth))
            reason += f"; held to {workers} by the memory budget"
        n0, d0 = self.workers, self.depth
        self._record(kind, before or win, win if before is not None else None,
                     (n0, workers), (d0, depth), reason)
        self.workers, self.depth = workers, depth
        self._phase, self._holding, self._calm, self._waits = "settle", None, 0, 0
        return Move(workers, depth)

    def _record(self, kind: str, before: Window | None, after: Window | None,
                workers: tuple[int, int], depth: tuple[int, int], reason: str) -> TuningDecision:
        """Build, log and keep one decision (NOTE [ Autotuning decisions ])."""
        at = 0.0 if self._t0 is None else time.monotonic() - self._t0
        decision = TuningDecision(
            kind, self.delivered, at, workers, depth,
            (before.input_bound if before else None, after.input_bound if after else None),
            (before.rate if before else None, after.rate if after else None), reason)
        self._decisions.append(decision)
        del self._decisions[:-AutotuneStats.KEEP]
        self._decided += 1
        log.info("gpufeed autotune: %s", decision)
        if self.trace_owner is not None:  # an instant in gpufeed.trace's timeline, if on
            _timeline.instant(self.trace_owner, f"autotune: {kind}", args=decision.as_args())
        return decision

    # -- what stats() shows -----------------------------------------------------------------
    def snapshot(self) -> AutotuneStats:
        last = self._last
        if last is None:
            state = "starting: no window measured yet"
        elif self.schedule is not None:
            state = "following a test schedule"
        elif self._held:
            holds = [d for d in self._decisions if d.kind == "hold"]
            state = f"holding: {holds[-1].reason}" if holds else "holding"
        elif self._trial is not None:
            state = f"verifying {self._trial.kind} to {self.workers} workers"
        else:
            state = "steady" if self._phase == "measure" else "settling after a change"
        return AutotuneStats(
            workers=self.workers, max_workers=self.max_workers, worker_type=self.worker_type,
            depth=self.depth, cpu_budget=self.budgets.cpu_cores,
            cpu_used=last.cpu_cores if last else None,
            memory_budget=self.budgets.memory_bytes,
            memory_used=last.memory_used() if last else 0, state=state,
            decisions=tuple(self._decisions), decided=self._decided)
