"""Round 20: image-array (getitems-slot) with chunks of at most 32 (its chunk is then 2: the
64 MB bound on chunked batches' slots, 7 MB each) against at most 1, side by side, as
``cap_ab.py`` does for tabular: ``python cap_ab_image.py fresh|warm ROUNDS OUT.json``. The
JSON's ``cap1`` keys are the chunk of 1 (6 slots), ``cap32`` the chunk of 2 (10 slots).
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
torch.set_num_threads(1)
work = build("image-array", quick=False)
variant = next(v for v in work.variants if v.name == "getitems-slot")
ds = variant.dataset
_, fetch = _ceiling_fetch(variant)

def ceiling(r):
    batches = list(BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(r)),
                                work.batch_size, False))
    return measure_no_loader(fetch, batches, processes=2, init=one_intra_op_thread).samples_per_s

def loader_rate(seed):
    loader = gpufeed.DataLoader(ds, batch_size=work.batch_size, shuffle=True, num_workers=2,
                                collate_fn=variant.collate_fn,
                                persistent_workers=mode == "warm",
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
    for cap in ((32, 1) if r % 2 == 0 else (1, 32)):
        workahead.CHUNK_MAX = cap
        res[cap] = loader_rate(r)
    workahead.CHUNK_MAX = 32
    after = ceiling(r)
    c = (before + after) / 2
    rows.append({"ceiling_samples_per_s": [before, after], "cap32_samples_per_s": res[32][0],
                 "cap1_samples_per_s": res[1][0], "cap32_slots": res[32][1],
                 "cap1_slots": res[1][1]})
    print(f"round {r}: ceiling {c/1e6:.2f}M; cap 32 {res[32][0]/1e6:.2f}M "
          f"({res[32][0]/c:.0%}, {res[32][1]} slots); cap 1 {res[1][0]/1e6:.2f}M "
          f"({res[1][0]/c:.0%}, {res[1][1]} slots)", flush=True)
def share(k):
    return [x[k] / np.mean(x["ceiling_samples_per_s"]) for x in rows]
ratio = [x["cap32_samples_per_s"] / x["cap1_samples_per_s"] for x in rows]
summary = {"cap32_share_median": float(np.median(share("cap32_samples_per_s"))),
           "cap1_share_median": float(np.median(share("cap1_samples_per_s"))),
           "ratio_median": float(np.median(ratio)), "ratio_range": [min(ratio), max(ratio)],
           "cap32_faster_rounds": sum(x > 1 for x in ratio)}
print(summary)
with open(out, "w") as f:
    json.dump({"environment": environment(), "mode": mode, "workload": work.description,
               "rounds": rows, "summary": summary}, f, indent=1, default=str)
