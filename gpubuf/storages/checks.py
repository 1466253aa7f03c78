"""Checks of what storages are asked for: capacities, devices, and allocations against memory."""

from __future__ import annotations

import operator
import os
from typing import Any

import torch

from gpubuf.errors import CapacityError, InvalidDeviceError, StateDictError, StateDictKeyError

__all__ = [
    "MAX_CAPACITY", "check_device", "check_fits_memory", "check_max_size", "check_state_keys", "device_memory_bytes"
]

#: Indices are int64 tensors.
MAX_CAPACITY = 2**63 - 1


def check_max_size(max_size: Any, what: str = "max_size") -> int:
    """Returns ``max_size`` as an int, or raises :class:`CapacityError` when it is not a positive
    integer of at most ``2**63 - 1`` (indices are int64)."""
    if isinstance(max_size, bool) or not hasattr(max_size, "__index__"):
        raise CapacityError(f"{what} must be a positive integer, got {max_size!r} ({type(max_size).__name__})")
    value = operator.index(max_size)
    if value <= 0:
        raise CapacityError(f"{what} must be a positive integer, got {value}")
    if value > MAX_CAPACITY:
        raise CapacityError(f"{what} must be at most 2**63 - 1 (indices are int64), got {value}")
    return value


def check_device(device: Any, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that exists here.

    Raises:
        InvalidDeviceError: a malformed device (``"gpu0"``, ``3.5``), or a CUDA device when CUDA is
            not available (or an ordinal past the GPUs present).
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidDeviceError(
            f"{what}={device!r} is not a device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidDeviceError(f"{what}={device} was asked for, but CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidDeviceError(
                f"{what}={device}: expected an ordinal below the {torch.cuda.device_count()} GPUs present"
            )
    return device


def device_memory_bytes(device: torch.device, *, available: bool = False) -> int | None:
    """The physical memory of ``device`` in bytes (host RAM for the CPU), or None when unknown.

    With ``available``, the memory that can be allocated now instead (``MemAvailable`` of the
    host, the free memory of a GPU): the bound of a transient allocation such as a batch.
    """
    try:
        if device.type == "cpu":
            if available:
                with open("/proc/meminfo", encoding="ascii") as meminfo:
                    for line in meminfo:
                        if line.startswith("MemAvailable:"):
                            return int(line.split()[1]) * 1024
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            if available:
                return int(torch.cuda.mem_get_info(index)[0])
            return int(torch.cuda.get_device_properties(index).total_memory)
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None


def check_fits_memory(
    nbytes: int,
    device: torch.device,
    what: str,
    *,
    available: bool = False,
    expected: str = "a capacity whose rows fit in the device's memory (use LazyMemmapStorage for rows kept on disk)",
) -> None:
    """Refuses an allocation of ``nbytes`` that exceeds the physical memory of ``device``.

    The rule of in-memory storages: an allocation that cannot fit in the device's memory, even
    with nothing else on it, is refused before it is attempted (with overcommit, a host
    allocation larger than RAM would succeed and the process be killed at the first touch).
    Whether it fits beside what is already allocated is left to the allocator, except with
    ``available`` (transient allocations, such as a sampled batch).

    Raises:
        CapacityError: ``nbytes`` is larger than the device's memory.
    """
    total = device_memory_bytes(device, available=available)
    if total is not None and nbytes > total:
        has = "has available" if available else "has"
        raise CapacityError(f"{what} needs {nbytes:,} bytes on {device}, which {has} {total:,}: expected {expected}")


def check_state_keys(state_dict: Any, keys: tuple[str, ...], what: str) -> None:
    """Refuses a state dict that is not a dict, or that lacks one of ``keys``.

    Raises:
        StateDictError: not a dict.
        StateDictKeyError: a key is missing.
    """
    if not isinstance(state_dict, dict):
        raise StateDictError(f"{what}: expected a dict, got {type(state_dict).__name__}")
    for key in keys:
        if key not in state_dict:
            raise StateDictKeyError(f"{what}: missing key {key!r} (expected the keys of state_dict())")
