"""An epoch's plan reaches process workers with its shared memory passed on their own
connection (NOTE [ Plans without a sharing thread ] in ``_host/pool.py``): no thread is left
in the main process, and the workers read the same order."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils.data as tud

import gpufeed
from gpufeed._order.plan import COMPACT_FROM

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="Unix socket pairs")


def test_a_loader_leaves_no_descriptor_serving_thread_behind():
    """After shuffled epochs with process workers, the main process has no thread of Python's
    left (the stock loader's leave none either): none for Python 3.12+ to warn of at the
    program's next fork."""
    script = textwrap.dedent("""
        import threading
        import torch, gpufeed
        data = [torch.tensor([i]) for i in range(64)]
        for persistent in (False, True):
            loader = gpufeed.DataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                                        persistent_workers=persistent)
            for epoch in range(2):
                assert sorted(int(v) for b in loader for v in b) == list(range(64))
            del loader
        print(sorted(t.name for t in threading.enumerate()))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "['MainThread']", done.stdout


class Indices(tud.Dataset):
    """Each batch is its indices, read at once (``__getitems__``, which the stock loader calls
    too): the million samples of an epoch of the int32 plan cost no sample-by-sample loop on
    either side (the stock loader's took most of the test's time)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])

    def __getitems__(self, indices):
        return [torch.as_tensor(indices, dtype=torch.int64)]


@pytest.mark.parametrize(("n", "context"), [  # int64 and int32 plans (spawn: the same socket)
    (1000, "fork"), (1000, "spawn"), (COMPACT_FROM + 5, "fork")])
def test_workers_read_the_order_the_stock_loader_reads(n, context):
    data = Indices(n) if n >= COMPACT_FROM else tud.TensorDataset(torch.arange(n))
    batch = 64 if n < COMPACT_FROM else 32768  # some 32 batches an epoch
    want = tud.DataLoader(data, batch_size=batch, shuffle=True, num_workers=2,
                          persistent_workers=True, multiprocessing_context=context,
                          generator=torch.Generator().manual_seed(3))
    got = gpufeed.DataLoader(data, batch_size=batch, shuffle=True, num_workers=2,
                             persistent_workers=True, multiprocessing_context=context,
                             generator=torch.Generator().manual_seed(3))
    for _ in range(2):  # a persistent pool gets each epoch's plan
        assert all(torch.equal(a[0], b[0]) for a, b in zip(want, got, strict=True))


def test_a_sharded_plan_reads_the_same_with_and_without_workers_and_resumed():
    """``seed=`` with a rank: the plan is a strided view into the sampler's draw (rank 1 of 2:
    an offset and a stride); the same batches without workers, and resumed mid-epoch."""
    data = list(range(5000))

    def make():
        return gpufeed.DataLoader(data, batch_size=50, shuffle=True, seed=7, rank=1,
                                  world_size=2, num_workers=2, persistent_workers=True)

    without = [b.tolist() for b in gpufeed.DataLoader(data, batch_size=50, shuffle=True, seed=7,
                                                      rank=1, world_size=2)]
    run = make()
    it = iter(run)
    head = [next(it).tolist() for _ in range(7)]
    state = run.state_dict()
    rest = [b.tolist() for b in it]
    again = make()
    again.load_state_dict(state)
    assert head + rest == without and len(without) == 50
    assert [b.tolist() for b in again] == rest


def test_the_file_system_strategy_pickles_the_plan_as_before():
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        data = list(range(300))
        want = list(tud.DataLoader(data, batch_size=32, shuffle=True,
                                   generator=torch.Generator().manual_seed(1)))
        got = list(gpufeed.DataLoader(data, batch_size=32, shuffle=True, num_workers=2,
                                      generator=torch.Generator().manual_seed(1)))
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
