"""Running a test in a new interpreter, for tests that measure the process tree's memory.

A measurement of the tree's PSS compares a peak with a baseline taken at its start. In a
suite's long-lived process that baseline moves for reasons of its own: the garbage of earlier
tests, allocator arenas handed back to the system, processes started by earlier tests (a Ray
session, a framework's workers) still winding down. Any of them can lower the tree by more than
the test's own growth while it measures (CI saw 54 MiB of a 192 MiB peak, and a tree that only
shrank, so that its peak was its first sample). A new interpreter has none of them.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_INSIDE = "GPUFEED_TEST_FRESH"
_ROOT = Path(__file__).resolve().parents[2]


def in_a_fresh_interpreter(test: Callable[..., None]) -> Callable[..., None]:
    """Decorate a test function of a module under ``bench/tests``: in the suite's process it runs
    ``pytest`` on that one test in a new interpreter (and fails with its output when that run
    fails); inside that interpreter it is the test itself."""
    module = sys.modules[test.__module__]
    nodeid = f"{Path(module.__file__ or '').resolve().relative_to(_ROOT)}::{test.__name__}"

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        if os.environ.get(_INSIDE) == nodeid:
            test(*args, **kwargs)
            return
        # no plugins of the environment's packages: the test uses none, and loading them
        # (hypothesis, pytest-benchmark, the frameworks') took about 2 of its 6 s
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
            cwd=_ROOT, env={**os.environ, _INSIDE: nodeid, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            capture_output=True, text=True, timeout=300,
        )
        if child.returncode != 0:
            raise AssertionError(f"{nodeid} failed in a new interpreter:\n"
                                 f"{child.stdout[-6000:]}\n{child.stderr[-2000:]}")

    return run
