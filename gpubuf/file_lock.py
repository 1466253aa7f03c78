"""An exclusive lock between the threads and processes that share a file path.

Used by the memory-mapped storages' shared write state and by the shared priority sampler; it
sits below both, next to :mod:`gpubuf.errors`.
"""

from __future__ import annotations

import fcntl
import os
import threading
from typing import Any

__all__ = ["FileLock"]


class FileLock:
    """An exclusive lock between threads and processes: a thread lock plus ``flock`` on a file.

    Reentrant within a thread. ``flock`` belongs to an open file description, which a forked
    child shares with its parent, so a child reopens the file before its first use of the lock
    (and gets a fresh thread lock, in case another thread of the parent held it at the fork).

    Args:
        path: the lock file; created when missing.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._open()

    def _open(self) -> None:
        if self._fd >= 0:
            # The inherited descriptor: closing our copy leaves the parent's lock untouched.
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pid = os.getpid()
        self._thread_lock = threading.RLock()
        self._depth = 0

    def acquire(self) -> None:
        if self._pid != os.getpid():
            self._open()
        self._thread_lock.acquire()
        if self._depth == 0:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._thread_lock.release()
                raise
        self._depth += 1

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = -1

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self._fd = -1
        self._open()
