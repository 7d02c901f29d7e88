"""Ctrl-C where Python would drop it: held across a fork, raised again after a finalizer.

NOTE [ Ctrl-C that Python drops ]
---------------------------------
Python runs a signal's handler in the main thread at its next bytecode. Two kinds of code
print the handler's exception ("Exception ignored in ...") and go on without it:

- finalizers and weak-reference callbacks (a batch's slot release, NOTE [ Ctrl-C and slot
  releases ] in ``_memory/release.py``): ``interrupt_main_later`` interrupts the main thread
  again once the finalizer has returned;
- ``os.register_at_fork`` hooks. ``Process.start()`` with the fork method spends milliseconds
  in ``fork()`` (the page tables of a process that imported torch), and a SIGINT that
  arrives meanwhile is handled in the parent's after-fork hooks: dropped, and the loop goes
  on. Measurements: docs/how-it-works/measurements/memory.md#ctrl-c-that-python-drops.
  ``ctrl_c_held`` swaps in a handler that only notes the signal for the length of a forked
  start and hands it to the replaced handler afterwards, so the KeyboardInterrupt is raised
  in the loader's own code, which cleans up as for any other. (Spawn and forkserver starts
  run no at-fork hook here: nothing is held.)

An iterator dropped unclosed closes its pool from ``__del__``, and stopping workers takes
milliseconds: a Ctrl-C then would be dropped and stop the close half-way. That close runs
under ``ctrl_c_held(in_finalizer=True)``: it finishes, then the main thread is interrupted.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def ctrl_c_held(in_finalizer: bool = False, *, hold: bool = True) -> Iterator[None]:
    """Hold a SIGINT that arrives inside the block and deliver it to the handler in force
    before once the block is over (after any exception of the block's own); ``in_finalizer``,
    where that would be dropped too: :func:`interrupt_main_later` instead. ``hold=False``
    holds nothing (a spawned worker's start runs no at-fork hook, and pickling a large
    dataset for it would hold a Ctrl-C as long). Does nothing off the main thread, the only
    one that runs signal handlers, or where the handler is ignored or installed from C.
    """
    previous = signal.getsignal(signal.SIGINT)
    if (not hold or threading.current_thread() is not threading.main_thread()
            or previous is None or previous == signal.SIG_IGN):
        yield
        return
    held: list[FrameType | None] = []

    def note(signum: int, frame: FrameType | None) -> None:
        held.append(frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and in_finalizer:
            interrupt_main_later()
        elif held:
            if callable(previous):  # Python's own raises KeyboardInterrupt here
                previous(signal.SIGINT, held[0])
            else:  # SIG_DFL: end the process as the signal would have
                signal.raise_signal(signal.SIGINT)


def interrupt_main_later(delay_s: float = 0.02) -> None:
    """Interrupt the main thread again after ``delay_s``, from a daemon thread, so a Ctrl-C
    caught in a finalizer is raised once that code has returned. With Python's own SIGINT
    handler, a real SIGINT to the main thread (it also wakes a blocking wait); else the
    handler is run as for a SIGINT (``_thread.interrupt_main``).
    """
    main = threading.main_thread().ident
    kill = getattr(signal, "pthread_kill", None)
    if main is not None and kill is not None and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    ):
        timer = threading.Timer(delay_s, kill, (main, signal.SIGINT))
    else:
        timer = threading.Timer(delay_s, _thread.interrupt_main)
    timer.daemon = True
    timer.name = "gpufeed-reinterrupt"
    timer.start()
