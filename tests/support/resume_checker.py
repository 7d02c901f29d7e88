"""The one shared resume checker: stop, save, restart in a fresh process, compare every batch.

For each :class:`Case`:

1. *reference*: an uninterrupted run of ``epochs`` epochs, every batch kept as bytes; after
   ``stop`` delivered batches (counted across epochs, so a stop can fall in any epoch or on an
   epoch boundary) ``loader.state_dict()`` goes to a file with ``torch.save`` and the run goes
   on, as a training loop's checkpoint does;
2. *resumed*: a fresh Python process (one subprocess for a whole grid, to pay torch's import
   once) builds the loader again, possibly with another ``num_workers``/``worker_type``, loads
   the state with ``torch.load(weights_only=True)`` and runs to the end;
3. *compare*: with ``in_order=True``, the resumed batches must equal the reference's after the
   stop batch for batch, bytes-exact (dtype, shape and bytes of every leaf); with
   ``in_order=False`` the order inside an epoch is free, so the multisets must be equal.

Samples carry draws from gpufeed's per-sample generators (torch, numpy and ``random``) made in
``__getitem__``, and, in cases without thread workers (which do not seed the global generators),
from the global generators too, so the comparison also checks per-sample seeding across worker
counts and kinds. ``iterable=True`` cases read a
:class:`ShardedStream` instead, whose workers' shards differ in length, so that workers run dry
at different points and the round robin must resume mid-turn. ``warm=True`` cases resume onto
persistent workers already running (and interrupted mid-epoch) with another seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import gpufeed

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
Leaf = tuple[str, tuple[int, ...], bytes]


class RandomTransformDataset(Dataset[tuple[torch.Tensor, ...]]):
    """Sample ``i``: its index and "random transform" draws from gpufeed's per-sample
    generators (torch, numpy, ``random``); with ``global_draws``, one draw from each global
    generator too (seeded per sample by process workers and ``num_workers=0``, not by thread
    workers, which share them: NOTE [ Seeding and threads ])."""

    def __init__(self, n: int, *, global_draws: bool = False) -> None:
        self.n = n
        self.global_draws = global_draws

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        sample = (
            torch.tensor([index]),
            torch.rand(2, generator=gpufeed.random.sample_generator()),
            torch.from_numpy(gpufeed.random.sample_rng().random(2)),
            torch.tensor([gpufeed.random.sample_random().random()], dtype=torch.float64),
        )
        if not self.global_draws:
            return sample
        return (
            *sample,
            torch.rand(2),
            torch.from_numpy(np.random.rand(2)),
            torch.tensor([random.random()], dtype=torch.float64),
        )


class ShardedStream(IterableDataset[torch.Tensor]):
    """Samples ``0..n-1`` split into contiguous shards, worker ``w`` of ``W`` getting a share
    proportional to ``w + 1`` (so workers run dry at different times), resumable per worker.

    The position is kept per worker id, so one object shared by thread workers works too.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.done: dict[int, int] = {}
        self.loaded: dict[int, int] = {}

    @staticmethod
    def _worker() -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def __iter__(self) -> Any:
        w, nw = self._worker()
        total = nw * (nw + 1) // 2
        lo, hi = self.n * (w * (w + 1) // 2) // total, self.n * ((w + 1) * (w + 2) // 2) // total
        start = self.loaded.pop(w, 0)
        self.done[w] = start
        for i in range(lo + start, hi):
            self.done[w] += 1
            yield torch.tensor([i])

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done.get(self._worker()[0], 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded[self._worker()[0]] = state["done"]


@dataclass(frozen=True)
class Case:
    """One resume scenario; ``resume_*`` fields change the loader after the restart."""

    num_workers: int = 0
    worker_type: str = "process"
    shuffle: bool = True
    drop_last: bool = False
    in_order: bool = True
    epochs: int = 2
    stop: int = 3
    resume_workers: int | None = None
    resume_worker_type: str | None = None
    persistent: bool = False
    device: str | None = None
    n: int = 22
    batch_size: int | None = 4
    seed: int = 1234
    iterable: bool = False
    warm: bool = False

    def loader(self, *, resumed: bool = False, seed: int | None = None) -> gpufeed.DataLoader:
        workers = self.num_workers
        kind = self.worker_type
        if resumed:
            workers = self.resume_workers if self.resume_workers is not None else workers
            kind = self.resume_worker_type or kind
        dataset: Any = ShardedStream(self.n) if self.iterable else RandomTransformDataset(
            self.n, global_draws=self.without_threads)
        return gpufeed.DataLoader(
            dataset, batch_size=self.batch_size, shuffle=self.shuffle and not self.iterable,
            drop_last=self.drop_last, num_workers=workers, in_order=self.in_order,
            worker_type=kind, seed=self.seed if seed is None else seed, device=self.device,
            persistent_workers=self.persistent and workers > 0,
        )

    @property
    def without_threads(self) -> bool:
        """No thread workers before or after the restart: global draws are seeded too."""
        kinds = {self.worker_type, self.resume_worker_type or self.worker_type}
        workers = {self.num_workers, self.num_workers if self.resume_workers is None
                   else self.resume_workers}
        return "thread" not in kinds or workers == {0}

    @property
    def label(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default]
        return ",".join(fields) or "default"


def leaves(batch: Any) -> list[Leaf]:
    """Every tensor of a (nested) batch as ``(dtype, shape, bytes)``."""
    if isinstance(batch, torch.Tensor):
        t = batch.detach().cpu().contiguous()
        return [(str(t.dtype), tuple(t.shape), t.view(torch.uint8).numpy().tobytes())]
    if isinstance(batch, dict):
        return [leaf for key in sorted(batch) for leaf in leaves(batch[key])]
    if isinstance(batch, (list, tuple)):
        return [leaf for item in batch for leaf in leaves(item)]
    raise TypeError(f"unexpected leaf {type(batch)!r}")


def run(case: Case, *, state_path: Path | None = None) -> list[Any]:
    """Run ``case`` for its epochs; with ``state_path``, save ``state_dict()`` there after
    ``case.stop`` batches (before the first with ``stop=0``) and go on."""
    loader = case.loader()
    out: list[Any] = []
    if case.stop == 0 and state_path is not None:
        torch.save(loader.state_dict(), state_path)
    for _ in range(case.epochs):
        for batch in loader:
            out.append(leaves(batch))
            if state_path is not None and len(out) == case.stop:
                torch.save(loader.state_dict(), state_path)
    return out


def resume(case: Case, state_path: Path, needed: int) -> list[Any]:
    """Fresh loader, state loaded, run until ``needed`` batches (at most epochs + 1 passes).

    ``case.warm``: the loader is built with another seed and broken out of mid-epoch first, so
    the state lands on persistent workers that are running with the wrong seed.
    """
    loader = case.loader(resumed=True, seed=case.seed + 1 if case.warm else None)
    if case.warm:
        it = iter(loader)
        next(it)
        next(it)
        del it
    loader.load_state_dict(torch.load(state_path, weights_only=True))
    out: list[Any] = []
    for _ in range(case.epochs + 1):
        if len(out) >= needed:
            break
        for batch in loader:
            out.append(leaves(batch))
    return out


def compare(case: Case, reference: list[Any], tail: list[Any]) -> str | None:
    """``None`` when the resumed run delivers the reference's batches after the stop, else what
    differs (the batches before it are the reference's own: its state was saved there)."""
    want = reference[case.stop:]
    if len(tail) != len(want):
        return (f"{case.label}: {case.stop} batches before the stop + {len(tail)} after it, "
                f"but the uninterrupted run delivered {len(reference)}")
    if not case.in_order:
        return None if sorted(tail) == sorted(want) else f"{case.label}: batches differ"
    for number, (have, expected) in enumerate(zip(tail, want, strict=True), case.stop):
        if have != expected:
            return f"{case.label}: batch {number} (after the stop) differs from the reference"
    return None


def check_many(cases: list[Case], workdir: Path) -> dict[Case, str | None]:
    """Check every case; all resumes run in ONE fresh subprocess, started first so that its
    imports overlap the reference runs (it waits for the jobs file's name on its stdin).
    Returns case -> error|None."""
    results: dict[Case, str | None] = {}
    jobs, references = [], {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(SRC)]))
    with subprocess.Popen(
        [sys.executable, "-c", "from support import resume_checker; resume_checker.main()"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            for k, case in enumerate(cases):
                state_path = workdir / f"state{k}.pt"
                try:
                    with warnings.catch_warnings():  # 3 workers on a 2-core machine are fine
                        warnings.filterwarnings("ignore", "This DataLoader will create",
                                                UserWarning)
                        references[case] = run(case, state_path=state_path)
                except Exception:
                    results[case] = f"{case.label}: {traceback.format_exc()}"
                    continue
                jobs.append({"case": dataclasses.asdict(case), "state": str(state_path),
                             "out": str(workdir / f"out{k}.pt"),
                             "needed": max(0, len(references[case]) - case.stop)})
            (workdir / "jobs.json").write_text(json.dumps(jobs))
            _, stderr = proc.communicate(str(workdir / "jobs.json") + "\n", timeout=300)
        finally:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"resume subprocess failed ({proc.returncode}):\n{stderr}")
    for job in jobs:
        case = Case(**job["case"])
        answer = torch.load(job["out"], weights_only=True)
        if isinstance(answer, str):
            results[case] = f"{case.label}: after the restart: {answer}"
        else:
            results[case] = compare(case, references[case], answer)
    return results


def main() -> None:
    """Subprocess entry: resume each job of the JSON file named on the first line of stdin."""
    warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
    for job in json.loads(Path(sys.stdin.readline().strip()).read_text()):
        try:
            answer: Any = resume(Case(**job["case"]), Path(job["state"]), job["needed"])
        except Exception:
            answer = traceback.format_exc()
        torch.save(answer, job["out"])
