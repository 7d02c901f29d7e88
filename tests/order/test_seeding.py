"""Per-sample seeding: stable seeds, three generators, restored state, threads and fork."""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._order import seeding as _seeding
from gpufeed._order.seeding import (
    batch_seed,
    resolve_seed,
    sample_seed,
    seed_globals,
    seeded,
)
from support.resume_checker import RandomTransformDataset, leaves


def _draw(index: int) -> tuple[float, float, float]:
    """A "random transform": one draw from each global generator."""
    return (torch.rand(()).item(), float(np.random.rand()), random.random())


def fetch_seeded(get, indices, *, seed, epoch):
    """``[get(i) for i in indices]``, each call seeded as a seeded fetch does."""
    out = []
    with seeded(seed, epoch) as reseed:
        for index in indices:
            reseed(index)
            out.append(get(index))
    return out


def test_sample_seed_is_stable_and_spread():
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 450  # no collisions, (0,1,x) != (1,0,x)
    assert all(0 <= x < 2**64 for x in seeds)
    assert sample_seed(2**70, 0, 0) == sample_seed(2**70 % 2**64, 0, 0)


def test_batch_seed_depends_on_first_index_and_size():
    assert batch_seed(1, 0, [4, 5]) == batch_seed(1, 0, [4, 9])
    assert batch_seed(1, 0, [4, 5]) != batch_seed(1, 0, [4, 5, 6])
    assert batch_seed(1, 0, []) == batch_seed(1, 0, [])


def test_seed_globals_seeds_three_different_streams():
    seed_globals(123)
    a = _draw(0)
    seed_globals(123)
    assert _draw(0) == a
    seed_globals(124)
    assert _draw(0) != a
    seed_globals(2**40 + 7)  # torch and numpy both run MT19937: keep them apart
    t = torch.randint(0, 2**31, (4,)).tolist()
    n = np.random.randint(0, 2**31, 4).tolist()
    assert t != n


def test_fetch_does_not_depend_on_batching_or_order():
    whole = fetch_seeded(_draw, list(range(8)), seed=7, epoch=1)
    parts = fetch_seeded(_draw, [5, 6, 7], seed=7, epoch=1) + fetch_seeded(
        _draw, [0, 1, 2, 3, 4], seed=7, epoch=1
    )
    assert whole == parts[3:] + parts[:3]
    assert fetch_seeded(_draw, [3], seed=7, epoch=2) != whole[3:4]
    assert fetch_seeded(_draw, [3], seed=8, epoch=1) != whole[3:4]
    assert len(set(whole)) == 8


def test_callers_random_streams_are_restored():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    expected = [_draw(0) for _ in range(3)]
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    got = []
    for k in range(3):
        fetch_seeded(_draw, [k, k + 1], seed=1, epoch=0)
        got.append(_draw(0))
    assert got == expected


def test_state_restored_after_an_exception():
    torch.manual_seed(5)
    expected = torch.rand(())
    torch.manual_seed(5)

    def boom(index: int) -> None:
        raise KeyError(index)

    with pytest.raises(KeyError):
        fetch_seeded(boom, [1], seed=0, epoch=0)
    assert torch.rand(()) == expected


def test_batched_reseed():
    with seeded(3, 0) as reseed:
        reseed.batch([10, 11])
        a = _draw(0)
    with seeded(3, 0) as reseed:
        reseed.batch([10, 12])
        assert _draw(0) == a


def test_threads_get_the_same_values_as_one_thread():
    indices = list(range(64))
    expected = fetch_seeded(_draw, indices, seed=2, epoch=3)
    results: dict[int, list[tuple[float, float, float]]] = {}

    def work(part: int) -> None:
        out = []
        for _ in range(5):
            out = []
            for i in indices[part::4]:
                out += fetch_seeded(_draw, [i], seed=2, epoch=3)
        results[part] = out

    threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for part in range(4):
        assert results[part] == expected[part::4]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_forked_child_gets_a_fresh_lock():
    with seeded(0, 0):  # held by this thread while forking
        pid = os.fork()
        if pid == 0:  # child: the inherited lock must not block
            try:
                fetch_seeded(_draw, [0], seed=0, epoch=0)
            finally:
                os._exit(0 if not _seeding._lock._is_owned() else 1)  # type: ignore[attr-defined]
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_resolve_seed():
    assert resolve_seed(5, None, distributed=False) == 5
    g = torch.Generator()
    g.manual_seed(77)
    assert resolve_seed(None, g, distributed=False) == 77
    assert resolve_seed(None, None, distributed=True) == 0
    torch.manual_seed(1)
    drawn = resolve_seed(None, None, distributed=False)
    torch.manual_seed(1)
    assert resolve_seed(None, None, distributed=False) == drawn
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="seed must be an int >= 0"):
            resolve_seed(bad, None, distributed=False)  # type: ignore[arg-type]


# -- end to end, through gpufeed.DataLoader --------------------------------------------------


def _batches(global_draws=False, **kwargs):
    loader = gpufeed.DataLoader(RandomTransformDataset(18, global_draws=global_draws),
                                batch_size=4, shuffle=True, seed=7, **kwargs)
    return [leaves(b) for _ in range(2) for b in loader]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker:UserWarning")
def test_batches_are_the_same_for_any_workers():
    reference = _batches()
    for workers, kind in [(1, "process"), (2, "thread"), (2, "process"), (4, "thread")]:
        assert _batches(num_workers=workers, worker_type=kind) == reference, (workers, kind)


def test_global_draws_are_seeded_per_sample_in_processes_and_without_workers():
    reference = _batches(global_draws=True)
    assert _batches(global_draws=True, num_workers=2) == reference


class _Batched(RandomTransformDataset):
    def __getitems__(self, indices):
        return [self[i] for i in indices]


def test_batched_fetch_is_seeded_per_batch():
    def run(**kwargs):
        loader = gpufeed.DataLoader(_Batched(10), batch_size=3, seed=1, **kwargs)
        return [leaves(b) for b in loader]

    assert run() == run(num_workers=2, worker_type="thread")


def test_opt_out_keeps_the_stock_random_stream():
    def run(**kwargs):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        loader = gpufeed.DataLoader(RandomTransformDataset(6, global_draws=True), batch_size=3,
                                    **kwargs)
        return [leaves(b) for b in loader]

    stock = run()
    assert run(seed=3, deterministic=False)[0][0] == stock[0][0]  # same indices, in order
    assert run(seed=3, deterministic=False) == stock  # no reseeding: the global stream
    assert run(seed=3) != stock


def test_seeded_loading_leaves_the_training_loop_stream_alone():
    def run(**kwargs):
        torch.manual_seed(0)
        for _ in gpufeed.DataLoader(RandomTransformDataset(6, global_draws=True), batch_size=3,
                                    **kwargs):
            pass
        return torch.rand(3)

    assert torch.equal(run(seed=5), run(seed=6))
