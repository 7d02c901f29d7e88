"""gpufeed.DataLoader over Ray Data (NOTE [ Ray Data batches ] in _sources/ray.py).

One local Ray instance for the module (Ray takes ~10 s to start on a loaded machine); the
two-node cluster lives in ``test_ray_cluster.py``.
"""

from __future__ import annotations

import _thread
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gpufeed

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'gpufeed[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'gpufeed[ray]'")

pytestmark = pytest.mark.filterwarnings(
    # Ray's own deprecations and resource warnings while it starts and stops, not gpufeed's
    "ignore::DeprecationWarning", "ignore::ResourceWarning", "ignore::FutureWarning",
)


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.preserve_order = True  # compare batches with Ray's own, in order
    ray.data.range(4, override_num_blocks=2).materialize()  # Ray's workers started once
    yield
    ray.shutdown()


def table(n: int) -> Any:
    """``n`` rows: an id, a float vector and an image-like uint8 array per row."""
    def make(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["id"]
        return {"id": ids, "x": np.stack([ids, ids * 2], 1).astype(np.float32),
                "img": (ids[:, None, None] % 251 * np.ones((1, 4, 4))).astype(np.uint8)}
    return ray.data.range(n, override_num_blocks=4).map_batches(make)


def ray_idle(timeout_s: float = 10.0) -> bool:
    """Every CPU of the Ray instance is free again: no Ray task runs on for a loop that
    stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == 2:
            return True
        time.sleep(0.1)
    return False


def no_loader_thread(timeout_s: float = 10.0) -> bool:
    """The loader's thread ended (its iterator was dropped or closed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gc.collect()
        if not [t for t in threading.enumerate() if t.name.startswith("gpufeed-worker")]:
            return True
        time.sleep(0.1)
    return False


def test_import_gpufeed_does_not_import_ray() -> None:
    code = ("import sys, gpufeed, gpufeed.sources; "
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- batches ---------------------------------------------------------------------------------
def test_batches_are_ray_torch_batches_copied_once() -> None:
    ds = table(100).materialize()  # 4 blocks of 25 rows: batches of 16 span two blocks
    loader = gpufeed.DataLoader(ds, batch_size=16)
    ours = list(loader)
    theirs = list(ds.iter_torch_batches(batch_size=16))
    assert len(ours) == len(theirs) == 7
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    stats = loader.stats()
    assert stats.counters["batches"] == 7 and stats.counters["samples"] == 100
    assert loader.batch_size == 16 and loader.dataset.source is ds
    for batch in ours:  # the batches are the loop's to write into: copies, not Ray's memory
        for col in batch.values():
            col.fill_(7)
    again = torch.cat([b["id"] for b in ds.iter_torch_batches(batch_size=16)])
    assert again.tolist() == list(range(100))  # the object store's blocks are untouched


def test_no_loader_thread_runs_ray_iterates_in_the_loop() -> None:
    """Ray's iterator fetches ahead in its own threads; gpufeed adds none (rule (2))."""
    loader = gpufeed.DataLoader(table(40), batch_size=10)
    for _ in loader:
        assert not [t for t in threading.enumerate() if t.name.startswith("gpufeed-worker")]


def test_batches_cut_from_blocks_of_any_size() -> None:
    """Blocks of 1, 7, 0 and 30 rows, cut into batches of 4: Ray's rows, Ray's order."""
    from gpufeed._sources.ray import cut_batches

    sizes = [1, 7, 0, 30]
    ends = np.cumsum([0, *sizes])
    blocks = [{"i": np.arange(a, b), "v": np.arange(a, b, dtype=np.float32)[:, None] * [1, 2],
               "s": np.array([f"r{k}" for k in range(a, b)], dtype=object)}
              for a, b in itertools.pairwise(ends)]
    for drop_last, want in ((False, [4] * 9 + [2]), (True, [4] * 9)):
        got = list(cut_batches(iter(blocks), 4, drop_last, None))
        assert [len(b["i"]) for b in got] == want
        ids = torch.cat([b["i"] for b in got])
        assert ids.tolist() == list(range(sum(want)))
        assert torch.equal(torch.cat([b["v"] for b in got])[:, 1], ids.float() * 2)
        assert [s for b in got for s in b["s"]] == [f"r{k}" for k in range(sum(want))]
        assert all(isinstance(b["s"], np.ndarray) and b["i"].dtype == torch.int64 for b in got)


def test_a_column_whose_pieces_differ_in_shape_becomes_one_array_per_row() -> None:
    from gpufeed._sources.ray import cut_batches

    blocks = [{"r": np.zeros((3, 2), np.float32)}, {"r": np.ones((3, 5), np.float32)}]
    (first, second) = cut_batches(iter(blocks), 4, False, None)
    assert first["r"].dtype == object and [row.shape for row in first["r"]] == [(2,)] * 3 + [(5,)]
    assert isinstance(second["r"], torch.Tensor) and second["r"].shape == (2, 5)


def test_drop_last_collate_fn_and_a_second_epoch() -> None:
    ds = table(50)
    loader = gpufeed.DataLoader(ds, batch_size=16, drop_last=True)
    for _ in range(2):  # each iter() is a pass of Ray's executor
        sizes = [len(b["id"]) for b in loader]
        assert sizes == [16, 16, 16]
    seen: list[Any] = []

    def collate(batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, int]:
        seen.append(type(batch["x"]))  # Ray's numpy batch, as iter_torch_batches hands it
        return torch.from_numpy(batch["x"].copy()), len(batch["id"])

    out = list(gpufeed.DataLoader(ds, batch_size=16, collate_fn=collate))
    assert [n for _, n in out] == [16, 16, 16, 2] and set(seen) == {np.ndarray}
    assert torch.equal(torch.cat([x for x, _ in out])[:, 0], torch.arange(50.0))


def test_strings_stay_as_ray_gives_them() -> None:
    ds = ray.data.from_items([{"name": f"n{i}", "v": i} for i in range(5)])
    (batch,) = list(gpufeed.DataLoader(ds, batch_size=8))
    assert list(batch["name"]) == [f"n{i}" for i in range(5)]
    assert torch.equal(batch["v"], torch.arange(5))


def test_device_stage_and_trace(tmp_path: Path) -> None:
    ds = table(64)
    loader = gpufeed.DataLoader(ds, batch_size=16, device="cpu",
                                device_transform=lambda b: {**b, "x": b["x"] * 10})
    path = tmp_path / "trace.json"
    with gpufeed.trace(path):
        xs = [b["x"][:, 0] for b in loader]
    assert torch.equal(torch.cat(xs), torch.arange(64.0) * 10)
    events = json.loads(path.read_text())["traceEvents"]
    fetches = [e for e in events if e.get("name") == "fetch" and e.get("ph") == "X"]
    assert len(fetches) >= 4  # each Ray batch's fetch, on the loop thread's "fetching" track
    assert loader.stats().counters["samples"] == 64


def test_simulated_cuda_builds_pinned_batches_and_copies_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from support.sim_cuda import SimCuda

    sim = SimCuda(0, max_steps=1)
    sim.install(monkeypatch)
    loader = gpufeed.DataLoader(table(64), batch_size=8, device="cuda",
                                device_transform=lambda b: b)
    got = []
    for batch in loader:
        assert sim.on_device(batch["x"])
        sim.launch(sim.consumer, lambda x: got.append(x.clone()), batch["x"])
    sim.drain()
    assert torch.equal(torch.cat(got)[:, 0], torch.arange(64.0))
    assert sim.violations == []
    # each column of each batch copied once, into page-locked memory: never pinned a second time
    assert [c for c in sim.calls if c[0] == "pin_memory"] == [("pin_memory", 0)] * (8 * 3)


@pytest.mark.cuda
def test_cuda_device_stage_delivers_ray_batches_intact_under_a_busy_consumer() -> None:
    """On a real GPU: each column copied once into page-locked memory, copied ahead on the side
    stream, and every batch on the device equal to Ray's rows while the consumer's stream is
    kept busy (a copy racing the consumer would show as a wrong row)."""
    loader = gpufeed.DataLoader(table(512), batch_size=32, device="cuda", device_depth=3)
    seen = []
    for batch in loader:
        assert batch["x"].is_cuda and batch["img"].is_cuda
        torch.cuda._sleep(2_000_000)  # the step's kernels: the consumer stream stays busy
        seen.append(batch["x"][:, 0].cpu())
        assert torch.equal(batch["img"][:, 0, 0, 0].cpu(),
                           (batch["id"].cpu() % 251).to(torch.uint8))
    assert torch.equal(torch.cat(seen), torch.arange(512.0))


# -- refused, with the Ray way ------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"shuffle": True}, "random_shuffle"),
    ({"sampler": range(10)}, "local_shuffle_buffer_size"),
    ({"num_workers": 2}, "map_batches"),
    ({"num_workers": "auto"}, "map_batches"),
    ({"seed": 0}, "local_shuffle_seed"),
    ({"rank": 0, "world_size": 2}, "streaming_split"),
    ({"batch_size": None}, "batch_size=N"),
    ({"ray_options": {"batch_format": "pandas"}}, "local_shuffle_buffer_size"),
])
def test_arguments_that_cannot_apply_name_the_fix(kwargs: dict[str, Any], fix: str) -> None:
    args = {"batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=fix):
        gpufeed.DataLoader(ray.data.range(10), **args)
    with pytest.raises(ValueError, match="applies to a Ray Data dataset"):
        gpufeed.DataLoader(list(range(4)), ray_options={"prefetch_batches": 2})


def test_local_shuffle_buffer_through_ray_options() -> None:
    loader = gpufeed.DataLoader(
        table(200), batch_size=20,
        ray_options={"local_shuffle_buffer_size": 100, "local_shuffle_seed": 3})
    ids = torch.cat([b["id"] for b in loader]).tolist()
    assert sorted(ids) == list(range(200)) and ids != list(range(200))


# -- several trainers ----------------------------------------------------------------------------
@ray.remote(num_cpus=0)  # the consumer takes no CPU from the preprocessing pool
def train_on(shard: Any, epochs: int) -> list[list[int]]:
    """A trainer handed its shard (as Ray Train hands ``get_dataset_shard``'s)."""
    import gpufeed as gf

    loader = gf.DataLoader(shard, batch_size=10)
    return [torch.cat([b["id"] for b in loader]).tolist() for _ in range(epochs)]


def test_streaming_split_shards_to_trainers_disjoint_and_equal() -> None:
    """Two trainers, as two ranks: one a Ray task handed its shard, one this process; each
    epoch of the split is read by both at once."""
    ours, theirs = table(120).streaming_split(2, equal=True)
    remote = train_on.remote(theirs, 2)  # type: ignore[attr-defined]
    local = train_on._function(ours, 2)  # type: ignore[attr-defined]
    got = [local, ray.get(remote, timeout=120)]
    for epoch in range(2):
        a, b = got[0][epoch], got[1][epoch]
        assert len(a) == len(b) == 60 and not set(a) & set(b)
        assert sorted(a + b) == list(range(120))


# -- faults ----------------------------------------------------------------------------------
def test_a_failing_map_batches_surfaces_with_its_message_and_nothing_runs_on() -> None:
    def bad(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if 37 in batch["id"]:
            raise ValueError("cannot decode row 37")
        time.sleep(0.05)
        return batch

    loader = gpufeed.DataLoader(ray.data.range(400, override_num_blocks=8).map_batches(bad),
                                batch_size=10)
    started = time.monotonic()
    with pytest.raises(Exception, match="cannot decode row 37") as info:
        for _ in loader:
            pass
    assert time.monotonic() - started < 10
    assert "MapBatches(bad)" in str(info.value)  # the operator it ran in, as Ray names it
    shown = "".join(traceback.format_exception(info.value))  # what the loop's traceback says
    assert "cannot decode row 37" in shown and 'in bad\n    raise ValueError' in shown
    assert ray_idle()
    del info
    assert no_loader_thread()


def test_a_killed_ray_worker_is_retried_by_ray(tmp_path: Path) -> None:
    marker = tmp_path / "killed"

    def dies_once(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if 150 in batch["id"] and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process dies mid-epoch
        return batch

    ds = ray.data.range(300, override_num_blocks=6).map_batches(dies_once)
    ids = torch.cat([b["id"] for b in gpufeed.DataLoader(ds, batch_size=32)]).tolist()
    assert marker.exists()  # it did die, and Ray ran its task again
    assert ids == list(range(300))  # every row once, in order


def test_ctrl_c_stops_the_loop_and_ray_cleanly() -> None:
    def slow(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.2)
        return batch

    ds = ray.data.range(2000, override_num_blocks=40).map_batches(slow)
    loader = gpufeed.DataLoader(ds, batch_size=10)
    n = 0
    with pytest.raises(KeyboardInterrupt):
        for _ in loader:
            n += 1
            if n == 3:  # Ctrl-C while the loop waits on the next batch
                threading.Timer(0.05, _thread.interrupt_main).start()
    assert n < 200
    assert ray_idle() and no_loader_thread()


def test_state_dict_only_between_epochs() -> None:
    ds = table(40)
    loader = gpufeed.DataLoader(ds, batch_size=10)
    assert loader.state_dict()["batches_delivered"] == 0  # before the first epoch
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="between epochs"):
        loader.state_dict()
    for _ in it:
        pass
    state = loader.state_dict()  # the epoch ended: the next one starts afresh
    assert state["epoch"] == 1
    again = gpufeed.DataLoader(ds, batch_size=10)
    again.load_state_dict(state)
    assert torch.cat([b["id"] for b in again]).tolist() == list(range(40))
    assert again.state_dict()["epoch"] == 2
