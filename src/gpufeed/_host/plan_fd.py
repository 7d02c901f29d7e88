"""An epoch's plan sent to process workers with its shared memory as a descriptor of its own.

NOTE [ Plans without a sharing thread ]
---------------------------------------
A shuffled epoch's order (``IndexPlan.perm``, ``_order/plan.py``) is drawn into shared memory
and sent to every process worker in ``UsePlan``. Pickled as torch pickles a shared tensor (the
``file_descriptor`` strategy), its descriptor would go through
``multiprocessing.resource_sharer``, a main-process thread that, once started, runs until the
program exits: every later fork would then fork a multi-threaded process, which Python 3.12+
warns of (a ``DeprecationWarning``: an error in suites that turn warnings into errors). The
stock loader leaves no such thread (torch's intra-op threads, once started, warn in both).

So the pool sends the plan's storage descriptor itself, right after the message, over the
worker's own Unix socket pair (``SCM_RIGHTS``); the message carries a ``SharedPerm``
(``messages.py``) instead of the tensor, and the worker's ``ProcessChannel`` takes the
descriptor first and rebuilds the tensor on the same shared memory. Only with the
``file_descriptor`` strategy (torch's default on Linux) and a plan already in shared memory;
otherwise the plan pickles as torch pickles it. Tested in ``tests/host/test_plan_fd.py``.
"""

from __future__ import annotations

import socket
from multiprocessing.reduction import sendfds
from typing import Any

import torch

from .._order.plan import IndexPlan
from .messages import SharedPerm, ToWorker, UsePlan


def detach(msg: ToWorker) -> tuple[ToWorker, int]:
    """``msg`` as pickled, and the descriptor to send right after it (-1: none), which the
    plan's storage owns: the caller neither closes nor keeps it."""
    if type(msg) is not UsePlan or msg.plan.perm is None:
        return msg, -1
    perm = msg.plan.perm
    if (not isinstance(perm, torch.Tensor) or not perm.is_shared()
            or torch.multiprocessing.get_sharing_strategy() != "file_descriptor"):
        return msg, -1
    try:
        fd, nbytes = perm.untyped_storage()._share_fd_cpu_()
    except (AttributeError, RuntimeError):  # a torch without it, or a storage shared by name
        return msg, -1
    plan = msg.plan
    stub = IndexPlan(None, plan.n, plan.batch_size, plan.drop_last, plan.single)
    stub.perm = SharedPerm(  # type: ignore[assignment]
        nbytes, perm.dtype, int(perm.storage_offset()), perm.numel(), perm.stride(0))
    return UsePlan(msg.gen, stub), fd


def send_descriptor(conn: Any, fd: int) -> None:
    """Pass ``fd`` over ``conn``, a Unix socket pair's end, after its message."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sendfds(sock, [fd])
