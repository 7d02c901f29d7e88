"""Thread workers import nothing. An import holds a module lock while it runs; if another
thread forks meanwhile (another loader starting process workers, a stock loader that
``accelerator.prepare`` built), the child gets that lock held by a thread it does not have,
and its first use of the module waits for good. Before the fix a thread worker's first random
probe imported ``numpy.random`` (numpy 2 does so on first use), and ``ImageFolder``'s first
PNG imported Pillow's plugins: a stock loader started mid-epoch hung in 4 runs of 10."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

PROBE = textwrap.dedent('''
    import sys, threading
    import numpy as np, torch
    import gpufeed

    root, arrow, h5 = sys.argv[1], sys.argv[2] == "arrow", sys.argv[3]
    if arrow:
        import pyarrow
    if h5:
        import h5py
    seen = set()

    def hook(event, args):
        if event == "import" and threading.current_thread() is not threading.main_thread():
            seen.add(args[0])

    class Numbers(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.tensor([i])

    def loader(dataset, **kw):
        return gpufeed.DataLoader(dataset, batch_size=4, num_workers=2, worker_type="thread",
                                  **kw)

    sys.addaudithook(hook)  # from here on, as in a program that imported only gpufeed
    loaders = [loader(Numbers()), loader(Numbers(), seed=3, shuffle=True),
               loader(Numbers(), device="cpu"), loader(Numbers(), prefetch_factor=1),
               loader(gpufeed.sources.ArrayDataset(torch.arange(64.0))),
               loader(gpufeed.sources.PackedList([f"s{i}" for i in range(64)]))]
    if root != "-":
        loaders += [loader(gpufeed.sources.ImageFolder(root, size=16)),
                    loader(gpufeed.sources.ImageFolder(root, size=16, crop="center"))]
    if arrow:
        import pyarrow as pa
        table = pa.table({"ids": [[i] * (i % 5 + 1) for i in range(64)], "y": list(range(64))})
        loaders.append(loader(gpufeed.sources.ArrowDataset(table)))
    if h5:
        loaders.append(loader(gpufeed.sources.HDF5Dataset(h5, keys=["x"])))
    for epoch in range(2):
        for each in loaders:
            for batch in each:
                pass
    print(sorted(seen))
''')


def _images(root: Path) -> str:
    """A class folder with JPEGs and a PNG (Pillow's path), or "-" without the image extra."""
    if not all(importlib.util.find_spec(m) for m in ("PIL", "simplejpeg")):
        return "-"
    from PIL import Image

    (root / "a").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k in range(6):
        pixels = rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "a" / (f"{k}.jpg" if k % 3 else f"{k}.png"))
    return str(root)


def test_thread_workers_import_nothing(tmp_path: Path) -> None:
    arrow = "arrow" if importlib.util.find_spec("pyarrow") else "-"
    h5 = ""
    if importlib.util.find_spec("h5py"):
        import h5py

        h5 = str(tmp_path / "rows.h5")
        with h5py.File(h5, "w") as f:
            f["x"] = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    out = subprocess.run([sys.executable, "-c", PROBE, _images(tmp_path / "images"), arrow, h5],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
