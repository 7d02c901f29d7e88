"""Fetchers: ``make_fetcher`` picks one per dataset kind, ``batch_source`` the batch reader."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from gpufeed._host.fetch import IterFetcher, MapFetcher, batch_source, make_fetcher


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i * i])


class Count(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return (torch.tensor([i]) for i in range(3))


class Reader(Dataset[torch.Tensor]):
    """Reads a batch per call (NOTE [ Batch sources ] in ``_sources/protocol.py``)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])

    def gpufeed_batch(self, indices: Any, *, seed: Any, epoch: int, alloc: Any) -> Any:
        out = alloc((len(indices), 1), torch.int64)
        out[:, 0] = torch.as_tensor(list(indices)) + 100 * epoch
        return out

    def gpufeed_samples(self, indices: Any, *, seed: Any, epoch: int) -> list[Any]:
        return [torch.tensor([i + 100 * epoch]) for i in indices]


def _make(dataset: Any, **kw: Any) -> MapFetcher | IterFetcher:
    args: dict[str, Any] = dict(
        is_iterable=isinstance(dataset, IterableDataset), auto_collation=True, collate_fn=None,
        drop_last=False, sample_seed=None, base_seed=0,
    )
    args.update(kw)
    return make_fetcher(dataset, **args)


def test_map_style_datasets_get_a_map_fetcher():
    fetcher = _make(Squares(), sample_seed=3)
    assert isinstance(fetcher, MapFetcher)
    assert (fetcher.seed, fetcher.auto_collation, fetcher.source) == (3, True, None)
    assert torch.equal(fetcher.fetch([1, 2], None), torch.tensor([[1], [4]]))
    single = _make(Squares(), auto_collation=False)
    assert isinstance(single, MapFetcher) and torch.equal(single.fetch(3, None), torch.tensor([9]))


def test_iterable_datasets_get_an_iter_fetcher():
    fetcher = _make(Count(), drop_last=True, sample_seed=3)
    assert isinstance(fetcher, IterFetcher) and fetcher.drop_last
    assert not hasattr(fetcher, "epoch")  # iterable datasets get no per-sample seeding
    assert torch.equal(fetcher.fetch(2, None, epoch=4), torch.tensor([[0], [1]]))
    with pytest.raises(StopIteration):  # one left: short, dropped
        fetcher.fetch(2, None)


def test_the_default_collate_function_is_gpufeeds_own():
    assert _make(Squares(), collate_fn=default_collate).collate_fn is None
    assert _make(Count(), collate_fn=default_collate).collate_fn is None
    mine = lambda batch: batch
    assert _make(Squares(), collate_fn=mine).collate_fn is mine


def test_batch_sources_read_whole_batches_with_the_epoch():
    reader = Reader()
    assert batch_source(reader) is reader and batch_source(Squares()) is None
    fetcher = _make(reader)
    assert isinstance(fetcher, MapFetcher) and fetcher.source is reader
    assert torch.equal(fetcher.fetch([1, 2], None, epoch=2), torch.tensor([[201], [202]]))
    assert torch.equal(fetcher.fetch([1, 2], None), torch.tensor([[1], [2]]))
    stacked = _make(reader, collate_fn=torch.stack)
    assert torch.equal(stacked.fetch([3], None, epoch=1), torch.tensor([[103]]))
    assert _make(reader, auto_collation=False).source is None  # one sample per "batch"


def test_arrow_tables_get_the_arrow_reader():
    pa = pytest.importorskip("pyarrow")
    from gpufeed._sources.arrow import ArrowSource

    table = pa.table({"x": list(range(8))})
    assert isinstance(batch_source(table), ArrowSource)


def test_arrow_is_never_imported_for_a_plain_dataset(monkeypatch):
    for name in ("pyarrow", "datasets"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert batch_source(Squares()) is None
    assert "pyarrow" not in sys.modules and "datasets" not in sys.modules


def test_the_epoch_seeds_per_sample_random_state():
    class Noisy(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.rand(1)

    fetcher = _make(Noisy(), sample_seed=5)
    a, b, again = (fetcher.fetch([0, 1], None, epoch=e) for e in (0, 1, 0))
    assert torch.equal(a, again) and not torch.equal(a, b)
