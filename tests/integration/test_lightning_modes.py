"""Lightning's other ways of running loaders, each run twice, once on stock loaders and once on
gpufeed's built with the same arguments: the batches every hook sees must be the same.

The modes (one process, CPU): loaders reloaded every epoch, validation in the middle of an
epoch with persistent workers on both loaders, gradient accumulation, ``overfit_batches``,
``limit_*_batches``, and ``validate``/``test``/``predict`` on their own. Lightning re-creates a
loader to add its sampler where it needs one (``overfit_batches`` swaps in a sequential one):
gpufeed's must come back as gpufeed's, with the new sampler.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import gpufeed
from support.frameworks import Pairs, trainer

pl = pytest.importorskip("lightning.pytorch")

# 22 training samples in batches of 4 (6 steps an epoch); 10 validation samples in 3s.
N, BATCH, N_VAL, VAL_BATCH = 22, 4, 10, 3


class Recorder(pl.LightningModule):
    """A one-weight model that records the sample numbers of every batch each hook gets, and
    which loader class gave the training batches (``loaders``)."""

    def __init__(self, make: Any, *, workers: int, persistent: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.make, self.workers, self.persistent = make, workers, persistent
        self.seen: dict[str, list[list[int]]] = {"train": [], "val": [], "test": [],
                                                 "predict": []}
        self.built = 0  # train_dataloader() calls
        self.kinds: set[type] = set()  # the classes of the loaders Lightning ran

    def _kind(self, loaders: Any) -> None:
        for loader in loaders if isinstance(loaders, list) else [loaders]:
            self.kinds.add(type(loader))

    def _ids(self, batch: Any) -> list[int]:
        return [int(v) for v in batch[0].flatten().tolist()]

    def on_train_epoch_start(self) -> None:
        self._kind(self.trainer.train_dataloader)

    def on_validation_epoch_start(self) -> None:
        self._kind(self.trainer.val_dataloaders)

    def on_test_epoch_start(self) -> None:
        self._kind(self.trainer.test_dataloaders)

    def on_predict_epoch_start(self) -> None:
        self._kind(self.trainer.predict_dataloaders)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train"].append(self._ids(batch))
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["val"].append(self._ids(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["test"].append(self._ids(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["predict"].append(self._ids(batch))
        return self.layer(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def _loader(self, n: int, batch: int, shuffle: bool) -> Any:
        kwargs: dict[str, Any] = {"num_workers": self.workers}
        if self.workers:
            kwargs["persistent_workers"] = self.persistent
        return self.make(Pairs(n), batch_size=batch, shuffle=shuffle, **kwargs)

    def train_dataloader(self) -> Any:
        self.built += 1
        return self._loader(N, BATCH, shuffle=True)

    def val_dataloader(self) -> Any:
        return self._loader(N_VAL, VAL_BATCH, shuffle=False)

    def test_dataloader(self) -> Any:
        return self._loader(N_VAL, VAL_BATCH, shuffle=False)

    def predict_dataloader(self) -> Any:
        return self._loader(N_VAL, VAL_BATCH, shuffle=False)


def _run(make: Any, tmp_path: Any, *, workers: int = 2, persistent: bool = False,
         calls: tuple[str, ...] = ("fit",), **trainer_kwargs: Any) -> tuple[Recorder, Any]:
    """One run: the global generators seeded as ``seed_everything`` does, then ``calls`` on a
    fresh Trainer; returns the model (its records) and the predictions."""
    pl.seed_everything(0, verbose=False)
    model = Recorder(make, workers=workers, persistent=persistent)
    run = trainer(tmp_path / make.__module__, epochs=trainer_kwargs.pop("epochs", 2),
                  **trainer_kwargs)
    predictions = None
    with warnings.catch_warnings():
        # Lightning's advice (more workers, a logger, sync_dist) on both sides alike
        warnings.simplefilter("ignore")
        for call in calls:
            if call == "predict":
                predictions = run.predict(model)
            else:
                getattr(run, call)(model)
    return model, predictions


def _same_on_both(tmp_path: Any, **kwargs: Any) -> Recorder:
    """The run on stock loaders, then on gpufeed's: the same batches in every hook, the same
    steps and predictions, and only loaders of each side's class. Returns gpufeed's model."""
    stock, stock_pred = _run(tud.DataLoader, tmp_path, **kwargs)
    ours, our_pred = _run(gpufeed.DataLoader, tmp_path, **kwargs)
    assert ours.seen == stock.seen
    assert ours.built == stock.built and ours.global_step == stock.global_step
    if stock_pred is not None:
        assert our_pred is not None and len(our_pred) == len(stock_pred)
        for a, b in zip(stock_pred, our_pred, strict=True):
            assert torch.equal(a, b)
    assert stock.kinds == {tud.DataLoader} and ours.kinds == {gpufeed.DataLoader}
    return ours


@pytest.mark.parametrize("persistent", [False, True])
def test_reloaded_every_epoch_with_validation_mid_epoch(tmp_path, persistent):
    """``reload_dataloaders_every_n_epochs=1`` builds the training loader each epoch;
    ``val_check_interval=0.5`` runs validation after 3 of the 6 steps, the training workers
    waiting mid-epoch (persistent on both loaders, or not)."""
    ours = _same_on_both(
        tmp_path, epochs=3, persistent=persistent, reload_dataloaders_every_n_epochs=1,
        val_check_interval=0.5)
    assert ours.built == 3 and len(ours.seen["train"]) == 18
    assert len(ours.seen["val"]) == 6 * 4  # twice an epoch, 4 batches of 3, 3, 3, 1
    assert ours.seen["train"][:6] != ours.seen["train"][6:12]  # each epoch reshuffled


def test_gradient_accumulation_and_limited_batches(tmp_path):
    ours = _same_on_both(
        tmp_path, epochs=2, accumulate_grad_batches=2, limit_train_batches=5,
        limit_val_batches=2)
    assert len(ours.seen["train"]) == 10 and len(ours.seen["val"]) == 4
    assert ours.global_step == 6  # 3 optimizer steps an epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_overfit_batches_reuses_the_first_batches_in_order(tmp_path, workers):
    """``overfit_batches=2`` re-creates the training loader with a sequential sampler (Lightning
    warns) and trains on its first two batches every epoch."""
    ours = _same_on_both(tmp_path, epochs=2, workers=workers, overfit_batches=2)
    first = [list(range(0, 4)), list(range(4, 8))]
    assert ours.seen["train"] == first * 2


def test_validate_test_and_predict_on_their_own(tmp_path):
    ours = _same_on_both(tmp_path, persistent=True,
                          calls=("validate", "test", "predict", "validate"))
    want = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert ours.seen["val"] == want * 2 and ours.seen["test"] == want
    assert ours.seen["predict"] == want
