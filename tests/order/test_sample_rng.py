"""Per-sample generators (``gpufeed.random.sample_generator``, ``sample_rng``,
``sample_random``): the same draws for any workers, whatever the training loop draws; seeded
thread workers run in parallel; gpufeed's sources draw from them too (NOTE [ Seeding and
threads ])."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import gpufeed
from gpufeed._sources.protocol import index_array, sample_seeds
from support.resume_checker import leaves

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker")


def _draw_all() -> list[float]:
    return [torch.rand((), generator=gpufeed.random.sample_generator()).item(),
            float(gpufeed.random.sample_rng().random()), gpufeed.random.sample_random().random()]


def test_outside_a_loader_they_follow_torch_manual_seed():
    torch.manual_seed(3)
    first = _draw_all()
    torch.manual_seed(3)
    assert _draw_all() == first
    assert _draw_all() != first  # each call outside a fetch is a fresh generator


class _Probe(Dataset):
    """Records, per sample, what the generator functions return."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        g = gpufeed.random.sample_generator()
        same = (g is gpufeed.random.sample_generator()
                and gpufeed.random.sample_rng() is gpufeed.random.sample_rng())
        a = torch.rand(3, generator=g)
        b = torch.rand(3, generator=gpufeed.random.sample_generator())  # the stream goes on
        again = torch.rand(3, generator=gpufeed.random.sample_generator(index=i))  # a fresh one
        return torch.tensor([i]), a, b, again, torch.tensor([same])


class _BatchedProbe(_Probe):
    def __getitems__(self, indices):  # asks for each sample's generator by index
        return [(torch.tensor([i]),
                 torch.rand(3, generator=gpufeed.random.sample_generator(index=i)))
                for i in indices]


def test_one_generator_per_sample_and_index_gives_that_samples():
    batches = list(gpufeed.DataLoader(_Probe(), batch_size=4, seed=5, collate_fn=list))
    samples = [s for b in batches for s in b]
    for _, a, b, again, same in samples:
        assert same.item()
        assert not torch.equal(a, b)  # continued, not restarted
        assert torch.equal(a, again)  # index= gives the sample's own generator, afresh
    firsts = {tuple(s[1].tolist()) for s in samples}
    assert len(firsts) == len(samples)  # every sample its own stream
    batched = list(gpufeed.DataLoader(_BatchedProbe(), batch_size=4, seed=5, collate_fn=list,
                                      num_workers=2, worker_type="thread"))
    got = {s[0].item(): s[1] for b in batched for s in b}  # __getitems__ by index
    assert len(got) == len(samples)
    assert all(torch.equal(got[s[0].item()], s[1]) for s in samples)


def test_a_sample_index_that_is_not_an_int_is_named():
    class Keys(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, key):
            return float(torch.rand((), generator=gpufeed.random.sample_generator()))

    for kind in (dict(), dict(num_workers=1, worker_type="thread")):
        loader = gpufeed.DataLoader(Keys(), batch_size=None, sampler=["a", "b"], seed=0, **kind)
        with pytest.raises(TypeError, match=r"need an int sample index, but.*'a'.*index="):
            list(loader)


class _Slow(Dataset):
    """5 ms a sample (sleeping: the GIL is free), one draw from the sample's generator; counts
    how many ``__getitem__`` calls ran at once."""

    def __init__(self, n: int = 48, draw: bool = True) -> None:
        self.n, self.draw = n, draw
        self.lock = threading.Lock()
        self.active = self.most = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            time.sleep(0.005)
            x = (torch.rand(2, generator=gpufeed.random.sample_generator()) if self.draw
                 else torch.zeros(2))
            return torch.tensor([i]), x
        finally:
            with self.lock:
                self.active -= 1


def test_seeded_thread_workers_run_getitem_in_parallel():
    """The old design serialised seeded ``__getitem__`` calls under one lock (most == 1)."""
    ds = _Slow(draw=False)
    list(gpufeed.DataLoader(ds, batch_size=4, num_workers=4, worker_type="thread", seed=1))
    assert ds.most >= 2, "seeded __getitem__ calls ran one at a time"


def _run_with_loop_draws(loader, draws: int):
    """Iterate like a training loop that draws from every global generator between steps."""
    out = []
    for batch in loader:
        out.append(leaves(batch))
        for _ in range(draws):
            torch.rand(100)
            np.random.rand(10)
            random.random()
    return out


@pytest.mark.parametrize("seed", [11, None], ids=["seed", "no-seed"])
def test_thread_workers_ignore_the_training_loops_draws(seed):
    """The same samples as without workers, whatever the loop draws; without seed= they follow
    torch.manual_seed (the base seed is drawn as torch draws its workers')."""

    def run(draws, manual_seed=0, **kwargs):
        torch.manual_seed(manual_seed)
        loader = gpufeed.DataLoader(_Slow(24), batch_size=2, shuffle=seed is not None,
                                    seed=seed, **kwargs)
        return _run_with_loop_draws(loader, draws)

    reference = run(0)
    threads = dict(num_workers=4, worker_type="thread")
    assert run(5, **threads) == reference
    assert run(0, **threads) == reference
    assert run(3, num_workers=2) == reference  # processes too
    if seed is None:
        assert run(0, manual_seed=1, **threads) != reference


class _Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(w, 12, n):
            yield torch.tensor([i]), torch.rand(2, generator=gpufeed.random.sample_generator())


def test_iterable_datasets_draw_per_worker_and_position():
    def run(kind, seed=4):
        loader = gpufeed.DataLoader(_Stream(), batch_size=2, num_workers=2, worker_type=kind,
                                    seed=seed)
        return [leaves(b) for b in loader]

    assert run("thread") == run("process")
    draws = [b[1][2] for b in run("thread")]
    assert len(set(draws)) == len(draws)  # workers and positions get their own streams
    assert run("thread", seed=5) != run("thread")


class _Source(Dataset):
    """A batch source (NOTE [ Batch sources ]) whose random choice comes from
    ``sample_seeds``, as ImageFolder's crops do; its first batch waits until the loop has
    drawn, so a source that drew from the global generator would see the loop's draw."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 12

    def gpufeed_batch(self, indices, *, seed, epoch, alloc):
        if self.gate is not None:
            self.gate.wait(10)
        idx = index_array(indices)
        seeds = sample_seeds(idx, seed, epoch)
        return [torch.from_numpy(idx), torch.tensor([s % 1000 for s in seeds])]

    def gpufeed_samples(self, indices, *, seed, epoch):
        a, b = self.gpufeed_batch(indices, seed=seed, epoch=epoch, alloc=None)
        return list(zip(a, b, strict=True))


def test_sources_without_seed_follow_manual_seed_not_the_loops_draws():
    def run(num_workers, loop_draws):
        gate = threading.Event()
        torch.manual_seed(0)
        loader = gpufeed.DataLoader(_Source(gate), batch_size=3, num_workers=num_workers,
                                    worker_type="thread")
        it = iter(loader)
        if loop_draws:
            torch.rand(1000)  # the training loop's draw, before the workers read a batch
        gate.set()
        return [leaves(b) for b in it]

    reference = run(0, False)
    assert run(2, True) == reference
    assert run(2, False) == reference


def test_sources_read_by_hand_inside_a_fetch_take_the_fetchs_seed():
    """A dataset that wraps a source and reads it sample by sample (``epoch=0`` by hand) gets
    the loader's epoch, not the same choices every epoch."""

    class Wrapper(Dataset):
        source = _Source()

        def __len__(self):
            return 12

        def __getitem__(self, i):
            return self.source.gpufeed_samples([i], seed=None, epoch=0)[0]

    loader = gpufeed.DataLoader(Wrapper(), batch_size=3, seed=2, num_workers=2,
                                worker_type="thread")
    epochs = [[leaves(b) for b in loader] for _ in range(2)]
    assert epochs[0] != epochs[1]
    direct = gpufeed.DataLoader(_Source(), batch_size=3, seed=2)
    assert [leaves(b) for b in direct] == epochs[0]


def test_image_folder_crops_follow_manual_seed_not_the_loops_draws(tmp_path):
    """ImageFolder's random crops and flips, without seed=: the same for thread workers as
    without workers, whatever the training loop draws between batches (they were drawn from
    torch's global generator, which thread workers share with the loop)."""
    image = pytest.importorskip("PIL.Image")
    pytest.importorskip("simplejpeg")
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for k in range(6):
            pixels = rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)
            image.fromarray(pixels).save(tmp_path / c / f"{k}.jpg")
    folder = gpufeed.sources.ImageFolder(tmp_path, size=16, crop="random")

    def run(**kwargs):
        torch.manual_seed(0)
        return _run_with_loop_draws(gpufeed.DataLoader(folder, batch_size=3, **kwargs), 4)

    assert run(num_workers=2, worker_type="thread") == run()


def test_a_reseeded_generator_draws_what_a_fresh_one_of_its_sample_would():
    """``SampleScope``'s docstring: the torch and Python generators are the scope's own, re-seeded
    per sample; what a sample draws must not depend on what the previous sample drew (normal
    draws leave a cached value behind in both)."""
    from gpufeed._order.sample_rng import SampleScope

    def draws(scope: SampleScope, index: int) -> list[float]:
        scope.at(index)
        gen, rnd = gpufeed.random.sample_generator(), gpufeed.random.sample_random()
        return [*torch.randn(3, generator=gen).tolist(), rnd.gauss(0, 1), rnd.random()]

    reused = SampleScope()
    reused.open(11, 2)
    try:
        # Sample 4 after 3, whose odd normal draws left each generator a cached one.
        draws(reused, 3)
        after = draws(reused, 4)
    finally:
        reused.close()
    fresh = SampleScope()
    fresh.open(11, 2)
    try:
        alone = draws(fresh, 4)
    finally:
        fresh.close()
    assert after == alone
    # and the seed is the documented one
    scope = SampleScope()
    scope.open(11, 2)
    scope.close()
    assert scope.seed_of(4) == gpufeed.random.sample_seed(11, 2, 4)
