"""The public surface: the top level and each documented submodule behind a sorted ``__all__``
that lists exactly its public names, each importable and documented."""

import importlib
import inspect
import subprocess
import sys
import types

import pytest
import torch

import gpufeed

SUBMODULES = ("errors", "random", "samplers", "sources", "stats", "tools")
PUBLIC = ("gpufeed", *(f"gpufeed.{m}" for m in SUBMODULES))


def _own_doc(obj: object) -> str:
    """The object's own docstring ("" when it has none): not one inherited from a base class,
    nor the signature a dataclass writes in when it has none."""
    doc = obj.__doc__ if isinstance(obj, type | types.ModuleType) else inspect.getdoc(obj)
    name = getattr(obj, "__name__", "")
    if not doc or (isinstance(obj, type) and doc.startswith(f"{name}(")):
        return ""
    return doc.strip()


def test_the_top_level_is_small():
    """What nearly every program touches; the rest is in the submodules."""
    assert len(gpufeed.__all__) <= 20, gpufeed.__all__
    assert set(SUBMODULES) <= set(gpufeed.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_all_is_sorted_importable_and_exactly_the_public_names(name):
    module = importlib.import_module(name)
    names = list(module.__all__)
    assert names == sorted(names) and len(set(names)) == len(names), names
    # gpufeed.hf needs Accelerate, so the top level does not import it: once anything has,
    # Python binds it on the package too.
    optional = {"hf"} if name == "gpufeed" else set()
    public = {n for n in vars(module) if not n.startswith("_")} - optional
    assert public == set(names) - {"__version__"}, (
        f"public but not in __all__: {sorted(public - set(names))}; in __all__ but not "
        f"defined: {sorted(set(names) - public - {'__version__'})}")
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(names)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_documented(name):
    module = importlib.import_module(name)
    assert _own_doc(module), f"{name} has no docstring"
    missing = [n for n in module.__all__
               if n != "__version__" and not _own_doc(getattr(module, n))]
    assert not missing, f"{name}: no docstring of their own: {missing}"


def test_a_name_in_two_submodules_is_one_object():
    seen: dict[str, object] = {}
    for name in PUBLIC:
        module = importlib.import_module(name)
        for n in module.__all__:
            assert seen.setdefault(n, getattr(module, n)) is getattr(module, n), n


def test_the_old_top_level_names_are_gone():
    """No aliases: the names moved to their submodules (the package was never published);
    only WorkerError, which nearly every program may catch, is in both places."""
    for module in SUBMODULES:
        for n in importlib.import_module(f"gpufeed.{module}").__all__:
            if n not in gpufeed.__all__:
                assert not hasattr(gpufeed, n), f"gpufeed.{n}: use gpufeed.{module}.{n}"
    assert not hasattr(gpufeed, "ImageFolder") and not hasattr(gpufeed, "sample_generator")


def test_dataloader_is_a_torch_dataloader():
    loader = gpufeed.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)))
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert gpufeed.get_worker_info is torch.utils.data.get_worker_info


def test_worker_type_is_a_literal_type_checkers_hold_calls_to(tmp_path):
    """A misspelt worker kind is a type error for mypy (and editors), still a ValueError at run
    time."""
    with pytest.raises(ValueError, match="worker_type='proces' is not supported"):
        gpufeed.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), worker_type="proces")
    pytest.importorskip("mypy.api")
    # torch and numpy unread: seconds, not a minute (numpy ships stubs, which mypy reads
    # despite follow_imports unless follow_imports_for_stubs says otherwise: half the run)
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n"
        "[mypy-torch.*]\nfollow_imports = skip\n"
        "[mypy-numpy.*]\nfollow_imports = skip\nfollow_imports_for_stubs = True\n")
    (tmp_path / "user.py").write_text(
        "from typing import Literal\n\nimport gpufeed\n\n"
        "def kind() -> Literal['process', 'thread']:\n    return 'thread'\n\n"
        "gpufeed.DataLoader([1, 2], worker_type='proces')\n"
        "gpufeed.DataLoader([1, 2], worker_type='thread')\n"
        "gpufeed.DataLoader([1, 2], worker_type=kind())\n")
    # In a process of its own: mypy run in this one leaves some 740,000 objects behind, which
    # every later full collection walks (tests after this one took 2-6x longer).
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                           str(tmp_path / "mypy.ini"), "--no-incremental",
                           str(tmp_path / "user.py")], capture_output=True, text=True, timeout=300)
    out, err, status = done.stdout, done.stderr, done.returncode
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert status == 1 and len(errors) == 1, out + err
    assert "user.py:8:" in errors[0] and "\"Literal['process', 'thread']\"" in errors[0]
