"""The public API is exactly what the README documents, behind a sorted __all__."""

import re
from pathlib import Path

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


def test_readme_mentions_every_export():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    names = [n for n in gpufeed.__all__ if n != "__version__"]
    missing = [n for n in names if not re.search(rf"\b{n}\b", readme)]
    assert not missing, f"README does not document: {missing}"


def test_dataloader_is_a_torch_dataloader():
    loader = gpufeed.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)))
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert gpufeed.get_worker_info is torch.utils.data.get_worker_info
