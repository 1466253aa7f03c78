"""File checksums of a checkpoint: XXH3-64 written, XXH3-64 and CRC-32 read.

A dump hashes every file's bytes while it writes them, and a load while it reads them: the
bytes are never gone over a second time for the checksum. XXH3 (the ``xxhash`` package) runs at
memory speed (over 10 GB/s a core), several times CRC-32's, so it costs a small fraction of the
disk time. Format version 1 recorded CRC-32 (``zlib``); those checkpoints still load.

``meta.json`` records a file's checksum as ``"xxh3_64": "<16 hex digits>"`` (a string: JSON
readers other than Python's lose precision on integers past 2^53).
"""

from __future__ import annotations

import zlib
from typing import Any

import xxhash

from gpubuf.checkpoint.errors import CheckpointCorruptError

#: The checksum a dump records, and the ``meta.json`` field that holds it.
WRITTEN = "xxh3_64"
#: The fields a load accepts, by format version.
FIELDS = {1: "crc32", 2: "xxh3_64"}


class Hasher:
    """A streaming checksum of one algorithm (``"xxh3_64"`` or ``"crc32"``)."""

    __slots__ = ("name", "_state", "_crc")

    def __init__(self, name: str = WRITTEN) -> None:
        if name not in ("xxh3_64", "crc32"):
            raise ValueError(f"unknown checksum {name!r}")
        self.name = name
        self._state = xxhash.xxh3_64() if name == "xxh3_64" else None
        self._crc = 0

    def update(self, data: Any) -> None:
        """Adds ``data`` (any buffer: bytes, memoryview, numpy array) to the checksum."""
        if self._state is not None:
            self._state.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> str | int:
        """The checksum as ``meta.json`` records it: hex string (XXH3-64) or integer (CRC-32)."""
        if self._state is not None:
            return self._state.hexdigest()
        return self._crc


def parse(entry: dict, version: int, where: str, *, nullable: bool) -> tuple[str, str | int] | None:
    """The ``(algorithm, value)`` a ``files`` entry of format ``version`` records, or None.

    Raises:
        CheckpointCorruptError: the field is missing or malformed (or null for a file that is not live).
    """
    field = FIELDS[version]
    if field not in entry:
        raise CheckpointCorruptError(f"{where}: missing field {field!r}")
    value = entry[field]
    if value is None:
        if nullable:
            return None
        raise CheckpointCorruptError(f"{where}.{field}: null, but the file is not live")
    if field == "crc32":
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 32:
            raise CheckpointCorruptError(f"{where}.crc32: expected an integer in [0, 2^32), got {value!r:.80}")
        return field, value
    if not isinstance(value, str) or len(value) != 16 or not set(value) <= set("0123456789abcdef"):
        raise CheckpointCorruptError(f"{where}.xxh3_64: expected 16 lowercase hex digits, got {value!r:.80}")
    return field, value


def describe(value: str | int) -> str:
    return value if isinstance(value, str) else f"{value:#010x}"
