"""Typed errors of checkpointing.

Every error derives from :class:`CheckpointError`, itself a :class:`~gpubuf.errors.GpubufError`
and a ``ValueError``. Whenever one is raised by a load, the target buffer is exactly as it was
before the call; whenever one is raised by a dump, the checkpoint previously at the target path
(if any) is exactly as it was.
"""

from __future__ import annotations

from gpubuf.errors import GpubufError, UnsupportedDataError

__all__ = [
    "CheckpointError",
    "NotACheckpointError",
    "CheckpointCorruptError",
    "CheckpointVersionError",
    "UnsafeCheckpointError",
    "CheckpointMismatchError",
    "UnserializableDataError",
    "CheckpointWarning",
    "CheckpointPathError",
    "CheckpointIOError",
]


class CheckpointError(GpubufError, ValueError):
    """Base class of every checkpoint error."""


class NotACheckpointError(CheckpointError):
    """The path is not a checkpoint: a foreign or partial directory, or a missing one.

    Also raised by a dump that would replace a non-empty directory that is not a checkpoint, or
    a checkpoint holding a memory-mapped storage's own files (which the replacement would delete).
    """


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's content is inconsistent: a truncated or oversized file, a checksum that
    does not match, a size / dtype / shape that disagrees with ``meta.json``, or a malformed
    ``meta.json``."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written in a format version this gpubuf cannot read."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint holds something that is never read: a symlink or a path leading outside the
    checkpoint directory, a pickle file, or any file ``meta.json`` does not list."""


class CheckpointMismatchError(CheckpointError):
    """A valid checkpoint that does not fit the target buffer: another storage, sampler or writer
    kind, another capacity, or another data layout."""


class UnserializableDataError(CheckpointError, UnsupportedDataError):
    """The buffer holds an object that cannot be written without pickle (e.g. an instance of an
    arbitrary class in a ``ListStorage``). Also a ``TypeError``, as TorchRL raises for data it
    cannot store."""


class CheckpointPathError(CheckpointError, TypeError):
    """A checkpoint path that is not a path (``None``, a number): also a ``TypeError``, as
    ``os.fspath`` raises."""


class CheckpointIOError(CheckpointError, OSError):
    """The file system refused a checkpoint's files: a path under a regular file, no permission,
    no space. Also an ``OSError``; the previous checkpoint at the path (if any) is intact."""


class CheckpointWarning(UserWarning):
    """Something of a checkpoint was skipped on purpose (e.g. a pickle file of a TorchRL
    checkpoint, never unpickled) or could not be restored here (e.g. a CUDA generator state on a
    machine without CUDA)."""
