"""For every test folder (tests/, bench/tests/): the suite's process freezes what it holds
between modules.

Before the first test of each module the process collects, then freezes what is left (the
imported libraries, the fixtures that live on). A full collection walks every object the
process tracks: with torch, Lightning, transformers and Ray imported that is over half a million
objects and most of a second, and the leak checks and measurements collect before and after
hundreds of tests. Frozen objects are never walked again; what a test makes is collected as
ever. A test that unfreezes (tests/host/test_frozen_heap.py) only makes the collections of the
rest of its module slower.
"""

from __future__ import annotations

import gc

import pytest

_module_frozen: list[object] = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    module = getattr(item, "module", None)
    if module is not _module_frozen[0]:
        _module_frozen[0] = module
        gc.collect()
        gc.freeze()
