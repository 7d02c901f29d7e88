"""Thread workers the GIL holds back, under ``num_workers="auto"``: seen, and said once.

Auto never changes the worker type (NOTE [ Autotuning decisions ] in ``_host/autotune.py``).
With ``worker_type="thread"``, when the loop waits (input-bound at least ``GROW_AT``) and the
autotuner's decision on that window holds more workers back (a budget, crowded cores,
``max_workers``, a count that gave nothing) or reverts a growth that gave no gain, while the
whole process used under ``GIL_CORES`` cores of a budget of two or more, the dataset's work
holds the GIL: threads run it one core of Python at a time, and process workers would use the
other cores. The iterator (``_host/auto_iter.py``) then warns once per loader, a
:class:`ThreadWorkersWarning` naming ``worker_type="process"`` (:func:`held_back`).

Why it warns and does not switch the type at an epoch boundary: process workers pickle the
dataset (a dataset written for threads may not pickle), run ``worker_init_fn`` and
``get_worker_info()`` in another process, seed the global random generators there (a thread
dataset's draws would change), and take /dev/shm and private memory the budgets were not
sized for: a drop-in loader cannot do that behind the program's back.

Measured with ``bench/autotune_threads.py`` (pure-Python samples, batch 8, a 1 ms step, 2
cores shared with other jobs, load average 7-9; 3 alternating rounds of 4 s): the warning came
once in every thread run, at batch 101-279 (about a second in); the medians, their ranges
overlapping on that busy machine, were auto on threads 0.84x of the best, auto on processes
0.92x, 2 threads 1.00x, 2 processes 0.75x. The gap a switch would win did not stand out of the
noise there (the lab's quieter run measured auto on threads at 0.55x of the best static
setting): no case for the risks above. The process's CPU is the tell, so on a machine whose
cores other programs keep busy the advice may name cores that process workers would not get
either.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from .autotune import GROW_AT
from .window import Window, pct

if TYPE_CHECKING:
    from .autotune import AutoTuner

__all__ = ["GIL_CORES", "ThreadWorkersWarning", "gil_advice", "held_back"]

GIL_CORES = 1.5  # a process using less than this many cores while its threads are held back
#: the autotuners (one per loader) whose loader has been told already
_told: weakref.WeakSet[AutoTuner] = weakref.WeakSet()


class ThreadWorkersWarning(UserWarning):
    """``num_workers="auto"`` with ``worker_type="thread"`` saw the loop wait while more thread
    workers could not help: the work holds the GIL; ``worker_type="process"`` would run it on
    the other cores."""


def held_back(tuner: AutoTuner, win: Window, decided: int) -> str | None:
    """The words to warn with, once per loader, when the decision the tuner took on ``win``
    (``decided``: its count of decisions before) held thread workers back or undid a growth
    and ``win`` shows the GIL (:func:`gil_advice`); else None."""
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
    """The words to warn with when ``win`` shows thread workers the GIL holds back (see the
    module's text; ``why``: what held them back), else None."""
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
