"""Names of torch's multiprocessing iterator that programs reach for, kept on ``WorkerIter``.

Not public API, but programs written for the stock loader use them:

- ``loader._iterator._workers``: the worker processes (for their pids or liveness): the process
  workers in force; empty for thread workers and once the workers have stopped.
- ``loader._iterator._shutdown_workers()``: stop the workers now (persistent ones, before a
  loader is replaced). It is ``close()``: the loader's next ``iter()`` starts a new iterator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .pool import Pool


class StockNames:
    """``_workers`` and ``_shutdown_workers`` for an iterator with a worker pool."""

    _pool: Pool

    @property
    def _workers(self) -> list[Any]:
        pool: Pool | None = getattr(self, "_pool", None)  # (missing on a half-built iterator)
        return pool.processes() if pool is not None else []

    def _shutdown_workers(self) -> None:
        self.close()  # type: ignore[attr-defined]  # WorkerIter's
