"""Choosing between a Triton kernel and its torch twin.

Dispatch follows the tensor, never the machine: a CUDA tensor goes to Triton, a CPU tensor to
the twin. ``backend="triton"`` on a tensor Triton cannot run on raises
:class:`~gpubuf.errors.BackendUnavailableError`; ``"auto"`` never warns. Tests run the Triton
kernels on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``), which this module
honours for an explicit ``backend="triton"``.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Literal

import torch

from gpubuf.errors import BackendUnavailableError

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


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


def resolve_backend(tensor: torch.Tensor, backend: str) -> str:
    """Returns ``"torch"`` or ``"triton"`` for an op whose data lives where ``tensor`` lives.

    Raises:
        ValueError: ``backend`` is not one of ``"auto"``, ``"torch"``, ``"triton"``.
        BackendUnavailableError: ``backend="triton"`` for a tensor Triton cannot run on here.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if tensor.is_cuda and _triton_importable():
            return "triton"
        return "torch"
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


def kernel_module(name: str):
    """Imports ``gpubuf_kernels.<name>`` on first use, so ``import gpubuf`` never imports Triton."""
    return importlib.import_module(f"gpubuf_kernels.{name}")
