"""Support script for tests/integration/test_frameworks.py (not a test module): Lightning's
``ddp_spawn`` on two CPU processes with gpufeed loaders built before ``fit``, so Lightning
pickles them to the processes it spawns and rebuilds them there with a ``DistributedSampler``.

``python lightning_spawn.py OUT WORKER_TYPE``: 2 epochs with a checkpoint every 2 steps; each
rank writes the sample numbers of its training and validation batches, and the class and worker
type of the loaders it got, to ``OUT/rank{r}-reference.json``; then a second ``fit`` from the
checkpoint of step 6, mid-epoch 1, writes ``OUT/rank{r}-resumed.json``.
"""

from __future__ import annotations

import atexit
import gc
import json
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")  # Lightning's advice about workers, loggers, ...
if __name__ in ("__main__", "__mp_main__"):  # this script and the processes it spawns
    # The interpreter's last garbage collection, at exit, walks the whole heap that Lightning's
    # imports built: seconds in each of this run's 5 processes on a loaded machine (the main
    # one and each fit's 2). The results are written by then; the objects still alive are
    # frozen out of it.
    atexit.register(gc.freeze)

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import gpufeed  # noqa: E402
from support.frameworks import Pairs  # noqa: E402

N, BATCH = 36, 4  # 18 samples a rank: 5 batches, the last of 2


class Recorder(pl.LightningModule):
    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out, self.tag = out, tag
        self.seen: dict[str, list[list[int]]] = {"train": [], "val": []}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen["train"].append([int(v) for v in x.flatten().tolist()])
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["val"].append([int(v) for v in batch[0].flatten().tolist()])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def on_train_end(self) -> None:
        loaders = [self.trainer.train_dataloader, self.trainer.val_dataloaders]
        result = dict(self.seen, rank=self.global_rank,
                      classes=[type(d).__module__ + "." + type(d).__name__ for d in loaders],
                      worker_types=[getattr(d, "worker_type", None) for d in loaders],
                      contexts=[_start_method(d) for d in loaders],
                      samplers=[type(d.sampler).__name__ for d in loaders])
        Path(self.out, f"rank{self.global_rank}{self.tag}.json").write_text(json.dumps(result))


def _start_method(loader: Any) -> str | None:
    context = loader.multiprocessing_context
    return None if context is None else context.get_start_method()


def main(out: str, worker_type: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def loader(shuffle: bool) -> gpufeed.DataLoader:
        # A process Lightning spawned starts its workers by spawn too, unless told: each would
        # import this script, so Lightning, anew (10 s of CPU; 36 such starts made this test
        # take minutes). Forked workers keep it short, and the rebuilt loaders must keep the
        # context they were given.
        return gpufeed.DataLoader(Pairs(N), batch_size=BATCH, shuffle=shuffle, num_workers=2,
                                  worker_type=worker_type, multiprocessing_context="fork")

    def trainer(every: int | None) -> pl.Trainer:
        checkpoints = [ModelCheckpoint(dirpath=Path(out, "ckpt"), every_n_train_steps=every,
                                       save_top_k=-1, filename="{epoch}-{step}")] if every else []
        return pl.Trainer(
            accelerator="cpu", devices=2, max_epochs=2, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=bool(every), callbacks=checkpoints,
            num_sanity_val_steps=0, default_root_dir=out,
            strategy=DDPStrategy(start_method="spawn", process_group_backend="gloo",
                                 timeout=timedelta(seconds=60)))

    trainer(2).fit(Recorder(out, "-reference"), loader(True), loader(False))
    trainer(None).fit(Recorder(out, "-resumed"), loader(True), loader(False),
                      ckpt_path=str(Path(out, "ckpt", "epoch=1-step=6.ckpt")))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
