"""Datasets with fast paths: batched reads, decoding into the batch's slot, no copy-on-write.

Each is an ordinary map-style ``torch.utils.data.Dataset`` that also works with the stock
loader; under :class:`gpufeed.DataLoader` its batches are read in one call and written straight
into the shared, pinned ring.
"""

from ._host.output import batch_empty
from ._sources.arrays import ArrayDataset
from ._sources.hdf5 import HDF5Dataset
from ._sources.images import ImageFolder
from ._sources.packed import PackedList
from ._sources.padded import ArrowDataset
from ._sources.protocol import SourceChanged
from ._sources.tarimages import ImageShards
from ._sources.tarindex import TarFormatError

__all__ = [
    "ArrayDataset",
    "ArrowDataset",
    "HDF5Dataset",
    "ImageFolder",
    "ImageShards",
    "PackedList",
    "SourceChanged",
    "TarFormatError",
    "batch_empty",
]
