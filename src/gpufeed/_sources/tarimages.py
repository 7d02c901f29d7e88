"""``ImageShards``: images and labels in tar shards (webdataset's layout), read at random.

The shards are indexed as NOTE [ Tar shards ] in ``tarindex.py`` says; each sample is one
``pread`` of its image's bytes, decoded as ``ImageFolder`` decodes (``decoded.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .decoded import DecodedImages
from .packed import PackedList
from .protocol import dataset_repr
from .tarindex import Member, ShardStamp, expand, index_all, read_range, samples

#: the members taken as a sample's image, first found first (webdataset's image extensions)
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "webp", "bmp", "tif",
                    "tiff")


class _Shard:
    """One shard's samples: keys, texts, and per sample a row of ``table``: image offset and
    size, extension number, label (-1 without ``label``)."""

    def __init__(self, path: str, found: list[Member], stamp: ShardStamp, image: Sequence[str],
                 label: str | None, text: str | None):
        self.keys: list[str] = []
        self.texts: list[str] = []
        self.stamp = stamp
        rows: list[tuple[int, int, int, int]] = []
        with open(path, "rb") as f:
            for key, parts in samples(path, found):
                kind = next((k for k, e in enumerate(image) if e in parts), None)
                missing = [f"image member ({', '.join(image)})"] if kind is None else []
                missing += [f"{e!r} {what} member" for e, what in ((label, "label"),
                                                                  (text, "text"))
                            if e is not None and e not in parts]
                if kind is None or missing:
                    raise ValueError(
                        f"shard {path!r}: sample {key!r} has no {' and no '.join(missing)} "
                        f"(it has: {', '.join(sorted(parts)) or 'none'}); give image=/label=/"
                        "text= the extensions your shards use, or remove the sample")
                m = parts[image[kind]]
                lab = -1
                if label is not None:
                    raw = parts[label]
                    lab = _label(os.pread(f.fileno(), raw.size, raw.offset)
                                 if raw.size <= 4096 else b"(over 4 KiB)", path, key, label)
                if text is not None:
                    self.texts.append(_text(f.fileno(), parts[text], path, key, text))
                self.keys.append(key)
                rows.append((m.offset, m.size, kind, lab))
        self.table = np.array(rows, dtype=np.int64).reshape(-1, 4)


def _label(raw: bytes, path: str, key: str, ext: str) -> int:
    try:
        return int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"shard {path!r}: the label {key}.{ext} holds {raw[:20]!r}, not an "
                         "integer class index") from None


def _text(fd: int, m: Member, path: str, key: str, ext: str) -> str:
    raw = os.pread(fd, m.size, m.offset)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"shard {path!r}: the text {key}.{ext} is not UTF-8 ({exc})") from None


class ImageShards(DecodedImages):
    """Images (with integer labels, texts, or both) in tar shards, as uint8 (3, h, w) tensors.

    A sample is the members ``<key>.<ext>`` next to each other in a shard (webdataset's
    layout): an image (the first of ``image`` found), a label (``<key>.cls``: an integer in
    text) and, when asked, a text (``text="txt"``: a caption, UTF-8). The shards are indexed
    when the dataset is built, reading their headers (and the labels and texts) only
    (NOTE [ Tar shards ]), so this is a map-style dataset: ``shuffle=True`` shuffles every
    sample, ``seed=`` makes epochs reproducible for any number or kind of workers, a resume is
    exact and ranks share the samples out. Images decode, crop and flip as ``ImageFolder``'s
    do (the same pixels for the same bytes and seed). Needs ``pip install 'gpufeed[image]'``.

    A sample is ``(image, label)``, ``(image, label, text)`` with ``text=``, ``(image, text)``
    with ``label=None`` too, and the image alone with neither; a batch is the list of those
    fields collated (texts as a tuple of ``str``), as the stock loader collates them.

    Args:
        shards: tar files: a list of paths, a folder (its ``*.tar``), a glob pattern, or
            brace ranges and lists (``"train-{000000..000146}.tar"``, ``"{a,b}-{0..9}.tar"``).
            Plain tar: compressed shards are refused, as they cannot be read at random.
        image: the extensions taken as a sample's image, first found first.
        label: the extension of the label member (its text is an integer), or None.
        text: the extension of a text member (``"txt"``, ``"json"``) given as ``str``, or
            None. Texts are read when the dataset is built and kept in one buffer.
        size, crop, flip, scale, ratio, center_fraction, fast, dct_scale, on_error: as
            ``ImageFolder``'s, and so are ``decoder``, ``memory_format``, ``decode`` and
            ``transform`` (a skipped image is black, before the transform, and its label -1;
            with ``label=None`` only ``skipped``, per process, counts it).
            ``target_transform`` is refused.

    Attributes: ``shards`` (the paths), ``keys`` (each sample's key), ``targets`` (int64
    labels; -1 without ``label``), ``texts`` (with ``text``), ``shard_of`` (each sample's shard
    number).
    """

    _instead = ("For arbitrary PIL transforms, read the shards with webdataset and pass that "
                "dataset to gpufeed.DataLoader.")

    def __init__(
        self, shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
        size: int | tuple[int, int], image: str | Sequence[str] = IMAGE_EXTENSIONS,
        label: str | None = "cls", text: str | None = None, crop: str = "random",
        flip: bool | None = None, scale: tuple[float, float] | None = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3), center_fraction: float = 0.875,
        fast: bool = False, dct_scale: bool = True, on_error: str = "raise",
        decoder: str = "auto", memory_format: torch.memory_format = torch.contiguous_format,
        transform: Any = None, target_transform: Any = None, decode: str = "cpu",
    ) -> None:
        super().__init__(size=size, crop=crop, flip=flip, scale=scale, ratio=ratio,
                         center_fraction=center_fraction, fast=fast, dct_scale=dct_scale,
                         on_error=on_error, decoder=decoder, memory_format=memory_format,
                         transform=transform, target_transform=target_transform, decode=decode)
        exts = (image,) if isinstance(image, str) else tuple(image)
        if not exts or not all(isinstance(e, str) and e for e in exts) or not all(
                e is None or (isinstance(e, str) and e) for e in (label, text)):
            raise ValueError(f"image={image!r}, label={label!r} and text={text!r} must be "
                             "member extensions such as 'jpg', 'cls' and 'txt' (label and "
                             "text may be None)")
        self.image = tuple(e.lower().lstrip(".") for e in exts)
        self.label, self.text = (None if e is None else e.lower().lstrip(".")
                                 for e in (label, text))
        paths = expand(shards)
        missing = [p for p in paths if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"shard {missing[0]!r} does not exist or is not a file" + (
                    f" ({len(missing)} of the {len(paths)} shards are missing)"
                    if len(missing) > 1 else ""))
        parts: list[Any] = index_all(paths, lambda p, found, st: _Shard(
            p, found, st, self.image, self.label, self.text))
        if not sum(len(s.keys) for s in parts):
            raise ValueError(f"the {len(paths)} shard(s) hold no sample (first: {paths[0]!r})")
        self.shards = PackedList(paths)
        self._stamps: list[ShardStamp] = [s.stamp for s in parts]
        self.keys = PackedList([k for s in parts for k in s.keys])
        self.texts = PackedList([t for s in parts for t in s.texts]) if text else None
        self.shard_of = np.concatenate([np.full(len(s.keys), k, dtype=np.int32)
                                        for k, s in enumerate(parts)])
        table = np.concatenate([s.table for s in parts])
        self.targets = table[:, 3].copy()
        self._offsets, self._sizes = table[:, 0].copy(), table[:, 1].copy()
        self._exts = table[:, 2].astype(np.uint8)

    def __len__(self) -> int:
        return len(self.targets)

    def __repr__(self) -> str:
        first = self.shards[0] if len(self.shards) == 1 else \
            f"{self.shards[0]} ... {self.shards[-1]}"
        return dataset_repr(self, len(self), first, [
            f"Shards: {len(self.shards)}, image={'/'.join(self.image)}, label={self.label}, "
            f"text={self.text}", *self._settings()])

    # -- the fields of a sample ---------------------------------------------------------------
    def _fields(self, idx: np.ndarray, images: Any, labels: Any) -> list[Any]:
        fields = [images]
        if self.label is not None:
            fields.append(labels)
        if self.texts is not None:  # a tuple, as default_collate leaves a field of str
            fields.append(tuple(self.texts[int(i)] for i in idx))
        return fields

    # -- where an image's bytes are ---------------------------------------------------------
    def _read(self, index: int) -> bytes:
        shard = int(self.shard_of[index])
        return read_range(self.shards[shard], int(self._offsets[index]),
                          int(self._sizes[index]), self._stamps[shard])

    def _name(self, index: int) -> str:
        ext = self.image[int(self._exts[index])]
        return f"{self.keys[index]}.{ext} in shard {self.shards[int(self.shard_of[index])]!r}"
