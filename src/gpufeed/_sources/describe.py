"""``repr`` of the sources, in torchvision's dataset layout: what a log or a notebook shows."""

from __future__ import annotations

from collections.abc import Iterable


def dataset_repr(obj: object, length: int, location: str | None,
                 settings: Iterable[str]) -> str:
    """torchvision's ``VisionDataset.__repr__`` layout, ``settings`` one line each::

        Dataset ImageFolder
            Number of datapoints: 1281167
            Root location: /data/imagenet/train
            <one line per key setting>
    """
    body = [f"Number of datapoints: {length}"]
    if location is not None:
        body.append(f"Root location: {location}")
    body.extend(settings)
    return "\n".join([f"Dataset {type(obj).__name__}", *("    " + line for line in body)])
