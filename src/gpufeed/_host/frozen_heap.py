"""Python's cyclic collector and forked workers: the parent's objects frozen across the fork.

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

Measured here (Python 3.11, 2026-11-27, ``benchmarks/results/round21/frozen-heap.md``): the
main process holding a million annotation dicts (2.2M tracked objects), one ``gc.collect()`` in
a stock loader's worker made 163 MiB of its memory private and took 352-441 ms; in gpufeed's,
0.1-0.3 MiB and 7-8 ms (its own objects); with the freeze turned off, as stock. Python
3.11-3.13 run a full collection only when the objects that survived younger ones reach a
quarter of the old generation (none in 50,000 reads of that dataset, whose workers' memory grew
alike on every side: the reference counts), or when code calls ``gc.collect()``; Python 3.14's
incremental collector scans the old generation a slice at a time with the young ones, so there
every worker walks what it inherited.

So process workers are started between ``gc.freeze()`` and ``gc.unfreeze()`` (the fork start
method only: spawned children inherit no objects): the children keep the parent's objects in
the permanent generation, which their collector never scans, and the parent's collector gets
them back as soon as the workers are started, all in its old generation (its young objects as
if they had survived a collection: a young cycle dropped right after a start waits for the
next full collection). The worker's own objects are collected as usual. Seen from a worker,
the inherited objects are in no generation: ``gc.get_objects()`` and ``gc.get_referrers()``
there list the worker's own objects only. Left alone: a program that froze objects itself
(``gc.get_freeze_count()`` not 0), whose freeze an unfreeze would undo. Loaders starting
workers in several threads at once take turns (a lock), so one's unfreeze never lands inside
another's fork. Cost: on the default build both calls move whole lists, whatever their length
(5 and 1 us with 2M objects here); on a free-threaded build (whose collector scans every object
each time, so a worker would copy its inherited heap at every collection) each stops the world
and visits every object, so a pool starts all its workers under one freeze.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["heap_frozen"]

_turns = threading.Lock()


@contextlib.contextmanager
def heap_frozen(*, fork: bool) -> Iterator[None]:
    """Around starting process workers: with ``fork``, the main process's objects are frozen
    for the block (NOTE [ Frozen heap at fork ]), unless the program froze objects itself."""
    if not fork:
        yield
        return
    with _turns:
        if gc.get_freeze_count():  # the program's own freeze: kept as it is
            yield
            return
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
