"""The write state of a storage, kept where every process that opens the storage sees it.

A storage that several processes extend needs four counters that all of them agree on: its
length, the write cursor (the dim-0 row the next batch starts at), the number of items written
since the last ``empty()``, and how many dim-0 rows of its files already have disk blocks. They
live in a small file of native-endian int64 slots, ``<scratch_dir>/.gpubuf/state``, mapped
shared into every process, and every read-modify-write of them holds an exclusive ``flock`` on
``<scratch_dir>/.gpubuf/lock``. A plain read is one aligned 8-byte load, which is atomic on every
platform torch supports, so ``len(storage)`` takes no lock.

Why a file rather than ``multiprocessing.Value``: a file is found by its path, so the same state
is reached by forked children, by spawned children that unpickle the storage, and by unrelated
processes that construct the storage on the same ``scratch_dir`` (``shared_init=True``).
``multiprocessing`` objects only travel through process creation and cannot serve the last case.

:class:`LocalState` has the same interface for a storage that no other process can see yet
(before its files exist); a storage swaps it for a :class:`FileState` when it creates them.
"""

from __future__ import annotations

import mmap
import os
import sys

from gpubuf.file_lock import FileLock
from gpubuf.storages.base import WriteCursor

__all__ = ["FileLock", "FileState", "LocalState", "STATUS_EMPTY", "STATUS_INITIALIZING", "STATUS_READY"]

_MAGIC = int.from_bytes(b"gpubufst", sys.byteorder, signed=True)
_VERSION = 1
_SLOTS = 16

# Slot numbers in the state file.
_S_MAGIC = 0
_S_VERSION = 1
_S_STATUS = 2
_S_LENGTH = 3
_S_CURSOR = 4
_S_WRITE_COUNT = 5
_S_ALLOC_ROWS = 6
_S_MAX_SIZE = 7
_S_NDIM = 8

STATUS_EMPTY = 0  # the state exists, the data files do not
STATUS_INITIALIZING = 1  # a process is creating the data files (if it died, the next one redoes it)
STATUS_READY = 2  # the data files and their layout description are complete

STATE_DIRNAME = ".gpubuf"


def state_dir(directory: str) -> str:
    """Where a storage rooted at ``directory`` keeps its state, lock and layout files."""
    return os.path.join(directory, STATE_DIRNAME)


class LocalState(WriteCursor):
    """The write counters of a storage that lives in this process only."""

    shared = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.alloc_rows = 0
        self.status = STATUS_EMPTY

    def values(self) -> dict[str, int]:
        return {"length": self.length, "cursor": self.cursor, "write_count": self.write_count}

    def close(self) -> None:
        pass


def _slot(index: int, doc: str) -> property:
    def fget(self: "FileState") -> int:
        return self._view()[index]

    def fset(self: "FileState", value: int) -> None:
        self._view()[index] = int(value)

    return property(fget, fset, doc=doc)


class FileState:
    """The write counters of a storage, in a state file shared by every process that opens it.

    Use :meth:`open` to get one. Read-modify-writes of the counters must hold :attr:`lock`.

    Attributes:
        directory: the storage's root directory (its ``scratch_dir``).
        lock: the :class:`FileLock` that serialises changes.
    """

    shared = True

    length = _slot(_S_LENGTH, "The storage's length (items over its first ``ndim`` dims).")
    cursor = _slot(_S_CURSOR, "The dim-0 row the next round-robin batch starts at.")
    write_count = _slot(_S_WRITE_COUNT, "Items written through writers since the last ``empty()``.")
    alloc_rows = _slot(_S_ALLOC_ROWS, "Dim-0 rows ``[0, alloc_rows)`` of every data file have disk blocks.")
    status = _slot(_S_STATUS, "STATUS_EMPTY, STATUS_INITIALIZING or STATUS_READY.")
    max_size = _slot(_S_MAX_SIZE, "The ``max_size`` the storage was constructed with.")
    ndim = _slot(_S_NDIM, "The ``ndim`` the storage was constructed with.")

    def __init__(self, directory: str, lock: FileLock, path: str) -> None:
        self.directory = directory
        self.lock = lock
        self.path = path
        self._map: mmap.mmap | None = None
        self._slots: memoryview | None = None
        self._map_file()

    @classmethod
    def open(cls, directory: str, *, max_size: int, ndim: int, reset: bool) -> "FileState":
        """Opens (creating when missing) the state of the storage rooted at ``directory``.

        Args:
            directory: the storage's root directory; created when missing.
            max_size, ndim: written into a new state; an existing one must hold the same values.
            reset: start from an empty storage even when a state exists (its counters are zeroed).

        Raises:
            ValueError: an existing state was made for another ``max_size`` or ``ndim``, or the
                file is not a gpubuf state file.
            OSError: the files cannot be created.
        """
        meta = state_dir(directory)
        os.makedirs(meta, exist_ok=True)
        lock = FileLock(os.path.join(meta, "lock"))
        path = os.path.join(meta, "state")
        with lock:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fresh = os.fstat(fd).st_size == 0
                if fresh or reset:
                    # Written in one call, so a reader never sees a magic without its counters.
                    slots = [0] * _SLOTS
                    slots[_S_MAGIC] = _MAGIC
                    slots[_S_VERSION] = _VERSION
                    slots[_S_MAX_SIZE] = max_size
                    slots[_S_NDIM] = ndim
                    os.pwrite(fd, b"".join(v.to_bytes(8, sys.byteorder, signed=True) for v in slots), 0)
                else:
                    raw = os.pread(fd, 8 * _SLOTS, 0)
                    values = [int.from_bytes(raw[i : i + 8], sys.byteorder, signed=True) for i in range(0, len(raw), 8)]
                    if len(values) != _SLOTS or values[_S_MAGIC] != _MAGIC or values[_S_VERSION] != _VERSION:
                        raise ValueError(f"{path} is not a gpubuf storage state file (version {_VERSION})")
                    if values[_S_MAX_SIZE] != max_size or values[_S_NDIM] != ndim:
                        raise ValueError(
                            f"the storage in {directory} was made with max_size={values[_S_MAX_SIZE]}, "
                            f"ndim={values[_S_NDIM]}; this one asks for max_size={max_size}, ndim={ndim}"
                        )
            finally:
                os.close(fd)
            return cls(directory, lock, path)

    def _map_file(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._map = mmap.mmap(fd, 8 * _SLOTS, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("q")

    def _view(self) -> memoryview:
        if self._slots is None:
            raise ValueError(f"the state file {self.path} was closed")
        return self._slots

    def values(self) -> dict[str, int]:
        return {"length": self.length, "cursor": self.cursor, "write_count": self.write_count}

    def close(self) -> None:
        if self._slots is not None:
            self._slots.release()
            self._slots = None
        if self._map is not None:
            self._map.close()
            self._map = None
        self.lock.close()

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "lock": self.lock, "path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.directory = state["directory"]
        self.lock = state["lock"]
        self.path = state["path"]
        self._map = None
        self._slots = None
        self._map_file()
