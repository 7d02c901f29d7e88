"""What ships is what a user installs: the sdist and the wheel built from this tree hold the
package (every module, ``py.typed``) and nothing of the repository's (no tests, no benchmark lab,
no results); the wheel, installed into a fresh virtual environment, imports from there, runs a
loader and ``gpufeed --version``.

The development install is editable, so a module the archives leave out would still import in
every other test: this one asserts that ``gpufeed`` comes from the fresh environment. The build
runs without isolation (``--no-isolation``: the installed setuptools, no index needed) on a copy
of the tree, so that nothing is written into the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOOP = """
import sys
import torch
import gpufeed
from gpufeed.sources import ArrayDataset

print(gpufeed.__file__)
data = torch.arange(96, dtype=torch.float32).reshape(48, 2)
for worker_type in ("process", "thread"):
    loader = gpufeed.DataLoader(ArrayDataset(data), batch_size=8, num_workers=2,
                                worker_type=worker_type)
    got = torch.cat([x for (x,) in loader])
    assert torch.equal(got, data), worker_type
print("loop ok")
"""


def _env() -> dict[str, str]:
    """The environment without the development tree on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return {**env, "PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INDEX": "1"}


def _run(*cmd: str | Path, cwd: Path) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _package_files() -> set[str]:
    """The files a user must get: every module and py.typed, relative to src/."""
    src = REPO / "src"
    return {p.relative_to(src).as_posix() for p in (src / "gpufeed").rglob("*")
            if p.is_file() and (p.suffix == ".py" or p.name == "py.typed")}


def test_the_built_archives_hold_the_package_and_the_wheel_installs_and_runs(tmp_path: Path):
    pytest.importorskip("build", reason="python -m build makes the archives: pip install build")
    tree = tmp_path / "tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.pyc", "*.egg-info", ".*_cache", "build", "dist", ".venv"))
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp_path / "dist", tree,
         cwd=tmp_path)
    (sdist,), (wheel,) = (tmp_path / "dist").glob("*.tar.gz"), (tmp_path / "dist").glob("*.whl")
    expected = _package_files()
    assert "gpufeed/py.typed" in expected and "gpufeed/_loader.py" in expected

    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        held = {n.removeprefix(f"{top}/") for n in tar.getnames()}
    assert {"pyproject.toml", "README.md"} <= held
    assert {f"src/{f}" for f in expected} <= held, sorted({f"src/{f}" for f in expected} - held)
    strays = sorted(n for n in held if n.split("/")[0] in {"tests", "bench", "docs", "scripts"}
                    or "results" in n.split("/"))
    assert not strays, f"the sdist holds the repository's files: {strays}"

    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    package = {n for n in names if n.startswith("gpufeed/")}
    assert package == expected, (sorted(expected - package), sorted(package - expected))
    dist_info = wheel.name.split("-py3")[0] + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"gpufeed", dist_info}, sorted(names)

    venv = tmp_path / "venv"  # torch (and pip) from the system's site-packages; gpufeed fresh
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv,
         cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    out = _run(python, "-I", "-c", LOOP, cwd=tmp_path).splitlines()
    assert Path(out[0]).resolve().is_relative_to(venv.resolve()), (
        f"gpufeed imported from {out[0]}, not from the fresh environment {venv}")
    assert out[-1] == "loop ok"
    version = _run(venv / "bin" / "gpufeed", "--version", cwd=tmp_path)
    assert version.startswith("gpufeed 0.1.0 "), version
