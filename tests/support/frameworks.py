"""Support for tests/integration/test_frameworks.py and tests/support/lightning_ddp.py (not a
test module): a tiny dataset and Lightning module that record the batches they train on."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is ``([i], [2 i])``: a batch's first leaf names the samples in it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i)]), torch.tensor([2.0 * i])


class PairStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An iterable ``Pairs`` that can say where it stands (so gpufeed can save its position)."""

    def __init__(self, n: int) -> None:
        self.n, self.at, self.start = n, 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        self.at, self.start = self.start, 0
        for i in list(range(wid, self.n, nw))[self.at:]:
            self.at += 1
            yield torch.tensor([float(i)]), torch.tensor([2.0 * i])

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["at"]


class PlainStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An iterable ``Pairs`` with no ``state_dict``: nothing can say where it stood."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            yield torch.tensor([float(i)]), torch.tensor([2.0 * i])


class PythonRandomSampler(Sampler[int]):
    """A user sampler that shuffles with Python's ``random`` and keeps no state: gpufeed
    cannot rewind it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        random.shuffle(order)
        return iter(order)


def lightning_module(loader_factory: Any = None, on_batch: Any = None) -> Any:
    """A one-weight regression whose ``seen`` lists each training batch's sample numbers;
    ``on_batch(batch)``, if given, is called on each (to check it)."""
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[list[int]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if on_batch is not None:
                on_batch(batch)
            self.seen.append([int(v) for v in x.flatten().tolist()])
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            if loader_factory is None:
                raise NotImplementedError
            return loader_factory()

    return Tiny()


def trainer(root: Path, *, epochs: int, every: int | None = None, accelerator: str = "cpu",
            **kwargs: Any) -> Any:
    """A quiet Trainer (on the CPU unless told); ``every``: a ModelCheckpoint every that many
    steps, all kept."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = []
    if every is not None:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every,
                                         save_top_k=-1, filename="{epoch}-{step}"))
    return pl.Trainer(
        accelerator=accelerator, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=every is not None,
        callbacks=callbacks, num_sanity_val_steps=0, default_root_dir=root, **kwargs,
    )


# How gpufeed's resume warnings begin (they are raised from inside Lightning's loops).
OURS = ("loader.state_dict() at batch", "cannot resume epoch")
# gpufeed's advice when a state is taken or loaded without seed= (a RandomStateWarning).
NO_SEED = ("loader.state_dict() was taken without seed=",
           "loader.load_state_dict() got a state saved without seed=")


def quiet_fit(trainer: Any, *args: Any, advice: list[str] | None = None, **kwargs: Any
              ) -> list[str]:
    """``trainer.fit`` with Lightning's advice silenced; returns gpufeed's resume warnings, and
    Lightning's "dataloader is not resumable" one; gpufeed's no-seed advice goes to ``advice``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(*args, **kwargs)
    messages = [str(w.message) for w in caught]
    if advice is not None:
        advice.extend(m for m in messages if m.startswith(NO_SEED))
    return [m for m in messages if m.startswith(OURS) or "dataloader is not resumable" in m]
