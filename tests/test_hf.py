"""``gpufeed.hf``: the Trainer and Accelerate read through gpufeed and give the stock results.

A tiny BERT from a config (no download), a padded text set with a column the model does not
take (``tests/support/hf_tiny.py``); CPU. The two-process checks run under torchrun
(``tests/support/hf_ddp.py``).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.utils.data as tud

import gpufeed

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import gpufeed.hf as hf  # noqa: E402  (needs accelerate)
from support.hf_tiny import text_set, trainer  # noqa: E402


def _quiet_train(t, **kwargs):
    """``t.train()``, returning the warnings it gave that name gpufeed or a skip."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train(**kwargs)
    return [str(w.message) for w in caught
            if "gpufeed" in str(w.message) or "skip_first_batches" in str(w.message)]


def test_trainer_steps_and_a_mid_epoch_resume_equal_the_stock_trainers(tmp_path):
    """Per-step losses and batches over 2 epochs (2 persistent process workers, the Trainer's
    seed_worker, column removal, a padding collator), and a resume from a checkpoint at batch
    2 of epoch 1: equal to the stock Trainer's, the resumed steps read through gpufeed, and no
    warning said. (The resumed runs read in the main process: the skip is the batch sampler's,
    whatever the workers.)"""
    train = text_set(24, seed=1)  # 6 steps an epoch in batches of 4
    runs = {}
    for name, kind in (("stock", transformers.Trainer), ("gpufeed", hf.Trainer)):
        whole = trainer(kind, str(tmp_path / name), train, num_train_epochs=2,
                        dataloader_num_workers=2, dataloader_persistent_workers=True,
                        dataloader_pin_memory=False, save_strategy="steps", save_steps=8)
        assert _quiet_train(whole) == []
        resumed = trainer(kind, str(tmp_path / f"{name}-again"), train, num_train_epochs=2,
                          dataloader_pin_memory=False, save_strategy="steps", save_steps=8)
        said = _quiet_train(resumed, resume_from_checkpoint=str(tmp_path / name / "checkpoint-8"))
        assert said == [], said  # no false alarm about skip_first_batches
        runs[name] = whole, resumed
    (stock, stock_resumed), (ours, ours_resumed) = runs["stock"], runs["gpufeed"]
    assert len(stock.losses) == 12 and ours.losses == stock.losses  # exact, not rounded
    assert ours.rows == stock.rows
    assert ours_resumed.losses == stock_resumed.losses == stock.losses[8:]
    assert ours_resumed.rows == stock.rows[8:]
    # the resumed epoch went through gpufeed: 4 batches read, none of the 2 skipped
    skipped = ours_resumed.resumed_loader
    assert isinstance(skipped, gpufeed.DataLoader)
    assert type(skipped.base_dataloader) is gpufeed.DataLoader
    assert skipped.base_dataloader.stats().counters["batches"] == 4
    assert type(stock_resumed.resumed_loader.base_dataloader) is tud.DataLoader
    loader = ours.get_train_dataloader()
    assert type(loader).__name__ == "DataLoaderShard" and isinstance(loader, gpufeed.DataLoader)
    assert loader.base_dataloader.num_workers == 2


def test_trainer_evaluate_and_predict_with_a_short_last_batch_equal_the_stock_trainers(
        tmp_path):
    """30 rows in batches of 8: the last batch's 6 rows count 6 times, not 8, in eval_loss
    (Accelerate's gather_for_metrics drops the rest, which it can only do in its wrapper)."""
    train, evaluation = text_set(8, seed=1), text_set(30, seed=2)
    results = {}
    for name, kind in (("stock", transformers.Trainer), ("gpufeed", hf.Trainer)):
        t = trainer(kind, str(tmp_path / name), train, evaluation, dataloader_pin_memory=False)
        metrics = t.evaluate()
        predicted = t.predict(evaluation)
        results[name] = metrics, predicted, t.eval_loaders
    (stock, stock_predicted, _), (ours, ours_predicted, loaders) = results["stock"], results[
        "gpufeed"]
    for loader in loaders:  # evaluate's and predict's: 4 batches each, read through gpufeed
        assert type(loader.base_dataloader) is gpufeed.DataLoader
        assert loader.base_dataloader.stats().counters["batches"] == 4
    for key in ("eval_loss", "eval_accuracy"):
        assert ours[key] == stock[key], key
    assert ours_predicted.predictions.shape == (30, 2)
    assert (ours_predicted.predictions == stock_predicted.predictions).all()
    assert ours_predicted.metrics["test_loss"] == stock_predicted.metrics["test_loss"]


@pytest.mark.parametrize("arguments", [
    dict(train_sampling_strategy="group_by_length", dataloader_drop_last=True),
    dict(train_sampling_strategy="sequential", dataloader_num_workers=1,
         dataloader_prefetch_factor=3, dataloader_persistent_workers=True),
    dict(remove_unused_columns=False, train_sampling_strategy="batch_rebalance"),
], ids=["group_by_length+drop_last", "sequential+workers", "batch_rebalance"])
def test_trainer_loader_arguments_keep_their_meanings(tmp_path, arguments):
    """The loaders' batches over two epochs, as the stock Trainer builds them (no training)."""
    seen = {}
    for name, kind in (("stock", transformers.Trainer), ("gpufeed", hf.Trainer)):
        t = trainer(kind, str(tmp_path / name), text_set(22, seed=3),
                    dataloader_pin_memory=False, **arguments)
        loader = t.get_train_dataloader()
        torch.manual_seed(0)
        epochs = []
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            epochs.append([{k: v.tolist() for k, v in b.items()} for b in loader])
        seen[name] = epochs, loader
    (stock, _), (ours, loader) = seen["stock"], seen["gpufeed"]
    assert type(loader.base_dataloader) is gpufeed.DataLoader
    assert ours == stock and len(ours[0]) in (5, 6)
    if arguments.get("train_sampling_strategy") != "sequential":
        assert stock[0] != stock[1]  # a new order each epoch, the same on both sides
    if "dataloader_prefetch_factor" in arguments:
        base = loader.base_dataloader
        assert base.prefetch_factor == 3 and base.persistent_workers and base.num_workers == 1


def test_trainer_gpufeed_options_reach_the_loaders_and_bad_ones_are_refused(tmp_path):
    t = trainer(hf.Trainer, str(tmp_path), text_set(8, seed=1), dataloader_pin_memory=False,
                dataloader_num_workers=1, gpufeed_options={"worker_type": "thread"})
    base = t.get_train_dataloader().base_dataloader
    assert base.worker_type == "thread" and base.num_workers == 1
    # the Trainer's seed_worker would reseed the training loop's generators from a thread
    assert base.worker_init_fn is None
    processes = trainer(hf.Trainer, str(tmp_path), text_set(8, seed=1),
                        dataloader_pin_memory=False, dataloader_num_workers=1)
    assert processes.get_train_dataloader().base_dataloader.worker_init_fn.func.__name__ == (
        "seed_worker")
    with pytest.raises(ValueError, match=r"gpufeed_options \['seed'\] cannot be given"):
        trainer(hf.Trainer, str(tmp_path), text_set(8, seed=1), gpufeed_options={"seed": 1})
    with pytest.raises(ValueError, match="only 'auto' is taken here"):
        trainer(hf.Trainer, str(tmp_path), text_set(8, seed=1),
                gpufeed_options={"num_workers": 3})


class Ids(tud.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 13

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _ids(loader):
    return [b.flatten().tolist() for b in loader]


def test_accelerator_prepare_keeps_gpufeed_with_the_stock_wrappers_batches():
    """One process: prepare keeps a gpufeed loader (thread workers, stats) under Accelerate's
    wrapper, with the stock wrapper's batches (seedable sampler), its end-of-loader flag and
    remainder, and skip_first_batches keeps it too; no warning said."""
    config = accelerate.DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = hf.Accelerator(cpu=True, dataloader_config=config)
        prepared = ours.prepare(gpufeed.DataLoader(Ids(), batch_size=4, shuffle=True,
                                                   num_workers=1, worker_type="thread"))
        stock = accelerate.Accelerator(cpu=True, dataloader_config=config).prepare(
            tud.DataLoader(Ids(), batch_size=4, shuffle=True))
        assert isinstance(prepared, gpufeed.DataLoader) and prepared in ours._dataloaders
        assert prepared.base_dataloader.worker_type == "thread"
        ends, remainders = [], []
        got = []
        for batch in prepared:
            got.append(batch.flatten().tolist())
            ends.append(ours.gradient_state.end_of_dataloader)
            remainders.append(ours.gradient_state.remainder)
        assert got == _ids(stock) and sorted(v for b in got for v in b) == list(range(13))
        assert ends == [False, False, False, True] and remainders == [1] * 4
        assert prepared.stats().counters["batches"] == 4
        assert ours.prepare(prepared) is prepared  # prepared once
        # the next epoch, 2 batches skipped by the sampler: the stock wrapper's last 2
        skipped = ours.skip_first_batches(prepared, 2)
        stock_skipped = accelerate.skip_first_batches(stock, 2)
        assert type(skipped.base_dataloader) is gpufeed.DataLoader
        assert _ids(skipped) == _ids(stock_skipped) and len(_ids(skipped)) == 2
        assert skipped.base_dataloader.stats().counters["batches"] == 4  # 2 per epoch read
        # gather_for_metrics keeps the 13 samples of an evaluation's 4 batches
        evaluation = ours.prepare(gpufeed.DataLoader(Ids(), batch_size=4))
        assert [int(v) for b in evaluation for v in ours.gather_for_metrics(b)] == list(
            range(13))
        # a stock loader is prepared as Accelerate prepares it
        plain = ours.prepare(tud.DataLoader(Ids(), batch_size=4))
        assert type(plain.base_dataloader) is tud.DataLoader


def test_accelerator_skip_first_batches_of_an_unprepared_loader_keeps_gpufeed():
    ours = hf.Accelerator(cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        skipped = ours.skip_first_batches(
            gpufeed.DataLoader(Ids(), batch_size=4, worker_type="thread", num_workers=1), 3)
    assert type(skipped) is gpufeed.DataLoader and skipped.worker_type == "thread"
    assert _ids(skipped) == [[12]]


def test_accelerator_refuses_a_loader_that_shards_by_rank_itself():
    with pytest.raises(ValueError, match=r"shard this gpufeed\.DataLoader a second time"):
        hf.Accelerator(cpu=True).prepare(
            gpufeed.DataLoader(Ids(), batch_size=4, rank=0, world_size=2))


def test_plain_accelerator_warning_names_gpufeed_hf():
    with pytest.warns(UserWarning, match="from gpufeed.hf import Accelerator"):
        accelerate.Accelerator(cpu=True).prepare(gpufeed.DataLoader(Ids(), batch_size=4))


def test_two_processes_each_ranks_batches_and_the_gathered_metrics_equal_stock(
        tmp_path_factory):
    """torchrun, 2 CPU processes (gloo): the Trainer's per-rank batches and losses and its
    gathered evaluation, and gpufeed.hf.Accelerator's prepared loaders under dispatch_batches,
    split_batches, even_batches=False and the seedable sampler, as the stock ones. (The same
    launch runs tests/integration/test_frameworks.py's checks of the stock Accelerate.)"""
    from support.hf_ddp import launch_once

    done, out = launch_once(tmp_path_factory)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["said"] == [], r["said"]
        stock, ours = r["trainer/stock"], r["trainer/gpufeed"]
        assert ours == stock, r["rank"]  # losses, batches, gathered metrics
        assert r["trainer/base"] == "DataLoader" and r["trainer/read"] == 4
        assert len(stock["losses"]) == 4 and len(stock["predictions"]) == 13
        for mode in ("dispatch", "split", "uneven", "seedable"):
            assert r[f"accelerate/gpufeed/{mode}"] == r[f"accelerate/stock/{mode}"], mode
            assert r[f"accelerate/base/{mode}"] == "gpufeed"
    # each rank read its own half of every epoch
    halves = [{tuple(row) for batch in r["trainer/gpufeed"]["rows"] for row in batch}
              for r in ranks]
    assert not halves[0] & halves[1]
    for mode in ("dispatch", "split", "uneven", "seedable"):
        got = sorted(v for r in ranks for b in r[f"accelerate/gpufeed/{mode}"] for v in b)
        assert set(got) == set(range(13 if mode == "uneven" else 16)), (mode, got)
