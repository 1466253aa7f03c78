"""TorchRL as an optional comparison: imported lazily, and every failure turned into a reason.

TorchRL is not a dependency of gpubuf. It may be missing, or installed but broken (for example
its C++ extension built against another torch, which makes some of its classes raise). The
harness must then report TorchRL's rows as unavailable, with the reason, and carry on.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from types import ModuleType
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

_MODULE = "torchrl.data"


class TorchRLUnavailable(Exception):
    """TorchRL (or one of its parts) cannot be used here; the message says why."""


def describe_error(err: BaseException) -> str:
    """A one-line reason for an exception: its type and the first line of its message."""
    message = str(err).strip().splitlines()
    return f"{type(err).__name__}: {message[0]}" if message else type(err).__name__


def load_torchrl_data() -> ModuleType:
    """Imports ``torchrl.data`` (on first call only; Python caches the module).

    Returns:
        The ``torchrl.data`` module.

    Raises:
        TorchRLUnavailable: the import failed, whatever the exception was.
    """
    try:
        module = importlib.import_module(_MODULE)
    except BaseException as err:  # a broken install can raise anything, even SystemExit from a C extension
        if isinstance(err, KeyboardInterrupt):
            raise
        raise TorchRLUnavailable(f"cannot import {_MODULE}: {describe_error(err)}") from err
    return module


def attempt(fn: Callable[[], T], what: str) -> tuple[T | None, str | None]:
    """Runs ``fn`` and returns ``(value, None)``, or ``(None, reason)`` when it raises.

    Args:
        fn: the construction or first call of an optional provider.
        what: what ``fn`` does, for the reason (``"construction"``, ``"first call"``).
    """
    try:
        return fn(), None
    except KeyboardInterrupt:
        raise
    except TorchRLUnavailable as err:
        return None, str(err)
    except BaseException as err:
        return None, f"{what} failed: {describe_error(err)}"


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Drops ``torchrl`` log records below WARNING for the duration.

    TorchRL logs an INFO line to stdout on every storage initialisation, which would
    interleave with the harness's table. A filter rather than a level: TorchRL sets its
    logger's level when it is imported, which happens inside this block.
    """
    logger = logging.getLogger("torchrl")
    quiet = _BelowWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _require(module: ModuleType, names: tuple[str, ...]) -> ModuleType:
    for name in names:
        if not hasattr(module, name):
            raise TorchRLUnavailable(f"{_MODULE} has no {name}")
    return module


def namespace() -> Any:
    """The TorchRL classes the uniform workload uses (``TensorDictReplayBuffer``, ``ReplayBuffer``,
    ``LazyTensorStorage``), as attributes of ``torchrl.data``.

    Raises:
        TorchRLUnavailable: TorchRL cannot be imported, or lacks one of those classes.
    """
    return _require(load_torchrl_data(), ("TensorDictReplayBuffer", "ReplayBuffer", "LazyTensorStorage"))


#: Longest reason kept from an extension's import error (a missing C++ symbol is hundreds of characters).
_MAX_REASON = 240


def prioritized_namespace() -> Any:
    """The TorchRL classes of the prioritized cycle (``TensorDictPrioritizedReplayBuffer``,
    ``PrioritizedReplayBuffer``, ``LazyTensorStorage``), as attributes of ``torchrl.data``.

    TorchRL's prioritized samplers keep their sum and min trees in its C++ extension
    (``torchrl._torchrl``). A wheel built against another torch imports fine but cannot load
    the extension, and the buffers then raise when built; this checks the extension first, so
    the reason names the real cause.

    Raises:
        TorchRLUnavailable: TorchRL cannot be imported, lacks one of those classes, or its
            extension does not load.
    """
    module = _require(
        load_torchrl_data(), ("TensorDictPrioritizedReplayBuffer", "PrioritizedReplayBuffer", "LazyTensorStorage")
    )
    try:
        extension = importlib.import_module("torchrl._torchrl")
    except BaseException as err:  # an ABI mismatch surfaces as ImportError, but a broken build can raise anything
        if isinstance(err, KeyboardInterrupt):
            raise
        hint = " (scripts/build_torchrl_extension.py rebuilds it for this torch)"
        reason = f"TorchRL's C++ extension (its segment trees) does not load: {describe_error(err)}"
        if len(reason) > _MAX_REASON - len(hint):
            reason = reason[: _MAX_REASON - len(hint) - 3] + "..."
        reason += hint
        raise TorchRLUnavailable(reason) from err
    if not hasattr(extension, "SumSegmentTreeFp32"):
        raise TorchRLUnavailable("TorchRL's C++ extension has no SumSegmentTreeFp32")
    return module


__all__ = [
    "TorchRLUnavailable",
    "attempt",
    "describe_error",
    "load_torchrl_data",
    "namespace",
    "prioritized_namespace",
    "quiet_logs",
]
