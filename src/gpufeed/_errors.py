"""Errors raised by gpufeed and the carrier that brings a worker's exception home.

    Exception
     └── RuntimeError
          └── WorkerError        a worker process died (signal or exit code), timed out,
                                 or its start-up failed
Exceptions raised by the user's dataset or collate function are re-raised in the main
process with their own type where possible, the worker's traceback and the sample index.
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
        try:
            pickle.dumps(self.exc_type)
        except Exception:  # a class defined in a closure or __main__ of a spawned child
            self.exc_type = RuntimeError
        self.where = where
        self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.exc_type, self.where, self.text))

    def reraise(self) -> None:
        msg = (
            f"Caught {self.exc_type.__name__} {self.where}.\n"
            f"Original traceback (worker):\n{self.text}"
        )
        if self.exc_type is KeyError:
            msg = KeyErrorMessage(msg)  # keep the newlines readable
        try:
            exc = self.exc_type(msg)
        except Exception:
            raise RuntimeError(msg) from None
        raise exc


class KeyErrorMessage(str):
    """KeyError quotes its message with repr(); this keeps the traceback readable."""

    def __repr__(self) -> str:
        return str(self)


def _rebuild(exc_type: type[BaseException], where: str, text: str) -> RemoteError:
    obj = RemoteError.__new__(RemoteError)
    obj.exc_type, obj.where, obj.text = exc_type, where, text
    return obj


def capture(where: str) -> RemoteError:
    """Wrap the exception being handled (call inside ``except``)."""
    exc = sys.exc_info()[1]
    assert exc is not None  # internal: only called from an except block
    return RemoteError(exc, where)
