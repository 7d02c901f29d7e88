"""Where an epoch starts, and which of its batches have reached the user.

NOTE [ Delivery tracking ]: the host iterator numbers an epoch's batches by their position in the
batch plan and calls :meth:`DeliveryTracker.produced` as it hands each one on; the outermost
stage (the host iterator, or the device stage wrapped in :class:`Delivered`) calls
:meth:`DeliveryTracker.delivered` as the user receives one: the oldest produced (stages are FIFO).

NOTE [ Iterable resume ]: an iterable dataset has no batch plan. Each worker reads its own
stream, and the next batch goes to the next worker in turn (torch's round robin: batch ``k`` to
worker ``k % num_workers`` while all have data); a worker that runs dry answers "stop" for the
batch it was given, which is skipped, and drops out of the turn. The delivered sequence is thus
a function of the workers' streams alone, and a resume needs exactly:

1. each worker's ``dataset.state_dict()`` as of its *last delivered* batch (batches it had
   fetched ahead are fetched again), and
2. whose turn is next: the worker after the one that delivered the last batch.

The resumed iterator restarts each worker from its state and the turn at that worker; one that
had run dry answers "stop" at once, dropping out as in the uninterrupted run. "stop" answers
use batch numbers but never reach the user, so for iterable datasets the tracker counts
delivered batches instead of numbering them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from .._base import timeline as _timeline
from .._base.tree import batch_len

if TYPE_CHECKING:
    from .._base.stats import StatsRecorder


T = TypeVar("T")


class ResumePoint(NamedTuple):
    """Where the next ``__iter__`` starts: ``resume.prepare_resume``, or ``ResumePoint(epoch)``.

    Attributes:
        epoch: the epoch to run (seeds per-sample random state; the loader's epoch counter).
        done: batches ``0 .. done-1`` of its plan were delivered already.
        ahead: later batch numbers delivered already (``in_order=False`` only).
        seeked: the sampler itself starts at batch ``done`` (nothing to drop from the plan).
        epoch_seed: the seed a ``RandomSampler`` on the global generator shuffles this epoch
            with (NOTE [ Rewinding samplers ] in ``_order/rewind.py``); ``None``: drawn afresh.
        sampler_state: what puts the sampler back where the saved epoch started, applied when
            the epoch starts (``rewind.restore_sampler``); ``None``: nothing.
        replay: the saved epoch (``epoch - 1``) was delivered whole but not ended: after the
            restore, the sampler draws it once more and drops it, as the saving run did.
        rolled: the state was taken after epoch ``epoch - 1``'s last batch, its iterator not
            run out: this point is the next epoch's start.
    """

    epoch: int
    done: int = 0
    ahead: tuple[int, ...] = ()
    seeked: bool = False
    epoch_seed: int | None = None
    sampler_state: Any = None
    replay: bool = False
    rolled: bool = False


class WorkerStates(NamedTuple):
    """An iterable dataset's position (NOTE [ Iterable resume ]).

    Attributes:
        states: per worker, its ``dataset.state_dict()`` as of its last delivered batch, or
            ``None`` when it delivered none this epoch (its stream starts afresh).
        next_worker: the worker whose turn it is to produce the next batch.
    """

    states: list[Any]
    next_worker: int = 0


def numbered(plan: Iterable[T], point: ResumePoint) -> Iterator[tuple[int, T]]:
    """``(batch_number, indices)`` of the batches still to deliver in ``point.epoch``, numbered
    by position in the whole epoch: unless the sampler seeked, the first ``point.done`` items
    of ``plan`` are drawn and dropped (no data is fetched), and so are numbers in
    ``point.ahead``. A plan too short raises ``ValueError``."""
    iterator = iter(plan)
    skip = 0 if point.seeked else point.done
    for dropped in range(skip):
        if next(iterator, _END) is _END:
            raise ValueError(
                f"cannot skip {skip} batches: the batch plan ended after {dropped}; the state "
                "belongs to a loader with another dataset, batch_size or sampler"
            )
    excluded = set(point.ahead)
    for number, item in enumerate(iterator, start=point.done):
        if number not in excluded:
            yield number, item


_END: Any = object()


def _draw(plan: Iterator[tuple[int, Any]], numbers: list[int]) -> Iterator[Any]:
    """The items of a :func:`numbered` plan, keeping their numbers in ``numbers``."""
    for number, item in plan:
        numbers.append(number)
        yield item


class DeliveryTracker:
    """Which batches of one epoch the user has received (NOTE [ Delivery tracking ]).

    Args:
        plan: the loader's index sampler; :attr:`indices` draws what is still to fetch from it
            (:func:`numbered`). Loaders that slice an order themselves start at ``point.done``
            and skip ``point.ahead``.
        direct: the host iterator is outermost (a produced batch is delivered at once), not a
            device stage wrapped in :class:`Delivered`.
        iterable: an iterable dataset's epoch: delivered batches are counted, and the workers'
            positions kept (NOTE [ Iterable resume ]), from ``resumed``.

    Every call is O(1) amortised; out-of-order numbers (``in_order=False``) wait in a set until
    the contiguous prefix reaches them.
    """

    def __init__(
        self, point: ResumePoint, plan: Iterable[Any] = (), *, direct: bool = True,
        iterable: bool = False, resumed: WorkerStates | None = None,
    ) -> None:
        self.point = point
        self.epoch = point.epoch
        self.prefix = point.done
        self.iterable = iterable
        self.ahead = set() if iterable else {n for n in point.ahead if n >= point.done}
        self.direct = direct
        self.finished = False
        # A ``rewind.EpochSeed`` for ``plan.make_plan``, set by whoever builds the tracker.
        self.epoch_seed: Any = None
        resumed = resumed or WorkerStates([])
        self.worker_states = {w: s for w, s in enumerate(resumed.states) if s is not None}
        self.next_worker = resumed.next_worker
        self._in_flight: deque[tuple[int, Any]] = deque()
        self._numbers: list[int] = []
        self._reached = 0  # batches that reached the user (or failed on the way) this iterator
        self._close_at: int | None = None  # see follow_stock
        self._close: Callable[[], None] | None = None
        # Not a method: a generator of ``self`` would make the tracker and its draw a
        # reference cycle, keeping the sampler and dataset alive until a collection.
        self.indices: Iterator[Any] = _draw(numbered(plan, point), self._numbers)
        self._advance()

    def follow_stock(self, close_at: int, close: Callable[[], None]) -> None:
        """Run ``close`` once ``close_at`` batches reached the user (or failed on the way):
        where the stock loader's sampler pulls run out (``plan.pull_as_stock``). Counted on the
        user's side, so that a device stage's batches taken ahead do not count yet."""
        self._close_at, self._close = close_at, close

    def _count_reached(self) -> None:
        self._reached += 1
        if self._reached == self._close_at:
            self._close()  # type: ignore[misc]  # set with _close_at

    def produced_nth(self, k: int, worker_state: tuple[int, Any] | None = None) -> None:
        """:meth:`produced` for the iterator's ``k``-th batch (0-based): the ``k``-th drawn from
        :attr:`indices`, or ``point.done + k`` for a loader that slices an order itself."""
        number = self._numbers[k] if k < len(self._numbers) else self.point.done + k
        if number == self.prefix and self.direct and not self.ahead and worker_state is None:
            self.prefix += 1  # the common case of produced() and delivered(), in one call
            self._count_reached()
            return
        self.produced(number, worker_state)

    def produced(self, batch_number: int, worker_state: tuple[int, Any] | None = None) -> None:
        """Host side: batch ``batch_number`` (its position in the epoch's plan) leaves the host
        iterator, with ``(worker_id, dataset.state_dict())`` for iterable datasets."""
        self._in_flight.append((batch_number, worker_state))
        if self.direct:
            self.delivered()

    def delivered(self) -> None:
        """User side: the oldest produced batch has reached the user."""
        number, worker_state = self._in_flight.popleft()
        self._count_reached()
        if worker_state is not None:
            worker, self.worker_states[worker] = worker_state
            self.next_worker = worker + 1  # taken modulo num_workers by dataset_states()
        if self.iterable or number == self.prefix:
            self.prefix += 1
            self._advance()
        else:
            self.ahead.add(number)

    def failed(self) -> None:
        """User side: the oldest produced batch failed on its way (a device stage's copy or
        ``device_transform`` raised): a resume retries it; later ones are delivered ahead."""
        self._in_flight.popleft()
        self._count_reached()

    def fetch_failed(self) -> None:
        """User side: a batch's failed fetch reached the user as its error. A resume retries it;
        stock pulled its indices all the same, so it counts towards the closing draw
        (:meth:`follow_stock`)."""
        self._count_reached()

    def host_exhausted(self) -> None:
        """The host iterator raised ``StopIteration`` (ends the epoch only when ``direct``)."""
        if self.direct:
            self.user_exhausted()

    def user_exhausted(self) -> None:
        """The user saw ``StopIteration``: the epoch is over. Without workers, the ``next()``
        that raised it is a pull of the stock loader's sampler too: after a full last batch,
        the one that makes its closing draw."""
        self.finished = True
        if self._close_at is not None and self._reached + 1 == self._close_at:
            self._count_reached()

    def _advance(self) -> None:
        while self.prefix in self.ahead:
            self.ahead.discard(self.prefix)
            self.prefix += 1

    def position(self) -> tuple[int, int, list[int]]:
        """``(epoch, batches_delivered, delivered_ahead)``; a finished epoch reads as the next."""
        if self.finished:
            return self.epoch + 1, 0, []
        return self.epoch, self.prefix, sorted(self.ahead)

    def dataset_states(self, workers: int) -> WorkerStates:
        """An iterable dataset's position over ``workers`` workers (NOTE [ Iterable resume ]);
        all ``None`` from worker 0 once the epoch is over (the next one starts afresh)."""
        if self.finished:
            return WorkerStates([None] * workers, 0)
        states = [self.worker_states.get(w) for w in range(workers)]
        return WorkerStates(states, self.next_worker % workers)


class Delivered(Iterator[T]):
    """Wrap the outermost iterator (e.g. the device stage) to report deliveries to a tracker.

    With ``recorder`` (the loader's ``StatsRecorder``) it records each handover, as the host
    iterator does when outermost: the loop's step since the last batch, its wait in ``next()``
    (the first's as "startup"), the batch and its samples (``batch_len``; 1 per item when
    ``count_samples`` is false: ``batch_size=None``), the gauge "device_ahead" (the stage's
    ``in_flight``), and a handout in the active trace (NOTE [ Timeline ] (3)). The host
    iterator behind records none (``StatsRecorder.passed_on``): the stage takes batches ahead,
    and "batches" counts what the loop received. Forwards ``len()`` and any attribute.
    """

    def __init__(self, inner: Iterator[T], tracker: DeliveryTracker, *,
                 recorder: StatsRecorder | None = None, count_samples: bool = True) -> None:
        self.inner = inner
        self.tracker = tracker
        self._recorder = recorder
        self._count_samples = count_samples
        self._returned_at = 0.0  # when the last batch was handed over (0: none yet)
        self._handed = 0  # batches handed over by this iterator (the trace's batch numbers)

    def __next__(self) -> T:
        asked_at = time.perf_counter()
        try:
            item = next(self.inner)
        except StopIteration:
            self.tracker.user_exhausted()
            raise
        except Exception:  # a produced batch that failed in the stage (its error_took_a_batch)
            if getattr(self.inner, "error_took_a_batch", False):
                self.tracker.failed()
            elif getattr(self.inner, "error_from_source", False):  # a batch's failed fetch
                self.tracker.fetch_failed()
            raise
        self.tracker.delivered()
        if self._recorder is not None:
            self._record(self._recorder, item, asked_at)
        return item

    def _record(self, recorder: StatsRecorder, item: Any, asked_at: float) -> None:
        now = time.perf_counter()
        last = self._returned_at
        samples = (batch_len(item) or 0) if self._count_samples else 1
        stats = getattr(self.inner, "stats", None)  # the device stage's: DeviceStats
        ahead = getattr(stats(), "in_flight", None) if callable(stats) else None
        recorder.handout(asked_at - last if last else None, now - asked_at, samples,
                         gauges=(("device_ahead", ahead),) if ahead is not None else ())
        self._returned_at = end = time.perf_counter()
        tl = _timeline.active
        if tl is not None:
            tl.handout(recorder, self._handed, self.tracker.epoch, last, asked_at, now, end)
        self._handed += 1

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
