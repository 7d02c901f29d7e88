"""Walking nested batches: containers keep their type, leaves are visited in order."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

from gpufeed._base.tree import tree_leaves, tree_map
from support.fakes import Point


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int
    extra: dict


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: tuple


def _tag(x):
    return ("leaf", x) if not isinstance(x, torch.Tensor) else x + 1


def test_builtin_containers_keep_type_and_order():
    batch = {"b": [1, (2, 3)], "a": (torch.zeros(2), {"z": 4})}
    out = tree_map(_tag, batch)
    assert type(out) is dict and list(out) == ["b", "a"]
    assert type(out["b"]) is list and type(out["b"][1]) is tuple
    assert out["b"] == [("leaf", 1), (("leaf", 2), ("leaf", 3))]
    assert torch.equal(out["a"][0], torch.ones(2))
    assert out["a"][1] == {"z": ("leaf", 4)}


def test_namedtuple_ordereddict_defaultdict_keep_type():
    od = collections.OrderedDict([("y", 1), ("x", 2)])
    dd = collections.defaultdict(list, {"k": 5})
    out = tree_map(_tag, [Point(1, 2), od, dd])
    assert type(out[0]) is Point and out[0] == Point(("leaf", 1), ("leaf", 2))
    assert type(out[1]) is collections.OrderedDict and list(out[1]) == ["y", "x"]
    assert type(out[2]) is collections.defaultdict and out[2].default_factory is list
    assert out[2]["k"] == ("leaf", 5)


def test_dataclasses_rebuilt_with_mapped_fields():
    s = Sample(torch.zeros(2), 3, {"m": "x"})
    out = tree_map(_tag, s)
    assert type(out) is Sample
    assert torch.equal(out.image, torch.ones(2))
    assert out.label == ("leaf", 3) and out.extra == {"m": ("leaf", "x")}
    f = tree_map(_tag, Frozen(torch.zeros(1), (1,)))
    assert type(f) is Frozen and f.b == (("leaf", 1),)


def test_strings_bytes_arrays_and_tensors_are_leaves():
    leaves = tree_leaves(["abc", b"xy", np.arange(3), torch.arange(2), 7, None, 1.5])
    assert [type(x) for x in leaves] == [str, bytes, np.ndarray, torch.Tensor, int,
                                         type(None), float]


def test_tree_leaves_order_matches_tree_map():
    batch = {"a": [1, 2], "b": Point(3, {"c": 4}), "d": (5,)}
    assert tree_leaves(batch) == [1, 2, 3, 4, 5]
    seen = []
    tree_map(lambda x: seen.append(x) or x, batch)
    assert seen == [1, 2, 3, 4, 5]


def test_input_is_not_mutated():
    inner = [1, 2]
    batch = {"a": inner, "od": collections.OrderedDict(k=[3])}
    out = tree_map(lambda x: x * 10, batch)
    assert batch == {"a": [1, 2], "od": collections.OrderedDict(k=[3])}
    assert out["a"] == [10, 20] and out["a"] is not inner
    assert out["od"]["k"] == [30]


def test_torch_size_and_empty_containers():
    out = tree_map(lambda x: x, {"shape": torch.Size([2, 3]), "e": [], "t": (), "d": {}})
    assert type(out["shape"]) is torch.Size and out["shape"] == (2, 3)
    assert out["e"] == [] and out["t"] == () and out["d"] == {}
    assert type(out["e"]) is list and type(out["t"]) is tuple


def test_identity_map_returns_equal_structure():
    batch = {"x": [Point(torch.arange(3), "s")], "y": (1.5, {"z": np.ones(2)})}
    out = tree_map(lambda x: x, batch)
    assert out["x"][0].x is batch["x"][0].x
    assert out["y"][1]["z"] is batch["y"][1]["z"]
    assert type(out["x"][0]) is Point


@dataclasses.dataclass
class _Later:
    x: torch.Tensor
    later: torch.Tensor = dataclasses.field(init=False)
    inits: int = 0

    def __post_init__(self):
        self.inits += 1


@dataclasses.dataclass(frozen=True, slots=True)
class _FrozenSlots:
    x: torch.Tensor


def test_dataclasses_are_rebuilt_as_unpickling_rebuilds_them():
    """No __post_init__ again; an init=False field kept when set, left unset when not;
    frozen and slotted classes too."""
    def double(t):
        return t * 2 if isinstance(t, torch.Tensor) else t

    unset = tree_map(double, _Later(torch.ones(2)))
    assert torch.equal(unset.x, torch.full((2,), 2.0)) and not hasattr(unset, "later")
    assert unset.inits == 1
    done = _Later(torch.ones(1))
    done.later = torch.zeros(1)
    mapped = tree_map(lambda t: t + 1 if isinstance(t, torch.Tensor) else t, done)
    assert torch.equal(mapped.later, torch.ones(1)) and mapped.inits == 1
    assert torch.equal(tree_map(lambda t: t + 1, _FrozenSlots(torch.zeros(1))).x, torch.ones(1))
