"""Fixtures shared by every test folder.

- ``worker_type``: a test that takes it runs once per entry of :data:`WORKER_TYPES`, ids
  ``[process]`` and ``[thread]`` (first, before the ids of the test's own parameters). A test
  that parametrizes ``worker_type`` itself, in a grid with other arguments, overrides the
  fixture; a grid over every type takes its values from ``from conftest import
  WORKER_TYPES``, and a grid that pairs each type with its own values (a timeout, an idiom,
  ``num_workers=0``) lists the pairs itself.
- ``small_dataset``: ``RichDataset(8)``, a fresh one per test.
- ``no_leaks`` (``@pytest.mark.usefixtures("no_leaks")``): a resource snapshot (processes,
  /dev/shm, fds, gpufeed threads) before the test, :func:`support.leaks.assert_no_leaks` at
  teardown, once the test's locals are gone; a failed test is not checked (as with the context
  manager). ``@pytest.mark.leaks(settle_s=...)`` sets how long it waits (default 3 s). A check
  that must run while the test still holds something (an exception, a closed iterator), or
  inside a loop, uses the context manager :func:`support.leaks.no_leaks` instead.

Tests marked ``cuda`` are skipped without a CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from support.fakes import RichDataset
from support.leaks import assert_no_leaks, snapshot

WORKER_TYPES = ["process", "thread"]


def _ctrl_c_as_a_terminal_gives_it() -> None:
    """Let Ctrl-C raise KeyboardInterrupt in this process and the scripts it starts, as in a
    terminal, when the suite was launched with SIGINT ignored (``cmd &`` in a script or under
    ``nohup`` ignores it, and Python then installs no handler): the Ctrl-C tests send it."""
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_ctrl_c_as_a_terminal_gives_it()


def pytest_configure(config):
    config.addinivalue_line("markers", "leaks(settle_s): how long the no_leaks fixture waits")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Records whether the test's call failed, for ``no_leaks``."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed


@pytest.fixture(autouse=True)
def _finish_simulated_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """After a test that installed the simulated CUDA runtime: let it finish what the test
    left (closed rings, queued work) before its monkeypatch is undone."""
    yield
    from support.sim_cuda import INSTALLED

    while INSTALLED:
        INSTALLED.pop().finish()


@pytest.fixture(params=WORKER_TYPES)
def worker_type(request) -> str:
    return request.param


@pytest.fixture
def small_dataset() -> RichDataset:
    return RichDataset(8)


@pytest.fixture
def no_leaks(request) -> Iterator[None]:
    marker = request.node.get_closest_marker("leaks")
    settle_s = marker.kwargs.get("settle_s", 3.0) if marker else 3.0
    before = snapshot()
    yield
    if not request.node.stash.get(_CALL_FAILED, True):
        assert_no_leaks(before, settle_s)
