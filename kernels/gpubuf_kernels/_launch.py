"""Launcher helpers every Triton launcher shares: the one launch call, where a launch may run,
unit widths, device guard.

Plain torch, no Triton and no gpubuf: the kernel modules import this at their own import, and
nothing here touches a device until a launcher calls it.

Every launcher launches through :func:`launch`, so one place sees every Triton launch. Whoever
wants to count them (``gpubuf.ops.device_work``) registers a listener; with none registered a
launch costs one extra attribute check.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, ContextManager, Iterator

import torch

_listeners: list[Callable[[Any, tuple, dict], None]] = []
_state = threading.local()


def add_launch_listener(listener: Callable[[Any, tuple, dict], None]) -> None:
    """Calls ``listener(kernel, args, kwargs)`` before every Triton launch made through :func:`launch`.

    What the launchers really pass: a counter of device work reads the kernel's name
    (:func:`kernel_name`), the compile check the argument types Triton's JIT gives them on a GPU
    (``gpubuf.tools.aot.launched``).
    """
    _listeners.append(listener)


def remove_launch_listener(listener: Callable[[Any, tuple, dict], None]) -> None:
    """Stops calling ``listener``; a listener that was never added is ignored."""
    with contextlib.suppress(ValueError):
        _listeners.remove(listener)


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Skips every launch this thread makes through :func:`launch` inside the block.

    What a call costs the host on the device path, without its kernels: for measuring it where
    the kernels cannot run at speed (Triton's interpreter). The launches' outputs are left
    unwritten, so nothing inside the block may read them.
    """
    _state.skip = getattr(_state, "skip", 0) + 1
    try:
        yield
    finally:
        _state.skip -= 1


def launching() -> bool:
    """True inside a :func:`launch` of this thread that listeners were told about.

    Under Triton's interpreter a launch runs torch ops on the host (argument copies); a counter
    of device work skips those, as they are not the kernel's.
    """
    return getattr(_state, "depth", 0) > 0


def kernel_name(kernel: Any) -> str:
    """The Python name of a jitted (or interpreted) Triton function."""
    name = getattr(kernel, "__name__", None)
    return name if name is not None else getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
    """Launches ``kernel[grid](*args, **kwargs)``: the one call every launcher makes.

    Args:
        kernel: a ``triton.jit`` function.
        grid: the launch grid, a tuple of one to three ints.
        *args, **kwargs: the kernel's arguments, constexprs and launch options (``num_warps``).

    Returns:
        What the launch returns (the compiled kernel handle on CUDA).
    """
    if getattr(_state, "skip", 0):
        return None
    if not _listeners:
        return kernel[grid](*args, **kwargs)
    for listener in tuple(_listeners):
        listener(kernel, args, kwargs)
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        return kernel[grid](*args, **kwargs)
    finally:
        _state.depth -= 1


def compiled(kernel: Any) -> bool:
    """True when ``kernel`` runs compiled, False when Triton's interpreter runs it.

    Fixed when the kernel was decorated: ``triton.jit`` reads ``TRITON_INTERPRET`` then and
    returns an interpreted function under it. A launcher that picks a constexpr by it (CUDA's
    libdevice exists only compiled) asks the kernel, not the environment: no read per launch, and
    a variable changed after import cannot disagree with the kernel.
    """
    return type(kernel).__name__ != "InterpretedFunction"


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


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of Python ints, for launchers.

    ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from Python
    each costs about 2 us (against 0.03 here), several times per launch.
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def unit_bytes(*sizes: int) -> int:
    """Widest unit (16, 8, 4, 2 or 1 bytes) that divides every size and address given.

    A copy moves its bytes in units of this width, so every access is aligned to it whatever
    the dtype of the data.

    Args:
        *sizes: byte sizes, strides and raw addresses.

    Returns:
        16, 8, 4, 2 or 1.
    """
    # The largest power of two dividing them all is the lowest bit set in any of them (none set:
    # they are all 0, which every width divides).
    bits = 0
    for size in sizes:
        bits |= size
    return min(bits & -bits, 16) if bits else 16


def device_guard(device: torch.device) -> ContextManager:
    """Makes ``device`` current for a launch on CUDA (Triton launches on the current device); a no-op elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
