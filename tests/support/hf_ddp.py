"""``gpufeed.hf`` on two CPU processes (gloo), launched by torchrun: each rank writes what the
stock and gpufeed sides gave it (``tests/test_hf.py``) to ``OUT/rank{r}.json``, then runs
``accelerate_ddp.py``'s checks of the stock Accelerate in the same processes, into
``OUT/accelerate`` (``tests/integration/test_frameworks.py``): one launch, each rank importing
Accelerate once, for both test files (:func:`launch_once`).

    torchrun --nproc-per-node=2 hf_ddp.py OUT
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.utils.data as tud

import gpufeed


class Ids(tud.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _trainer(kind: type, out: Path) -> dict[str, Any]:
    """One epoch of 32 rows (4 steps of 4 on each rank), then evaluate() and predict() over 13
    rows (one batch of 8 per rank: rank 1's is padded by Accelerate and the padding dropped
    when gathered)."""
    from support.hf_tiny import text_set, trainer

    t = trainer(kind, str(out), text_set(32, seed=1), text_set(13, seed=2),
                dataloader_pin_memory=False, num_train_epochs=1)
    t.train()
    metrics = t.evaluate()
    predicted = t.predict(text_set(13, seed=2))
    report = {"losses": t.losses, "rows": t.rows,
              "eval": [metrics["eval_loss"], metrics["eval_accuracy"]],
              "predictions": predicted.predictions.tolist()}
    loader = t.train_loaders[0]
    base = loader.base_dataloader
    extra = {"base": type(base).__name__,
             "read": base.stats().counters["batches"] if isinstance(base, gpufeed.DataLoader)
             else None}
    t.accelerator.free_memory()
    del t, loader, base
    gc.collect()
    return {"report": report, **extra}


def main(out: Path) -> None:
    import accelerate
    import transformers

    import gpufeed.hf as hf

    rank = int(os.environ["RANK"])
    report: dict[str, Any] = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, kind in (("stock", transformers.Trainer), ("gpufeed", hf.Trainer)):
            done = _trainer(kind, out / name)
            report[f"trainer/{name}"] = done["report"]
            if name == "gpufeed":
                report["trainer/base"], report["trainer/read"] = done["base"], done["read"]
        # Accelerate's ways of sharing batches out (16 samples in batches of 2; 13 leave an
        # uneven end): the stock wrapper's batches on every rank, read through gpufeed
        for mode, config in (("dispatch", dict(dispatch_batches=True)),
                             ("split", dict(split_batches=True)),
                             ("uneven", dict(even_batches=False)),
                             ("seedable", dict(use_seedable_sampler=True, data_seed=5))):
            for side, make, maker in (("stock", tud.DataLoader, accelerate.Accelerator),
                                      ("gpufeed", gpufeed.DataLoader, hf.Accelerator)):
                accelerator = maker(
                    cpu=True, dataloader_config=accelerate.DataLoaderConfiguration(**config))
                prepared = accelerator.prepare(make(Ids(13 if mode == "uneven" else 16),
                                                    batch_size=2,
                                                    shuffle=mode == "seedable"))
                report[f"accelerate/{side}/{mode}"] = [[int(v) for v in b.flatten()]
                                                       for b in prepared]
                if side == "gpufeed":
                    report[f"accelerate/base/{mode}"] = (
                        "gpufeed" if type(prepared.base_dataloader) is gpufeed.DataLoader
                        else type(prepared.base_dataloader).__name__)
    report["said"] = [str(w.message) for w in caught
                      if "gpufeed" in str(w.message) or "skip_first_batches" in str(w.message)]
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    accelerate.PartialState().wait_for_everyone()
    from support import accelerate_ddp

    (out / "accelerate").mkdir(exist_ok=True)  # by each rank
    accelerate_ddp.main(out / "accelerate")  # closes the process group at its end
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


#: the one launch of a test session: (the finished torchrun, OUT), or the failure to report
_launched: dict[str, tuple[subprocess.CompletedProcess[str], Path] | str] = {}


def launch_once(tmp_path_factory: Any, timeout: float = 300
                ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """torchrun this script on 2 processes, once a test session, whichever test file asks
    first (:func:`support.procs.run_in_session`)."""
    import pytest

    from support.procs import HangError, run_in_session

    if "run" not in _launched:
        out = tmp_path_factory.mktemp("hf_ddp")
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "--monitor-interval=0.5", __file__, str(out)]
        try:
            _launched["run"] = (run_in_session(args, out, timeout, MASTER_ADDR="127.0.0.1"),
                                out)
        except HangError as e:
            _launched["run"] = f"torchrun {e}"
    launched = _launched["run"]
    if isinstance(launched, str):
        pytest.fail(launched)
    return launched


if __name__ == "__main__":
    # The interpreter's last garbage collection, at exit, walks the whole heap that
    # transformers' and Accelerate's imports built (seconds a rank on a loaded machine): the
    # results are written by then, so the objects still alive are frozen out of it.
    atexit.register(gc.freeze)
    main(Path(sys.argv[1]))
