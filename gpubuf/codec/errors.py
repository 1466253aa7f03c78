"""Errors of the row codec."""

from __future__ import annotations

from gpubuf.errors import GpubufError

__all__ = ["CorruptRowError"]


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
