"""A byte-count progress bar for large dumps and loads, shown only in a terminal.

The bar goes to stderr, and only when stderr is a TTY and the job moves at least
:data:`MIN_BYTES`: logs, CI output and small checkpoints stay clean. ``tqdm`` draws it when
installed; otherwise a one-line built-in bar does. ``GPUBUF_PROGRESS=0`` turns it off,
``GPUBUF_PROGRESS=1`` forces it on (still only for jobs of at least ``MIN_BYTES``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

MIN_BYTES = 256 << 20


def _wanted(total: int) -> bool:
    setting = os.environ.get("GPUBUF_PROGRESS", "").strip()
    if setting == "0" or total < MIN_BYTES:
        return False
    if setting == "1":
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _TinyBar:
    """``desc: 42% |#########            | 1.1/2.5 GiB 850 MiB/s``, redrawn at most 10 times a second."""

    WIDTH = 30

    def __init__(self, total: int, desc: str, stream: Any) -> None:
        self.total = total
        self.desc = desc
        self.stream = stream
        self.done = 0
        self.start = self.last = time.monotonic()
        self._draw()

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            self._draw()

    def _draw(self) -> None:
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        fill = int(frac * self.WIDTH)
        rate = self.done / max(time.monotonic() - self.start, 1e-9)
        gib = 1 << 30
        self.stream.write(
            f"\r{self.desc}: {frac:4.0%} |{'#' * fill}{' ' * (self.WIDTH - fill)}| "
            f"{self.done / gib:.2f}/{self.total / gib:.2f} GiB {rate / (1 << 20):.0f} MiB/s"
        )
        self.stream.flush()

    def close(self) -> None:
        self._draw()
        self.stream.write("\n")
        self.stream.flush()


class _TqdmBar:
    def __init__(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def progress_bar(total: int, desc: str) -> Any:
    """A bar over ``total`` bytes with ``update(n)`` and ``close()``; a no-op outside a terminal."""
    if not _wanted(total):
        return _NoBar()
    try:
        return _TqdmBar(total, desc)
    except ImportError:
        return _TinyBar(total, desc, sys.stderr)
