"""Launcher helpers the gather kernels share: where a launch may run, unit widths, device guard.

Plain torch, no Triton and no gpubuf: the kernel modules import this at their own import, and
nothing here touches a device until a launcher calls it.
"""

from __future__ import annotations

import contextlib
import os
from typing import ContextManager

import torch


def interpreter_enabled() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_launch_device(device: torch.device, launcher: str) -> None:
    """Checks that a launcher can run on ``device``: CUDA, or CPU under the interpreter.

    Args:
        device: the device of the launcher's inputs.
        launcher: the launcher's name, for the message.

    Raises:
        ValueError: any other device.
    """
    if device.type != "cuda" and not (device.type == "cpu" and interpreter_enabled()):
        raise ValueError(f"{launcher} runs on CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), got {device}")


def unit_bytes(*sizes: int) -> int:
    """Widest unit (16, 8, 4, 2 or 1 bytes) that divides every size and address given.

    A copy moves its bytes in units of this width, so every access is aligned to it whatever
    the dtype of the data.

    Args:
        *sizes: byte sizes, strides and raw addresses.

    Returns:
        16, 8, 4, 2 or 1.
    """
    for width in (16, 8, 4, 2):
        if all(size % width == 0 for size in sizes):
            return width
    return 1


def device_guard(device: torch.device) -> ContextManager:
    """Makes ``device`` current for a launch on CUDA (Triton launches on the current device); a no-op elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
