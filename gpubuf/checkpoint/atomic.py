"""Crash-safe replacement of a checkpoint directory.

A dump writes into a sibling temporary directory ``.<name>.gpubuf-tmp-<pid>-<hex>``, each file
synced to disk once written, writes ``meta.json`` last, fsyncs the directories, and only then
puts it in place:

* where the OS can (Linux ``renameat2(RENAME_EXCHANGE)``), the new and the previous directories
  swap names in one atomic step: at every instant ``<name>`` is one complete checkpoint, the
  previous or the new one;
* elsewhere, the previous directory is first renamed to ``.<name>.gpubuf-prev`` and the new one
  renamed to ``<name>``. A process killed between the two renames leaves no ``<name>`` but an
  intact ``.<name>.gpubuf-prev``: :func:`recover` (run by every dump and load) renames it back.

The previous checkpoint is deleted only once the new one is in place. A killed dump leaves at
most a temporary directory behind, never taken for a checkpoint (it is not at ``<name>``, and it
has no ``meta.json`` until complete); the next dump removes those of dead processes.

In place (zero copy): when a memory-mapped storage's files already lie in ``<name>``, they stay
where they are and are listed in ``meta.json`` as live. The other arrays go to a fresh
``<name>/.gpubuf-ckpt-<pid>-<hex>/`` directory and the new ``meta.json`` replaces the previous one
with one atomic rename; what the previous ``meta.json`` referenced is deleted afterwards. A kill
leaves the previous ``meta.json`` and everything it references; the debris (a
``.gpubuf-ckpt-*`` directory that ``meta.json`` does not reference and no running dump holds,
see :func:`hold`, or a ``.gpubuf-meta-*`` file of a dead process) is removed by
:func:`recover_in_place`, which every dump and load runs first. The live files themselves are the storage's: they hold its current rows, not
those of the dump time, as with TorchRL's memory-mapped checkpoints.

Two processes dumping to the same path at once are not supported.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path

from gpubuf.checkpoint.format import fsync_path

TMP_MARK = ".gpubuf-tmp-"
PREV_MARK = ".gpubuf-prev"
# Tests turn this off to exercise the two-rename path on Linux.
USE_EXCHANGE = True

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = None


def tmp_dir_for(final: Path) -> Path:
    """Creates and returns a fresh temporary directory next to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    path = final.parent / f".{final.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def prev_dir_for(final: Path) -> Path:
    return final.parent / f".{final.name}{PREV_MARK}"


def fsync_directories(root: Path) -> None:
    """fsyncs every directory below ``root`` and ``root`` itself (deepest first), so that the
    entries of the files written in them are durable. The files' own data is not flushed here:
    each writer syncs its file once it is complete (see :mod:`gpubuf.checkpoint.arrays`)."""
    for dirpath, _, _ in os.walk(root, topdown=False):
        fsync_path(Path(dirpath), directory=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths; False where the OS or filesystem cannot."""
    global _libc
    if not USE_EXCHANGE or not hasattr(os, "uname") or os.uname().sysname != "Linux":
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = _libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, f"renameat2 exchange of {a} and {b} failed: {os.strerror(err)}")


def commit(tmp: Path, final: Path) -> None:
    """Puts the complete directory ``tmp`` at ``final``, replacing what was there.

    ``tmp`` must already be fsynced. On return ``final`` is the new checkpoint, durable, and the
    previous one is gone.
    """
    parent = final.parent
    if final.exists() or final.is_symlink():
        if _exchange(tmp, final):
            fsync_path(parent, directory=True)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        prev = prev_dir_for(final)
        if prev.exists():
            shutil.rmtree(prev)
        os.rename(final, prev)
        os.rename(tmp, final)
        fsync_path(parent, directory=True)
        shutil.rmtree(prev, ignore_errors=True)
        return
    os.rename(tmp, final)
    fsync_path(parent, directory=True)


def recover(final: Path) -> None:
    """Finishes or undoes what a killed dump left next to ``final``; removes dead dumps' temp dirs.

    * ``final`` missing and ``.<name>.gpubuf-prev`` present: the dump died between its two renames;
      the previous checkpoint is renamed back to ``final``.
    * ``final`` present and ``.<name>.gpubuf-prev`` present: the dump died after putting the new
      checkpoint in place; the previous one is deleted.
    * ``.<name>.gpubuf-tmp-<pid>-*`` of a process that no longer runs: deleted.
    """
    parent = final.parent
    if not parent.is_dir():
        return
    prev = prev_dir_for(final)
    if prev.is_dir() and not prev.is_symlink():
        if not final.exists() and not final.is_symlink():
            os.rename(prev, final)
            fsync_path(parent, directory=True)
        else:
            shutil.rmtree(prev, ignore_errors=True)
    remove_dead(parent, f".{final.name}{TMP_MARK}")


def remove_dead(root: Path, prefix: str, *, files: bool = False) -> None:
    """Removes the directories (``files``: the files) in ``root`` named ``<prefix><pid>-...``
    whose process no longer runs: what killed dumps and loads left behind."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        if not (entry.is_file if files else entry.is_dir)(follow_symlinks=False):
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            if files:
                os.unlink(entry.path)
            else:
                shutil.rmtree(entry.path, ignore_errors=True)


GEN_MARK = ".gpubuf-ckpt-"
META_TMP_MARK = ".gpubuf-meta-"


def gen_dir_for(final: Path) -> Path:
    """Creates the directory of an in-place dump's copied arrays, inside ``final``."""
    path = final / f"{GEN_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def commit_meta_in_place(final: Path, text: str, keep: set[str]) -> None:
    """Atomically replaces ``final/meta.json`` with ``text``, then deletes the debris.

    Args:
        final: the checkpoint directory.
        text: the new ``meta.json``.
        keep: first path components inside ``final`` that the new checkpoint references and
            that must survive (its generation directory); other ``.gpubuf-ckpt-*`` directories
            (the previous generations) are deleted once the new ``meta.json`` is in place.
    """
    tmp = final / f"{META_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}.tmp"
    with open(tmp, "x", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, final / "meta.json")
    fsync_path(final, directory=True)
    for entry in os.scandir(final):
        if entry.name.startswith(GEN_MARK) and entry.name not in keep and not _busy(entry.path):
            shutil.rmtree(entry.path, ignore_errors=True)


def hold(directory: Path) -> int | None:
    """Takes an exclusive ``flock`` on ``directory`` for as long as the returned fd stays open.

    An in-place dump holds its generation directory this way: :func:`recover_in_place` never
    removes a directory whose dump is still running, and the kernel releases the lock when the
    dumping process dies, however it dies. None where ``flock`` does not exist.
    """
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(directory, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _busy(directory: str) -> bool:
    """Whether a running dump holds ``directory`` (see :func:`hold`)."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def recover_in_place(final: Path, referenced: set[str]) -> None:
    """Removes an in-place checkpoint's debris: generation directories that ``meta.json`` does
    not reference and no running dump holds (a killed dump's, or one superseded by a dump killed
    before it cleaned up), and temporary meta files of dead processes."""
    try:
        entries = list(os.scandir(final))
    except OSError:
        return
    for entry in entries:
        if entry.name not in referenced and entry.name.startswith(GEN_MARK) and entry.is_dir(follow_symlinks=False):
            if not _busy(entry.path):
                shutil.rmtree(entry.path, ignore_errors=True)
    remove_dead(final, META_TMP_MARK, files=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (this process does; a zombie does not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed process stays a zombie until its parent reaps it: it runs no more dumps.
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            state = file.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True
