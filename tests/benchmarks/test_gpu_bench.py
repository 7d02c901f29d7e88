"""The GPU benchmark's steady-state warm-up, tested on CPU (gpufeed.benchmarks.gpu)."""

from __future__ import annotations

import torch

import gpufeed
from gpufeed.benchmarks.gpu import _ring_grows, warm_up


def test_warm_up_runs_until_the_ring_stops_growing() -> None:
    carved = [1, 2, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4]  # slots carved after each batch
    seen: list[int] = []
    it = iter(range(100))
    count = iter(carved)
    state = {"now": 0}

    def consume(b: int) -> None:
        seen.append(b)
        state["now"] = next(count)

    done = warm_up(it, consume, lambda: state["now"], settle=3, cap=20)
    assert done == 8  # the 5th batch carved the last slot; 3 more without growth
    assert seen == list(range(8))


def test_warm_up_is_bounded_and_at_least_settle() -> None:
    state = {"now": 0}

    def grow(_: int) -> None:
        state["now"] += 1  # a ring that never settles

    assert warm_up(iter(range(100)), grow, lambda: state["now"], settle=2, cap=7) == 7
    assert warm_up(iter(range(100)), lambda b: None, lambda: 0, settle=4, cap=16) == 4


def test_warm_up_reads_a_gpufeed_loaders_ring_counter() -> None:
    """On a real loader (CPU): once warm-up ends, no slot is carved in the next batches."""
    data = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    loader = gpufeed.DataLoader(gpufeed.ArrayDataset(data), batch_size=2, num_workers=2,
                                worker_type="thread")
    grows = _ring_grows(loader)
    it = iter(loader)
    done = warm_up(it, lambda b: None, grows, settle=4, cap=20)
    assert 4 <= done < 20 and grows() >= 1
    before = grows()
    for _ in range(8):
        next(it)
    assert grows() == before
    it.close()  # type: ignore[attr-defined]
    assert _ring_grows(torch.utils.data.DataLoader(data))() == 0  # stock: no ring
