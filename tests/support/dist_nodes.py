"""Run by tests/integration/test_two_nodes.py: one rank per node, two nodes on one machine.

Each of two ``torchrun --nnodes=2 --nproc-per-node=1`` launches (a c10d rendezvous on
127.0.0.1, gloo) runs this script once, in two steps. First the rank writes
``<out>/rank<R>.json`` with its environment, its shard of one epoch
(``gpufeed.DataLoader(..., seed=3)``, two process workers), the budgets gpufeed gives it, and
a mid-epoch ``state_dict()`` with the batches after it, then resumes from that state in a new
loader. Then both ranks hold a loader with process workers mid-epoch, rank 1 kills itself with
SIGKILL and rank 0 waits on a collective: it must fail with an error and leave no process
behind. (One launch for both: starting the four interpreters is most of the test's time.)

Usage: ``torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d ... dist_nodes.py OUT``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dist_sampling import BATCH, Indexed

import gpufeed
from gpufeed._base.system import local_ranks, memory_available, usable_cpus
from gpufeed._host.cost import DEFAULT_MEMORY_SHARE, Budgets

STOP_AT = 2  # batches delivered before the state is taken


def loader() -> gpufeed.DataLoader:
    return gpufeed.DataLoader(Indexed(), batch_size=BATCH, shuffle=True, seed=3, num_workers=2)


def indices(batches: list) -> list[list[int]]:
    return [[int(i) for i in index] for index, _ in batches]


def run(out: Path, rank: int) -> None:
    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK",
                                          "GROUP_RANK", "RANK")}
    epoch = indices(list(loader()))
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(STOP_AT)]
    state = first.state_dict()
    rest = indices(list(it))
    resumed = loader()
    resumed.load_state_dict(state)
    budgets = Budgets.default()
    report = {
        "rank": rank, "world_size": dist.get_world_size(), "env": env,
        "loader_world": [first.rank, first.world_size], "epoch": epoch,
        "head": indices(head), "rest": rest, "resumed": indices(list(resumed)), "state": state,
        "budget_cpus": budgets.cpu_cores, "budget_memory": budgets.memory_bytes,
        "machine_cpus": usable_cpus(per_rank=False), "local_ranks": local_ranks(),
        "memory_share": DEFAULT_MEMORY_SHARE * memory_available(),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()


def die(rank: int) -> None:
    held = iter(loader())
    next(held)  # process workers running, a batch in flight
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))  # rank 1 never joins
    dist.barrier()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run(Path(sys.argv[1]), rank)
    die(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
