"""``ImageFolder``: torchvision's class-per-folder images, decoded a batch per call.

The layout (``scan``), ``samples`` (``Samples``) and their errors are torchvision's; decoding,
crops and flips are ``decoded.py``'s, shared with ``ImageShards``. Paths are kept relative to
``root`` in a ``PackedList`` and labels in one int64 array (NOTE [ Copy-on-write and Python
objects ]).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch

from .decoded import DecodedImages
from .packed import PackedList
from .protocol import dataset_repr


class ImageFolder(DecodedImages):
    """Images in ``root/<class>/<file>`` as uint8 (3, h, w) tensors of ``size`` and int labels.

    torchvision's ``ImageFolder`` layout and attributes: ``classes`` (sorted sub-folders),
    ``class_to_idx``, ``samples`` and ``imgs`` (``(path, class_index)`` per image, made on
    access; assigning a list of pairs re-packs them), ``targets`` (an int64 array), the same
    FileNotFoundError for a class folder without a valid file. Pair with ``gpufeed.Normalize``
    on the device. Needs ``pip install 'gpufeed[image]'`` (simplejpeg and Pillow).

    Args:
        root: the folder of class folders.
        size: output ``int`` (square) or ``(height, width)``.
        crop: ``"random"``: a random-resized crop (area fraction drawn from ``scale``, aspect
            ratio log-uniform in ``ratio``, torchvision's ``RandomResizedCrop``;
            ``scale=None`` for a plain ``size`` window at a random place); ``"center"``:
            torchvision's ``Resize(S)`` then ``CenterCrop(size)`` with
            ``S = int(min(size) / center_fraction)`` (256 for 224 and the default 0.875; larger
            when a non-square ``size`` would not fit): the shorter side resized to ``S``, the
            longer to ``int(S * longer / shorter)``, by torch's antialiased bilinear filter as
            torchvision's tensor path, then the central ``size`` with its rounding. Equal to
            torchvision's tensor path (``decode_jpeg``) to within a level or two (tested); its
            PIL path (Pillow's resize) differs from both by about a level. Exceptions:
            ``fast=True``, and ``dct_scale``, which decodes an image whose sides are at least
            twice the resized ones at 1/2, 1/4 or 1/8 scale first (a random crop's box then
            snaps to whole pixels of the scaled image: on a smooth 1200x900 photo resized to
            64, 2 levels on average and up to 25 at edges; ``dct_scale=False`` for equality).
        flip: random horizontal flip with probability 1/2. Default: on for ``crop="random"``.
        scale, ratio: as torchvision's ``RandomResizedCrop``.
        center_fraction: for ``crop="center"``, the share of the resized image kept (0.875:
            224 of 256).
        fast: the fast (less accurate) DCT, and fast chroma upsampling where the whole image
            is decoded (never with a region: NOTE [ Decoding ]).
        dct_scale: decode at a reduced DCT scale when the region is at least twice the output
            in both directions (faster; the resampling then starts from a DCT-domain downscale).
        on_error: ``"raise"`` (an error naming the file) or ``"skip"``: an unreadable image
            becomes a black image with label -1 (mask with ``labels >= 0``), counted in
            ``skipped`` of the process that read it.
        extensions: file endings taken (default torchvision's ``IMG_EXTENSIONS``); not with
            ``is_valid_file``.
        is_valid_file: ``path -> bool``, torchvision's alternative to ``extensions`` (full path).
        allow_empty: accept class folders without a valid file (torchvision's knob).
        decoder: ``"auto"`` (libjpeg-turbo >= 3.0's region decode when found, else simplejpeg,
            said once), ``"turbojpeg"`` (raise if missing) or ``"simplejpeg"``.
        memory_format: the images' layout in memory, their shape being ``(B, 3, h, w)``
            either way: ``torch.contiguous_format`` (CHW planes, as torchvision's) or
            ``torch.channels_last`` (HWC, as the decoder writes it: no transposition in the
            workers, about a tenth of a 224 crop's cost; the layout channels-last models take
            on the GPU). Values are equal; ``view`` on a channels-last batch needs
            ``.contiguous()`` first (NOTE [ Resampling ] in ``resample.py``).
        decode: ``"cpu"`` (default: the workers decode), ``"gpu"`` (under
            ``gpufeed.DataLoader(device="cuda")``, the workers ship each JPEG's bytes and crop
            box and the device stage decodes, crops and resizes the batch on the GPU with
            nvImageCodec, ``pip install 'gpufeed[gpu-decode]'``; without the library, CUDA or a
            device stage, the CPU decodes, said once) or ``"auto"`` (the GPU when it can, else
            the CPU, quietly). Same batch structure; pixels within a few levels of the CPU
            path's with ``dct_scale=False`` (docs/guides/gpu-decode.md). ``dataset[i]`` and
            other loaders always decode on the CPU.
        transform: a callable applied in the worker to each image after the crop, resize
            and flip: it takes the uint8 ``(3, h, w)`` tensor (as ``torchvision.transforms.v2``
            does) and returns the sample's image (any shape or dtype, one per batch with the
            default collation). Its random draws are per sample:
            ``gpufeed.random.sample_generator()`` inside it always; torch's global generator
            (torchvision's random transforms) with process workers or ``num_workers=0`` and
            ``seed=``; thread workers warn (``RandomStateWarning``) instead
            (NOTE [ Image transforms ]). Normalising is cheaper on the device
            (``device_transform=gpufeed.Normalize(...)``).
        target_transform, loader: refused with a TypeError that names what to use instead
            (a ``collate_fn``, or torchvision's own ``ImageFolder`` in ``gpufeed.DataLoader``).
    """

    _instead = ("For arbitrary PIL transforms keep torchvision.datasets.ImageFolder(root, "
                "transform=...) and pass it to gpufeed.DataLoader, which loads it as the stock "
                "loader does.")

    def __init__(
        self, root: str | os.PathLike[str], *, size: int | tuple[int, int],
        crop: str = "random", flip: bool | None = None,
        scale: tuple[float, float] | None = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3), center_fraction: float = 0.875,
        fast: bool = False, dct_scale: bool = True, on_error: str = "raise",
        extensions: Sequence[str] | None = None,
        is_valid_file: Callable[[str], bool] | None = None, allow_empty: bool = False,
        decoder: str = "auto", memory_format: torch.memory_format = torch.contiguous_format,
        transform: Any = None, target_transform: Any = None, loader: Any = None,
        decode: str = "cpu",
    ) -> None:
        super().__init__(size=size, crop=crop, flip=flip, scale=scale, ratio=ratio,
                         center_fraction=center_fraction, fast=fast, dct_scale=dct_scale,
                         on_error=on_error, decoder=decoder, memory_format=memory_format,
                         transform=transform, target_transform=target_transform, loader=loader,
                         decode=decode)
        if is_valid_file is not None and not callable(is_valid_file):
            raise TypeError(f"is_valid_file must be a callable path -> bool, got "
                            f"{is_valid_file!r}")
        self.root = os.path.expanduser(os.fspath(root))
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"ImageFolder root {self.root!r} is not a folder")
        self.classes = find_classes(self.root)
        self.class_to_idx = {c: k for k, c in enumerate(self.classes)}
        if extensions is None and is_valid_file is None:
            extensions = IMG_EXTENSIONS
        files, labels = scan(self.root, self.classes, extensions=extensions,
                             is_valid_file=is_valid_file, allow_empty=allow_empty)
        self.files = PackedList(files)  # NOTE [ Copy-on-write and Python objects ]
        self.targets = np.asarray(labels, dtype=np.int64)

    # -- torchvision's attributes ------------------------------------------------------------
    @property
    def samples(self) -> Samples:
        """``(path, class_index)`` per image, torchvision's ``samples``; assignable."""
        return Samples(self.root, self.files, self.targets)

    @samples.setter
    def samples(self, value: Iterable[tuple[str, int]]) -> None:
        # a PackedList and one array (NOTE [ Copy-on-write and Python objects ] in packed.py)
        self.files, self.targets = pack(self.root, value)

    imgs = samples

    def __len__(self) -> int:
        return len(self.files)

    def path(self, index: int) -> str:
        return os.path.join(self.root, self.files[index])

    def __repr__(self) -> str:
        return dataset_repr(self, len(self), self.root,
                            [f"Classes: {len(self.classes)}", *self._settings()])

    def _read(self, index: int) -> bytes:
        with open(self.path(index), "rb") as f:
            return f.read()

    def _name(self, index: int) -> str:
        return repr(self.path(index))


# -- torchvision's class-per-folder layout --------------------------------------------------------

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
    """(paths relative to ``root``, class indices) of the valid files of ``root/<class>/**/``,
    in torchvision's ``DatasetFolder`` order (files sorted within each class, sub-folders and
    links followed).

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
