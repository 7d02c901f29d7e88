"""Names of torch's multiprocessing iterator that programs reach for, kept on ``WorkerIter``.

Neither is public API, but programs written for the stock loader use both, and a drop-in
keeps them working:

- ``loader._iterator._workers``: the worker processes, read for their pids (pinning each to a
  core with ``taskset``, reading their memory) or their liveness. gpufeed's are the process
  workers in force (``multiprocessing`` process objects, as stock's); thread workers have no
  process, so the list is empty, as it is once the workers have stopped.
- ``loader._iterator._shutdown_workers()``: stop the workers now, typically persistent ones
  before a loader is replaced, to free their memory and descriptors. It is ``close()``: the
  loader's next ``iter()`` starts a new iterator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pool import Pool

__all__ = ["StockNames"]


class StockNames:
    """``_workers`` and ``_shutdown_workers`` for an iterator with a worker pool."""

    _pool: Pool

    @property
    def _workers(self) -> list[Any]:
        pool: Pool | None = getattr(self, "_pool", None)  # (missing on a half-built iterator)
        return pool.processes() if pool is not None else []

    def _shutdown_workers(self) -> None:
        self.close()  # type: ignore[attr-defined]  # WorkerIter's
