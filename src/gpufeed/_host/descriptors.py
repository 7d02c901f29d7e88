"""Running out of file descriptors, on either side of a process worker's pipe.

Batches the ring does not hold travel as memory files (NOTE [ Spill ] in ``_memory/spill.py``)
whose descriptors a thread in the worker passes to the main process. Out of descriptors, the
user gets torch's words (``TOO_MANY_FILES``), which programs match on, then where and why:

- a worker, fetching or sending: the batch's result is that error
  (:func:`worker_out_of_descriptors`);
- the worker's descriptor-passing thread: it hangs up (and prints why); the main process sees
  EOF while unpickling a message from a worker still alive half a second later (:func:`receive`);
- the main process, receiving: tested as torch tests it (:func:`out_of_fds`).
"""

from __future__ import annotations

import errno
import os
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any

from .._base.errors import TOO_MANY_FILES, RemoteError, WorkerError, out_of_descriptors
from .messages import ToMain


def too_many_files(where: str) -> str:
    """torch's out-of-descriptors message, then where it happened (``where``) and why."""
    return (f"{TOO_MANY_FILES}. (gpufeed: {where}; each batch the slot ring does not hold "
            "(those your loop keeps hold their slots) travels as a memory file whose descriptor "
            "the worker passes to the main process, which closes it once mapped, and each "
            "tensor the ring cannot hold (nested, sparse, subclasses) as torch shares it, which "
            "the sharing strategy governs; a larger ring_bytes= or worker_type='thread' needs "
            "none)")


def out_of_fds(margin: int = 10) -> bool:
    """Whether this process is (nearly) out of descriptors: opening ``margin`` of them fails."""
    fds: list[int] = []
    try:
        for _ in range(margin):
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as e:
        return e.errno == errno.EMFILE
    finally:
        for fd in fds:
            os.close(fd)
    return False


def worker_out_of_descriptors(worker_id: int, doing: str) -> RemoteError:
    """In a worker, for the out-of-descriptors exception being handled."""
    text = traceback.format_exc()
    return RemoteError.plain(WorkerError, too_many_files(
        f"worker {worker_id} (pid {os.getpid()}) ran out of file descriptors {doing}"
    ) + f"\nOriginal traceback (worker):\n{text}")


def receive(conn: Any, proc: Any, w: int) -> ToMain:
    """The next message from process worker ``w``. The pipe's own errors propagate (EOF: the
    worker is gone); out of descriptors, on either side: torch's "Too many open files"."""
    what = "a message"
    try:
        buf = conn.recv_bytes()
        # a batch's descriptors are fetched from the worker while unpickling
        what = "a batch"
        msg: ToMain = ForkingPickler.loads(buf)
        return msg
    except Exception as e:
        if out_of_descriptors(e) or out_of_fds():
            raise WorkerError(too_many_files(
                f"the main process, receiving {what} from worker {w}")) from e
        if what == "a batch" and isinstance(e, EOFError):
            # A worker that exits also hangs up, and it is reported as dead: not one still
            # alive half a second later.
            proc.join(0.5)
            if proc.is_alive():
                raise WorkerError(too_many_files(
                    f"worker {w} (pid {proc.pid}) could not pass a batch's descriptor to the "
                    "main process: its descriptor-passing thread failed, as it does when the "
                    "worker runs out of file descriptors")) from e
        raise
