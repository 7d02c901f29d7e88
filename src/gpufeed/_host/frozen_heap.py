"""Python's cyclic collector and forked workers: a worker freezes the objects it inherited.

NOTE [ Frozen heap at fork ]
----------------------------
A forked worker inherits every object of the main process, sharing its pages until it writes
to one. Reading an object writes its reference count (NOTE [ Copy-on-write and Python objects ]
in ``_sources/packed.py``); a full collection in the worker writes more: the collector's header
of every container it inherited, read or not, so the worker copies every page holding one.
It also finalizes there the parent's garbage awaiting the parent's next full collection
(``__del__`` and ``weakref.finalize`` of objects the worker does not own: a stock loader's
iterator left in a cycle prints "AssertionError: can only test a child process" from each
worker that collects it). Python 3.11-3.13 collect in full rarely, or on ``gc.collect()``;
3.14's incremental collector walks the old generation a slice at a time, in every worker. One
collection under a million dicts made 163-169 MiB of a stock worker private, 0.2-0.3 MiB of
gpufeed's. Measurements: docs/how-it-works/measurements/host.md#frozen-heap-at-fork.

So a worker forked by gpufeed freezes what it inherited before it runs code of its own: an
``os.register_at_fork`` hook calls ``gc.freeze()`` in the child while the parent is starting
workers (a count the child reads in its copy of the parent's memory; other forks pass through,
but for one made by another thread during a start, which freezes too, to no harm). Frozen
objects are in the permanent generation, which the worker's collector never scans; a freeze
writes only the headers at the ends of the generations' lists. The main process is untouched:
freezing there would move its young objects to its oldest generation at each start, and,
skipping a program's own freeze, would never freeze on Python 3.12, which starts with objects
frozen. Seen from a worker, the inherited objects are in no generation (``gc.get_objects()``
lists its own only); a process it forks freezes nothing more. Spawned and forkserver children
inherit no objects.

A free-threaded build is the exception: there a freeze sets a bit in every object, which in a
child would write every page it inherited, and a collection writes every object it scans. So
the parent freezes instead, around a pool's starts (``gc.freeze()`` before, ``gc.unfreeze()``
after, under a lock shared by all loaders, not when the program has frozen objects itself):
its workers' collectors skip the frozen objects, and the parent writes each object twice.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sysconfig
import threading
from collections.abc import Iterator

#: whether this is a free-threaded build, whose freeze writes to every object (NOTE)
_FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
_turns = threading.Lock()
#: workers being forked now, by any loader: read by the child, in its copy of this module
_forking = 0


def _freeze_in_child() -> None:
    """After every ``os.fork()``, in the child: a worker freezes what it inherited (NOTE)."""
    global _forking
    if _forking:
        _forking = 0  # the worker's own forks, if any, inherit nothing to freeze again
        gc.freeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_freeze_in_child)


@contextlib.contextmanager
def heap_frozen(*, fork: bool) -> Iterator[None]:
    """Around starting process workers with ``fork`` (NOTE [ Frozen heap at fork ])."""
    global _forking
    if not fork:
        yield
    elif _FREE_THREADED:
        with _turns:
            if gc.get_freeze_count():  # the program's own freeze: kept as it is
                yield
                return
            gc.freeze()
            try:
                yield
            finally:
                gc.unfreeze()
    else:
        with _turns:
            _forking += 1
        try:
            yield
        finally:
            with _turns:
                _forking -= 1
