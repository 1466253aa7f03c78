"""Storage checkpointers, with TorchRL's class names: the codecs of storages.

A storage is written by ``storage.checkpointer`` when one is set, else by the checkpointer
registered for its class (:class:`TensorStorageCheckpointer` for tensor and memory-mapped
storages, :class:`ListStorageCheckpointer` for list storages). Each can also write or read a
storage on its own with :meth:`StorageCheckpointerBase.dumps` /
:meth:`~StorageCheckpointerBase.loads`.

Hooks: save hooks registered on the checkpointer or on the storage
(``storage.register_save_hook``) are called, in that order, on the storage's whole content
before it is written: ``hook(data, path=scratch_dir)`` (``path`` only when the hook takes it;
files it writes there are discarded). Load hooks are called on what was read, before it is
installed: ``hook(data, out=None)``. With hooks, the content is written as a value (see
:mod:`gpubuf.checkpoint.values`), so whatever structure the hooks return is kept.
"""

from gpubuf.checkpoint.base import StorageCheckpointerBase, call_hook
from gpubuf.checkpoint.codecs import is_memmap, storage_codec
from gpubuf.checkpoint.ensemble import StorageEnsembleCheckpointer
from gpubuf.checkpoint.values import decode_layout, encode_layout
from gpubuf.checkpoint.list_storage import CompressedListStorageCheckpointer, ListStorageCheckpointer
from gpubuf.checkpoint.tensor_storage import TensorStorageCheckpointer
from gpubuf.checkpoint.ted import FlatStorageCheckpointer, H5StorageCheckpointer, NestedStorageCheckpointer

__all__ = [
    "StorageCheckpointerBase",
    "TensorStorageCheckpointer",
    "FlatStorageCheckpointer",
    "NestedStorageCheckpointer",
    "H5StorageCheckpointer",
    "ListStorageCheckpointer",
    "CompressedListStorageCheckpointer",
    "StorageEnsembleCheckpointer",
    "call_hook",
    "decode_layout",
    "encode_layout",
    "is_memmap",
    "storage_codec",
]
