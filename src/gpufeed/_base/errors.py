"""Errors raised by gpufeed and the carrier that brings a worker's exception home.

    Exception
     └── RuntimeError
          └── WorkerError        a worker process died (signal or exit code), timed out,
               │                 or its start-up failed; the main process ran out of file
               │                 descriptors (torch's "Too many open files" message)
               └── SharedMemoryError (_memory/spill.py)  a process worker got no shared memory for
                                 a batch the ring did not hold
Exceptions raised by the user's dataset or collate function are re-raised in the main
process with their own type, the worker's traceback and the sample index. A class that cannot
be pickled (defined in a function, or in ``__main__`` of a spawned child) becomes a
RuntimeError naming it, and only where it must cross processes: thread workers keep it.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from typing import Any


class WorkerError(RuntimeError):
    """A gpufeed worker could not deliver: it died, hung past ``timeout``, or failed to start."""


class RemoteError:
    """An exception caught in a worker, in a form that pickles whatever the exception holds."""

    def __init__(self, exc: BaseException, where: str) -> None:
        self.exc_type: type[BaseException] = type(exc)
        self.type_name = type(exc).__name__
        self.where = where
        self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))

    def __reduce__(self) -> tuple[Any, ...]:
        exc_type = self.exc_type
        try:  # checked only here: a thread worker's error is never pickled
            pickle.dumps(exc_type)
        except Exception:  # a class defined in a closure or __main__ of a spawned child
            exc_type = RuntimeError
        return (_rebuild, (exc_type, self.type_name, self.where, self.text))

    def reraise(self) -> None:
        msg = (
            f"Caught {self.type_name} {self.where}.\n"
            f"Original traceback (worker):\n{self.text}"
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


def _rebuild(
    exc_type: type[BaseException], type_name: str, where: str, text: str
) -> RemoteError:
    obj = RemoteError.__new__(RemoteError)
    obj.exc_type, obj.type_name, obj.where, obj.text = exc_type, type_name, where, text
    return obj


def capture(where: str) -> RemoteError:
    """Wrap the exception being handled (call inside ``except``)."""
    exc = sys.exc_info()[1]
    assert exc is not None  # internal: only called from an except block
    return RemoteError(exc, where)
