"""Photo-like JPEG sets for the data-source benchmark: realistic entropy and file sizes.

A decoder's time grows with the entropy-coded data (at quality 90 about 70% of a decode is
entropy decoding), so the images must weigh what photos weigh: ImageNet's are ~110 KB at about
500x375, and ~30 KB once resized to 256x256. Smooth random fields at three scales (the scene's
light and shapes), two fine-grained texture fields and a little noise reach those sizes at
quality 90, deterministically from the seed; ``detail`` (the texture's amplitude, in levels)
sets the size: 30 gives ~110 KB at 500x375, 18 about 30 KB at 256x256.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

import numpy as np
import torch

__all__ = ["DETAIL", "mean_file_bytes", "photo_like", "photo_set", "pillow_sample"]

#: ``detail`` per (height, width) that reaches the photo file sizes above at quality 90.
DETAIL = {(375, 500): 30.0, (256, 256): 18.0}


def photo_like(height: int, width: int, seed: int, detail: float) -> np.ndarray:
    """A deterministic photo-like RGB image (uint8 HWC)."""
    rng = np.random.default_rng(seed)
    img = np.zeros((height, width, 3), np.float32)
    for cells, amp in ((3, 60.0), (10, 30.0), (40, 18.0), (max(2, height // 4), detail),
                       (max(2, height // 2), detail)):
        field = rng.standard_normal((1, 3, cells, max(2, round(cells * width / height))))
        up = torch.nn.functional.interpolate(torch.from_numpy(field.astype(np.float32)),
                                             size=(height, width), mode="bicubic",
                                             align_corners=False)
        img += amp * up[0].permute(1, 2, 0).numpy()
    img += rng.normal(0, detail / 4, img.shape).astype(np.float32)
    img += (120 + rng.uniform(-30, 30, 3)).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def photo_set(cache: Path, name: str, count: int, hw: tuple[int, int]) -> Path:
    """``count`` photo-like JPEGs of ``hw`` (quality 90) in ten class folders, built once."""
    from PIL import Image

    detail = DETAIL.get(hw, 20.0)
    root = cache / f"{name}-photo-{count}-{hw[0]}x{hw[1]}"
    done = root / ".done"
    if done.exists():
        return root
    for k in range(count):
        d = root / f"c{k % 10}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(photo_like(hw[0], hw[1], k, detail)).save(d / f"{k:06d}.jpg", quality=90)
    done.touch()
    return root


def mean_file_bytes(root: Path) -> float:
    """The mean size of the JPEGs under ``root``."""
    sizes = [p.stat().st_size for p in root.rglob("*.jpg")]
    return float(np.mean(sizes)) if sizes else 0.0


def pillow_sample(source: str | IO[bytes], size: int, resized: bool) -> torch.Tensor:
    """What users write today, per sample, with Pillow: open and decode an image (a path or a
    file object), crop (a random ``size`` window, or torchvision's random-resized crop with a
    bilinear resize to ``size``), flip at random; a CHW uint8 tensor. Draws from torch's
    generator, as torchvision's transforms do."""
    from PIL import Image

    with Image.open(source) as im:
        im = im.convert("RGB")
        w, h = im.size
        s = size
        if resized:
            area = h * w * float(torch.empty(()).uniform_(0.08, 1.0))
            ratio = float(torch.empty(()).uniform_(np.log(3 / 4), np.log(4 / 3)).exp())
            cw = min(w, max(1, round((area * ratio) ** 0.5)))
            ch = min(h, max(1, round((area / ratio) ** 0.5)))
            top = int(torch.randint(0, h - ch + 1, ()))
            left = int(torch.randint(0, w - cw + 1, ()))
            im = im.resize((s, s), Image.Resampling.BILINEAR,
                           box=(left, top, left + cw, top + ch))
        else:
            top, left = int(torch.randint(0, h - s + 1, ())), int(torch.randint(0, w - s + 1, ()))
            im = im.crop((left, top, left + s, top + s))
        arr = np.asarray(im)
    if torch.rand(()) < 0.5:
        arr = arr[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def flip_to_float(img: torch.Tensor) -> torch.Tensor:
    """The sources benchmark's ``transform=``: a flip and a conversion to float32 in [0, 1],
    written in torch, as a torchvision user's ``RandomHorizontalFlip(p=1)`` + ``ToDtype``."""
    return img.flip(-1).to(torch.float32).div_(255)
