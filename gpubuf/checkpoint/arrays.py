"""Raw array files: writing tensors with their checksums, reading them back fully verified.

Writing: an array of at least :data:`PACK_THRESHOLD` bytes gets a file of its own
(``<name>.bin``); smaller arrays of one component are concatenated into ``<component>/packed.bin``
at 64-byte aligned offsets, so that a ``ListStorage`` of many small tensors is a handful of files
rather than one per tensor. Tensors on any device are streamed in chunks (a CUDA tensor is
copied to the host one chunk at a time, never whole).

Every file's checksum (:mod:`~gpubuf.checkpoint.checksums`) is computed over the bytes as they
are written, each chunk is handed to the disk as soon as it is written
(:mod:`~gpubuf.checkpoint.writeback`), and the file is synced once, when complete: the bytes are
gone over once, and the final sync finds them mostly on disk already.

Reading: every listed file is checked (a regular file inside the checkpoint, the recorded size,
the recorded checksum) while it is read into host memory, or, for a target that copies the
bytes elsewhere anyway (a memory-mapped storage), while it is hashed through a read-only
mapping of the file; the arrays are then views of those bytes. Nothing is handed to a codec
before every file has passed.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpubuf.checkpoint.checksums import WRITTEN, Hasher, describe
from gpubuf.checkpoint.checksums import parse as parse_checksum
from gpubuf.checkpoint.errors import CheckpointCorruptError, UnsafeCheckpointError, UnserializableDataError
from gpubuf.checkpoint.format import (
    PICKLE_SUFFIXES,
    check_relpath,
    dtype_name,
    parse_dtype,
    parse_shape,
    require,
    require_int,
    resolve_inside,
)
from gpubuf.checkpoint.prefault import populate
from gpubuf.checkpoint.progress import progress_bar
from gpubuf.checkpoint.staging import Staging
from gpubuf.checkpoint.writeback import Writeback

PACK_THRESHOLD = 1 << 20
#: Files read at once by a load (each on its own thread; the copies and page faults run in parallel).
READERS = min(4, os.cpu_count() or 1)
#: Files written at once by a dump, each on its own thread.
WRITERS = READERS
ALIGN = 64
CHUNK = 16 << 20
#: Bytes hashed and written at a time: small enough to be hashed and copied out of the CPU caches,
#: large enough that a system call costs nothing next to it; each is handed to the disk at once.
WRITE_CHUNK = 8 << 20
#: Bytes read, hashed and written at a time by a copy (:func:`read_file` with ``copy_to``).
COPY_CHUNK = 4 << 20
#: Bytes per ``write``: the page cache takes folios no larger than a write, and folios of 2 MiB
#: come from the free blocks that a VM's balloon hands back to the host, which then faults every
#: page in again: 64 KiB writes measured 4x to 5x less CPU than 4 MiB ones on a Firecracker VM
#: (6.18 kernel, ext4), for about 16 system calls per MiB.
PIECE = 64 << 10
FILE_SUFFIXES = (".bin", ".h5")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_array_name(name: str) -> str:
    """Array names are ``/``-separated segments of ``[A-Za-z0-9_.-]`` (they become file paths)."""
    parts = name.split("/")
    if not name or any(not p or p in (".", "..") or not set(p) <= _NAME_CHARS for p in parts):
        raise ValueError(f"invalid array name {name!r}")
    return name


def as_raw(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor`` detached, dense, contiguous, with conj/neg bits resolved; refuses what has no raw bytes.

    Raises:
        UnserializableDataError: sparse, quantized, nested or meta tensors, or a dtype without a
            raw representation.
    """
    if not isinstance(tensor, torch.Tensor):
        raise UnserializableDataError(f"{what}: expected a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_quantized or getattr(tensor, "is_nested", False):
        raise UnserializableDataError(f"{what}: {tensor.layout} / quantized / nested tensors cannot be written as raw arrays")
    if tensor.device.type == "meta":
        raise UnserializableDataError(f"{what}: a tensor on the meta device holds no data to write")
    dtype_name(tensor.dtype)
    tensor = tensor.detach()
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor.contiguous()


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# ---------------------------------------------------------------------- writing
@dataclass
class _Pending:
    name: str
    tensor: torch.Tensor
    nbytes: int


@dataclass
class ArraySet:
    """Tensors to be written, by name; filled by codecs' output, written by :meth:`write`.

    ``live`` arrays already sit in files inside the target directory (a memory-mapped storage
    dumped where it lives): they are listed, not copied.
    """

    arrays: dict[str, _Pending] = field(default_factory=dict)
    live: dict[str, dict] = field(default_factory=dict)
    h5: dict[str, dict] = field(default_factory=dict)  # file -> {"arrays": [names], "kwargs": {...}}
    live_files: set = field(default_factory=set)

    def add(self, name: str, tensor: torch.Tensor, *, h5_file: str | None = None, h5_kwargs: dict | None = None) -> None:
        check_array_name(name)
        if name in self.arrays or name in self.live:
            raise ValueError(f"array {name!r} given twice")
        tensor = as_raw(tensor, name)
        self.arrays[name] = _Pending(name, tensor, tensor.numel() * tensor.element_size())
        if h5_file is not None:
            entry = self.h5.setdefault(h5_file, {"arrays": [], "kwargs": dict(h5_kwargs or {})})
            entry["arrays"].append(name)

    def add_live(self, name: str | None, file: str, tensor: torch.Tensor | None, offset: int = 0) -> None:
        """Lists ``file`` (relative to the target) as live: never copied, its size alone recorded.

        With a ``tensor``, the array ``name`` is that tensor's bytes in ``file`` from ``offset`` on;
        without, the file is listed only (a memory-mapped storage's own bookkeeping files).
        """
        self.live_files.add(file)
        if tensor is None:
            return
        check_array_name(name)
        if name in self.arrays or name in self.live:
            raise ValueError(f"array {name!r} given twice")
        self.live[name] = {"file": file, "offset": offset, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                           "nbytes": tensor.numel() * tensor.element_size()}

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.arrays.values())

    def write(self, root: Path, *, desc: str = "gpubuf dump", prefix: str = "", live_root: Path | None = None) -> tuple[dict, dict]:
        """Writes every array under ``root`` (a fresh directory) and syncs each file.

        The files are synced once all are written, so that the file system commits their
        metadata together (one journal commit on ext4, where a sync per file as it completes
        made one each) while their data went to disk as it was written.

        Args:
            root: where the files go.
            prefix: prepended to the recorded file paths (``root`` relative to the checkpoint).
            live_root: the checkpoint directory, which live file paths are relative to.

        Returns:
            ``(files, arrays)``, the two tables of ``meta.json``.
        """
        files: dict[str, dict] = {}
        table: dict[str, dict] = {}
        in_h5 = {name for entry in self.h5.values() for name in entry["arrays"]}
        own: list[_Pending] = []
        packs: dict[str, list[_Pending]] = {}
        for pending in self.arrays.values():
            if pending.name in in_h5:
                continue
            if pending.nbytes >= PACK_THRESHOLD or "/" not in pending.name:
                own.append(pending)
            else:
                packs.setdefault(pending.name.split("/")[0] + "/packed.bin", []).append(pending)
        placements: dict[str, list[tuple[int, _Pending]]] = {}
        for pending in own:
            rel = pending.name + ".bin"
            placements[rel] = [(0, pending)]
            table[pending.name] = _entry(rel, 0, pending)
        for rel, members in packs.items():
            placed, offset = placements.setdefault(rel, []), 0
            for pending in members:
                offset = -(-offset // ALIGN) * ALIGN
                placed.append((offset, pending))
                table[pending.name] = _entry(rel, offset, pending)
                offset += pending.nbytes
        bar = progress_bar(self.nbytes, desc)
        unsynced: list[int] = []
        try:
            written = _write_files(root, placements, bar, unsynced)
            files.update((rel, written[rel]) for rel in placements)
            for rel, entry in self.h5.items():
                members = [self.arrays[name] for name in entry["arrays"]]
                files[rel] = _write_h5(root, rel, members, entry["kwargs"], bar)
                for pending in members:
                    table[pending.name] = {**_entry(rel, 0, pending), "dataset": _dataset_name(pending.name)}
            for fd in unsynced:
                _sync_data(fd)
        finally:
            for fd in unsynced:
                os.close(fd)
            bar.close()
        files = {prefix + rel: entry for rel, entry in files.items()}
        table = {name: {**entry, "file": prefix + entry["file"]} for name, entry in table.items()}
        for rel in sorted(self.live_files):
            files[rel] = {"nbytes": os.path.getsize((live_root or root) / rel), WRITTEN: None, "live": True}
        for name, entry in self.live.items():
            table[name] = dict(entry)
        return files, table


def _entry(rel: str, offset: int, pending: _Pending) -> dict:
    return {
        "file": rel,
        "offset": offset,
        "nbytes": pending.nbytes,
        "dtype": dtype_name(pending.tensor.dtype),
        "shape": list(pending.tensor.shape),
    }


def _file_bytes(placed: list[tuple[int, _Pending]]) -> int:
    return max(offset + pending.nbytes for offset, pending in placed)


def _write_files(root: Path, placements: dict[str, list[tuple[int, _Pending]]], bar: Any,
                 unsynced: list[int]) -> dict[str, dict]:
    """Writes each file of ``placements`` (see :func:`_write_file`), the largest first on up to
    :data:`WRITERS` threads when two or more are large, and returns ``{file: its meta entry}``.

    ``os.write`` copies into the page cache without the GIL, so that one thread's copy runs
    while another hashes; every opened file is in ``unsynced`` even when a write fails."""
    order = sorted(placements, key=lambda rel: -_file_bytes(placements[rel]))
    if WRITERS < 2 or len(order) < 2 or _file_bytes(placements[order[1]]) < PACK_THRESHOLD:
        return {rel: _write_file(root, rel, placements[rel], bar, unsynced) for rel in order}
    with ThreadPoolExecutor(min(WRITERS, len(order))) as pool:
        futures = {rel: pool.submit(_write_file, root, rel, placements[rel], bar, unsynced) for rel in order}
        try:
            return {rel: future.result() for rel, future in futures.items()}
        except BaseException:
            for future in futures.values():
                future.cancel()
            raise


def _write_file(root: Path, rel: str, placed: list[tuple[int, _Pending]], bar: Any, unsynced: list[int]) -> dict:
    """Writes the arrays ``placed`` (at their offsets) to the new file ``root/rel``, hashing each
    piece as it goes out and handing each chunk to the disk; the open file goes to ``unsynced``,
    for the caller to sync (``fdatasync``) and close."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    hasher = Hasher()
    position = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    writeback = Writeback(fd)
    try:
        _reserve(fd, _file_bytes(placed))
        for offset, pending in placed:
            if offset > position:
                pad = b"\x00" * (offset - position)
                _write_all(fd, pad)
                hasher.update(pad)
                position = offset
            raw = _byte_view(pending.tensor)
            for start in range(0, pending.nbytes, WRITE_CHUNK):
                chunk = raw[start : start + WRITE_CHUNK]
                if chunk.device.type != "cpu":
                    chunk = chunk.cpu()
                # Straight from the tensor's memory (a storage's mapping, for a memory-mapped
                # one): hashed while the chunk is still in the CPU caches, then written.
                view = memoryview(chunk.numpy()).cast("B")
                for at in range(0, len(view), PIECE):
                    piece = view[at : at + PIECE]
                    hasher.update(piece)
                    _write_all(fd, piece)
                writeback.written(position + start, len(view))
                bar.update(len(view))
            position += pending.nbytes
    except BaseException:
        os.close(fd)
        raise
    unsynced.append(fd)
    return {"nbytes": position, WRITTEN: hasher.value()}


def _write_all(fd: int, view: Any) -> None:
    """``os.write`` until every byte of ``view`` is out (a write may be partial)."""
    view = memoryview(view).cast("B")
    while view.nbytes:
        done = os.write(fd, view)
        view = view[done:]


def _sync_data(fd: int) -> None:
    # fdatasync flushes the data and the size (what reading the file back needs), not the
    # timestamps; where it does not exist, fsync.
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def _dataset_name(name: str) -> str:
    """The dataset of an array in its component's HDF5 file: its name without the component."""
    return name.split("/", 1)[1] if "/" in name else name


def _write_h5(root: Path, rel: str, members: list[_Pending], kwargs: dict, bar: Any) -> dict:
    import h5py
    import numpy as np

    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w-") as h5:
        for pending in members:
            tensor = pending.tensor.cpu()
            try:
                data = tensor.numpy()
            except TypeError:
                # bfloat16 / float8 have no numpy dtype: their bytes are stored as uint8.
                data = _byte_view(tensor).numpy()
            h5.create_dataset(_dataset_name(pending.name), data=np.ascontiguousarray(data), **kwargs)
            bar.update(pending.nbytes)
    # h5py writes the file itself: its checksum needs the bytes read back (HDF5 files only).
    hasher = Hasher()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK):
            hasher.update(chunk)
        _sync_data(file.fileno())
    return {"nbytes": path.stat().st_size, WRITTEN: hasher.value()}


# ---------------------------------------------------------------------- reading
@dataclass(frozen=True)
class ArraySpec:
    name: str
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    dataset: str | None = None


def parse_tables(meta: dict) -> tuple[dict[str, dict], dict[str, ArraySpec]]:
    """Validates the ``files`` and ``arrays`` tables of ``meta.json`` (no file is opened).

    Each entry of the returned files table is ``{"nbytes", "checksum": (algorithm, value) or
    None, "live"}``; the checksum field read is the one of the header's format version.

    Raises:
        CheckpointCorruptError: a malformed entry, a size that disagrees with dtype x shape, an
            array outside its file.
        UnsafeCheckpointError: a path leading outside the checkpoint, a file type never written.
    """
    files: dict[str, dict] = {}
    for rel, entry in meta["files"].items():
        where = f"meta.json files[{rel!r}]"
        check_relpath(rel, where)
        live = entry.get("live", False) is True
        if live and rel.lower().endswith(PICKLE_SUFFIXES):
            raise UnsafeCheckpointError(f"{where}: a pickle file is never part of a checkpoint")
        if not live and not rel.endswith(FILE_SUFFIXES):
            raise UnsafeCheckpointError(f"{where}: only {'/'.join(FILE_SUFFIXES)} files are written by a dump")
        nbytes = require_int(entry, "nbytes", where)
        checksum = parse_checksum(entry, meta["version"], where, nullable=live)
        files[rel] = {"nbytes": nbytes, "checksum": checksum, "live": live}
    specs: dict[str, ArraySpec] = {}
    for name, entry in meta["arrays"].items():
        where = f"meta.json arrays[{name!r}]"
        rel = require(entry, "file", str, where)
        if rel not in files:
            raise CheckpointCorruptError(f"{where}: file {rel!r} is not in the files table")
        offset = require_int(entry, "offset", where)
        nbytes = require_int(entry, "nbytes", where)
        dtype = parse_dtype(require(entry, "dtype", str, where), where)
        shape = parse_shape(require(entry, "shape", list, where), where + ".shape")
        expected = shape.numel() * dtype.itemsize
        if nbytes != expected:
            raise CheckpointCorruptError(
                f"{where}: {nbytes} bytes recorded, but shape {list(shape)} of {dtype} needs {expected}"
            )
        dataset = entry.get("dataset")
        if dataset is not None and not isinstance(dataset, str):
            raise CheckpointCorruptError(f"{where}.dataset: expected a string")
        if dataset is None and not files[rel]["live"]:
            if offset + nbytes > files[rel]["nbytes"]:
                raise CheckpointCorruptError(
                    f"{where}: bytes [{offset}, {offset + nbytes}) lie past the end of {rel!r} ({files[rel]['nbytes']} bytes)"
                )
        if dataset is None:
            if offset % max(dtype.itemsize, 1):
                raise CheckpointCorruptError(f"{where}: offset {offset} is not aligned to {dtype} elements")
        specs[name] = ArraySpec(name, rel, offset, nbytes, dtype, shape, dataset)
    return files, specs


def _open_regular(path: Path, rel: str) -> Any:
    # O_NONBLOCK: opening a FIFO planted under a listed name must not hang the load.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    file = os.fdopen(fd, "rb", buffering=0)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        file.close()
        raise UnsafeCheckpointError(f"{rel!r} is not a regular file: refused")
    return file


def read_file(
    root: Path, rel: str, expected: dict, bar: Any, *, mapped: bool = False, copy_to: Path | None = None
) -> torch.Tensor:
    """A listed file's bytes as a host ``uint8`` tensor, its size and checksum checked.

    Args:
        root: the checkpoint directory.
        rel: the file, relative to ``root``.
        expected: its entry of the parsed files table (``nbytes`` and ``checksum``).
        bar: a progress bar (``update(nbytes)``).
        mapped: return a private (copy-on-write) mapping of the file, hashed through the mapping,
            instead of a copy read into new memory. For callers that copy the bytes elsewhere
            anyway: the file's pages are read once, by the hash, and no anonymous memory is
            faulted in. Files under :data:`PACK_THRESHOLD` bytes are read either way.
        copy_to: a new file to copy the bytes to as they are read and hashed (a memory-mapped
            storage's file to be, see :mod:`~gpubuf.checkpoint.staging`); the result is then a
            private mapping of the copy. Files under :data:`PACK_THRESHOLD` bytes are read.

    Raises:
        CheckpointCorruptError: missing, truncated, oversized, or a checksum mismatch.
        UnsafeCheckpointError: it resolves outside the checkpoint or is not a regular file.
    """
    path = resolve_inside(root, rel, "meta.json files")
    try:
        file = _open_regular(path, rel)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{rel!r} is listed in meta.json but missing") from None
    checksum = expected["checksum"]
    hasher = Hasher(checksum[0]) if checksum is not None else None
    with file:
        size = os.fstat(file.fileno()).st_size
        nbytes = expected["nbytes"]
        if size != nbytes:
            raise CheckpointCorruptError(
                f"{rel!r} is {size} bytes, meta.json records {nbytes}: "
                + ("truncated" if size < nbytes else "it has trailing bytes")
            )
        if copy_to is not None and nbytes >= PACK_THRESHOLD:
            out = _copy_verified(file, rel, nbytes, copy_to, hasher, bar)
        elif mapped and nbytes >= PACK_THRESHOLD:
            out = _map_private(file.fileno(), nbytes)
            view = memoryview(out.numpy())
            for start in range(0, nbytes, CHUNK):
                if hasher is not None:
                    hasher.update(view[start : start + CHUNK])
                bar.update(min(CHUNK, nbytes - start))
        else:
            out = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(out.numpy())
            done = 0
            while done < nbytes:
                end = min(done + CHUNK, nbytes)
                if nbytes >= PACK_THRESHOLD:
                    populate(out, done, end - done)  # the read below then faults no page in
                got = file.readinto(view[done:end])
                if not got:
                    raise CheckpointCorruptError(f"{rel!r} ended after {done} of {nbytes} bytes (truncated while read)")
                if hasher is not None:
                    hasher.update(view[done : done + got])
                done += got
                bar.update(got)
            if file.read(1):
                raise CheckpointCorruptError(f"{rel!r} grew past {nbytes} bytes while read")
    if hasher is not None and hasher.value() != checksum[1]:
        raise CheckpointCorruptError(
            f"{rel!r}: {checksum[0]} checksum {describe(hasher.value())} does not match {describe(checksum[1])} in "
            "meta.json (the file is corrupt)"
        )
    return out


def _copy_verified(file: Any, rel: str, nbytes: int, copy_to: Path, hasher: Hasher | None, bar: Any) -> torch.Tensor:
    """Copies the open checkpoint file ``file`` to the new file ``copy_to`` through a buffer of
    :data:`COPY_CHUNK` bytes, hashing each chunk between its read and its write; returns a
    private mapping of the copy.

    The copy is not synced: it becomes a memory-mapped storage's file, which is never synced.
    """
    buffer = memoryview(bytearray(COPY_CHUNK))
    copy_to.parent.mkdir(parents=True, exist_ok=True)
    out_fd = os.open(copy_to, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        _reserve(out_fd, nbytes)
        done = 0
        while done < nbytes:
            got = file.readinto(buffer[: min(COPY_CHUNK, nbytes - done)])
            if not got:
                raise CheckpointCorruptError(f"{rel!r} ended after {done} of {nbytes} bytes (truncated while read)")
            chunk = buffer[:got]
            if hasher is not None:
                hasher.update(chunk)
            written = 0
            while written < got:
                written += os.pwrite(out_fd, chunk[written : written + PIECE], done + written)
            done += got
            bar.update(got)
        if file.read(1):
            raise CheckpointCorruptError(f"{rel!r} grew past {nbytes} bytes while read")
        return _map_private(out_fd, nbytes, read_ahead=False)
    finally:
        os.close(out_fd)


def _reserve(fd: int, nbytes: int) -> None:
    """Allocates the blocks of a new file before it is written: a full disk fails here, and the
    writes that follow skip the file system's block allocation (measured 1.5x to 5x faster on
    ext4 than writes that allocate as they go)."""
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is None:
        return
    try:
        allocate(fd, 0, nbytes)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise  # ENOSPC above all


def _map_private(fd: int, nbytes: int, *, read_ahead: bool = True) -> torch.Tensor:
    """A copy-on-write mapping of the first ``nbytes`` of ``fd`` as a ``uint8`` tensor (it keeps
    the mapping alive; writes to it never reach the file)."""
    block = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    # Read ahead of the hash. (Not MADV_SEQUENTIAL: it lets the kernel drop the pages right
    # behind the hash, and the copy that follows would read them from disk again.)
    if read_ahead and hasattr(mmap, "MADV_WILLNEED"):
        try:
            block.madvise(mmap.MADV_WILLNEED)
        except OSError:
            pass  # advice only
    return torch.frombuffer(block, dtype=torch.uint8, count=nbytes)


def view_array(raw: torch.Tensor, spec: ArraySpec) -> torch.Tensor:
    """The typed array ``spec`` within the bytes ``raw`` of its file (a view, no copy)."""
    chunk = raw[spec.offset : spec.offset + spec.nbytes]
    if spec.dtype != torch.uint8:
        chunk = chunk.view(spec.dtype)
    return chunk.view(spec.shape)


def read_h5_array(path: Path, spec: ArraySpec) -> torch.Tensor:
    """Reads dataset ``spec.dataset`` of an (already verified) HDF5 file, refusing links to other files.

    Raises:
        UnsafeCheckpointError: the dataset is a soft or external link, a virtual dataset, or has
            external storage: any of these reads bytes outside the checked file.
        CheckpointCorruptError: a missing dataset or one of another dtype / shape.
    """
    import h5py

    with h5py.File(path, "r") as h5:
        link = h5.get(spec.dataset, getlink=True)
        if link is None:
            raise CheckpointCorruptError(f"{spec.file!r} has no dataset {spec.dataset!r}")
        if not isinstance(link, h5py.HardLink):
            raise UnsafeCheckpointError(f"{spec.file!r}: dataset {spec.dataset!r} is a link: refused")
        dset = h5[spec.dataset]
        if not isinstance(dset, h5py.Dataset) or dset.is_virtual or dset.external:
            raise UnsafeCheckpointError(f"{spec.file!r}: {spec.dataset!r} is not a plain dataset: refused")
        data = dset[()]
    tensor = torch.from_numpy(data.copy() if not data.flags.writeable else data).reshape(-1)
    if tensor.dtype == torch.uint8 and spec.dtype != torch.uint8 and tensor.numel() == spec.nbytes:
        tensor = tensor.view(spec.dtype)
    if tensor.dtype != spec.dtype or tensor.numel() != spec.shape.numel():
        raise CheckpointCorruptError(
            f"{spec.file!r}: dataset {spec.dataset!r} holds {tensor.numel()} x {tensor.dtype}, meta.json records "
            f"{list(spec.shape)} x {spec.dtype}"
        )
    return tensor.view(spec.shape)


def read_arrays(
    root: Path,
    files: dict[str, dict],
    specs: dict[str, ArraySpec],
    *,
    desc: str = "gpubuf load",
    mapped: str | None = None,
    stage: Staging | None = None,
) -> dict[str, Any]:
    """Reads and verifies every non-live file, then returns ``{array name: host tensor}``.

    Arrays of live files are returned as :class:`LiveArray` (their path; nothing is read). Large
    files whose path starts with ``mapped`` (a component's folder, ``"storage/"``) are verified
    through private mappings (see :func:`read_file`): for a component whose codec copies the
    arrays into its own memory before the load returns. Large files under ``stage.prefix`` are
    copied into ``stage``'s folder while verified, and the arrays that fill one of those copies
    whole are listed in ``stage.arrays`` (see :mod:`~gpubuf.checkpoint.staging`).
    """
    total = sum(f["nbytes"] for f in files.values() if not f["live"])
    staged = set()
    if stage is not None:
        staged = {
            rel for rel, f in files.items()
            if not f["live"] and rel.startswith(stage.prefix) and rel.endswith(".bin") and f["nbytes"] >= PACK_THRESHOLD
        }
    if staged:
        stage.open(sum(files[rel]["nbytes"] for rel in staged))

    def read(rel: str) -> torch.Tensor:
        return read_file(
            root, rel, files[rel], bar, mapped=mapped is not None and rel.startswith(mapped),
            copy_to=stage.directory / rel if rel in staged else None,
        )

    # Largest first, on READERS threads (reads, copies and page faults run without the GIL).
    order = sorted((rel for rel, f in files.items() if not f["live"]), key=lambda rel: -files[rel]["nbytes"])
    bar = progress_bar(total, desc)
    raws: dict[str, torch.Tensor] = {}
    try:
        if READERS > 1 and len(order) > 1 and files[order[1]]["nbytes"] >= PACK_THRESHOLD:
            with ThreadPoolExecutor(min(READERS, len(order))) as pool:
                futures = {rel: pool.submit(read, rel) for rel in order}
                try:
                    for rel, future in futures.items():
                        raws[rel] = future.result()
                except BaseException:
                    for future in futures.values():
                        future.cancel()
                    raise
        else:
            for rel in order:
                raws[rel] = read(rel)
    finally:
        bar.close()
    if staged:
        for name, spec in specs.items():
            if spec.file in staged and spec.dataset is None and spec.offset == 0 and spec.nbytes == files[spec.file]["nbytes"]:
                stage.arrays[name] = stage.directory / spec.file
    for rel, expected in files.items():
        if expected["live"]:
            # A live file keeps changing after the dump (it is a storage's mapped file): only its
            # presence as a regular file inside the checkpoint is checked here, its size below.
            path = resolve_inside(root, rel, "meta.json files")
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{rel!r} is listed in meta.json but missing") from None
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeCheckpointError(f"{rel!r} is not a regular file: refused")
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        if files[spec.file]["live"]:
            path = resolve_inside(root, spec.file, f"meta.json arrays[{name!r}]")
            size = os.stat(path).st_size
            if size < spec.offset + spec.nbytes:
                raise CheckpointCorruptError(
                    f"{spec.file!r} is {size} bytes, too short for array {name!r} (bytes up to {spec.offset + spec.nbytes})"
                )
            out[name] = LiveArray(path, spec)
        elif spec.dataset is not None:
            out[name] = read_h5_array(resolve_inside(root, spec.file, "meta.json"), spec)
        else:
            out[name] = view_array(raws[spec.file], spec)
    return out


@dataclass(frozen=True)
class LiveArray:
    """An array left in place in a live (memory-mapped) file; a codec maps it itself."""

    path: Path
    spec: ArraySpec

    def map(self, *, shared: bool = True) -> torch.Tensor:
        """Maps the file and returns the array's typed view (writes reach the file when ``shared``)."""
        nbytes = self.spec.offset + self.spec.nbytes
        raw = torch.from_file(str(self.path), shared=shared, size=nbytes, dtype=torch.uint8)
        return view_array(raw, self.spec)

    def read(self) -> torch.Tensor:
        """A private host copy of the array's current bytes."""
        return self.map(shared=False).clone()
