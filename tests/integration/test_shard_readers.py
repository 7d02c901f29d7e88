"""webdataset, litdata and Hugging Face streaming datasets under gpufeed's workers: each sample
once per epoch, any split."""

import collections
import io

import numpy as np
import pytest
import torch

import gpufeed

# webdataset leaves a shard's file to the garbage collector when a stream stops early, under
# the stock loader too: not ours to judge here
pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
WORKERS = [(0, "process"), (2, "process"), (2, "thread")]


def _keys(loader, field):
    out = []
    for batch in loader:
        v = batch[field]
        out += v.tolist() if isinstance(v, torch.Tensor) else list(v)
    return out


def _check_once_per_epoch(make, field, n, ranks=(1, 2), monkeypatch=None, set_rank=None):
    """For each world size: every rank's samples under gpufeed equal the stock loader's (as a
    multiset), and together the ranks see each of the ``n`` samples exactly once."""
    for world in ranks:
        for nw, wt in WORKERS:
            seen: collections.Counter = collections.Counter()
            for rank in range(world):
                set_rank(rank, world)
                ds = make()
                got = _keys(gpufeed.DataLoader(ds, batch_size=3, num_workers=nw,
                                               worker_type=wt), field)
                want = _keys(torch.utils.data.DataLoader(make(), batch_size=3, num_workers=nw),
                             field)
                assert sorted(got) == sorted(want), (world, rank, nw, wt)
                seen.update(got)
            assert seen == collections.Counter(range(n)), (world, nw, wt, seen)


# -- webdataset ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    wds = pytest.importorskip("webdataset")
    root = tmp_path_factory.mktemp("wds")
    paths = []
    for s in range(4):
        path = root / f"shard-{s:02d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for j in range(6):
                i = s * 6 + j
                buf = io.BytesIO()
                np.save(buf, np.full(3, i, dtype=np.float32))
                sink.write({"__key__": f"s{i:03d}", "idx.txt": str(i), "x.npy": buf.getvalue()})
        paths.append(str(path))
    return paths


def test_webdataset_each_sample_once(shards, monkeypatch):
    wds = pytest.importorskip("webdataset")

    def make():
        return (wds.WebDataset(shards, shardshuffle=False, nodesplitter=wds.split_by_node,
                               workersplitter=wds.split_by_worker, empty_check=False)
                .decode().map(lambda s: {"idx": int(s["idx.txt"]), "x": s["x.npy"]}))

    def set_rank(rank, world):  # webdataset reads RANK / WORLD_SIZE (or torch.distributed)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))

    _check_once_per_epoch(make, "idx", 24, set_rank=set_rank)
    set_rank(0, 1)
    batch = next(iter(gpufeed.DataLoader(make(), batch_size=4, num_workers=2)))
    assert torch.equal(batch["x"][:, 0], batch["idx"].float())


# -- litdata ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    pytest.importorskip("litdata")
    from litdata.streaming.writer import BinaryWriter

    root = tmp_path_factory.mktemp("litdata")
    writer = BinaryWriter(str(root), chunk_size=4)
    for i in range(24):
        writer.add_item(i, {"idx": i, "x": np.full(3, i, dtype=np.float32)})
    writer.done()
    writer.merge()
    return str(root)


def test_litdata_each_sample_once(chunks):
    litdata = pytest.importorskip("litdata")
    from litdata.utilities.env import _DistributedEnv

    world_rank = [1, 0]

    def make():
        ds = litdata.StreamingDataset(chunks)
        # what torch.distributed would tell it in a real run of ``world`` ranks
        ds.distributed_env = _DistributedEnv(world_rank[0], world_rank[1], 1)
        return ds

    def set_rank(rank, world):
        world_rank[:] = [world, rank]

    _check_once_per_epoch(make, "idx", 24, set_rank=set_rank)


# -- Hugging Face datasets, streaming (datasets.IterableDataset) -----------------------------


@pytest.mark.parametrize("nw, wt", WORKERS)
def test_hf_iterable_dataset_gives_stocks_batches(nw, wt):
    """Shards split among the workers by torch's worker info, as under the stock loader: the
    same batches in the same order, each epoch of a shuffled stream as well (set_epoch)."""
    datasets = pytest.importorskip("datasets")
    rows = {"x": list(range(40)), "y": [2 * i for i in range(40)]}
    stream = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=4)

    def batches(loader):
        return [(b["x"].tolist(), b["y"].tolist()) for b in loader]

    want = batches(torch.utils.data.DataLoader(stream, batch_size=4, num_workers=nw))
    assert sorted(x for xs, _ in want for x in xs) == list(range(40))
    assert batches(gpufeed.DataLoader(stream, batch_size=4, num_workers=nw,
                                      worker_type=wt)) == want
    shuffled = stream.shuffle(seed=1, buffer_size=8)
    for epoch in range(2):
        shuffled.set_epoch(epoch)
        want = batches(torch.utils.data.DataLoader(shuffled, batch_size=4, num_workers=nw))
        assert batches(gpufeed.DataLoader(shuffled, batch_size=4, num_workers=nw,
                                          worker_type=wt)) == want
