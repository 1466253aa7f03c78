"""Typed errors raised by gpubuf.

Every error derives from :class:`GpubufError` and from the builtin exception
that TorchRL raises in the same situation (``ValueError``, ``TypeError``,
``RuntimeError`` or ``IndexError``), so code written against TorchRL that
catches builtin exceptions keeps working, and new code can catch the precise
type.

Whenever one of these is raised by a buffer, storage, sampler or writer, the
object is left exactly as it was before the call: no row written, no cursor
moved, no priority changed.
"""

from __future__ import annotations

__all__ = [
    "GpubufError",
    "SchemaMismatchError",
    "DTypeMismatchError",
    "DeviceMismatchError",
    "UnsupportedDataError",
    "EmptyBufferError",
    "BatchSizeError",
    "CapacityError",
    "IndexOutOfRangeError",
    "BackendUnavailableError",
    "PriorityError",
    "MemmapStorageError",
    "ScratchDirError",
    "StorageExistsError",
    "DiskFullError",
    "StorageMismatchError",
    "NotSharableError",
    "StorageNotSharableError",
    "RankKeyError",
    "RankValueError",
    "ImmutableStorageError",
    "EnsembleBatchSizeError",
    "CorruptRowError",
    "SliceArgumentError",
    "TrajectoryKeyError",
    "TrajectoryLengthError",
    "TrajectoryStepError",
    "ShardUnavailableError",
    "RateLimitTimeoutError",
    "InvalidArgumentError",
    "ArgumentConflictError",
    "UnsupportedOptionError",
    "InvalidDeviceError",
    "ComponentTypeError",
    "InvalidIndexError",
    "InvalidSliceError",
    "MissingKeyError",
    "StateDictError",
    "StateDictKeyError",
    "WritePositionError",
    "BufferShutDownError",
]


class GpubufError(Exception):
    """Base class of every error gpubuf raises on purpose."""


class SchemaMismatchError(GpubufError, ValueError, RuntimeError):
    """A batch's keys or trailing shapes differ from what the storage holds.

    Also a RuntimeError: TorchRL raises one for a shape mismatch on ``extend``."""


class DTypeMismatchError(GpubufError, TypeError, RuntimeError):
    """A batch's leaf has another dtype than the storage's leaf of that key.

    Also a RuntimeError: TorchRL raises one for a dtype mismatch on ``extend``."""


class DeviceMismatchError(GpubufError, ValueError):
    """A tensor is on a device that the operation cannot accept."""


class UnsupportedDataError(GpubufError, TypeError):
    """The data's type cannot be held by this storage (e.g. a str in a TensorStorage)."""


class EmptyBufferError(GpubufError, RuntimeError):
    """Sampling or reading was asked of a buffer that holds no item."""


class BatchSizeError(GpubufError, RuntimeError, ValueError):
    """No batch size was given, neither to the constructor nor to ``sample``, or it is invalid.

    Also a ``ValueError``: TorchRL raises one for a batch size a sampler without replacement cannot
    serve (``drop_last=True`` without a batch size, or with fewer items than a batch)."""


class CapacityError(GpubufError, ValueError):
    """A capacity (``max_size``) that is not a positive integer, that overflows int64, or whose
    allocation cannot fit in the memory of its device."""


class IndexOutOfRangeError(GpubufError, IndexError):
    """An index outside the written range of a storage or priority tree."""


class BackendUnavailableError(GpubufError, RuntimeError):
    """An explicit kernel backend was requested that cannot run here."""


class PriorityError(GpubufError, ValueError, RuntimeError):
    """A priority that is NaN, infinite or negative, or whose shape does not match its index.

    Also a RuntimeError: TorchRL raises one for a priority / index length mismatch."""


# ------------------------------------------------------------------ memory-mapped storages
class MemmapStorageError(GpubufError, OSError):
    """The files of a memory-mapped storage cannot be created, opened or written.

    Raised before anything is changed: rows already stored stay intact and readable.
    """


class ScratchDirError(MemmapStorageError):
    """The ``scratch_dir`` cannot hold the storage: not writable, or not a directory."""


class StorageExistsError(MemmapStorageError, FileExistsError, RuntimeError):
    """The storage's files already exist and ``existsok=False`` (also a ``RuntimeError``, the
    class TorchRL raises there)."""


class DiskFullError(MemmapStorageError):
    """No space left on the device (``ENOSPC``/``EDQUOT``) for the rows being written."""


class StorageMismatchError(SchemaMismatchError):
    """A storage found on disk was made with another capacity, ``ndim`` or data layout."""


class NotSharableError(GpubufError, RuntimeError):
    """A component cannot be sent to a spawned process: the copy there would diverge from this one."""


class StorageNotSharableError(NotSharableError):
    """A storage cannot be sent to another process in its current state."""


# ------------------------------------------------------------------ writers and ensembles
class RankKeyError(SchemaMismatchError, KeyError):
    """The data written has no entry at the writer's ``rank_key`` (a ``KeyError`` too, as in TorchRL)."""

    def __str__(self) -> str:
        # KeyError quotes its message; this one is a sentence.
        return str(self.args[0]) if self.args else ""


class RankValueError(GpubufError, ValueError):
    """A rank that cannot be ordered (NaN)."""


class ImmutableStorageError(GpubufError, RuntimeError):
    """A write (add, extend, set, empty) was asked of a dataset or storage that takes none.

    A ``RuntimeError``, as TorchRL raises in the same situation.
    """


class EnsembleBatchSizeError(BatchSizeError, ValueError):
    """A batch size that is not a multiple of ``num_buffer_sampled`` (a ``ValueError`` as in TorchRL)."""


# ------------------------------------------------------------------ compressed rows
class CorruptRowError(GpubufError, ValueError):
    """A stored compressed row failed verification on read.

    Raised instead of returning data when a row's length disagrees with what its header
    describes, its checksum does not match its bytes, its header holds an impossible line mode,
    its runs do not cover its lines exactly, or its reference row is missing or itself refers
    to another row. Nothing is returned for the batch (no partially decoded output escapes).

    Attributes:
        rows: the storage-level row numbers (as given in the read's index) that failed, sorted.
    """

    def __init__(self, message: str, rows: list[int] | None = None) -> None:
        super().__init__(message)
        self.rows = list(rows or [])


# ------------------------------------------------------------------ slice samplers
class SliceArgumentError(GpubufError, TypeError, ValueError, RuntimeError):
    """Slice sampler arguments that do not fit together: both or neither of ``num_slices`` and
    ``slice_len``, a non-positive one, exclusive boundary sources given together, or
    ``pad_output`` with ``strict_length``. TorchRL raises a ``TypeError``, ``RuntimeError`` or
    ``ValueError`` for these depending on the case; this class is all three."""


class TrajectoryKeyError(SchemaMismatchError, KeyError):
    """The storage holds none of the entries a slice sampler reads trajectory boundaries from
    (``traj_key``, ``end_key`` / ``end_keys``); a ``KeyError`` too."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TrajectoryLengthError(GpubufError, RuntimeError):
    """No stored trajectory is long enough for the slices asked for (``strict_length=True``),
    a ``RuntimeError`` as in TorchRL."""


class TrajectoryStepError(GpubufError, TypeError, ValueError, RuntimeError):
    """Stored trajectory ids or step numbers a fragmented slice sampler cannot order: not one
    integer per step, a negative step, or two stored steps with the same trajectory and step.
    TorchRL raises a ``TypeError``, ``ValueError`` or ``RuntimeError`` for these; this class is all three."""


class BufferShutDownError(GpubufError, RuntimeError):
    """A sample, or a conditional update submitted to run in the background, asked of a buffer
    after its ``shutdown()`` (TorchRL raises a ``RuntimeError``). Writes, reads by index and
    checkpoints still work; a shut down buffer cannot be started again."""


# ------------------------------------------------------------------ distributed buffers
class ShardUnavailableError(GpubufError, RuntimeError):
    """A shard of a distributed buffer cannot be reached: its actor died or is restarting.

    The other shards keep serving; a restarted shard reloads its last checkpoint.

    Attributes:
        shard: the number of the shard that failed.
    """

    def __init__(self, message: str, shard: int) -> None:
        super().__init__(message)
        self.shard = shard

    def __reduce__(self):
        # Keeps ``shard`` when the error crosses a process boundary (Ray tasks).
        return (type(self), (self.args[0], self.shard))


class RateLimitTimeoutError(GpubufError, TimeoutError):
    """A rate limiter did not admit an insert or a sample before the timeout (at once for ``wait=False``).

    Nothing was written or sampled: the call can be retried.
    """


# ------------------------------------------------------------------ arguments, indices, state
class InvalidArgumentError(GpubufError, ValueError):
    """A constructor or method argument outside its accepted range (an exponent that is negative
    or not finite, an unknown reduction, ``ndim < 1``, ``dim_extend`` past the data's dims,
    ``prefetch < 0``). A ``ValueError``, as TorchRL raises."""


class ArgumentConflictError(InvalidArgumentError, RuntimeError):
    """Arguments that exclude each other (``p`` with ``sample_from_all=True``, ``routing_key`` with
    ``routing_dim``), or an ensemble without members. Also a ``RuntimeError``: TorchRL raises a
    ``RuntimeError`` or a ``ValueError`` for these depending on the case."""


class UnsupportedOptionError(GpubufError, NotImplementedError):
    """An option TorchRL does not implement either (a priority ``dtype`` other than float32 and
    float64). A ``NotImplementedError``, as TorchRL raises."""


class InvalidDeviceError(DeviceMismatchError, RuntimeError):
    """A device that does not exist here: a malformed device string (``"gpu0"``) or a CUDA device
    without CUDA. Also a ``RuntimeError``, which torch raises for a malformed device string."""


class ComponentTypeError(GpubufError, TypeError):
    """A component (storage, sampler, writer) or argument of the wrong type."""


class InvalidIndexError(GpubufError, IndexError, TypeError):
    """An index that does not address items: a float, a float tensor, a boolean mask whose length
    differs from the buffer's, or an index of another kind than int, slice, sequence or tensor of
    ints. An ``IndexError`` (torch raises it for a float index) and a ``TypeError`` (TorchRL's
    priority update raises it for indices that are not ints)."""


class WritePositionError(IndexOutOfRangeError, RuntimeError):
    """A write at a position a list-like storage cannot take: more than one item past its end, past
    its capacity, or (``rb[i] = item``) past the items it holds. Also a ``RuntimeError``, as
    TorchRL raises."""


class InvalidSliceError(InvalidIndexError, ValueError):
    """A slice with a zero or negative step. Also a ``ValueError``, as torch raises."""


class MissingKeyError(SchemaMismatchError, KeyError):
    """A key the stored items do not have (``rb["nope"]``, ``update_tensordict_priority`` of a
    TensorDict without ``"index"``). Also a ``KeyError``, as TensorDict raises."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StateDictError(GpubufError, ValueError):
    """A state dict (``load_state_dict``) that does not fit the buffer or component it is loaded
    into: a value of the wrong type or out of range, a capacity, layout or buffer kind that
    differs, or components that disagree with each other. Nothing is loaded."""


class StateDictKeyError(StateDictError, KeyError):
    """A state dict that lacks a key (also a ``KeyError``, as TorchRL raises). Nothing is loaded."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
