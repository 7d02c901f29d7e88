"""Index plans of stock samplers (gpufeed._order.plan)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpufeed._order import plan
from gpufeed._order.plan import IndexPlan


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000, (1 << 20) + 3])
def test_closing_draw_leaves_the_generator_as_randperm(n: int) -> None:
    """The sampler's closing draw only moves the generator: the same state as a permutation,
    also past one buffer of draws."""
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    torch.randperm(n, generator=a)
    plan.advance_as_randperm(b, n)
    assert torch.equal(a.get_state(), b.get_state())
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


def test_closing_draw_falls_back_to_randperm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the draws would not match (another torch), or past randperm's 32-bit range, the
    permutation itself is drawn."""
    calls: list[int] = []
    real = torch.randperm

    def counting(n: int, **kw: object) -> torch.Tensor:
        calls.append(n)
        return real(n, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "randperm", counting)
    monkeypatch.setattr(plan, "_same_draws", None)
    plan.advance_as_randperm(torch.Generator(), 10)
    plan.advance_as_randperm(torch.Generator(), 10)
    assert calls == [1000]  # the check, once; the draws matched
    calls.clear()
    monkeypatch.setattr(plan, "_same_draws", False)
    plan.advance_as_randperm(torch.Generator(), 10)
    assert calls == [10]
    monkeypatch.setattr(plan, "_same_draws", True)
    monkeypatch.setattr(plan, "_RANDPERM_32BIT_BELOW", 10)
    plan.advance_as_randperm(torch.Generator(), 10)
    assert calls == [10, 10]


_PERMS = [None, torch.randperm(23, generator=torch.Generator().manual_seed(0)),
          torch.arange(23, dtype=torch.int32).flip(0)]


@pytest.mark.parametrize("perm", _PERMS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_array_holds_the_indices_of_batch(perm: torch.Tensor | None, drop_last: bool) -> None:
    """The gather's numpy view of a batch is the same indices as the tensor every other path
    slices (and turns into the list of ints datasets get)."""
    plan = IndexPlan(perm, 23, batch_size=5, drop_last=drop_last)
    for k in range(plan.n_batches):
        got = plan.batch_array(k)
        assert isinstance(got, np.ndarray) and got.ndim == 1
        assert got.tolist() == plan.batch(k).tolist()
        assert got.dtype == (np.int64 if perm is None else perm.numpy().dtype)
