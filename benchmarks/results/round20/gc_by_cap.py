"""Round 20: Python's collector in the loop, by chunk cap.

``python gc_by_cap.py EPOCHS CAP``: a persistent loader (tabular, 2 process workers, chunks of
at most CAP batches) for EPOCHS epochs; prints the collections by generation and their time
(``gc.callbacks``). The ``gc.collect()`` before the loop counts as one full collection.
"""

import collections
import gc
import sys
import time

import torch

import gpufeed
from gpufeed._host import workahead
from gpufeed._tools.measure import one_intra_op_thread
from gpufeed.benchmarks.workloads import build

epochs, workahead.CHUNK_MAX = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
work = build("tabular", quick=False)
ds = next(x for x in work.variants if x.name == "array").dataset
count: collections.Counter[int] = collections.Counter()
spent: collections.Counter[int] = collections.Counter()
began = [0.0]


def watch(phase: str, info: dict) -> None:
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        count[info["generation"]] += 1
        spent[info["generation"]] += time.perf_counter() - began[0]


gc.callbacks.append(watch)
loader = gpufeed.DataLoader(ds, batch_size=work.batch_size, shuffle=True, num_workers=2,
                            persistent_workers=True, worker_init_fn=one_intra_op_thread,
                            generator=torch.Generator().manual_seed(0))
gc.collect()
t0, batches = time.perf_counter(), 0
for _ in range(epochs):
    for _ in loader:
        batches += 1
wall = time.perf_counter() - t0
ms = {k: round(v * 1e3, 1) for k, v in sorted(spent.items())}
print(f"cap {workahead.CHUNK_MAX}: {batches} batches in {wall * 1e3:.0f} ms; collections "
      f"{dict(sorted(count.items()))}; ms {ms}")
