"""The support helpers that decide whether a test runs at all."""

import sys

import pytest

from support.compare import TORCHVISION_HINT, torchvision_or_skip


@pytest.mark.parametrize(("body", "why"), [
    ('raise RuntimeError("operator torchvision::nms does not exist")', "cannot load next to"),
    ('raise ImportError("No module named torchvision")', "is not installed"),
])
def test_a_torchvision_that_cannot_load_skips_with_the_cpu_advice(tmp_path, monkeypatch,
                                                                    body, why):
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        torchvision_or_skip()
    assert why in str(skipped.value) and TORCHVISION_HINT in str(skipped.value)
    assert "download.pytorch.org/whl/cpu" in TORCHVISION_HINT
