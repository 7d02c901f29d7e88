"""The memory a ring or a spill file is carved from: a sparse region, and the sizes in it.

The slot ring (``_memory/ring.py``, NOTE [ Slot lifetime ]) recycles slots of one
:class:`Region`; a spill file (``_memory/spill.py``, NOTE [ Spill ]) is a region of its own per
batch. Writers carve their leaves out of either with ``contiguous_at``, on ``ALIGN``-byte
boundaries.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import sys
import weakref
from typing import Any

import numpy as np
import torch

# A sparse reservation must not be charged to the commit limit up front (Linux's value; newer
# Pythons name it).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
ALIGN = 64  # bytes; every leaf starts on a cache-line boundary
PAGE = mmap.PAGESIZE  # 64 KiB on some aarch64 hosts (GH200): never assume 4096


def align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def contiguous_at(typed: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A C-contiguous tensor of ``shape`` viewing the 1-D ``typed`` from element ``offset``."""
    return typed.as_strided(shape, _strides.get(shape) or contiguous_strides(shape), offset)


_strides: dict[tuple[int, ...], tuple[int, ...]] = {}


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a C-contiguous tensor of ``shape``, computed once per shape (batches
    repeat their shapes)."""
    stride = _strides.get(shape)
    if stride is None:
        acc, rev = 1, []
        for d in reversed(shape):
            rev.append(acc)
            acc *= d
        stride = _strides[shape] = tuple(reversed(rev))
    return stride


def physical_memory() -> int:
    """The physical memory in whole pages (at least one): what a ring or a spill reserves at
    most, as live slots and leaves are touched memory (no more is of use), and mapping more
    fails (128 TiB is the whole address space)."""
    import psutil

    return max(psutil.virtual_memory().total // PAGE * PAGE, PAGE)


def default_reserve() -> int:
    """Address space reserved for a ring whose budget the user did not set: sparse, its
    pages cost memory only once touched, and the budget learnt from the first batch bounds
    what is touched."""
    return max(min(16 << 30, physical_memory() // 2) // PAGE * PAGE, PAGE)


def reserve_for(budget: int | None) -> int:
    """Address space to reserve for a ring of ``budget`` bytes (None: default), at most
    :func:`physical_memory`. Past the reservation batches fall back to ordinary allocation,
    as past the budget."""
    return default_reserve() if budget is None else min(budget, physical_memory())


def reserve_region(reserve: int, *, shared: bool, budget: int | None) -> Region:
    """A region of ``reserve`` bytes (at least a page) for a slot ring of ``ring_bytes=budget``;
    a reservation the system refuses is a ValueError that names the fix."""
    try:
        return Region(max(reserve, PAGE), shared=shared)
    except OSError as e:
        if e.errno not in (errno.ENOMEM, errno.EFBIG, errno.EINVAL):
            raise
        fix = (
            f"lower ring_bytes= (it is {budget})" if budget is not None
            else "set ring_bytes= to the bytes the ring may hold"
        )
        raise ValueError(
            f"gpufeed cannot reserve {reserve} bytes of address space for its slot ring "
            f"({e.strerror}): {fix}, or pass ring_bytes=0 to do without the ring"
        ) from e


def _anonymous_file(size: int) -> int:
    """A descriptor of a nameless file for a shared region: a ``memfd`` on Linux; elsewhere
    an unlinked temporary file, in /dev/shm when there is one, which leaves nothing behind
    either but whose pages may be written back to disk under memory pressure."""
    create = getattr(os, "memfd_create", None)
    if create is not None:
        return int(create("gpufeed-ring", getattr(os, "MFD_CLOEXEC", 0)))
    import tempfile

    ram = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryFile(prefix="gpufeed-ring-", dir=ram) as f:  # unlinked already
        return os.dup(f.fileno())  # not inheritable (PEP 446), like MFD_CLOEXEC


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class Region:
    """A sparse block of memory; shared for process workers, private for thread workers.

    Shared regions live in an anonymous memory file (``_anonymous_file``), not in /dev/shm:
    nothing to unlink or leave behind if a process is killed, no /dev/shm size limit. Pickling
    one (for spawned workers) passes its descriptor; fork inherits the mapping. Private regions
    are private anonymous memory, so ``discard`` really frees their pages (a shared anonymous
    mapping would keep them in shmem).

    The region owns its descriptor: ``close_fd()`` closes it, as does a finalizer when the
    region is collected first or ``__init__`` fails. The mapping belongs to ``mm`` (CPython's
    mmap keeps a descriptor of its own), which numpy and torch views keep alive.
    ``release()`` lets go of both, so a region still referenced after its ring closed (by a
    failed start-up's traceback, say) holds no descriptor and no memory.
    """

    def __init__(self, size: int, *, shared: bool) -> None:
        self.size = size
        self.fd = -1
        self.shared = shared
        self._pid = os.getpid()
        self._fd_fin: weakref.finalize[Any, Any] | None = None
        if shared:
            self.fd = _anonymous_file(size)
            self._fd_fin = weakref.finalize(self, _close_fd, self.fd)
            try:
                os.ftruncate(self.fd, size)
                self.mm = mmap.mmap(self.fd, size)
            except BaseException:
                self.close_fd()
                raise
        else:
            self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        self.array: np.ndarray = np.frombuffer(self.mm, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.array)

    def tensor_here(self) -> torch.Tensor:
        """The region's bytes in this process; in a child forked while the descriptor was open,
        a new mapping of the memory file: a driver may leave ranges page-locked before the fork
        out of the child's address space (``MADV_DONTFORK``), as ROCm's did."""
        if os.getpid() == self._pid or self.fd < 0:
            return self.tensor
        mm = mmap.mmap(self.fd, self.size)
        self.mm, self.array = mm, np.frombuffer(mm, dtype=np.uint8)  # the inherited one unused
        self.tensor = torch.from_numpy(self.array)
        self._pid = os.getpid()
        return self.tensor

    def discard(self, offset: int, size: int) -> None:
        """Give the pages of a retired slot back to the system (contents are lost)."""
        advice = getattr(mmap, "MADV_REMOVE" if self.shared else "MADV_DONTNEED", None)
        if advice is None:
            return  # this platform cannot punch holes: the pages stay until the ring closes
        with contextlib.suppress(OSError, ValueError):  # only memory use is at stake
            self.mm.madvise(advice, offset, size)

    def close_fd(self) -> None:
        """Drop the descriptor once workers have it; the mapping stays. Idempotent."""
        if self._fd_fin is not None:
            self._fd_fin()  # closes the descriptor once, and never again at collection
        self.fd = -1

    def release(self) -> None:
        """Let go of the descriptor and the mapping: unmapped at once when nothing views it,
        else with the last view. Idempotent."""
        self.close_fd()
        mm, self.mm = self.mm, None  # type: ignore[assignment]
        self.array = self.tensor = None  # type: ignore[assignment]
        if mm is not None:
            # BufferError: views of it are alive, and it is unmapped with the last of them.
            with contextlib.suppress(BufferError):
                mm.close()

    def __reduce__(self) -> tuple[Any, ...]:
        if self.fd < 0:
            raise RuntimeError("a gpufeed ring can only be sent to workers while they start")
        from multiprocessing.reduction import DupFd

        return (_attach, (DupFd(self.fd), self.size))


def _attach(dupfd: Any, size: int) -> Region:
    fd = dupfd.detach()
    obj = Region.__new__(Region)
    obj.size, obj.fd, obj.shared, obj._fd_fin = size, -1, True, None
    obj._pid = os.getpid()
    try:
        obj.mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    obj.array = np.frombuffer(obj.mm, dtype=np.uint8)
    obj.tensor = torch.from_numpy(obj.array)
    return obj
