"""The public API is exactly what the docs document, behind a sorted __all__."""

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import gpufeed


def test_all_is_sorted_and_importable():
    assert list(gpufeed.__all__) == sorted(gpufeed.__all__)
    for name in gpufeed.__all__:
        assert hasattr(gpufeed, name), name


def test_no_undocumented_public_names():
    public = {n for n in vars(gpufeed) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(gpufeed, n)).__name__ == "module"}
    assert public - modules == set(gpufeed.__all__) - {"__version__"}


def test_docs_mention_every_export():
    docs = Path(__file__).parents[1] / "docs"
    text = "\n".join(p.read_text() for p in sorted(docs.rglob("*.md")))
    names = [n for n in gpufeed.__all__ if n != "__version__"]
    missing = [n for n in names if not re.search(rf"\b{n}\b", text)]
    assert not missing, f"the docs do not mention: {missing}"


def test_dataloader_is_a_torch_dataloader():
    loader = gpufeed.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)))
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert gpufeed.get_worker_info is torch.utils.data.get_worker_info


def test_worker_type_is_a_literal_type_checkers_hold_calls_to(tmp_path):
    """A misspelt worker kind is a type error for mypy (and editors), still a ValueError at run
    time; ``gpufeed.WorkerType`` names the two kinds."""
    assert typing.get_args(gpufeed.WorkerType) == ("process", "thread")
    hints = typing.get_type_hints(gpufeed.DataLoader.__init__)
    assert hints["worker_type"] == gpufeed.WorkerType
    with pytest.raises(ValueError, match="worker_type='proces' is not supported"):
        gpufeed.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), worker_type="proces")
    pytest.importorskip("mypy.api")
    (tmp_path / "mypy.ini").write_text(  # torch and numpy unread: seconds, not a minute
        "[mypy]\nignore_missing_imports = True\nfollow_imports = silent\n"
        "[mypy-torch.*]\nfollow_imports = skip\n[mypy-numpy.*]\nfollow_imports = skip\n")
    (tmp_path / "user.py").write_text(
        "import gpufeed\n\n"
        "def kind() -> gpufeed.WorkerType:\n    return 'thread'\n\n"
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
    assert "user.py:6:" in errors[0] and "\"Literal['process', 'thread']\"" in errors[0]
