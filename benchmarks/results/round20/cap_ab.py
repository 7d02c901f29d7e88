"""Round 20: the chunk cap, 32 (69f8fe3) against another (64 before), side by side.

``python cap_ab.py fresh|warm ROUNDS OUT.json [WORKLOAD VARIANT OTHER_CAP]``, 2 process
workers; by default tabular ``array`` against 64. mode fresh: each side's rate over one epoch
of a new loader (batches 4..end), as the CPU benchmark times it; mode warm: the second epoch of
a persistent loader. The no-loader ceiling before and after each round. ``cap-fresh.json`` and
``cap-warm-growing.json`` were taken on 0e9c923, whose cap of 32 held only for a ring's first
epoch (``FRESH_CHUNK_MAX``, 64 after): in its warm mode the 32 side grew its ring to 258 slots
during the timed epoch. ``cap-warm.json``: this script, both caps held throughout.
``image-*.json``: ``image-array getitems-slot 1``, whose chunk under 32 is 2 (the 64 MB bound
on chunked batches' slots, 7 MB each: 10 slots, against 6 with one batch a message).
"""
import json
import sys
import time

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler

import gpufeed
from gpufeed._host import workahead
from gpufeed._tools.measure import one_intra_op_thread
from gpufeed.benchmarks.ceiling import measure_no_loader
from gpufeed.benchmarks.cpu import _ceiling_fetch
from gpufeed.benchmarks.environment import environment
from gpufeed.benchmarks.workloads import build

mode, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
workload, variant_name, other = (*sys.argv[4:6], int(sys.argv[6])) if len(sys.argv) > 4 else (
    "tabular", "array", 64)
torch.set_num_threads(1)
work = build(workload, quick=False)
variant = next(v for v in work.variants if v.name == variant_name)
ds = variant.dataset
_, fetch = _ceiling_fetch(variant)

def ceiling(r):
    batches = list(BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(r)),
                                work.batch_size, False))
    return measure_no_loader(fetch, batches, processes=2, init=one_intra_op_thread).samples_per_s

def loader_rate(seed):
    loader = gpufeed.DataLoader(ds, batch_size=work.batch_size, shuffle=True, num_workers=2,
                                collate_fn=variant.collate_fn, persistent_workers=mode == "warm",
                                worker_init_fn=one_intra_op_thread,
                                generator=torch.Generator().manual_seed(seed))
    if mode == "warm":
        for _ in loader:
            pass
    it = iter(loader)
    for _ in range(3):
        next(it)
    t0, s = time.perf_counter(), 0
    for b in it:
        s += len(b[0])
    rate = s / (time.perf_counter() - t0)
    grows = it.ring_info()["grows"]
    del it, loader
    return rate, grows

rows = []
for r in range(rounds):
    before = ceiling(r)
    res = {}
    for cap in ((32, other) if r % 2 == 0 else (other, 32)):
        workahead.CHUNK_MAX = cap
        res[cap] = loader_rate(r)
    workahead.CHUNK_MAX = 32
    after = ceiling(r)
    c = (before + after) / 2
    row = {"ceiling_samples_per_s": [before, after]}
    for cap in (32, other):
        row |= {f"cap{cap}_samples_per_s": res[cap][0], f"cap{cap}_slots": res[cap][1]}
    rows.append(row)
    print(f"round {r}: ceiling {c/1e6:.2f}M; " + "; ".join(
        f"cap {cap} {res[cap][0]/1e6:.2f}M ({res[cap][0]/c:.0%}, {res[cap][1]} slots)"
        for cap in (32, other)), flush=True)
def share(k):
    return [x[k] / np.mean(x["ceiling_samples_per_s"]) for x in rows]
ratio = [x["cap32_samples_per_s"] / x[f"cap{other}_samples_per_s"] for x in rows]
summary = {"cap32_share_median": float(np.median(share("cap32_samples_per_s"))),
           f"cap{other}_share_median": float(np.median(share(f"cap{other}_samples_per_s"))),
           "ratio_median": float(np.median(ratio)), "ratio_range": [min(ratio), max(ratio)],
           "cap32_faster_rounds": sum(x > 1 for x in ratio)}
print(summary)
with open(out, "w") as f:
    json.dump({"environment": environment(), "mode": mode, "workload": work.description,
               "rounds": rows, "summary": summary}, f, indent=1, default=str)
