"""gpufeed under the frameworks users train with: Lightning (one process, and DDP on two CPU
processes), Accelerate (a CPU Accelerator) and Hugging Face ``datasets``.

The frameworks are in the ``test`` extra (``scripts/setup.sh`` installs it); ``importorskip``
only guards a bare install.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.data as tud
from torch.utils.data.distributed import DistributedSampler

import gpufeed
from support.fakes import CountingDataset
from support.frameworks import (
    Pairs,
    PairStream,
    PlainStream,
    PythonRandomSampler,
    lightning_module,
    quiet_fit,
    trainer,
)
from support.procs import HangError, run_in_session

TESTS = Path(__file__).resolve().parents[1]


def _flat(batches):
    return [i for batch in batches for i in batch]

# -- Lightning, one process ------------------------------------------------------------------

# 22 samples in batches of 4: 6 steps an epoch, 12 in two; a checkpoint every 2 steps.
N, BATCH, EPOCHS = 22, 4, 2


def _stock_users_loader() -> gpufeed.DataLoader:
    """As stock users write it: shuffle=True, process workers, no seed=."""
    return gpufeed.DataLoader(Pairs(N), batch_size=BATCH, shuffle=True, num_workers=2)


def test_lightning_resumes_mid_epoch_exactly_without_seed(tmp_path):
    """Exact, and gpufeed says once per loader (while Lightning checkpoints, and when it
    resumes) that the random transforms are not replayed without seed=."""
    pytest.importorskip("lightning")
    reference = lightning_module()
    advice: list[str] = []
    assert quiet_fit(trainer(tmp_path, epochs=EPOCHS, every=2), reference, advice=advice,
                     train_dataloaders=_stock_users_loader()) == []
    assert len(advice) == 1 and advice[0].startswith("loader.state_dict() was taken"), advice
    assert len(reference.seen) == 12
    for epoch in (0, 1):  # each epoch is a permutation of the dataset
        assert sorted(_flat(reference.seen[6 * epoch:6 * epoch + 6])) == list(range(N))

    # step 8 = batch 2 of epoch 1: the rest of that epoch must be exactly the reference's
    resumed = lightning_module()
    advice.clear()
    assert quiet_fit(trainer(tmp_path / "again", epochs=EPOCHS), resumed, advice=advice,
                     train_dataloaders=_stock_users_loader(),
                     ckpt_path=tmp_path / "ckpt" / "epoch=1-step=8.ckpt") == []
    assert resumed.seen == reference.seen[8:]
    assert len(advice) == 1 and advice[0].startswith("loader.load_state_dict() got a state")

    # step 4 = batch 4 of epoch 0: exact to the epoch's end; epoch 1 draws a new shuffle from
    # this run's global generator, as torch's RandomSampler does
    early = lightning_module()
    quiet_fit(trainer(tmp_path / "early", epochs=EPOCHS), early,
              train_dataloaders=_stock_users_loader(),
              ckpt_path=tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    assert early.seen[:2] == reference.seen[4:6] and len(early.seen) == 8
    assert sorted(_flat(early.seen[2:])) == list(range(N))


@pytest.mark.filterwarnings("ignore::gpufeed.random.RandomStateWarning")  # no seed=: said too
def test_lightning_with_an_unrewindable_sampler_warns_and_restarts_the_epoch(tmp_path):
    pytest.importorskip("lightning")

    def make():
        return gpufeed.DataLoader(Pairs(N), batch_size=BATCH, sampler=PythonRandomSampler(N))

    first = lightning_module()
    said = quiet_fit(trainer(tmp_path, epochs=1, every=2), first, train_dataloaders=make())
    assert len(first.seen) == 6  # training went on: state_dict() did not raise
    assert len(said) == 1  # once, not at every checkpoint
    assert "cannot be resumed exactly: its sampler PythonRandomSampler" in said[0]
    resumed = lightning_module()
    said = quiet_fit(trainer(tmp_path / "again", epochs=1), resumed, train_dataloaders=make(),
                     ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert len(said) == 1 and "epoch restarts from its first batch" in said[0]
    # Lightning counts 4 steps left in the epoch; the loader restarted it with a new shuffle
    assert len(resumed.seen) == 4 and len(set(_flat(resumed.seen))) == 16

    loader = make()  # outside Lightning: the whole epoch again
    with pytest.warns(UserWarning, match="epoch restarts from its first batch"):
        loader.load_state_dict(torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt",
                                          weights_only=False)["loops"]["fit_loop"][
                                              "state_dict"]["combined_loader"][0])
    assert sorted(_flat(b[0].int().flatten().tolist() for b in loader)) == list(range(N))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_resume_after_an_epoch_cut_short_by_limit_train_batches(tmp_path, num_workers):
    """A checkpoint at the last of an epoch's limit_train_batches: the state says 4 of 6
    batches, Lightning resumes into the next epoch (load_state_dict, iter(), then the
    sampler's set_epoch), which must run its 4 batches as in the uninterrupted run (it got
    the saved epoch's 2 unused batches, with workers)."""
    pytest.importorskip("lightning")

    def make():
        return gpufeed.DataLoader(Pairs(22), batch_size=4, shuffle=True, seed=5,
                                  num_workers=num_workers)

    reference = lightning_module()
    quiet_fit(trainer(tmp_path, epochs=2, every=4, limit_train_batches=4), reference,
              train_dataloaders=make())
    resumed = lightning_module()
    quiet_fit(trainer(tmp_path / "again", epochs=2, limit_train_batches=4), resumed,
              train_dataloaders=make(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    assert len(reference.seen) == 8 and resumed.seen == reference.seen[4:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_checkpoints_an_iterable_dataset_without_state(tmp_path, num_workers):
    """Lightning checkpoints every loader that has a state_dict, by default at each epoch's
    end and here also mid-epoch: training over a stream gpufeed cannot position trains as with
    the stock loader (it raised at the first checkpoint), and a resume restarts the epoch."""
    pytest.importorskip("lightning")

    def run(make, root, **fit):
        module = lightning_module()
        said = quiet_fit(trainer(root, epochs=2, every=3), module, train_dataloaders=make(),
                         **fit)
        return module.seen, said

    def ours():
        return gpufeed.DataLoader(PlainStream(N), batch_size=BATCH, num_workers=num_workers)

    def stock():
        return tud.DataLoader(PlainStream(N), batch_size=BATCH, num_workers=num_workers)

    want, _ = run(stock, tmp_path / "stock")
    got, said = run(ours, tmp_path / "ours")
    assert got == want and len(got) == 12  # 2 epochs of 6 batches (22 samples, 4 a batch)
    assert len(said) == 1 and "PlainStream is an IterableDataset without its own" in said[0]
    ckpt = tmp_path / "ours" / "ckpt" / "epoch=0-step=3.ckpt"
    got, said = run(ours, tmp_path / "again", ckpt_path=ckpt)
    want, _ = run(stock, tmp_path / "stock-again",
                  ckpt_path=tmp_path / "stock" / "ckpt" / "epoch=0-step=3.ckpt")
    assert got == want and any("epoch restarts from its first batch" in m for m in said)


def test_lightning_resumes_a_sized_iterable_dataset_exactly(tmp_path):
    """With ``__len__``, Lightning fetches no batch ahead, so the checkpointed position is the
    last trained batch (without it Lightning's fetcher holds one batch, which a resume skips:
    documented in docs/compatibility.md)."""
    pytest.importorskip("lightning")

    class SizedStream(PairStream):
        def __len__(self):
            return N

    def make():
        return gpufeed.DataLoader(SizedStream(N), batch_size=BATCH)

    reference = lightning_module()
    quiet_fit(trainer(tmp_path, epochs=1, every=2), reference, train_dataloaders=make())
    resumed = lightning_module()
    quiet_fit(trainer(tmp_path / "again", epochs=1), resumed, train_dataloaders=make(),
              ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert resumed.seen == reference.seen[2:] and len(reference.seen) == 6


def test_loader_rebuilt_by_lightning_keeps_gpufeed_and_takes_the_sampler():
    """Lightning's DDP injects a DistributedSampler by rebuilding the loader from its public
    attributes; a loader built before torch.distributed was initialised must accept it."""
    data = pytest.importorskip("lightning.pytorch.utilities.data")
    loader = gpufeed.DataLoader(Pairs(N), batch_size=BATCH, shuffle=True, num_workers=1,
                                worker_type="thread", seed=3)
    sampler = tud.DistributedSampler(Pairs(N), num_replicas=2, rank=1, shuffle=True, seed=0)
    rebuilt = data._update_dataloader(loader, sampler)
    assert type(rebuilt) is gpufeed.DataLoader and rebuilt.worker_type == "thread"
    stock = tud.DataLoader(Pairs(N), batch_size=BATCH, sampler=sampler)
    assert [b[0].tolist() for b in rebuilt] == [b[0].tolist() for b in stock]


def test_loader_rebuilt_by_lightning_keeps_sizing_its_work_ahead():
    """The rebuild passes back every attribute that differs from the signature's default,
    prefetch_factor's 2 (torch's resolved default) among them: left unset by the user, it
    must stay unset, or cheap batches lose their chunked messages (a strict bound of 2)."""
    data = pytest.importorskip("lightning.pytorch.utilities.data")
    ds = CountingDataset(400)
    loader = gpufeed.DataLoader(ds, batch_size=1, num_workers=2, worker_type="thread")
    rebuilt = data._update_dataloader(loader, tud.SequentialSampler(ds))
    assert rebuilt.prefetch_factor == 2
    it = iter(rebuilt)
    for _ in range(40):  # long enough for the chunk size to adapt to these cheap batches
        next(it)
    time.sleep(0.3)
    ahead = ds.fetched - 40
    it.close()
    assert ahead > 2 * 2, f"only {ahead} samples fetched ahead: the rebuild bound work-ahead"


# -- Lightning DDP: two CPU processes, gloo, launched by torchrun -------------------------------


def _torchrun(modes: list[str], out: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "--monitor-interval=0.5", str(TESTS / "support" / "lightning_ddp.py"), *modes,
            str(out)]
    return _run(args, out, timeout, f"torchrun {' '.join(modes)}")


def _run(args: list[str], out: Path, timeout: float, what: str
         ) -> subprocess.CompletedProcess[str]:
    try:
        return run_in_session(args, out, timeout)
    except HangError as e:
        pytest.fail(f"{what} {e}")


@pytest.fixture(scope="module")
def lightning_ddp(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One torchrun launch for both DDP checks (each rank imports Lightning once): ``seeded``,
    then ``iterable``, whose refusal on rank 1 ends the launch; each mode in ``out/MODE``."""
    pytest.importorskip("lightning")
    out = tmp_path_factory.mktemp("lightning_ddp")
    return _torchrun(["seeded", "iterable"], out, timeout=300), out


@pytest.mark.slow
def test_lightning_ddp_resumes_every_rank_from_rank_0s_checkpoint(lightning_ddp):
    done, out = lightning_ddp
    out = out / "seeded"
    assert all((out / f"rank{r}.json").exists() for r in (0, 1)), \
        done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt"]
    for rank, result in enumerate(ranks):
        assert result["rank"] == rank and result["saved_rank"] == 0
        assert len(result["reference"]) == 8  # 2 epochs of 4 steps on each rank
        assert result["resumed"] == result["reference"][6:], rank  # from step 6 = mid-epoch 1
    # the two ranks saw disjoint halves of each epoch (gpufeed sharded by itself)
    epoch0 = [_flat(r["reference"][:4]) for r in ranks]
    assert not set(epoch0[0]) & set(epoch0[1])


@pytest.mark.slow
def test_lightning_ddp_refuses_rank_0s_state_where_it_depends_on_the_rank(lightning_ddp):
    done, out = lightning_ddp
    out = out / "iterable"
    assert done.returncode != 0  # rank 1 stopped the job
    assert (out / "rank1.error").exists(), done.stdout[-3000:] + done.stderr[-3000:]
    message = (out / "rank1.error").read_text()
    assert "this loader is rank 1 but the state was saved by rank 0" in message
    assert "iterable dataset's per-worker stream positions" in message
    assert not (out / "rank0.error").exists()  # rank 0 loads its own state


@pytest.mark.slow
def test_lightning_ddp_spawn_pickles_rebuilds_and_resumes_the_loaders(tmp_path):
    """``ddp_spawn`` on 2 processes, loaders built before ``fit``: each process gets gpufeed
    loaders (pickled, then rebuilt with Lightning's ``DistributedSampler``) whose batches are
    the sampler's, as the stock loader's are: train shuffled per epoch, validation in order.
    A second ``fit`` from the checkpoint of step 6 (mid-epoch 1, rank 0's loader state)
    trains each rank on exactly the batches the first run had left."""
    pytest.importorskip("lightning")
    script = str(TESTS / "support" / "lightning_spawn.py")
    # Each spawned process imports Lightning afresh (10-20 s here once torchmetrics finds
    # transformers installed), twice over for the two fits: the limit leaves room for that.
    done = _run([sys.executable, script, str(tmp_path), "process"], tmp_path, 240, "ddp_spawn")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        result, resumed = (json.loads((tmp_path / f"rank{rank}-{tag}.json").read_text())
                           for tag in ("reference", "resumed"))
        for run in (result, resumed):
            assert run["classes"] == ["gpufeed._loader.DataLoader"] * 2
            assert run["worker_types"] == ["process"] * 2
            assert run["contexts"] == ["fork"] * 2
            assert run["samplers"] == ["DistributedSampler"] * 2
        assert result["train"] == _shard(rank, True, 0) + _shard(rank, True, 1), rank
        assert result["val"] == _shard(rank, False, 0) * 2, rank
        assert resumed["train"] == result["train"][6:], rank  # 5 batches an epoch, 6 trained


def _shard(rank: int, shuffle: bool, epoch: int) -> list[list[int]]:
    """Rank ``rank``'s batches of lightning_spawn.py's data under a ``DistributedSampler``."""
    from support.lightning_spawn import BATCH, N

    sampler = DistributedSampler(range(N), num_replicas=2, rank=rank, shuffle=shuffle)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[k:k + BATCH] for k in range(0, len(order), BATCH)]


# -- Accelerate ------------------------------------------------------------------------------


@pytest.mark.slow
def test_accelerate_prepare_on_two_processes_shards_once(tmp_path_factory):
    """A stock program's loader, prepared, gives each rank the share the stock loader's does,
    with Accelerate's dispatch_batches, split_batches, even_batches=False and seedable sampler
    too; a loader that shards by rank itself (seed=) is refused by prepare() instead of being
    sharded twice (each rank a quarter of the data, half of it never seen)."""
    pytest.importorskip("accelerate")
    # one launch with tests/test_hf.py's two-process checks, which need these too
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from support.hf_ddp import launch_once

    done, out = launch_once(tmp_path_factory)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / "accelerate" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["gpufeed/shuffle=False"] == r["stock/shuffle=False"]
        assert "shard this gpufeed.DataLoader a second time" in r["seeded"]
    for side in ("stock", "gpufeed"):
        parts = [r[f"{side}/shuffle=True"] for r in ranks]
        assert len(parts[0]) == len(parts[1]) == 8 and sorted(parts[0] + parts[1]) == \
            list(range(16)), (side, parts)
    # dispatch_batches, split_batches, even_batches=False, a seedable sampler: the stock
    # loader's batches on every rank, and every sample given out
    for mode in ("dispatch", "split", "uneven", "seedable"):
        for r in ranks:
            assert r[f"gpufeed/{mode}"] == r[f"stock/{mode}"], (mode, r["rank"])
        got = sorted(v for r in ranks for b in r[f"gpufeed/{mode}"] for v in b)
        assert set(got) == set(range(13 if mode == "uneven" else 16)), (mode, got)
    # prepare(model, optimizer, train, eval), gradient accumulation, gather_for_metrics: the
    # same weights, synchronised steps and gathered metrics (each eval sample once)
    for r in ranks:
        assert r["gpufeed/loop"] == r["stock/loop"], r["rank"]
        assert r["gpufeed/loop"]["gathered"] == list(range(13))
        assert r["gpufeed/loop"]["synced_steps"] == 2


def test_accelerate_prepare_warns_and_the_documented_pattern_keeps_gpufeed():
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    loader = gpufeed.DataLoader(Pairs(N), batch_size=BATCH, shuffle=True, seed=4,
                                num_workers=1, worker_type="thread")
    with pytest.warns(UserWarning, match=r"accelerator.prepare\(loader\) rebuilds") as caught:
        prepared = accelerator.prepare(loader)
    assert caught[0].filename == __file__  # the user's line, not Accelerate's
    assert not isinstance(prepared.base_dataloader, gpufeed.DataLoader)  # what it warned of

    # the pattern: built after Accelerator(), on its device, not passed to prepare
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = gpufeed.DataLoader(Pairs(N), batch_size=BATCH, shuffle=True, seed=4,
                                num_workers=1, worker_type="thread",
                                device=accelerator.device)
    seen = []
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        seen.append(x.flatten().tolist())
    assert [b[0].flatten().tolist() for b in prepared] == seen  # same order as prepared
    assert loader.stats().counters["batches"] == 6 and loader.state_dict()["epoch"] == 1


def _resumed_by_accelerate(accelerate, tmp_path, *, on_device, **kwargs):
    """A loader registered for checkpointing, ``save_state`` two batches in: the rest of that
    run, then a fresh registered loader after ``load_state`` and its Accelerator."""

    def make(accelerator):
        loader = gpufeed.DataLoader(
            Pairs(N), batch_size=BATCH, shuffle=True, num_workers=1, worker_type="thread",
            device=accelerator.device if on_device else None, **kwargs)
        accelerator.register_for_checkpointing(loader)
        return loader

    accelerator = accelerate.Accelerator(cpu=True)
    it = iter(make(accelerator))
    next(it), next(it)
    accelerator.save_state(tmp_path / "state")
    rest_of_run = [b[0].flatten().tolist() for b in it]
    del it
    again = accelerate.Accelerator(cpu=True)
    fresh = make(again)
    again.load_state(tmp_path / "state")
    return rest_of_run, fresh, again


def test_accelerate_checkpoints_a_registered_loader_mid_epoch(tmp_path):
    """With the pattern above, ``register_for_checkpointing`` puts the loader's position in
    ``save_state``; ``load_state`` resumes it (stock users' loader: no seed=)."""
    accelerate = pytest.importorskip("accelerate")
    rest_of_run, fresh, _ = _resumed_by_accelerate(accelerate, tmp_path, on_device=True)
    assert [b[0].flatten().tolist() for b in fresh] == rest_of_run and len(rest_of_run) == 4


def test_accelerate_skip_first_batches_warns_once_of_the_stock_rebuild(tmp_path):
    """``skip_first_batches`` rebuilds a stock loader, which reads the gpufeed loader's sampler
    (a new epoch) instead of the position ``load_state`` restored: warned at the user's line,
    once per loader."""
    accelerate = pytest.importorskip("accelerate")
    rest_of_run, loader, again = _resumed_by_accelerate(accelerate, tmp_path, on_device=False,
                                                        seed=4)
    with pytest.warns(UserWarning, match=r"skip_first_batches\(loader\) rebuilds") as caught:
        skipped = again.skip_first_batches(loader, 2)
    assert len(caught) == 1 and caught[0].filename == __file__  # the user's line
    assert type(skipped) is tud.DataLoader  # what it warned of
    assert [b[0].flatten().tolist() for b in skipped] != rest_of_run  # as it warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.skip_first_batches(loader, 1)  # once per loader
        copy = pickle.loads(pickle.dumps(loader))  # other reads say nothing
        assert copy.multiprocessing_context is None and len(list(loader)) == 6  # used up


# -- Hugging Face datasets -------------------------------------------------------------------


def _pad(batch):
    ids = [item["ids"] for item in batch]
    longest = max(len(t) for t in ids)
    padded = torch.zeros(len(ids), longest, dtype=torch.long)
    for row, t in enumerate(ids):
        padded[row, : len(t)] = t
    return {"ids": padded, "label": torch.stack([item["label"] for item in batch]),
            "length": torch.tensor([len(t) for t in ids])}


def test_hf_dataset_with_format_torch_and_a_padding_collate(worker_type):
    datasets = pytest.importorskip("datasets")
    rows = {"ids": [list(range(1, 1 + (i * 7) % 11 + 1)) for i in range(30)],
            "label": [i % 3 for i in range(30)]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # datasets' own deprecation notices
        ds = datasets.Dataset.from_dict(rows).with_format("torch")
    stock = tud.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=_pad,
                           generator=torch.Generator().manual_seed(1))
    loader = gpufeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                collate_fn=_pad, worker_type=worker_type,
                                generator=torch.Generator().manual_seed(1))
    want, got = list(stock), list(loader)
    assert len(got) == len(want) == 8
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert {tuple(b["ids"].shape)[1] for b in got} != {11}  # the widths vary by batch
