"""Errors of the row codec (defined with every other typed error in :mod:`gpubuf.errors`)."""

from __future__ import annotations

from gpubuf.errors import CorruptRowError

__all__ = ["CorruptRowError"]
