"""Accelerate's ``prepare`` on two CPU processes (gloo), launched by torchrun: each rank writes
the samples its prepared loaders gave (``tests/integration/test_frameworks.py``).

    torchrun --nproc-per-node=2 accelerate_ddp.py OUT
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.utils.data as tud

import gpufeed

N = 16


class Ids(tud.Dataset[torch.Tensor]):
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def _train(make: type) -> dict[str, object]:
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train = make(Ids(N), batch_size=2, shuffle=True)
    evaluation = make(Ids(N - 3), batch_size=2)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train,
                                                              evaluation)
    steps = 0
    for x in train:
        with accelerator.accumulate(model):
            accelerator.backward(model(x.float()).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            steps += int(accelerator.sync_gradients)
    gathered = [int(v) for b in evaluation for v in accelerator.gather_for_metrics(b).flatten()]
    weights = [round(float(p), 6) for p in accelerator.unwrap_model(model).parameters()]
    # the DistributedDataParallel wrapper must go before the process group does: left to the
    # interpreter's exit, its reducer's teardown sometimes aborted the process ("terminate
    # called without an active exception"; 1 run in 8 on a loaded machine)
    accelerator.free_memory(model, optimizer, train, evaluation)
    del model, optimizer, train, evaluation
    gc.collect()
    return {"weights": weights, "synced_steps": steps, "gathered": sorted(gathered)}


def main(out: Path) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    report: dict[str, object] = {"rank": rank}
    warnings.simplefilter("ignore")  # the rebuild's warning is tested in one process
    for shuffle in (False, True):
        for name, make in (("stock", tud.DataLoader), ("gpufeed", gpufeed.DataLoader)):
            prepared = accelerator.prepare(make(Ids(), batch_size=2, shuffle=shuffle,
                                                num_workers=2))
            report[f"{name}/shuffle={shuffle}"] = [int(v) for b in prepared for v in b.flatten()]
    # Accelerate's other ways of sharing batches out: each rebuilds the loader from its
    # attributes, so gpufeed's must give what the stock loader's give (N = 16: 8 batches of 2;
    # Ids(N - 3) leaves an uneven last batch). No workers here or in the loop below: the
    # rebuilt loaders are stock ones either way, and every fork of these processes (gloo's
    # threads running) risks a child stuck before it runs: a stock worker hung so once in
    # about 45 runs under load, with the four configurations at 2 workers each
    for name, config in (("dispatch", dict(dispatch_batches=True)),
                         ("split", dict(split_batches=True)),
                         ("uneven", dict(even_batches=False)),
                         ("seedable", dict(use_seedable_sampler=True, data_seed=5))):
        other = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
        for side, make in (("stock", tud.DataLoader), ("gpufeed", gpufeed.DataLoader)):
            prepared = other.prepare(make(Ids(N - 3 if name == "uneven" else N), batch_size=2,
                                          shuffle=name == "seedable"))
            report[f"{side}/{name}"] = [[int(v) for v in b.flatten()] for b in prepared]
    # a training loop as Accelerate's examples write it: model, optimizer and both loaders
    # prepared together, gradient accumulation, metrics gathered over an uneven eval set
    for side, make in (("stock", tud.DataLoader), ("gpufeed", gpufeed.DataLoader)):
        report[f"{side}/loop"] = _train(make)
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
