"""Removing a storage's files when the process that made them ends, or when the storage goes away.

Each memory-mapped storage has a :class:`Cleaner` that knows its files. With
``auto_cleanup=True`` the cleaner runs, in the process that created the files only:

- when the storage is garbage-collected (a ``weakref.finalize`` on the storage object itself,
  so that copies of the storage, such as a checkpoint loader's shallow copy, never trigger it);
- on normal interpreter exit, which also covers Ctrl+C: the default SIGINT handler raises
  ``KeyboardInterrupt`` and an uncaught one ends the interpreter through the same exit path.
  gpubuf does not replace the SIGINT handler, so a program that catches ``KeyboardInterrupt``
  (a notebook, an interactive loop) keeps its buffer;
- at the end of a ``multiprocessing`` child, which leaves through ``os._exit`` and skips
  ``atexit`` but runs ``multiprocessing``'s finalizers;
- on SIGTERM, through a handler installed from the main thread unless the program ignores
  SIGTERM. It removes the files, then hands the signal to the previous handler, or restores
  the default action and re-raises it, so that the process still dies of SIGTERM.

A forked child inherits the registry and the handlers, but a cleaner only acts in the process
recorded as the files' owner, so a child never deletes its parent's buffer.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import threading
import weakref
from typing import Any

_LIVE: set["Cleaner"] = set()
_REGISTERED_PID: int | None = None
_PREVIOUS_SIGTERM: Any = None


class Cleaner:
    """Removes one storage's files.

    Attributes:
        root: the storage's directory (None until known).
        whole_dir: remove ``root`` entirely (a temporary directory the storage made); otherwise
            only :attr:`paths`, the ``.gpubuf`` folder and the folders left empty.
        paths: the data files.
        owner_pid: the process that created the files (or the directory), the only one where
            automatic cleanup acts; None while no process of this handle created them.
        auto: whether automatic cleanup is on (``auto_cleanup``).
        done: cleanup ran.
    """

    def __init__(self, *, auto: bool) -> None:
        self.root: str | None = None
        self.whole_dir = False
        self.paths: list[str] = []
        self.owner_pid: int | None = None
        self.auto = auto
        self.done = False

    def run(self) -> bool:
        """Removes the files now, whichever process this is. True if something was removed."""
        if self.done:
            return False
        self.done = True
        _LIVE.discard(self)
        root = self.root
        if root is None or not os.path.isdir(root):
            return False
        if self.whole_dir:
            shutil.rmtree(root, ignore_errors=True)
            return not os.path.exists(root)
        removed = False
        for path in self.paths:
            try:
                os.unlink(path)
                removed = True
            except OSError:
                continue
            parent = os.path.dirname(path)
            while parent != root and parent.startswith(root + os.sep) and _rmdir(parent):
                parent = os.path.dirname(parent)
        meta = os.path.join(root, ".gpubuf")
        if os.path.isdir(meta):
            shutil.rmtree(meta, ignore_errors=True)
            removed = True
        _rmdir(root)
        return removed

    def run_if_owner(self) -> None:
        """Automatic cleanup: acts only when enabled, and in the owning process."""
        if self.auto and not self.done and self.owner_pid == os.getpid():
            try:
                self.run()
            except Exception:
                # Exit paths must not fail; what could not be removed stays.
                pass

    def __getstate__(self) -> dict:
        # A copy sent to another process describes the same files but never owns them.
        state = dict(self.__dict__)
        state["owner_pid"] = None
        return state


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


def track(storage: Any, cleaner: Cleaner) -> None:
    """Runs ``cleaner`` (if owner) when ``storage`` is collected or the process ends."""
    _ensure_handlers()
    _LIVE.add(cleaner)
    weakref.finalize(storage, cleaner.run_if_owner)


def cleanup_all() -> None:
    """Runs every live cleaner owned by this process; never raises."""
    for cleaner in list(_LIVE):
        cleaner.run_if_owner()


def _on_sigterm(signum: int, frame: Any) -> None:
    cleanup_all()
    previous = _PREVIOUS_SIGTERM
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ensure_handlers() -> None:
    global _REGISTERED_PID, _PREVIOUS_SIGTERM
    pid = os.getpid()
    if _REGISTERED_PID == pid:
        return
    _REGISTERED_PID = pid
    atexit.register(cleanup_all)
    import multiprocessing.util

    # A multiprocessing child clears the finalizers it inherits and runs its own at exit.
    multiprocessing.util.Finalize(None, cleanup_all, exitpriority=0)
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        current = signal.getsignal(signal.SIGTERM)
        if current is _on_sigterm or current == signal.SIG_IGN:
            return
        _PREVIOUS_SIGTERM = current if callable(current) else None
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        # Signals are unavailable here (e.g. an embedded interpreter): the exit paths remain.
        pass
