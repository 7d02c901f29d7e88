"""Errors raised by gpufeed and the carrier that brings a worker's exception home.

    Exception
     └── RuntimeError
          └── WorkerError        a worker process died (signal or exit code), timed out,
               │                 or its start-up failed; the main process or a worker ran
               │                 out of file descriptors (torch's "Too many open files")
               └── SharedMemoryError  a process worker got no shared memory for a batch the
                                 ring did not hold (_memory/spill.py)
Exceptions raised by the user's dataset or collate function are re-raised in the main
process with their own type, the worker's traceback and the sample index. A class that cannot
be pickled (defined in a function, or in ``__main__`` of a spawned child) becomes a
RuntimeError naming it, and only where it must cross processes: thread workers keep it.
"""

from __future__ import annotations

import errno
import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

# torch's words (dataloader.py, NOTE [ DataLoader on Linux and open files limit ]), which
# programs match on; gpufeed's detail follows them.
TOO_MANY_FILES = (
    "Too many open files. Communication with the workers is no longer possible. Please "
    "increase the limit using `ulimit -n` in the shell or change the sharing strategy by "
    "calling `torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of "
    "your code"
)


class WorkerError(RuntimeError):
    """A gpufeed worker could not deliver: it died, hung past ``timeout``, or failed to start."""


def out_of_descriptors(exc: BaseException | None) -> bool:
    """Whether ``exc``, or one it was raised from or during, says a process ran out of file
    descriptors (EMFILE, ENFILE, or torch's shared memory's message)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            return True
        if "Too many open files" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


@dataclass(eq=False)
class RemoteError:
    """An exception caught in a worker (:func:`capture`), in a form that pickles whatever the
    exception holds: its type, the type's name, where it was caught and its traceback."""

    exc_type: type[BaseException]
    type_name: str
    where: str
    text: str

    def __reduce__(self) -> tuple[Any, ...]:
        exc_type = self.exc_type
        try:  # checked only here: a thread worker's error is never pickled
            pickle.dumps(exc_type)
        except Exception:  # a class defined in a closure or __main__ of a spawned child
            exc_type = RuntimeError
        return (RemoteError, (exc_type, self.type_name, self.where, self.text))

    @classmethod
    def plain(cls, exc_type: type[BaseException], message: str) -> RemoteError:
        """An error re-raised as ``exc_type(message)``, its message unchanged (gpufeed's own
        errors that start with torch's words, which programs match on)."""
        return cls(exc_type, "", "", message)

    def reraise(self) -> NoReturn:
        if not self.where:  # RemoteError.plain
            raise self.exc_type(self.text)
        where, detail = self.where, ""
        if " (gpufeed: " in where:  # torch's first line whole: "... worker process 0."
            where, detail = where.split(" (gpufeed: ", 1)
            detail = f"(gpufeed: {detail}\n"
        msg = (
            f"Caught {self.type_name} {where}.\n{detail}"
            f"Original {self.text}"  # torch's words: "Original Traceback (most recent ..."
        )
        if self.exc_type is KeyError:
            msg = KeyErrorMessage(msg)  # keep the newlines readable
        try:
            exc = self.exc_type(msg)
        except Exception:
            raise RuntimeError(msg) from None
        try:
            raise exc
        finally:  # no reference cycle through this frame: the iterator that raised is freed
            del exc  # at once, in the thread that drops the error, not by a later collection


class KeyErrorMessage(str):
    """KeyError quotes its message with repr(); this keeps the traceback readable."""

    def __repr__(self) -> str:
        return str(self)


def capture(where: str) -> RemoteError:
    """Wrap the exception being handled (call inside ``except``)."""
    exc = sys.exc_info()[1]
    assert exc is not None  # internal: only called from an except block
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteError(type(exc), type(exc).__name__, where, text)
