"""Choosing between a Triton kernel, a compiled CPU kernel and the torch twin.

Dispatch follows the tensor, never the machine: a CUDA tensor goes to Triton, a CPU tensor to
the op's compiled CPU kernel (``gpubuf_kernels.cpu``, Numba) where the op has one and Numba
imports, else to the twin. ``backend="triton"`` or ``"numba"`` where that cannot run raises
:class:`~gpubuf.errors.BackendUnavailableError`; ``"auto"`` never warns. Tests run the Triton
kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``), which this module
honours for an explicit ``backend="triton"``. ``GPUBUF_NUMBA=0`` in the environment keeps
``"auto"`` off the CPU kernels (the twins then run, as without Numba).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Literal

import torch

from gpubuf.errors import BackendUnavailableError

Backend = Literal["auto", "torch", "triton", "numba"]
BACKENDS = ("auto", "torch", "triton", "numba")


def interpreter_enabled() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except Exception:  # ImportError, or a broken install raising something else at import
        return False
    return True


@functools.lru_cache(maxsize=None)
def numba_importable() -> bool:
    """True when Numba imports (the optional ``gpubuf[cpu]`` dependency)."""
    try:
        importlib.import_module("numba")
    except Exception:  # ImportError, or a Numba that does not match this NumPy
        return False
    return True


# ``os.environ.get`` encodes the key and decodes the value on every call: microseconds that the
# small-batch sample path pays twice per step. CPython keeps the encoded pairs in a dict that
# every ``os.environ[...] = ...`` (``monkeypatch.setenv`` included) updates; this reads it.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
try:
    _NUMBA_KEY = os.environ.encodekey("GPUBUF_NUMBA")  # type: ignore[attr-defined]
    _OFF = os.environ.encodevalue("0")  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - not CPython's os._Environ
    _ENVIRON_DATA = None


def numba_enabled() -> bool:
    """True when ``"auto"`` may pick the CPU kernels: Numba imports and ``GPUBUF_NUMBA`` is not ``0``."""
    if _ENVIRON_DATA is not None:
        off = _ENVIRON_DATA.get(_NUMBA_KEY) == _OFF
    else:  # pragma: no cover - not CPython's os._Environ
        off = os.environ.get("GPUBUF_NUMBA", "1") == "0"
    return not off and numba_importable()


def resolve_backend(tensor: torch.Tensor, backend: str, *, has_cpu_kernel: bool = False) -> str:
    """Returns ``"torch"``, ``"triton"`` or ``"numba"`` for an op whose data lives where ``tensor`` lives.

    Args:
        tensor: the op's main operand; its device decides.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"numba"``.
        has_cpu_kernel: the op has a kernel in ``gpubuf_kernels.cpu``.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
        BackendUnavailableError: ``backend="triton"`` for a tensor Triton cannot run on here, or
            ``backend="numba"`` for an op without a CPU kernel, a non-CPU tensor or no Numba.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if tensor.is_cuda and _triton_importable():
            return "triton"
        if has_cpu_kernel and tensor.device.type == "cpu" and numba_enabled():
            return "numba"
        return "torch"
    if backend == "numba":
        if not has_cpu_kernel:
            raise BackendUnavailableError("backend='numba' was requested but this op has no CPU kernel")
        if tensor.device.type != "cpu":
            raise BackendUnavailableError(f"backend='numba' runs on CPU tensors only, got one on {tensor.device}")
        if not numba_importable():
            raise BackendUnavailableError("backend='numba' was requested but numba cannot be imported (pip install gpubuf[cpu])")
        return "numba"
    if backend == "triton":
        if not _triton_importable():
            raise BackendUnavailableError("backend='triton' was requested but triton cannot be imported")
        if tensor.is_cuda or (tensor.device.type == "cpu" and interpreter_enabled()):
            return "triton"
        raise BackendUnavailableError(
            f"backend='triton' cannot run on a tensor on {tensor.device}: Triton needs a CUDA tensor "
            "(or TRITON_INTERPRET=1 for CPU tensors); use backend='auto' or 'torch'"
        )
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@functools.lru_cache(maxsize=None)
def kernel_module(name: str):
    """Imports ``gpubuf_kernels.<name>`` on first use, so ``import gpubuf`` never imports Triton.

    Cached: the sample path asks for its kernels on every call, and ``import_module`` costs
    microseconds each time.
    """
    return importlib.import_module(f"gpubuf_kernels.{name}")
