"""The GPU benchmark's steady-state warm-up, tested on CPU (bench.gpu)."""

from __future__ import annotations

import warnings

import pytest
import torch

import gpufeed
from gpufeed._tools.bench_gpu import _ring_grows, loader_rates, warm_up


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
    # least: every worker has had the chance to read every distinct batch first
    assert warm_up(iter(range(100)), lambda b: None, lambda: 0, settle=4, cap=16, least=9) == 9


def test_warm_up_reads_a_gpufeed_loaders_ring_counter() -> None:
    """On a real loader (CPU): once warm-up ends, no slot is carved in the next batches."""
    data = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    loader = gpufeed.DataLoader(gpufeed.sources.ArrayDataset(data), batch_size=2, num_workers=2,
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


def test_to_device_has_no_ring_to_read() -> None:
    """The GPU benchmark's row over a registered region times ``to_device``, whose stats
    have no counters: reading them crashed ``gpufeed bench`` on every CUDA machine."""
    it = gpufeed.to_device(iter([torch.zeros(2)] * 3), "cpu")
    assert _ring_grows(it)() == 0
    assert len(list(it)) == 3


def test_loader_rows_run_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows (c) and (d) with their cycling sampler and warm-up, on CPU: both loaders give the
    timed batches (the device stage runs with ``device="cpu"``)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    data = torch.randint(0, 256, (8 * 4, 3, 8, 8), dtype=torch.uint8)
    settings = {"batches": 12, "repeats": 1, "warmup_batches": 2, "num_workers": 2}
    notes: list[str] = []
    with warnings.catch_warnings():  # pin_memory=True without CUDA: both loaders say so
        warnings.simplefilter("ignore", UserWarning)
        rates = loader_rates(data, 4, torch.device("cpu"), settings, notes, lambda s: 12 / s)
    assert not [n for n in notes if "not measured" in n], notes
    assert rates["c_stock_dataloader_pin_memory"] > 0 and rates["d_gpufeed_dataloader"] > 0
