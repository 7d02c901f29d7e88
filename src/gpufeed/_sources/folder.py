"""torchvision's class-per-folder layout: classes, files, ``samples``, with its errors.

``scan`` lists ``root/<class>/**/<file>`` as torchvision's ``DatasetFolder`` does (classes are
the sorted sub-folders, files sorted within each, sub-folders followed, links too); paths are
kept relative to ``root`` in a ``PackedList`` and labels in one int64 array (NOTE [ Copy-on-write
and Python objects ]). ``Samples`` shows them as torchvision's ``samples``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from .packed import PackedList

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_classes(root: str) -> list[str]:
    """The class folders of ``root``, sorted; FileNotFoundError (torchvision's) if none."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(
            f"Couldn't find any class folder in {root}. ImageFolder expects "
            "root/<class>/<image>")
    return classes


def scan(root: str, classes: Sequence[str], *, extensions: Sequence[str] | None,
         is_valid_file: Callable[[str], bool] | None,
         allow_empty: bool) -> tuple[list[str], list[int]]:
    """(paths relative to ``root``, class indices) of the valid files, in torchvision's order.

    A file is valid when ``is_valid_file(full path)`` says so, else when its name ends with
    one of ``extensions`` (case-insensitive). A class with no valid file raises torchvision's
    FileNotFoundError unless ``allow_empty``.
    """
    if (extensions is None) == (is_valid_file is None):
        raise ValueError("Both extensions and is_valid_file cannot be None or not None at the "
                         "same time")
    exts = tuple(e.lower() for e in extensions or ())
    files: list[str] = []
    labels: list[int] = []
    empty: list[str] = []
    for k, c in enumerate(classes):
        before = len(files)
        for dirpath, _, names in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            for name in sorted(names):
                path = os.path.join(dirpath, name)
                if is_valid_file(path) if is_valid_file is not None else \
                        name.lower().endswith(exts):
                    files.append(os.path.relpath(path, root))
                    labels.append(k)
        if len(files) == before:
            empty.append(c)
    if empty and not allow_empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
        if extensions is not None:
            msg += f"Supported extensions are: {', '.join(extensions)}"
        raise FileNotFoundError(msg)
    return files, labels


class Samples(Sequence[tuple[str, int]]):
    """torchvision's ``samples`` (and ``imgs``): ``(path, class_index)`` per image, the path
    joined to the dataset's root as torchvision joins it; tuples are made on access, so the
    list of a million images is never held in every worker. ``list(ds.samples)`` is
    torchvision's list; it compares equal to it."""

    def __init__(self, root: str, files: PackedList, targets: np.ndarray) -> None:
        self._root, self._files, self._targets = root, files, targets

    def __len__(self) -> int:
        return len(self._files)

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return os.path.join(self._root, self._files[index]), int(self._targets[index])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for f, t in zip(self._files, self._targets.tolist(), strict=True):
            yield os.path.join(self._root, f), t

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Samples | list | tuple):
            return len(self) == len(other) and all(
                a == tuple(b) for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence that compares by value

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"Samples([{head}{', ...' if len(self) > 3 else ''}], {len(self)} images)"


def pack(root: str, samples: Iterable[tuple[str, int]]) -> tuple[PackedList, np.ndarray]:
    """Files (relative to ``root`` when under it) and labels of ``(path, class_index)`` pairs,
    for assigning ``ds.samples = [...]`` as torchvision's users do (to subset or relabel)."""
    files: list[str] = []
    labels: list[int] = []
    for item in samples:
        try:
            path, label = item
        except (TypeError, ValueError):
            raise TypeError(f"samples must hold (path, class_index) pairs, got {item!r}") from None
        path = os.path.abspath(os.fspath(path))
        rel = os.path.relpath(path, os.path.abspath(root))
        files.append(path if rel.startswith(os.pardir) else rel)  # joined to root as given
        labels.append(int(label))
    return PackedList(files), np.asarray(labels, dtype=np.int64)
