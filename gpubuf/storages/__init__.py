"""Storages: where the buffer's items live."""

from gpubuf.storages.base import Storage
from gpubuf.storages.list import ListStorage
from gpubuf.storages.memmap import LazyMemmapStorage, SharedInitTensorStorage
from gpubuf.storages.codec_storage import CompressedTensorStorage
from gpubuf.storages.compressed import CompressedListStorage
from gpubuf.storages.ensemble import StorageEnsemble
from gpubuf.storages.frame_stack import FrameStackStorage
from gpubuf.storages.packed import PackedStorage
from gpubuf.storages.spill import SpillStorage
from gpubuf.storages.stack import LazyStackStorage
from gpubuf.storages.store import StoreStorage
from gpubuf.storages.tensor import LazyTensorStorage, TensorStorage

# The memory-mapped storages import the tensor ones: the package, above both, tells
# LazyTensorStorage what its shared_init=True builds.
LazyTensorStorage._shared_init_class = SharedInitTensorStorage

__all__ = [
    "Storage",
    "ListStorage",
    "TensorStorage",
    "LazyTensorStorage",
    "LazyMemmapStorage",
    "SpillStorage",
    "LazyStackStorage",
    "PackedStorage",
    "StorageEnsemble",
    "CompressedListStorage",
    "CompressedTensorStorage",
    "FrameStackStorage",
    "StoreStorage",
]
