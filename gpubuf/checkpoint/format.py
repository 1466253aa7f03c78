"""The on-disk format: ``meta.json`` schema and version, dtypes, and safe path handling.

A checkpoint is a directory::

    meta.json                  written last; its presence marks a complete checkpoint
    storage/leaf_0.bin ...     raw little-endian arrays, one file per large array
    storage/packed.bin         small arrays of a component, concatenated (64-byte aligned)
    sampler/..., writer/..., rng/...

``meta.json`` (format version 2)::

    {
      "format": "gpubuf.checkpoint", "version": 2, "byteorder": "little",
      "created_by": "gpubuf 0.1.0", "kind": "buffer" | "storage",
      "buffer": {"class": ..., "batch_size": ..., "transforms": <value>, "rng": {"device", "state"} | null},
      "components": {"storage": {"codec", "codec_version", "class", "state"}, "sampler": ..., "writer": ...},
      "files":  {"storage/leaf_0.bin": {"nbytes": 120, "xxh3_64": "9b0b9b6c8a1f0e3d"}, ...},
      "arrays": {"storage/leaf_0": {"file": "storage/leaf_0.bin", "offset": 0, "nbytes": 120,
                                    "dtype": "float32", "shape": [10, 3]}, ...}
    }

Every array is a typed view ``[offset, offset + nbytes)`` into a listed file; every file has its
size and XXH3-64 checksum recorded (:mod:`gpubuf.checkpoint.checksums`), so that a file can be
opened with ``torch.from_file`` or ``numpy.memmap`` by anyone, and checked before a single byte
of it is used. A file whose ``xxh3_64`` is ``null`` and ``live`` is true belongs to a
memory-mapped storage that keeps writing to it after the dump (the zero-copy case): only its
size is checked. Version 1 differs only in recording CRC-32 (``"crc32": <int>``); it still loads.

The checksum detects corruption (a torn write, a truncated copy, bit rot), not tampering; nothing in a
checkpoint is ever executed or unpickled, so a tampered checkpoint can at worst hold wrong data.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, Iterable

import torch

from gpubuf.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointVersionError,
    NotACheckpointError,
    UnsafeCheckpointError,
)

FORMAT_NAME = "gpubuf.checkpoint"
FORMAT_VERSION = 2
#: Versions this gpubuf reads (1 recorded CRC-32 checksums instead of XXH3-64).
READABLE_VERSIONS = (1, 2)
META_FILE = "meta.json"
# A meta.json past this size is refused before it is parsed: it cannot come from a dump (even a
# ListStorage of a million small items stays far below) and parsing it would exhaust memory.
MAX_META_BYTES = 512 << 20

# Extensions that torch.save / pickle produce, refused by name before anything else is read.
PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt", ".pth", ".t", ".ckpt", ".tar", ".joblib", ".npy", ".npz")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def check_host() -> None:
    """Raw arrays are written and read as the host's bytes, which must be little-endian.

    Raises:
        CheckpointError: on a big-endian host (no platform torch supports today is one).
    """
    import sys

    if sys.byteorder != "little":
        from gpubuf.checkpoint.errors import CheckpointError

        raise CheckpointError("gpubuf checkpoints are little-endian raw arrays; this host is big-endian")


# ---------------------------------------------------------------------- dtypes
def dtype_name(dtype: torch.dtype) -> str:
    """The name a dtype has in ``meta.json`` (``"float32"``); raises for dtypes without raw bytes."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        from gpubuf.checkpoint.errors import UnserializableDataError

        raise UnserializableDataError(f"tensors of dtype {dtype} cannot be written as raw arrays") from None


def parse_dtype(name: Any, where: str) -> torch.dtype:
    """The dtype named ``name`` in ``meta.json``; only plain dtype names are accepted.

    TorchRL writes ``"torch.float32"``; the ``torch.`` prefix is accepted and stripped.
    """
    if isinstance(name, str):
        dtype = _DTYPES.get(name.removeprefix("torch."))
        if dtype is not None:
            return dtype
    raise CheckpointCorruptError(f"{where}: unknown dtype {name!r}")


# ---------------------------------------------------------------------- schema helpers
def require(mapping: Any, key: str, kind: type | tuple, where: str) -> Any:
    """``mapping[key]`` checked to be of type ``kind``; raises :class:`CheckpointCorruptError`."""
    if not isinstance(mapping, dict):
        raise CheckpointCorruptError(f"{where}: expected a JSON object, got {type(mapping).__name__}")
    if key not in mapping:
        raise CheckpointCorruptError(f"{where}: missing field {key!r}")
    value = mapping[key]
    if not _is_kind(value, kind):
        raise CheckpointCorruptError(f"{where}.{key}: expected {_kind_name(kind)}, got {value!r:.80}")
    return value


def _is_kind(value: Any, kind: type | tuple) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is int and isinstance(value, bool):
            continue  # JSON booleans are Python ints; never accept one for an int field
        if k is None and value is None:
            return True
        if k is not None and isinstance(value, k):
            return True
    return False


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is None else k.__name__ for k in kinds)


def require_int(mapping: Any, key: str, where: str, *, minimum: int = 0, nullable: bool = False) -> int | None:
    value = require(mapping, key, (int, None) if nullable else int, where)
    if value is not None and value < minimum:
        raise CheckpointCorruptError(f"{where}.{key}: expected an integer >= {minimum}, got {value}")
    return value


def parse_shape(value: Any, where: str) -> torch.Size:
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise CheckpointCorruptError(f"{where}: a shape must be a list of non-negative ints, got {value!r:.80}")
    return torch.Size(value)


# ---------------------------------------------------------------------- safe paths
def check_relpath(rel: Any, where: str) -> str:
    """Validates a path relative to the checkpoint root, as listed in ``meta.json``.

    Raises:
        UnsafeCheckpointError: an absolute path, a ``..`` or empty component, a backslash or a NUL.
    """
    if not isinstance(rel, str) or not rel:
        raise CheckpointCorruptError(f"{where}: expected a relative file path, got {rel!r:.80}")
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafeCheckpointError(f"{where}: path {rel!r} leads outside the checkpoint directory")
    return rel


def is_inside(path: Path, root: Path) -> bool:
    """True when ``path`` (already resolved) is ``root`` or lies below it."""
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def resolve_inside(root: Path, rel: str, where: str) -> Path:
    """The real path of ``root / rel``; raises when symlinks lead it outside ``root``."""
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(real_root / rel))
    if not is_inside(target, real_root):
        raise UnsafeCheckpointError(f"{where}: {rel!r} resolves to {target}, outside the checkpoint {real_root}")
    return target


def looks_like_pickle(path: Path) -> bool:
    """True for files named or shaped like a pickle / ``torch.save`` archive (first bytes only)."""
    if path.name.lower().endswith(PICKLE_SUFFIXES):
        return True
    try:
        with open(path, "rb") as file:
            head = file.read(4)
    except OSError:
        return False
    # Protocol 2+ pickles start with PROTO (0x80) and the protocol number; torch.save writes zips.
    return (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5) or head.startswith(b"PK\x03\x04")


def scan_directory(root: Path, listed: Iterable[str], *, allowed_extra: Iterable[str] = ()) -> None:
    """Checks that ``root`` holds exactly the listed files and nothing unsafe.

    Symlinks are followed only to check where they lead: one leading outside ``root`` is refused.
    Every regular file must be ``meta.json``, listed, or in ``allowed_extra``; a pickle-like file
    and any other unlisted file or special file (FIFO, socket, device) is refused.

    Raises:
        UnsafeCheckpointError: as above. Nothing of an unlisted file is read but its first bytes.
    """
    listed = set(listed) | set(allowed_extra) | {META_FILE}
    real_root = Path(os.path.realpath(root))
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                target = Path(os.path.realpath(full))
                if not is_inside(target, real_root):
                    raise UnsafeCheckpointError(
                        f"{rel!r} is a symlink to {target}, outside the checkpoint directory {real_root}: refused"
                    )
                st = os.stat(full)
                if stat.S_ISDIR(st.st_mode):
                    continue  # its content is inside root and walked there
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeCheckpointError(f"{rel!r} is not a regular file (a FIFO, socket or device): refused")
            if rel in listed:
                continue
            if looks_like_pickle(full):
                raise UnsafeCheckpointError(
                    f"{rel!r} looks like a pickle / torch.save file; gpubuf checkpoints never hold one and never "
                    "unpickle anything: refused"
                )
            raise UnsafeCheckpointError(f"{rel!r} is not listed in {META_FILE}: refused (a checkpoint holds no other file)")


# ---------------------------------------------------------------------- meta.json
def read_json(path: Path, where: str, *, max_bytes: int = MAX_META_BYTES) -> Any:
    """Parses a JSON file that must be a regular file of at most ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise NotACheckpointError(f"{where}: {path} does not exist") from None
    except OSError as err:
        if os.path.islink(path):
            # meta.json itself is never a symlink in a checkpoint.
            raise UnsafeCheckpointError(f"{where}: {path} is a symlink: refused") from None
        raise CheckpointCorruptError(f"{where}: cannot open {path}: {err}") from None
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(file.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"{where}: {path} is not a regular file")
        if st.st_size > max_bytes:
            raise CheckpointCorruptError(f"{where}: {path} is {st.st_size} bytes, more than the {max_bytes} allowed")
        raw = file.read(max_bytes + 1)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise CheckpointCorruptError(f"{where}: {path} is not valid JSON: {err}") from None


def check_header(meta: Any, path: Path) -> dict:
    """Checks the format name, version and byte order of a parsed ``meta.json``.

    Raises:
        NotACheckpointError: not a gpubuf ``meta.json`` (a foreign directory).
        CheckpointVersionError: a version this gpubuf does not read.
        CheckpointCorruptError: a malformed header.
    """
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise NotACheckpointError(f"{path} is not a gpubuf checkpoint ({META_FILE} names no {FORMAT_NAME!r} format)")
    version = meta.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointVersionError(f"{path}: format version {version!r} is not an integer")
    if version not in READABLE_VERSIONS:
        newer = " (written by a newer gpubuf: upgrade to read it)" if version > FORMAT_VERSION else ""
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise CheckpointVersionError(
            f"{path}: format version {version} is not supported; this gpubuf reads versions {readable}{newer}"
        )
    if meta.get("byteorder") != "little":
        raise CheckpointCorruptError(f"{path}: byteorder {meta.get('byteorder')!r}; only 'little' is written or read")
    for key in ("components", "files", "arrays"):
        require(meta, key, dict, "meta.json")
    return meta


#: The key of ``meta.json`` that holds the SHA-256 of the rest of it (see :func:`seal_meta`).
DIGEST_KEY = "digest"


def meta_digest(meta: dict) -> str:
    """The SHA-256 (hex) of ``meta`` without its digest, over its canonical JSON (sorted keys)."""
    body = {key: value for key, value in meta.items() if key != DIGEST_KEY}
    text = json.dumps(body, allow_nan=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal_meta(meta: dict) -> dict:
    """``meta`` with its digest: an edit of any value (an exponent, a batch size) is caught on load."""
    return {**meta, DIGEST_KEY: meta_digest(meta)}


def check_digest(meta: dict, path: Path) -> None:
    """Checks the digest of a parsed ``meta.json``, when it has one.

    The array files carry checksums of their own; the digest covers the values ``meta.json``
    holds itself (component options, exponents, cursor, batch size), which could otherwise be
    edited within their types unnoticed. A ``meta.json`` without a digest (written before
    digests were) is read as it is.

    Raises:
        CheckpointCorruptError: the digest does not match the content.
    """
    if DIGEST_KEY not in meta:
        return
    recorded = meta[DIGEST_KEY]
    try:
        expected = meta_digest(meta)
    except (TypeError, ValueError):  # NaN or infinity: never written by a dump
        expected = None
    if not isinstance(recorded, str) or recorded != expected:
        raise CheckpointCorruptError(
            f"{path}: {META_FILE} does not match its digest: it was edited or damaged after the dump (expected the "
            "content the dump wrote)"
        )


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """Flushes a file or a directory entry to stable storage (a no-op where the OS cannot)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
