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
        assert got.dtype == np.int64 and plan.batch(k).dtype == torch.int64  # int32 plans too


@pytest.mark.parametrize("n", [plan.COMPACT_FROM - 1, plan.COMPACT_FROM, plan.COMPACT_FROM + 7])
def test_an_int32_permutation_draws_what_torch_draws(n: int) -> None:
    """The compact permutation is torch's own, value for value, and leaves the generator
    where torch's int64 draw leaves it."""
    ours, torchs = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
    compact = torch.empty(n, dtype=torch.int32)
    torch.randperm(n, generator=ours, out=compact)
    assert torch.equal(compact.long(), torch.randperm(n, generator=torchs))
    assert torch.equal(ours.get_state(), torchs.get_state())


class _Ids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return plan.COMPACT_FROM + 5

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: list[int]) -> list[int]:
        return indices


def test_a_shuffle_of_a_million_samples_shared_as_int32_gives_stocks_batches() -> None:
    import torch.utils.data as tud

    import gpufeed

    def batches(loader_cls, **kw):
        torch.manual_seed(11)
        loader = loader_cls(_Ids(), batch_size=1 << 16, shuffle=True, collate_fn=torch.tensor,
                            **kw)
        return [b for b in loader], torch.randint(0, 2**30, (1,))  # and the generator after

    (expected, after), (got, got_after) = batches(tud.DataLoader), batches(
        gpufeed.DataLoader, num_workers=2)
    assert len(got) == len(expected) and got_after == after
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == torch.int64 and torch.equal(e, g)
