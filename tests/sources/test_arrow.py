"""Hugging Face datasets and pyarrow Tables: one take per batch, the stock loader's batches."""

import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gpufeed
from gpufeed._host.fetch import MapFetcher
from gpufeed._sources.arrow import ArrowSource

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")


def assert_equal(want, got):
    assert type(want) is type(got)  # str and numpy.str_ too (numpy format gives numpy.str_)
    if isinstance(want, torch.Tensor):
        assert want.dtype == got.dtype and want.shape == got.shape and torch.equal(want, got)
    elif isinstance(want, dict):
        assert list(want) == list(got)
        for k in want:
            assert_equal(want[k], got[k])
    elif isinstance(want, (list, tuple)):
        assert len(want) == len(got)
        for a, b in zip(want, got, strict=True):
            assert_equal(a, b)
    elif isinstance(want, np.ndarray):
        assert want.dtype == got.dtype and np.array_equal(want, got, equal_nan=True)
    elif isinstance(want, (float, np.floating)) and want != want:
        assert got != got
    else:
        assert want == got


def make(n=60):
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({
        "x": list(rng.random((n, 5), dtype=np.float32)),
        "label": rng.integers(0, 10, n).tolist(),
        "text": [f"row {i}" for i in range(n)],
        "weight": rng.random(n).tolist(),
        "flag": [i % 3 == 0 for i in range(n)],
    })


ORDER = np.random.default_rng(1).permutation(60).tolist()


@pytest.mark.parametrize("fmt", [None, "numpy", "torch"])
def test_batches_equal_the_stock_loader(fmt):
    ds = make().with_format(fmt)
    want = list(DataLoader(ds, batch_size=8, sampler=ORDER))
    for nw, wt in ((0, "process"), (2, "process"), (2, "thread")):
        got = list(gpufeed.DataLoader(ds, batch_size=8, sampler=ORDER, num_workers=nw,
                                      worker_type=wt))
        assert_equal(want, got)
    fetcher = MapFetcher(ds, auto_collation=True, collate_fn=None)
    fetcher.fetch(ORDER[:8], None)
    assert isinstance(fetcher.source, ArrowSource) and not fetcher.source.stock_only
    assert fetcher.source.plan["x"][0] == ("columns" if fmt is None else "tensor")


def _stock_and_gpufeed(data, **options):
    """What the stock loader and gpufeed's (0, 2 process, 2 thread workers) give or raise."""
    def run(make, **extra):
        try:
            return list(make(data, **options, **extra))
        except Exception as exc:  # compared below: its type and last line
            return type(exc), str(exc).splitlines()[-1]
    return run(DataLoader), [run(gpufeed.DataLoader, num_workers=nw, worker_type=wt)
                             for nw, wt in ((0, "process"), (2, "process"), (2, "thread"))]


def test_a_format_dtype_numpy_lacks_keeps_the_fast_path():
    ds = make().with_format("torch", dtype=torch.bfloat16)  # numpy has no bfloat16
    want, gots = _stock_and_gpufeed(ds, batch_size=8, sampler=ORDER)
    assert want[0]["x"].dtype == torch.bfloat16
    for got in gots:
        assert_equal(want, got)
    source = ArrowSource(ds, hf=True)
    source.batch(np.arange(8), None)
    assert not source.stock_only and source.plan["x"] == ("tensor", torch.bfloat16)


def test_integers_the_batch_dtype_cannot_hold_are_never_wrapped():
    """uint64 above int64's range: the stock loader raises (torch.tensor of a Python int);
    so does gpufeed, where a cast would have wrapped the values to negative numbers."""
    big = datasets.Dataset(datasets.table.InMemoryTable(pa.table(
        {"u": pa.array([1, 2, 2**63 + 5, 2**64 - 1], pa.uint64())})))
    want, gots = _stock_and_gpufeed(big, batch_size=4)
    assert want[0] is ValueError
    for got in gots:
        assert got[0] is ValueError and got[1].endswith(want[1]), got
    small = big.select([0, 1])  # in range: the fast path, stock's values
    want, gots = _stock_and_gpufeed(small, batch_size=2)
    for got in gots:
        assert_equal(want, got)


def test_an_index_out_of_range_raises_the_datasets_own_error():
    ds = make(10)
    want, gots = _stock_and_gpufeed(ds, batch_size=3, sampler=[0, 1, 12])
    assert want[0] is IndexError and "12" in want[1]
    for got in gots:
        assert got[0] is IndexError and got[1].endswith(want[1]), got
    with pytest.raises(IndexError, match="index 12 is out of range for a table of 10 rows"):
        list(gpufeed.DataLoader(ds.data.table, batch_size=3, sampler=[0, 1, 12]))


def test_a_selected_and_shuffled_dataset_keeps_its_row_mapping():
    ds = make().shuffle(seed=3).select(range(10, 50)).with_format("torch", columns=["x", "text"])
    want = list(DataLoader(ds, batch_size=7))
    assert_equal(want, list(gpufeed.DataLoader(ds, batch_size=7, num_workers=2)))
    fetcher = MapFetcher(ds, auto_collation=True, collate_fn=None)
    assert_equal(want[1], fetcher.fetch(range(7, 14), None))
    assert fetcher.source.raw is not None and not fetcher.source.stock_only


def test_columns_without_a_fast_form_take_the_stock_path():
    ds = datasets.Dataset.from_dict({
        "tokens": [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]],  # lengths differ
        "maybe": [1.0, None, 2.0, 3.0],
    }).with_format("numpy")
    collate = lambda b: b
    want = list(DataLoader(ds, batch_size=2, collate_fn=collate))
    assert_equal(want, list(gpufeed.DataLoader(ds, batch_size=2, collate_fn=collate)))
    with pytest.raises(RuntimeError, match="equal size"):
        list(DataLoader(ds.select_columns(["tokens"]).with_format(None), batch_size=2))
    with pytest.raises(RuntimeError, match="equal size"):
        list(gpufeed.DataLoader(ds.select_columns(["tokens"]).with_format(None), batch_size=2))


def test_custom_collate_gets_the_stock_samples():
    ds = make().with_format("numpy")
    collate = lambda b: [s["label"] for s in b]
    want = list(DataLoader(ds, batch_size=8, collate_fn=collate))
    assert list(gpufeed.DataLoader(ds, batch_size=8, collate_fn=collate, num_workers=2)) == want


class Rows(Dataset):
    """What a pyarrow.Table's batch means: rows as numpy values."""

    def __init__(self, table):
        self.rows = table.to_pylist()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {"x": np.asarray(r["x"], dtype=np.float32), "y": np.int64(r["y"]),
                "name": r["name"]}


def test_pyarrow_table_batches():
    x = np.random.default_rng(2).random((30, 4), dtype=np.float32)
    table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 4),
                      "y": pa.array(np.arange(30), pa.int64()),
                      "name": [f"n{i}" for i in range(30)]})
    want = list(DataLoader(Rows(table), batch_size=8))
    for nw in (0, 2):
        got = list(gpufeed.DataLoader(table, batch_size=8, num_workers=nw))
        assert_equal(want, got)
    samples = next(iter(gpufeed.DataLoader(table, batch_size=3, collate_fn=lambda b: b)))
    assert samples[1]["name"] == "n1" and samples[1]["y"] == 1


def test_arrow_dataset_pads_lists_to_the_batch_maximum():
    tokens = [[1, 2, 3], [4, 5], [6], [], [7, 8, 9, 10], [11]]
    ds = datasets.Dataset.from_dict({"input_ids": tokens, "label": list(range(6))})
    for data in (ds.with_format("torch"), ds.data.table):
        padded = gpufeed.sources.ArrowDataset(data, pad={"input_ids": -1})
        for nw, wt in ((0, "process"), (2, "process"), (2, "thread")):
            got = list(gpufeed.DataLoader(padded, batch_size=4, num_workers=nw, worker_type=wt))
            assert [list(b) for b in got] == [["label", "input_ids", "input_ids_length"]] * 2
            ids = torch.tensor([t + [-1] * (3 - len(t)) for t in tokens[:4]])
            assert torch.equal(got[0]["input_ids"], ids)  # int64: the format's, and Arrow's
            assert got[1]["input_ids"].shape == (2, 4)  # this batch's own longest row
            assert got[0]["input_ids_length"].tolist() == [3, 2, 1, 0]
            assert torch.equal(got[1]["label"], torch.tensor([4, 5]))
        assert padded[1]["label"] == 1 and list(padded[1]["input_ids"]) == [4, 5]
    with pytest.raises(ValueError, match=r"lacks; it has \['input_ids', 'label'\]"):
        gpufeed.sources.ArrowDataset(ds, pad={"tokens": 0})
    with pytest.raises(TypeError, match="not a list of numbers"):
        gpufeed.sources.ArrowDataset(ds, pad={"label": 0})


def test_a_table_column_keeps_one_type_in_every_batch():
    """A table has no stock path to copy, so each column's form is decided on the whole
    table: a column with a null anywhere, or a list column whose rows differ in length
    anywhere, is Python values in every batch, never a tensor in some and a list in others."""
    table = pa.table({"f": [0.5, None, 1.5, 2.5, 3.5], "v": [[1], [2, 3], [], [4], [5]],
                      "u": [[1, 2]] * 5, "s": ["a", None, "c", "d", "e"]})
    for nw in (0, 2):
        got = list(gpufeed.DataLoader(table, batch_size=2, num_workers=nw))
        assert [type(b["f"]) for b in got] == [list] * 3
        assert [type(b["v"]) for b in got] == [list] * 3 and got[2]["v"] == [[5]]
        assert [type(b["u"]) for b in got] == [torch.Tensor] * 3 and got[2]["u"].shape == (1, 2)
        assert got[0]["f"] == [0.5, None] and got[0]["s"] == ["a", None]


def test_negative_indices_count_from_the_end():
    ds = datasets.Dataset.from_dict({"x": [10, 11, 12]})
    table = ds.data.table
    for data in (ds, ds.with_format("torch"), table):
        want = [{"x": 12}, {"x": 10}]
        got = next(iter(gpufeed.DataLoader(data, batch_sampler=[[-1, 0]])))
        assert torch.equal(torch.as_tensor(got["x"]), torch.tensor([12, 10]))
        padded = gpufeed.sources.ArrowDataset(data, pad={})
        assert [dict(r, x=int(r["x"])) for r in padded.__getitems__([-1, 0])] == want


def test_arrow_dataset_pads_a_fixed_length_list_column_too():
    features = datasets.Features({"p": datasets.Sequence(datasets.Value("int32"), length=2)})
    ds = datasets.Dataset.from_dict({"p": [[1, 2], [3, 4]]}, features=features)
    got = next(iter(gpufeed.DataLoader(gpufeed.sources.ArrowDataset(ds, pad={"p": 0}),
                                       batch_size=2)))
    assert torch.equal(got["p"], torch.tensor([[1, 2], [3, 4]]))
    assert got["p_length"].tolist() == [2, 2]


def test_arrow_dataset_refuses_holes_and_pad_values_that_do_not_fit():
    table = pa.table({"ids": pa.array([[1, None, 3], [4, 5]], pa.list_(pa.int64())),
                      "small": pa.array([[1], [2, 3]], pa.list_(pa.uint8()))})
    holes = gpufeed.sources.ArrowDataset(table, pad={"ids": 0})
    with pytest.raises(ValueError, match="row 0 of column 'ids' holds a null inside its list"):
        next(iter(gpufeed.DataLoader(holes, batch_size=2)))
    ok = next(iter(gpufeed.DataLoader(holes, batch_sampler=[[1]])))
    assert ok["ids"].dtype == torch.int64  # Arrow's own type, whatever the batch
    for pad in (-1, 0.5, "0"):
        bad = gpufeed.sources.ArrowDataset(table, pad={"small": pad})
        with pytest.raises(ValueError, match=f"pad value {pad!r} of column 'small' does not"):
            next(iter(gpufeed.DataLoader(bad, batch_size=2)))


ARROW_TYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "float32", "float64", "bool_"]


def _typed(n=5):
    """One scalar and one variable-length list column per Arrow number type."""
    cols = {}
    for t in ARROW_TYPES:
        typ = getattr(pa, t)()
        vals = [bool(i % 2) for i in range(n)] if t == "bool_" else list(range(n))
        cols[t] = pa.array(vals, typ)
        cols[f"l_{t}"] = pa.array([vals[:i % 3] for i in range(n)], pa.list_(typ))
    return datasets.Dataset(pa.table(cols))


@pytest.mark.parametrize("fmt", ["torch", "numpy", None])
def test_arrow_dataset_dtypes_are_the_formats(fmt):
    """Every column, padded or not, has the dtype the dataset's own format gives: with
    ``with_format("torch")`` int32 token ids arrive as int64 (issue 19: a language-model loss
    refused Arrow's int32), floats as float32."""
    ds = _typed()
    # numpy uint64 scalars: the stock default_collate raises ("an integer is required"), and so
    # does gpufeed; the list column stays
    scalars = [t for t in ARROW_TYPES if not (fmt == "numpy" and t == "uint64")]
    ds = ds.remove_columns([t for t in ARROW_TYPES if t not in scalars]).with_format(fmt)
    padded = gpufeed.sources.ArrowDataset(ds, pad={f"l_{t}": 0 for t in ARROW_TYPES})
    rows = ds.__getitems__(list(range(4)))  # what the stock loader collates
    stock = next(iter(DataLoader(ds.remove_columns([f"l_{t}" for t in ARROW_TYPES]),
                                 batch_size=4)))
    for nw in (0, 2):
        batch = next(iter(gpufeed.DataLoader(padded, batch_size=4, num_workers=nw)))
        for t in scalars:
            assert batch[t].dtype == stock[t].dtype, (t, batch[t].dtype, stock[t].dtype)
            assert torch.equal(batch[t], stock[t])
        for t in ARROW_TYPES:
            want = rows[1][f"l_{t}"]  # the format's own row: a tensor, an array or a list
            if not isinstance(want, torch.Tensor):  # a list: as torch.tensor makes it
                want = torch.tensor(want) if isinstance(want, list) else torch.tensor(
                    np.array(want))
            got = batch[f"l_{t}"]
            assert got.dtype == want.dtype, (t, got.dtype, want.dtype)
            assert torch.equal(got[1, :len(want)], want)
    if fmt == "torch":
        assert batch["l_int32"].dtype == torch.int64 and batch["l_float64"].dtype == torch.float32


def test_missing_extra_names_it(monkeypatch):
    ds = make()
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install 'gpufeed\[arrow\]'"):
        gpufeed.sources.ArrowDataset(ds, pad={"x": 0})


def test_arrow_dataset_repr_is_torchvisions_layout():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "label": [0, 1]})
    padded = gpufeed.sources.ArrowDataset(ds.with_format("torch"), pad={"input_ids": 0})
    assert repr(padded) == "\n".join(
        ["Dataset ArrowDataset", "    Number of datapoints: 2",
         "    Data: datasets.Dataset, format torch, columns ['input_ids', 'label']",
         "    Padded per batch: input_ids (pad 0)"])
    text = repr(gpufeed.sources.ArrowDataset(ds.data.table))
    assert "Data: pyarrow.Table, columns ['input_ids', 'label']" in text and "none" in text


def _to_arrays(samples):
    """A user's collate for PIL images: uint8 HWC arrays stacked, labels as a tensor."""
    return (torch.from_numpy(np.stack([np.asarray(s["image"]) for s in samples])),
            torch.tensor([s["label"] for s in samples]))


def test_image_features_give_the_stock_loaders_batches(tmp_path):
    """An ``Image`` feature (PNG files): the torch format's tensors through the default
    collate, and PIL images through a user's collate, as the stock loader gives them."""
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(2)
    paths = []
    for i in range(10):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).save(paths[-1])
    ds = datasets.Dataset.from_dict({"image": paths, "label": list(range(10))}).cast_column(
        "image", datasets.Image())
    for data, collate in ((ds.with_format("torch"), None), (ds, _to_arrays)):
        want, gots = _stock_and_gpufeed(data, batch_size=4, sampler=[3, 1, 4, 0, 5, 9, 2, 6, 8, 7],
                                        collate_fn=collate)
        assert isinstance(want, list) and len(want) == 3
        for got in gots:
            assert_equal(want, got)
