"""Python's cyclic collector and forked workers: a worker freezes the objects it inherited.

NOTE [ Frozen heap at fork ]
----------------------------
A forked worker inherits every object of the main process, sharing its pages until it writes
to one. Reading an object writes its reference count (NOTE [ Copy-on-write and Python objects ]
in ``_sources/packed.py``); the cyclic collector writes more: a full collection in the worker
rewrites the collector's header of every container object it inherited (lists, dicts, tuples,
class instances), read by the worker or not, so each worker copies every page that holds one.
It also finalizes, in the worker, the parent's garbage that was waiting for the parent's next
full collection: ``__del__`` methods and ``weakref.finalize`` callbacks of objects the worker
does not own run there (a stock loader's iterator left in a reference cycle prints
"AssertionError: can only test a child process" from each worker that collects it).

Measured here (2026-11-28, ``bench/results/frozen-heap-py3*.md``): the main
process holding a million annotation dicts (2.2M tracked objects), one ``gc.collect()`` in a
stock loader's worker made 163-169 MiB of its memory private and took 394-472 ms (medians on
Python 3.11, 3.12 and 3.13); in gpufeed's, 0.2-0.3 MiB and 10-14 ms (its own objects); with the
freeze turned off, as stock. Python 3.11-3.13 run a full collection only when the objects that
survived younger ones reach a quarter of the old generation (none in 50,000 reads of that
dataset, whose workers' memory grew alike on every side: the reference counts), or when code
calls ``gc.collect()``; Python 3.14's incremental collector scans the old generation a slice at
a time with the young ones, so there every worker walks what it inherited.

So a worker forked by gpufeed freezes what it inherited before it runs any code of its own: a
hook registered with ``os.register_at_fork`` calls ``gc.freeze()`` in the child while the
parent is starting workers (a count the child reads in its copy of the parent's memory; the
program's other forks pass through, but for one made by another thread during a start, which
freezes too, to no harm). The inherited objects go to the permanent generation, which the
worker's collector never scans; on the default build a freeze merges the generations' lists,
writing the headers of the few objects at their ends (so about nothing is copied), and the
worker's own objects are collected as usual. The main process is not touched: its collector,
its generations and any freeze of its own stay as they were (Python 3.12 starts with some of
its own objects frozen, 375 tuples here, so "nothing frozen" cannot tell a program that froze
objects itself). Seen from a worker, the inherited objects are in no generation:
``gc.get_objects()`` and ``gc.get_referrers()`` there list its own objects only; a process the
worker forks in turn freezes nothing more. Only the fork start method: spawned and forkserver
children inherit no objects of the program.

A free-threaded build is the exception: there a freeze stops the world and sets a bit in every
object, which in a child would write to every page it inherited, and its collector writes to
every object it scans. So there the parent freezes instead, once around a pool's starts
(``gc.freeze()`` before, ``gc.unfreeze()`` after, under a lock shared by all loaders, and not
when the program has frozen objects itself): its workers' collectors skip the frozen objects,
and the parent writes each object twice (not measured: no such build with torch here).

(The parent used to freeze on every build: that left Python 3.12, whose count of frozen
objects is never 0, with no freeze at all, and brought the parent's young objects back in its
oldest generation after each start.)
"""

from __future__ import annotations

import contextlib
import gc
import os
import sysconfig
import threading
from collections.abc import Iterator

__all__ = ["heap_frozen"]

#: whether this is a free-threaded build, whose freeze writes to every object (NOTE)
_FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
_turns = threading.Lock()
#: workers being forked now, by any loader: read by the child, in its copy of this module
_forking = 0


def _freeze_in_child() -> None:
    """After every ``os.fork()``, in the child: a worker being started freezes its inherited
    objects before any collection can reach them (NOTE [ Frozen heap at fork ])."""
    global _forking
    if _forking:
        _forking = 0  # the worker's own forks, if any, inherit nothing to freeze again
        gc.freeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_freeze_in_child)


@contextlib.contextmanager
def heap_frozen(*, fork: bool) -> Iterator[None]:
    """Around starting process workers: with ``fork``, each child freezes the objects it
    inherited (NOTE [ Frozen heap at fork ]); on a free-threaded build the main process's
    objects are frozen for the block instead, unless the program froze objects itself."""
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
