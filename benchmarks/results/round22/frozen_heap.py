"""Round 22: a worker's full collection against the objects it inherited, side by side (the
script of round 21, rerun with the freeze made in each forked worker, on Python 3.11-3.13).

``python frozen_heap.py ROUNDS OUT.json``: the main process holds a million annotation dicts
(``{"id", "box": [4 floats], "cat"}``, as a detection dataset's list); three loaders with 2
process workers read it: stock, gpufeed (each forked worker freezes what it inherited: NOTE
[ Frozen heap at fork ]) and gpufeed with the freeze turned off in this process. Mode
``collect``: each worker's first sample runs ``gc.collect()``; reported per worker, the memory
the collection made private (smaps' Private_Clean + Private_Dirty, ``private_bytes``) and its
time. Mode ``natural``: 50,000 samples read at random, no explicit collection; reported per
worker, its full collections (``gc.callbacks``) and its private memory at the end. Sides
alternate in each round.
"""
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.utils.data as tud

import gpufeed
from gpufeed._base.system import private_bytes
from gpufeed._host import elastic, pool
from gpufeed.benchmarks.environment import environment

FULL = [0]


def private_kib():
    return private_bytes(os.getpid()) // 1024  # Private_Clean + Private_Dirty


def count_full(phase, info):
    if phase == "stop" and info["generation"] == 2:
        FULL[0] += 1


class Annotations(tud.Dataset):
    def __init__(self, n, collect):
        self.rows = [{"id": i, "box": [float(i), 1.0, 2.0, 3.0], "cat": i % 80}
                     for i in range(n)]
        self.collect = collect

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if i < 0:  # a probe: this worker's figures
            return torch.tensor([os.getpid(), FULL[0], private_kib(), -1])
        if self.collect and not getattr(self, "_done", False):
            self._done = True
            before, t0 = private_kib(), time.perf_counter()
            gc.collect()
            return torch.tensor([os.getpid(), private_kib() - before,
                                 int((time.perf_counter() - t0) * 1e6), 0])
        return torch.tensor(self.rows[i]["box"])


class Order(tud.Sampler):
    """``count`` indices at random, then a probe per worker (two, in turn)."""

    def __init__(self, n, count):
        self.n, self.count = n, count

    def __iter__(self):
        yield from torch.randperm(self.n, generator=torch.Generator().manual_seed(0))[
            : self.count].tolist()
        yield from (-1, -1)

    def __len__(self):
        return self.count + 2


def init(_):
    gc.callbacks.append(count_full)


@contextlib.contextmanager
def unfrozen():
    keep = pool.heap_frozen, elastic.heap_frozen
    def off(*, fork):
        return contextlib.nullcontext()

    pool.heap_frozen = elastic.heap_frozen = off
    try:
        yield
    finally:
        pool.heap_frozen, elastic.heap_frozen = keep


def run(side, ds, mode):
    count = 2 if mode == "collect" else 50_000
    cls = tud.DataLoader if side == "stock" else gpufeed.DataLoader
    kw = dict(batch_size=None, sampler=Order(len(ds), count), num_workers=2, worker_init_fn=init)
    with unfrozen() if side == "gpufeed, not frozen" else contextlib.nullcontext():
        rows = [b.tolist() for b in cls(ds, **kw) if b.numel() == 4]
    if mode == "collect":
        return [{"private_mib": r[1] / 1024, "collect_ms": r[2] / 1e3} for r in rows
                if r[3] == 0]
    return [{"full_collections": r[1], "private_mib": r[2] / 1024} for r in rows if r[3] == -1]


def main():
    rounds, out = int(sys.argv[1]), sys.argv[2]
    sides = ["stock", "gpufeed", "gpufeed, not frozen"]
    doc = {"environment": environment(), "python": sys.version.split()[0], "modes": {}}
    for mode in ("collect", "natural"):
        ds = Annotations(1_000_000, collect=mode == "collect")
        gc.collect()
        results = {s: [] for s in sides}
        doc["parent_" + mode] = {"private_mib": private_kib() / 1024,
                                 "tracked_objects": len(gc.get_objects())}
        for r in range(rounds if mode == "collect" else 1):
            for side in sides[r % 3:] + sides[: r % 3]:
                results[side].append(run(side, ds, mode))
                print(mode, r, side, results[side][-1], flush=True)
        doc["modes"][mode] = results
        del ds
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    with open(out.replace(".json", ".md"), "w") as f:
        f.write(render(doc))


def render(doc):
    e, parent = doc["environment"], doc["parent_collect"]
    commit = f"{e['git_commit'][:10]}{', dirty' if e['git_dirty'] else ''}"
    lines = [
        "# A worker's full collection against the objects it inherited (round 22)", "",
        f"{e['date']} on `{e['hostname']}` ({e['cpu_affinity']} usable cores); Python "
        f"{doc['python']}, torch {e['torch']}, gpufeed {e['gpufeed']} ({commit}). Main process: "
        f"a million annotation dicts, {parent['private_mib']:.0f} MiB private, "
        f"{parent['tracked_objects']:,} tracked objects; 2 process workers per loader; "
        "`frozen_heap.py` (its docstring says how).", "",
        "## `gc.collect()` once in each worker (sides alternating; per worker)", "",
        "| side | private memory the collection made (MiB), median | min-max | "
        "collection time (ms), median | min-max |", "| --- | ---: | ---: | ---: | ---: |"]
    for side, runs in doc["modes"]["collect"].items():
        w = [x for r in runs for x in r]
        p, t = [x["private_mib"] for x in w], [x["collect_ms"] for x in w]
        lines.append(f"| {side} | {statistics.median(p):.1f} | {min(p):.1f}-{max(p):.1f} | "
                     f"{statistics.median(t):.0f} | {min(t):.0f}-{max(t):.0f} |")
    lines += ["", "## 50,000 random reads, no explicit collection (one round; per worker)", "",
              "| side | full collections | private memory at the end (MiB) |",
              "| --- | ---: | ---: |"]
    for side, runs in doc["modes"]["natural"].items():
        w = [x for r in runs for x in r]
        full = ", ".join(str(x["full_collections"]) for x in w)
        private = ", ".join(f"{x['private_mib']:.0f}" for x in w)
        lines.append(f"| {side} | {full} | {private} |")
    natural = doc["modes"]["natural"]
    fulls = sum(x["full_collections"] for runs in natural.values() for r in runs for x in r)
    if fulls == 0:
        lines += ["", f"No worker ran a full collection by itself in these reads (Python "
                  f"{doc['python']}), so their private memory at the end (the reference counts "
                  "of the rows read) compares like with like. The freeze matters where a full "
                  "collection runs: code calling `gc.collect()`, or Python 3.14's incremental "
                  "collector (not measured: no 3.14 interpreter on this machine)."]
    else:
        lines += ["", f"Workers ran {fulls} full collections by themselves in these reads "
                  f"(Python {doc['python']}): the private memory at the end includes what they "
                  "copied."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
