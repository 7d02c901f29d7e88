"""Accelerate's ``prepare`` on two CPU processes (gloo), launched by torchrun: each rank writes
the samples its prepared loaders gave (``tests/integration/test_frameworks.py``).

    torchrun --nproc-per-node=2 accelerate_ddp.py OUT
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.utils.data as tud

import gpufeed

N = 16


class Ids(tud.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def main(out: Path) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    report: dict[str, object] = {"rank": rank}
    warnings.simplefilter("ignore")  # the rebuild's warning is tested in one process
    for shuffle in (False, True):
        for name, make in (("stock", tud.DataLoader), ("gpufeed", gpufeed.DataLoader)):
            prepared = accelerator.prepare(make(Ids(), batch_size=2, shuffle=shuffle,
                                                num_workers=2))
            report[f"{name}/shuffle={shuffle}"] = [int(v) for b in prepared for v in b.flatten()]
    try:  # a loader that shards by rank itself (seed= under torch.distributed)
        accelerator.prepare(gpufeed.DataLoader(Ids(), batch_size=2, shuffle=True, seed=3))
        report["seeded"] = "prepared"
    except ValueError as exc:
        report["seeded"] = str(exc)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
