"""Pointer tables on the device, built once per layout and never copied with the host waiting.

The fused gathers describe their sources by a small int64 table (addresses, widths, strides)
that the kernel reads. A storage's layout changes only when it allocates its leaves, so the
table of a layout is built once: the host values go to pinned memory and reach the device by a
non-blocking copy on the current stream, and every later call with that layout reuses the
device copy. Nothing here waits for the device.

Ordering without waiting: a launch on the stream that made the copy is ordered after it. A
launch on another stream waits for the copy's event on the device (``Stream.wait_event``), until
the event is seen complete (``Event.query``, which does not block); from then on the table is
used freely. During CUDA graph capture no event is queried or waited for: capture after a
warm-up call (as ``torch.cuda.graph`` asks anyway), which has built and copied the tables.

A table asked for during a capture is kept for the rest of the process, out of the recent ones:
the captured kernels read it at every replay, which never passes through here, so an eviction
(by the writes' tables, one per batch address) would free memory a graph still reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

# Recent layouts: a sampling loop reads the same storage again and again; a handful of storages
# and output layouts per process is the common case, so a small LRU keeps them all.
_CACHE: OrderedDict[tuple, "_Table"] = OrderedDict()
_CACHE_SIZE = 64
#: Tables a CUDA graph capture used: never evicted (see the module docstring).
_CAPTURED: dict[tuple, "_Table"] = {}
_LOCK = threading.Lock()


class _Table:
    __slots__ = ("host", "device", "event", "stream", "done")

    def __init__(self, host: torch.Tensor, device: torch.Tensor, event: Any, stream: Any) -> None:
        self.host = host  # the pinned source of the copy: kept alive as long as the table
        self.device = device
        self.event = event
        self.stream = stream
        self.done = event is None


def device_table(entries: tuple[int, ...], cols: int, device: torch.device) -> torch.Tensor:
    """The int64 ``[len(entries) // cols, cols]`` table of ``entries`` on ``device``.

    Args:
        entries: the table's values, row after row (hashable: the cache key).
        cols: values per row.
        device: a CUDA device, or the CPU (under Triton's interpreter: the table is the host tensor).

    Returns:
        A tensor to pass to a kernel on the current stream; it must not be written.
    """
    key = (device, cols, entries)
    capturing = _capturing(device)
    with _LOCK:
        table = _CAPTURED.get(key) or _CACHE.get(key)
        if table is not None and key in _CACHE:
            _CACHE.move_to_end(key)
    if table is None:
        table = _make(entries, cols, device)
        with _LOCK:
            _CACHE[key] = table
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    elif not table.done:
        _order_after_copy(table, device)
    if capturing:
        with _LOCK:
            _CAPTURED[key] = table
            _CACHE.pop(key, None)
    return table.device


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _make(entries: tuple[int, ...], cols: int, device: torch.device) -> _Table:
    host = torch.tensor(entries, dtype=torch.int64).view(-1, cols)
    if device.type != "cuda":
        return _Table(host, host, None, None)
    host = host.pin_memory()
    stream = torch.cuda.current_stream(device)
    on_device = host.to(device, non_blocking=True)
    event = None
    if not torch.cuda.is_current_stream_capturing():
        event = torch.cuda.Event()
        event.record(stream)
    return _Table(host, on_device, event, stream)


def _order_after_copy(table: _Table, device: torch.device) -> None:
    if torch.cuda.is_current_stream_capturing():
        return  # built by the warm-up before capture; see the module docstring
    if table.event.query():
        table.done = True
        return
    stream = torch.cuda.current_stream(device)
    if stream != table.stream:
        stream.wait_event(table.event)


def clear() -> None:
    """Forgets every table (tests; or to release the pinned and device memory they hold, once
    no captured graph that used one will be replayed)."""
    with _LOCK:
        _CACHE.clear()
        _CAPTURED.clear()
