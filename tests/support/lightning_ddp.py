"""Support script for tests/integration/test_frameworks.py (not a test module): Lightning DDP
on two CPU processes (gloo), launched by ``torchrun --nproc-per-node=2``.

``python lightning_ddp.py MODE [MODE ...] OUT`` on each rank, for each MODE in turn (in one
launch, so that Lightning is imported once per rank), in ``OUT/MODE``:

1. trains (``seeded``: 2 epochs of 4 steps per rank) with a ``ModelCheckpoint`` every 2 steps
   (Lightning writes it on rank 0 only, with rank 0's loader state), recording the batches each
   rank saw;
2. trains again from a mid-epoch checkpoint on both ranks.

MODE ``seeded``: a map-style gpufeed loader with ``seed=``, built in ``train_dataloader()``
(after Lightning initialised torch.distributed, so it shards by rank itself); writes
``OUT/rank{r}.json``. MODE ``iterable``: an iterable dataset, whose state depends on the rank;
a rank that cannot load rank 0's state writes the error to ``OUT/rank{r}.error`` and exits 3
(torchrun then stops the other rank), so it comes last.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

warnings.simplefilter("ignore")  # Lightning's advice about workers, loggers, ...

import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import gpufeed  # noqa: E402
from support.frameworks import Pairs, PairStream, lightning_module, trainer  # noqa: E402

# 32 samples in batches of 4: 8 batches an epoch, 4 per rank.
N, BATCH = 32, 4


def make_loader(mode: str) -> gpufeed.DataLoader:
    if mode == "seeded":
        return gpufeed.DataLoader(Pairs(N), batch_size=BATCH, shuffle=True, seed=11)
    return gpufeed.DataLoader(PairStream(N), batch_size=BATCH)


def ddp_trainer(root: Path, epochs: int, **kwargs: object) -> object:
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
    return trainer(root, epochs=epochs, devices=2, strategy=strategy, **kwargs)


def main(modes: list[str], out: Path) -> None:
    torch.set_num_threads(1)
    for mode in modes:
        (out / mode).mkdir(exist_ok=True)  # by each rank
        run(mode, out / mode)
    # Lightning leaves the gloo process group up; tearing it down at interpreter exit sometimes
    # aborts the process ("terminate called without an active exception", exit code -6) after
    # the results are written. Close it here, while the other rank is still in step.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run(mode: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    # seeded: batch 2 of epoch 1 on each rank; iterable (8 steps an epoch: the stream is not
    # sharded), batch 2 of epoch 0 is enough to show the refusal
    epochs = 2 if mode == "seeded" else 1
    reference = lightning_module(lambda: make_loader(mode))
    ddp_trainer(out, epochs, every=2).fit(reference)  # type: ignore[attr-defined]
    name = "epoch=1-step=6.ckpt" if mode == "seeded" else "epoch=0-step=2.ckpt"
    checkpoint = out / "ckpt" / name
    saved = torch.load(checkpoint, weights_only=False)
    saved_state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]

    resumed = lightning_module(lambda: make_loader(mode))
    try:
        ddp_trainer(out / f"again{rank}", epochs).fit(resumed, ckpt_path=checkpoint)  # type: ignore[attr-defined]
    except ValueError as exc:
        (out / f"rank{rank}.error").write_text(str(exc))
        sys.stdout.flush()
        os._exit(3)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "saved_rank": saved_state["rank"],
        "reference": reference.seen, "resumed": resumed.seen,
    }))


if __name__ == "__main__":
    main(sys.argv[1:-1], Path(sys.argv[-1]))
