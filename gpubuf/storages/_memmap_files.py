"""The files of a memory-mapped storage: names, creation, block allocation, layout description.

One file per leaf holds the leaf's whole capacity as raw C-contiguous bytes in the machine's
byte order (little-endian on every platform gpubuf targets), shape ``[capacity_dim0,
*item_shape]``: ``torch.from_file``, ``numpy.memmap`` or a checkpoint reader opens it as is.
Files are created sparse (``ftruncate``), so a storage of 10^8 rows costs no disk until rows
are written. Before rows are written their blocks are reserved with ``posix_fallocate``: a full
disk then surfaces as :class:`DiskFullError` before any byte is copied, instead of a ``SIGBUS``
in the middle of a copy into the mapping.

Paths mirror the data's keys as TorchRL does: ``<scratch_dir>/<key>.memmap`` for a TensorDict
entry, nested keys as folders (``some/nested/data.memmap``), ``tensor.memmap`` for a plain
tensor and ``<i>.memmap`` for the i-th leaf of a pytree. The structure is described in
``<scratch_dir>/.gpubuf/layout.json`` so that a process holding no data can open the storage.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import re
import sys
import tempfile
from typing import Any
from urllib.parse import quote

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDict

from gpubuf.errors import DiskFullError, MemmapStorageError, ScratchDirError, StorageExistsError, StorageMismatchError
from gpubuf.storages._layout import Layout, LeafSpec, class_path, tensorclass_from_path
from gpubuf.storages._shared import state_dir

FORMAT = "gpubuf.memmap"
FORMAT_VERSION = 1
LAYOUT_FILE = "layout.json"


# ---------------------------------------------------------------------------------------- errors
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NO_ACCESS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENOENT}


def typed_os_error(err: OSError, what: str) -> MemmapStorageError:
    """Wraps an ``OSError`` from the file system into the matching gpubuf error (errno kept)."""
    if isinstance(err, MemmapStorageError):
        return err
    code = err.errno
    if code in _DISK_FULL:
        cls, hint = DiskFullError, "no space left for the storage's files; free disk space or choose another scratch_dir"
    elif code == errno.EEXIST:
        cls, hint = StorageExistsError, "the file exists; pass existsok=True to reuse it"
    elif code in _NO_ACCESS:
        cls, hint = ScratchDirError, "the scratch_dir is not a writable directory"
    else:
        cls, hint = MemmapStorageError, "cannot create or write the storage's files"
    typed = cls(code, f"{what}: {err.strerror or err} ({hint})", err.filename)
    typed.__cause__ = err
    return typed


# ------------------------------------------------------------------------------------ scratch dir
def check_scratch_dir(path: str) -> None:
    """Checks that ``path`` is, or can be created as, a writable directory; creates nothing.

    Raises:
        ScratchDirError: a path component is not a directory, or the directory (or its nearest
            existing ancestor) is not writable.
    """
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ScratchDirError(
            errno.ENOTDIR, f"scratch_dir {path!r} cannot be used: {probe!r} is not a directory", path
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == path else f"cannot be created: {probe!r} is not writable"
        raise ScratchDirError(errno.EACCES, f"scratch_dir {path!r} {what}", path)


def ram_available() -> int | None:
    """The host's available memory in bytes (``MemAvailable`` of ``/proc/meminfo``).

    Returns:
        The bytes, or None where ``/proc/meminfo`` cannot be read or has no such line.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def temp_base(nbytes: int) -> str:
    """Where a temporary storage of ``nbytes`` goes.

    ``/dev/shm`` (memory, no write-back to disk) when it has room for the whole capacity and the
    capacity is at most half the available RAM, as TorchRL does for its temporary memmaps;
    otherwise the system temporary directory (``TMPDIR``), so that buffers larger than memory
    live on disk.
    """
    shm = "/dev/shm"
    try:
        if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
            st = os.statvfs(shm)
            if nbytes <= st.f_bavail * st.f_frsize and nbytes <= (ram_available() or 0) // 2:
                return shm
    except OSError:
        pass
    return tempfile.gettempdir()


# ------------------------------------------------------------------------------------- file names
_SAFE = re.compile(r"^[^/\\\x00]+$")


def _path_part(part: Any) -> str:
    text = str(part)
    if _SAFE.match(text) and not text.startswith("."):
        return text
    return quote(text, safe="").replace(".", "%2E", 1) if text.startswith(".") else quote(text, safe="")


def leaf_relpath(kind: str, key: tuple) -> str:
    """The path of a leaf's file, relative to the scratch dir."""
    if kind == "tensor":
        return "tensor.memmap"
    parts = [_path_part(p) for p in key]
    return os.path.join(*parts[:-1], parts[-1] + ".memmap") if len(parts) > 1 else parts[0] + ".memmap"


# ------------------------------------------------------------------------------------ file access
def create_file(path: str, nbytes: int, *, exclusive: bool) -> int:
    """Creates (or, unless ``exclusive``, reuses) ``path`` as a sparse file of ``nbytes``; returns an fd."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, 0o644)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def adopt_file(source: str, path: str, nbytes: int) -> int:
    """Moves the complete file ``source`` (``nbytes``, on ``path``'s file system) to ``path``
    with a rename, nothing copied, and returns an fd of it.

    Raises:
        OSError: ``source`` is not ``nbytes`` long (``EINVAL``), or the rename failed.
    """
    size = os.stat(source).st_size
    if size != nbytes:
        raise OSError(errno.EINVAL, f"{source} holds {size} bytes, {nbytes} expected", source)
    os.replace(source, path)
    return open_file(path)


def open_file(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CLOEXEC)


def map_file(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Maps ``path`` shared (writes reach the file and every other process mapping it)."""
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def write_rows(fd: int, offset: int, rows: torch.Tensor) -> bool:
    """Writes the bytes of ``rows`` (a C-contiguous CPU tensor) to ``fd`` at ``offset``.

    A ``pwrite`` copies into the file's page cache without touching the storage's mapping: a
    copy through the mapping takes a page fault for every 4 KiB page on its first write, and
    again for every page the kernel has written back since (it write-protects them to track the
    next change), which at 48-byte rows is one fault every 85 rows. The mapping sees the new
    bytes at once (one page cache).

    Returns:
        False, having written nothing, when ``rows`` is not a contiguous CPU tensor.

    Raises:
        OSError: the write failed (a full disk raises ENOSPC here, not SIGBUS as through a mapping).
    """
    if rows.device.type != "cpu" or not rows.is_contiguous():
        return False
    if rows.numel() == 0:
        return True
    view = memoryview(rows.reshape(-1).view(torch.uint8).numpy())
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        view = view[done:]
        offset += done
    return True


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


#: ``cachestat``'s number, the same on every Linux architecture (the call exists from Linux 6.5 on).
_CACHESTAT = 451


@functools.lru_cache(maxsize=1)
def _syscall() -> Any:
    """libc's ``syscall`` where this is Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


#: File systems whose pages live in memory only: the kernel never writes them back, so a page
#: once written through a mapping stays writable there.
_MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})


@functools.lru_cache(maxsize=64)
def in_memory_fs(directory: str) -> bool:
    """Whether ``directory`` lives on a memory-only file system (``/dev/shm`` and other tmpfs).

    Read once per directory from ``/proc/self/mounts``: the mount point that is the longest
    prefix of the directory's real path. False where that cannot be read.
    """
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return False
    real = os.path.realpath(directory)
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind in _MEMORY_FILE_SYSTEMS


_cachestat_works = True


def mostly_dirty(fd: int, offset: int, length: int) -> bool:
    """Whether the page cache holds ``[offset, offset + length)`` of ``fd`` nearly all dirty.

    Overwriting rows through the storage's mapping is a plain copy while their pages are still
    dirty from the last write through it; once the kernel has written a page back it
    write-protects it, and the next copy takes a fault for every 4 KiB page, where a ``pwrite``
    takes none (:func:`write_rows`). The kernel's ``cachestat`` (one call, a walk of the range's
    cache entries) tells which case a write is in. False where the call is missing (older
    kernels, other systems): ``pwrite`` is then the choice, never worse than a few percent.
    """
    global _cachestat_works
    call = _syscall()
    if call is None or not _cachestat_works or length <= 0:
        return False
    span, stat = _CachestatRange(offset, length), _Cachestat()
    if call(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
        _cachestat_works = False  # ENOSYS, or a sandbox refusing it: it will not start working
        return False
    pages = (offset % 4096 + length + 4095) // 4096
    return 10 * (stat.nr_dirty + stat.nr_writeback) >= 9 * pages


def allocate_blocks(fd: int, offset: int, length: int) -> None:
    """Reserves disk blocks for ``[offset, offset + length)`` of a file (``posix_fallocate``)."""
    os.posix_fallocate(fd, offset, length)


# ------------------------------------------------------------------------------ layout description
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise StorageMismatchError(f"unknown dtype {name!r} in a storage layout file")
    return value


def describe(layout: Layout, *, max_size: int, ndim: int, capacity_dim0: int, rest_shape: list[int]) -> dict:
    """A JSON-ready description of a storage's files: enough to open them without the data."""
    leaves = []
    for spec in layout.leaves:
        leaves.append(
            {
                "key": list(spec.key),
                "dtype": _dtype_name(spec.dtype),
                "item_shape": list(spec.shape),
                "shape": [capacity_dim0, *spec.shape],
                "file": leaf_relpath(layout.kind, spec.key),
            }
        )
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "byte_order": sys.byteorder,
        "kind": layout.kind,
        "item_batch": list(layout.item_batch),
        "container": class_path(layout.container_cls) if layout.kind == "tensorclass" else None,
        "treespec": pytree.treespec_dumps(layout.treespec) if layout.kind == "pytree" else None,
        "max_size": max_size,
        "ndim": ndim,
        "capacity_dim0": capacity_dim0,
        "rest_shape": rest_shape,
        "leaves": leaves,
    }


def write_description(directory: str, description: dict) -> None:
    """Writes ``layout.json`` atomically (temporary file, then rename)."""
    meta = state_dir(directory)
    tmp = os.path.join(meta, LAYOUT_FILE + f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(description, f, indent=1)
    os.replace(tmp, os.path.join(meta, LAYOUT_FILE))


def read_description(directory: str) -> dict:
    path = os.path.join(state_dir(directory), LAYOUT_FILE)
    with open(path) as f:
        description = json.load(f)
    if description.get("format") != FORMAT or description.get("version") != FORMAT_VERSION:
        raise StorageMismatchError(
            f"{path} describes a {description.get('format')!r} v{description.get('version')} storage; this gpubuf "
            f"reads {FORMAT!r} v{FORMAT_VERSION}"
        )
    return description


def _key(raw: list) -> tuple:
    return tuple(raw)


def layout_from_description(description: dict) -> Layout:
    """Rebuilds the :class:`Layout` of a storage from its description.

    Raises:
        StorageMismatchError: the tensorclass of the stored items cannot be imported here.
    """
    kind = description["kind"]
    specs = [
        LeafSpec(_key(leaf["key"]), _dtype(leaf["dtype"]), torch.Size(leaf["item_shape"]))
        for leaf in description["leaves"]
    ]
    container_cls: type | None = None
    treespec = None
    if kind == "tensordict":
        container_cls = TensorDict
    elif kind == "tensorclass":
        try:
            container_cls = tensorclass_from_path(description["container"])
        except LookupError as err:
            raise StorageMismatchError(
                f"the storage's items cannot be rebuilt: {err} "
                "(or write a batch to the storage first: its class is then taken from the batch)"
            ) from err
    elif kind == "pytree":
        treespec = pytree.treespec_loads(description["treespec"])
    return Layout(kind, specs, torch.Size(description["item_batch"]), container_cls, treespec)


def check_same_layout(layout: Layout, description: dict, where: str) -> None:
    """Raises :class:`StorageMismatchError` when ``layout`` differs from the stored description."""
    theirs = [(_key(leaf["key"]), leaf["dtype"], list(leaf["item_shape"])) for leaf in description["leaves"]]
    ours = [(spec.key, _dtype_name(spec.dtype), list(spec.shape)) for spec in layout.leaves]
    problems = []
    if layout.kind != description["kind"]:
        problems.append(f"it holds {description['kind']} items, this batch is a {layout.kind}")
    elif layout.kind == "tensorclass" and class_path(layout.container_cls) != description["container"]:
        problems.append(f"it holds {description['container']} instances, got {class_path(layout.container_cls)}")
    if list(layout.item_batch) != list(description["item_batch"]):
        problems.append(f"its items have batch size {description['item_batch']}, got {list(layout.item_batch)}")
    if ours != theirs:
        problems.append(f"its leaves are {theirs}, got {ours}")
    if problems:
        raise StorageMismatchError(f"the storage in {where} does not match this data: " + "; ".join(problems))
