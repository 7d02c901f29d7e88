"""Thread workers the GIL holds back, under ``num_workers="auto"``: seen, and said once.

Auto never changes the worker type (NOTE [ Autotuning decisions ] in ``_host/autotune.py``).
With thread workers, when the loop waits (input-bound at least ``GROW_AT``) and the window's
decision holds more workers back (not for noise or a failed start) or reverts a growth, while
the whole process used under ``GIL_CORES`` cores of a budget of two or more, the work holds
the GIL: threads run it one core at a time. The iterator then warns once per loader, a
:class:`ThreadWorkersWarning` naming ``worker_type="process"`` (:func:`held_back`).

It warns rather than switch the type: process workers pickle the dataset, run
``worker_init_fn`` in another process, seed the global generators there and take memory the
budgets were not sized for, which a drop-in loader cannot do behind the program's back, and
the gain of a switch did not stand out of the noise. On a machine whose cores other programs
keep busy, the advice may name cores that process workers would not get either.
Measurements: docs/how-it-works/measurements/host.md#thread-workers-held-back.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from .autotune import GROW_AT
from .window import Window, pct

if TYPE_CHECKING:
    from .autotune import AutoTuner

GIL_CORES = 1.5
#: the autotuners (one per loader) whose loader has been told already
_told: weakref.WeakSet[AutoTuner] = weakref.WeakSet()


class ThreadWorkersWarning(UserWarning):
    """``num_workers="auto"`` with ``worker_type="thread"`` saw the loop wait while more thread
    workers could not help: the work holds the GIL; ``worker_type="process"`` would run it on
    the other cores."""


def held_back(tuner: AutoTuner, win: Window, decided: int) -> str | None:
    """The warning's words, once per loader, when the decision on ``win`` (``decided``: the
    count of decisions before) held thread workers back and ``win`` shows the GIL; else None."""
    if tuner.worker_type != "thread" or tuner in _told:
        return None
    stats = tuner.snapshot()
    if stats.decided == decided or not stats.decisions:
        return None
    last = stats.decisions[-1]
    grew_in_vain = last.kind == "revert" and last.workers[1] < last.workers[0]
    held = last.kind == "hold" and not last.reason.startswith(("the machine is too noisy",
                                                                "could not start"))
    if not (grew_in_vain or held):
        return None
    advice = gil_advice(win, tuner.budgets.cpu_cores, last.reason)
    if advice is not None:
        _told.add(tuner)
    return advice


def gil_advice(win: Window, cpu_budget: float, why: str) -> str | None:
    """The warning's words when ``win`` shows the GIL (``why``: what held workers back)."""
    cores = win.cpu_cores
    if win.input_bound < GROW_AT or cores is None or cores >= GIL_CORES or cpu_budget < 2:
        return None
    return (f"num_workers='auto' with worker_type='thread': your loop waits for data "
            f"(input-bound {pct(win.input_bound)}) and more thread workers cannot help ({why}): "
            f"the whole process used {cores:.1f} of the {cpu_budget:g} cores it may use, so the "
            "dataset's work holds the GIL (pure Python) and threads run it one core at a time. "
            "worker_type='process' would run it on the other cores (gpufeed.DataLoader(..., "
            "num_workers='auto', worker_type='process')); auto never changes the worker type "
            "itself")
