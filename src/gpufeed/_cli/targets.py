"""Loading what the user names on the command line: ``MODULE:NAME`` (or
``path/to/file.py:NAME``) targets, a dataset factory, and the errors they raise (exit code 2)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class UsageError(ValueError):
    """A command-line value gpufeed cannot use (exit code 2)."""


class TargetError(UsageError):
    """A ``MODULE:NAME`` argument that does not name what the command needs."""


def load_target(spec: str, *, what: str = "FACTORY") -> Callable[..., Any]:
    """Import ``MODULE:NAME`` (or ``path/to/file.py:NAME``) and return the callable it names."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"expected MODULE:{what} (e.g. mypkg.data:{what.lower()}), got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise TargetError(f"no file {module_name!r} (from {spec!r}); give an existing .py "
                              f"file or an importable module: MODULE:{what}")
        loc = importlib.util.spec_from_file_location(path.stem, path)
        if loc is None or loc.loader is None:
            raise TargetError(f"cannot load {module_name!r} as a Python module (from {spec!r})")
        module = importlib.util.module_from_spec(loc)
        sys.modules.setdefault(path.stem, module)  # so workers can unpickle what it defines
        loc.loader.exec_module(module)
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: the current directory imports
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                raise TargetError(f"cannot import module {module_name!r} (from {spec!r}): {exc}; "
                                  "check the spelling and that it is importable from the current "
                                  "directory or PYTHONPATH") from None
            raise
    if not hasattr(module, attr):
        names = ", ".join(n for n in dir(module) if not n.startswith("_"))[:300]
        raise TargetError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r}); "
                          f"it defines: {names or 'nothing public'}")
    target = getattr(module, attr)
    if not callable(target):
        raise TargetError(f"{spec!r} is a {type(target).__name__}, not a callable; {what} must "
                          "be a function (or class) to call")
    return target


def load_dataset(spec: str) -> Any:
    """Call the ``MODULE:FACTORY`` with no arguments and check it returned a dataset."""
    dataset = load_target(spec)()
    is_map = hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    if not (is_map or isinstance(dataset, torch.utils.data.IterableDataset)):
        raise TargetError(f"{spec!r} returned a {type(dataset).__name__}, not a dataset; FACTORY "
                          "must return a map-style dataset (__getitem__ and __len__) or a "
                          "torch.utils.data.IterableDataset")
    return dataset


def load_collate(spec: str | None) -> Callable[[list[Any]], Any] | None:
    """``--collate MODULE:FUNCTION`` (``gpufeed bench`` and ``tune``): the ``collate_fn`` every
    loader measured gets; None (no option) leaves the loaders' default."""
    return load_target(spec, what="FUNCTION") if spec else None
