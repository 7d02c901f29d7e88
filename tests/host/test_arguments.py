"""Bad arguments of ``gpufeed.DataLoader`` raise what the stock loader raises (torch 2.13): the
same exception class for every bad value, and stock's own words where torch wrote them (tools
match on those); where stock's error is an accident of Python (``range(2.0)``), gpufeed's names
the argument and the fix, and comes at construction rather than at ``iter()``."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch.utils.data import DataLoader as StockLoader
from torch.utils.data import TensorDataset

import gpufeed

DATA = TensorDataset(torch.arange(8.0))

# stock's iterator whose __init__ failed (prefetch_factor=0's assert, a bad context) raises in
# its __del__ (no _shutdown yet): torch's, collected in _error, not ours to fail on
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

#: (keyword arguments, whether stock's message is torch's own words that ours must contain)
CASES = [
    (dict(num_workers=2.0), True),  # "'float' object cannot be interpreted as an integer"
    (dict(num_workers=1.5), True),
    (dict(num_workers="2"), False),  # stock: "'<' not supported between 'str' and 'int'"
    (dict(num_workers=None), False),
    (dict(num_workers=-1), True),
    (dict(batch_size=2.0), False),
    (dict(batch_size="2"), False),
    (dict(batch_size=-1), True),
    (dict(batch_size=0), True),
    (dict(shuffle=True, sampler=[0, 1]), True),
    (dict(batch_sampler=[[0]], batch_size=2), True),
    (dict(batch_size=None, drop_last=True), True),
    (dict(sampler=5), False),
    (dict(batch_sampler=5), False),
    (dict(collate_fn=5), False),
    (dict(timeout=-1), True),
    (dict(timeout="1", num_workers=1), False),
    (dict(prefetch_factor=2, num_workers=0), True),
    (dict(prefetch_factor=2.0, num_workers=1), True),
    (dict(prefetch_factor="2", num_workers=1), False),
    (dict(prefetch_factor=-1, num_workers=1), True),
    (dict(persistent_workers=True, num_workers=0), True),
    (dict(multiprocessing_context=5, num_workers=1), True),
    (dict(multiprocessing_context="nope", num_workers=1), True),
    (dict(generator=5), False),
]


def _error(make, kwargs):
    """What building the loader and taking one batch raised, as (class, message), or None.
    The exception itself is not kept: its traceback's frames would keep a half-built stock
    iterator alive past the test, whose ``__del__`` then fails."""
    found = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loader = make(DATA, **kwargs)
            it = iter(loader)
            next(it)
            del it
        except Exception as exc:
            found = (type(exc), str(exc))
            del exc
        gc.collect(1)  # the young generations: a half-built iterator is new
    return found


@pytest.mark.parametrize(("kwargs", "words"), CASES,
                         ids=[repr(k).strip("{}").replace("'", "") for k, _ in CASES])
def test_bad_arguments_raise_what_stock_raises(kwargs, words):
    stock, ours = _error(StockLoader, kwargs), _error(gpufeed.DataLoader, kwargs)
    assert stock is not None, f"stock takes {kwargs}: not a bad value"
    assert ours is not None and ours[0] is stock[0], (kwargs, stock, ours)
    if words:
        assert stock[1].rstrip(".") in ours[1], (stock, ours)
    else:
        name = next(iter(kwargs))
        assert name in ours[1] or stock[1] == ours[1], (kwargs, ours)


def test_prefetch_factor_zero_is_a_value_error_not_stocks_assert():
    """The one class that differs: stock asserts at iter() (an AssertionError, which python -O
    strips, so the loader then hangs or loads nothing ahead); gpufeed raises a ValueError at
    construction, with stock's words."""
    stock = _error(StockLoader, dict(prefetch_factor=0, num_workers=1))
    ours = _error(gpufeed.DataLoader, dict(prefetch_factor=0, num_workers=1))
    assert stock is not None and ours is not None
    assert stock[0] is AssertionError and ours[0] is ValueError
    assert stock[1] in ours[1]


@pytest.mark.parametrize(("kwargs", "error"), [
    (dict(worker_type=5), TypeError), (dict(worker_type="fiber"), ValueError),
    (dict(device="cpu", device_depth=2.0), TypeError),
    (dict(device="cpu", device_depth=0), ValueError),
    (dict(seed=1.5), TypeError), (dict(seed=-1), ValueError),
    (dict(rank=0.0, world_size=2), TypeError), (dict(rank=-1, world_size=2), ValueError),
    (dict(rank=0, world_size=2.0), TypeError), (dict(rank=0, world_size=0), ValueError),
    (dict(num_workers="auto", max_workers=2.0), TypeError),
    (dict(num_workers="auto", max_workers=0), ValueError),
    (dict(ring_bytes=1.5), TypeError), (dict(ring_bytes=-1), ValueError),
    (dict(worker_nice=1.5), TypeError), (dict(worker_nice=99), ValueError),
    (dict(deterministic="yes"), TypeError),
])
def test_gpufeeds_own_arguments_follow_the_same_rule(kwargs, error):
    """A value of the wrong type is a TypeError, a value of the right type out of range a
    ValueError; both name the argument."""
    with pytest.raises(error) as caught:
        gpufeed.DataLoader(DATA, **kwargs)
    assert any(name in str(caught.value) for name in kwargs), str(caught.value)


def test_a_worker_count_set_later_is_checked_as_in_the_constructor():
    loader = gpufeed.DataLoader(DATA)
    with pytest.raises(TypeError, match="'float' object cannot be interpreted as an integer"):
        loader.num_workers = 2.0
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        loader.num_workers = -1
