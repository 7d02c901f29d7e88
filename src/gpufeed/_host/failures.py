"""What the iterator reports when a worker fails, times out or cannot start.

torch's own phrase comes first in each (programs and frameworks match on it), then gpufeed's
detail: which worker, which batches it held, and the fix.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import warnings
from collections.abc import Iterator
from typing import NamedTuple, NoReturn

from .._base.errors import RemoteError, WorkerError

#: torch's warning, word for word, when a worker process cannot be started because its
#: arguments cannot be pickled (spawn and forkserver pickle the dataset and the functions).
START_PICKLE_WARNING = (
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork')."
)


@contextlib.contextmanager
def warn_if_unpicklable() -> Iterator[None]:
    """Around ``Process.start()``: torch's warning before the pickling error goes on."""
    try:
        yield
    except (TypeError, AttributeError, pickle.PicklingError):
        warnings.warn(START_PICKLE_WARNING, stacklevel=3)
        raise


def describe_exit(pid: int | None, w: int, code: int | None) -> str:
    """What happened to worker ``w`` (process ``pid``, exit code ``code``)."""
    if code is None:
        return f"gpufeed worker {w} (pid {pid}) is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {
            "SIGKILL": " (often the kernel's out-of-memory killer: lower num_workers or "
            "batch size)",
            "SIGBUS": " (often /dev/shm is full: enlarge it, e.g. docker --shm-size, or lower "
            "ring_bytes; `gpufeed doctor` checks it)",
            "SIGSEGV": " (a crash in native code of the dataset or a library it calls)",
        }.get(name, "")
        stock = f"DataLoader worker (pid {pid}) is killed by signal: {signal.strsignal(-code)}."
        # Stock raises "... exited unexpectedly" from the signal's message: both phrases.
        return (
            f"{stock} DataLoader worker (pid(s) {pid}) exited unexpectedly: gpufeed worker "
            f"{w} was killed by {name}{hint}"
        )
    if code == 0:
        return f"DataLoader worker (pid {pid}) exited unexpectedly (gpufeed worker {w}, code 0)"
    return (
        f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}. "
        f"gpufeed worker {w} exited with code {code}"
    )


class Lost(NamedTuple):
    """In the place of a dead worker's first batch: the error raised when the loop gets there
    (the batches before it, from the other workers, come first); a ``RemoteError`` for a
    worker that could not start (``StartFailed`` in ``WorkerIter._handle``)."""

    error: WorkerError | RemoteError

    def raise_it(self) -> NoReturn:
        if isinstance(self.error, RemoteError):
            self.error.reraise()
        raise self.error


def lost_worker(desc: str, held: list[int]) -> WorkerError:
    """The error for a worker that exited (``desc``) holding batches ``held``: it works through
    them in order, but a result it sent can be lost with it (a fallback batch's memory is
    handed over by the dead process): the culprit is one of them, maybe not the first."""
    named = ", ".join(map(str, sorted(held)[:6])) + (", ..." if len(held) > 6 else "")
    detail = f" while it held batch{'es' if len(held) > 1 else ''} {named}" if held else ""
    return WorkerError(
        f"{desc}{detail}. No batch was lost silently: the epoch stops here. "
        "Rerun with num_workers=0 to see the error in the main process."
    )


def timed_out(timeout_text: str, tasks: dict[int, int]) -> WorkerError:
    """The error for ``timeout=`` (as given, ``timeout_text``) passed with ``tasks`` (batch ->
    worker) unanswered."""
    waiting = [f"batch {i} on worker {w}" for i, w in sorted(tasks.items())]
    return WorkerError(
        f"DataLoader timed out after {timeout_text} seconds (gpufeed: waiting for "
        f"{', '.join(waiting[:4]) or 'a batch'}); raise timeout= or find what blocks the dataset"
    )


def check_not_forked(pid: int) -> None:
    """Raise the forked-loader error where this process is not ``pid``, the workers' parent."""
    if os.getpid() != pid:
        raise RuntimeError(
            f"this gpufeed DataLoader's workers were started in process {pid}, and this "
            f"process (pid {os.getpid()}) is a fork of it: the loader was created before a fork "
            "and cannot be used here (threads do not survive fork(), and process workers answer "
            "their parent only); re-create the DataLoader in this process"
        )
