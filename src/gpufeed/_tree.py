"""Walking nested batches: tuples, lists, dicts, namedtuples and dataclasses.

A batch is a tree whose containers are rebuilt with their own type and whose leaves
(tensors, arrays, numbers, strings, anything else) are handed to a function.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

_ATOMS = (str, bytes, bytearray, memoryview)


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Return ``obj`` with every leaf replaced by ``fn(leaf)``; containers keep their type."""
    t = type(obj)
    if t is list:
        return [tree_map(fn, x) for x in obj]
    if t is tuple:
        return tuple(tree_map(fn, x) for x in obj)
    if t is dict:
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, _ATOMS):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return t(*(tree_map(fn, x) for x in obj))
    if isinstance(obj, Mapping):
        if isinstance(obj, MutableMapping):
            clone = copy.copy(obj)
            for k, v in obj.items():
                clone[k] = tree_map(fn, v)
            return clone
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, Sequence) and not _is_tensor_like(obj):
        if isinstance(obj, MutableSequence):
            seq = copy.copy(obj)
            for i, v in enumerate(obj):
                seq[i] = tree_map(fn, v)
            return seq
        try:
            return t(tree_map(fn, x) for x in obj)
        except TypeError:
            return [tree_map(fn, x) for x in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: tree_map(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init
        }
        return dataclasses.replace(obj, **changes)
    return fn(obj)


def tree_leaves(obj: Any) -> list[Any]:
    """The leaves of ``obj`` in the order :func:`tree_map` visits them."""
    out: list[Any] = []

    def visit(x: Any) -> Any:
        out.append(x)
        return x

    tree_map(visit, obj)
    return out


def _is_tensor_like(obj: Any) -> bool:
    # torch.Tensor and numpy arrays are leaves even though they are iterable.
    return hasattr(obj, "__array_interface__") or hasattr(obj, "data_ptr")
