"""Running out of file descriptors: what is recognised as such, and how a message that could
not be unpickled is told apart from a worker that exited (``_host/descriptors.py``)."""

from __future__ import annotations

import errno
from multiprocessing.reduction import ForkingPickler

import pytest

from gpufeed._base.errors import WorkerError, out_of_descriptors
from gpufeed._host.descriptors import receive


def _hangs_up() -> None:
    raise EOFError  # what fetching a descriptor from a sharer that hung up raises


class _Lost:
    """Pickles as a call that fails when unpickled, like a spill whose descriptor is gone."""

    def __reduce__(self):
        return (_hangs_up, ())


class _Conn:
    def recv_bytes(self) -> bytes:
        return bytes(ForkingPickler.dumps(_Lost()))


class _Proc:
    def __init__(self, exits: bool) -> None:
        self.exits, self.pid, self.alive = exits, 1234, True

    def join(self, timeout: float) -> None:
        self.alive = not self.exits

    def is_alive(self) -> bool:
        return self.alive


def test_a_descriptor_lost_by_a_live_worker_is_too_many_open_files():
    with pytest.raises(WorkerError) as info:
        receive(_Conn(), _Proc(exits=False), 0)
    msg = str(info.value)
    assert msg.startswith("Too many open files. Communication with the workers is no longer "
                          "possible.") and "worker 0 (pid 1234)" in msg


def test_a_descriptor_lost_by_an_exiting_worker_is_its_death():
    """The worker hung up because it exited (its own error, a signal): the pool reports it
    dead, with its exit code, not as a shortage of descriptors."""
    with pytest.raises(EOFError):
        receive(_Conn(), _Proc(exits=True), 0)


def test_out_of_descriptors_looks_through_the_chain():
    emfile = OSError(errno.EMFILE, "Too many open files")
    try:
        try:
            raise emfile
        except OSError as e:
            raise RuntimeError("could not make the spill file") from e
    except RuntimeError as wrapped:
        assert out_of_descriptors(wrapped)
    assert out_of_descriptors(RuntimeError("unable to open shared memory object: Too many open "
                                           "files (24)"))
    assert not out_of_descriptors(OSError(errno.ENOSPC, "No space left on device"))
    assert not out_of_descriptors(None)
