"""Pickle-free, crash-safe checkpoints of replay buffers.

``ReplayBuffer.dumps(path)`` / ``loads(path)`` (aliases ``dump``, ``save``, ``load``) call
:func:`dump_buffer` / :func:`load_buffer`. A checkpoint is a directory holding ``meta.json``
(format name and version, each component's codec and state, the size, dtype, shape and XXH3-64 checksum of
every array) and raw little-endian array files that ``torch.from_file`` or ``numpy.memmap`` can
open; see :mod:`gpubuf.checkpoint.format`.

* No pickle anywhere: nothing is ever unpickled, and a pickle file found in a checkpoint is
  refused (:class:`UnsafeCheckpointError`).
* Crash safety: a dump is written to a temporary directory and renamed into place
  (:mod:`gpubuf.checkpoint.atomic`).
* Validation first: a load checks everything before it changes the buffer.
* Each storage, sampler and writer goes through a small codec registered for its class
  (:func:`register_codec`); storages' codecs are the checkpointer classes, which keep TorchRL's
  names.
* A checkpoint written by TorchRL's ``ReplayBuffer.dumps`` loads too
  (:mod:`gpubuf.checkpoint.torchrl_import`).
"""

from gpubuf.checkpoint.buffer import (
    dump_buffer,
    dump_component,
    dump_storage,
    load_buffer,
    load_component,
    load_storage,
)
from gpubuf.checkpoint.base import StorageCheckpointerBase
from gpubuf.checkpoint.ensemble import StorageEnsembleCheckpointer
from gpubuf.checkpoint.list_storage import CompressedListStorageCheckpointer, ListStorageCheckpointer
from gpubuf.checkpoint.tensor_storage import TensorStorageCheckpointer
from gpubuf.checkpoint.codecs import Codec, Context, H5Array, LiveFile, StateDictCodec, codec_for, register_codec
from gpubuf.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    CheckpointIOError,
    CheckpointPathError,
    CheckpointWarning,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnserializableDataError,
)
from gpubuf.checkpoint.format import FORMAT_NAME, FORMAT_VERSION
from gpubuf.checkpoint.ted import FlatStorageCheckpointer, H5StorageCheckpointer, NestedStorageCheckpointer

# Registers the prioritized sampler's codec.
from gpubuf.checkpoint import prioritized as _prioritized  # noqa: E402,F401

__all__ = [
    "dump_buffer",
    "load_buffer",
    "dump_storage",
    "load_storage",
    "dump_component",
    "load_component",
    "StorageCheckpointerBase",
    "TensorStorageCheckpointer",
    "FlatStorageCheckpointer",
    "NestedStorageCheckpointer",
    "H5StorageCheckpointer",
    "ListStorageCheckpointer",
    "CompressedListStorageCheckpointer",
    "StorageEnsembleCheckpointer",
    "Codec",
    "Context",
    "LiveFile",
    "H5Array",
    "StateDictCodec",
    "codec_for",
    "register_codec",
    "CheckpointError",
    "NotACheckpointError",
    "CheckpointCorruptError",
    "CheckpointVersionError",
    "UnsafeCheckpointError",
    "CheckpointMismatchError",
    "UnserializableDataError",
    "CheckpointIOError",
    "CheckpointPathError",
    "CheckpointWarning",
    "FORMAT_NAME",
    "FORMAT_VERSION",
]
