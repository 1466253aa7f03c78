"""The backend table: which implementation of an op runs for a tensor on a device.

Every op has a torch twin (``gpubuf.ops.<op>``: the specification and the fallback) and at most
two kernels, listed in :data:`KERNELS` by ``(op, device type)``: a Triton launcher for
``"cuda"`` and a compiled CPU kernel (``gpubuf_kernels.cpu``, Numba) for ``"cpu"``.

Dispatch follows the tensor, never the machine:

- ``backend="auto"``: a CUDA tensor takes the op's ``"cuda"`` kernel, a CPU tensor its ``"cpu"``
  kernel where Numba imports and ``GPUBUF_NUMBA`` is not ``0`` (read when gpubuf is imported);
  otherwise the twin runs. It never warns and never raises for lack of a kernel.
- ``backend="triton"``: the ``"cuda"`` kernel, for CUDA tensors or, under Triton's interpreter
  (``TRITON_INTERPRET=1``), CPU tensors. This is how tests force the whole device path (a
  buffer, its storage and its sampler built with ``backend="triton"``) onto CPU tensors.
- ``backend="numba"``: the ``"cpu"`` kernel; ``backend="torch"``: the twin.

An explicit backend that cannot run raises :class:`~gpubuf.errors.BackendUnavailableError`.
Components (storages, samplers) keep a backend and pass it to the ops; they call
:func:`device_path` where they choose between the device's route and the host's, and never
test ``tensor.is_cuda`` themselves.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable

import torch

from gpubuf.errors import BackendUnavailableError

BACKENDS = ("auto", "torch", "triton", "numba")

#: The one table: ``(op, device type) -> "module:function"`` in ``gpubuf_kernels``. The
#: ``"cuda"`` rows are Triton launchers, the ``"cpu"`` rows compiled CPU kernels; an op without
#: a row for a device runs its twin there.
KERNELS: dict[tuple[str, str], str] = {
    ("gather_rows", "cuda"): "gather:gather_rows_triton",
    ("gather_rows", "cpu"): "cpu.rows:gather_rows",
    ("write_rows", "cuda"): "write_rows:write_rows_triton",
    ("gather_packed", "cuda"): "gather_packed:gather_packed_triton",
    ("gather_packed", "cpu"): "cpu.gather_packed:copy_rows",
    ("decode_rows", "cuda"): "codec:decode_rows_triton",
    ("decode_rows", "cpu"): "cpu.codec:decode_rows",
    ("sumtree_update", "cuda"): "sumtree:sumtree_update_triton",
    ("sumtree_update", "cpu"): "cpu.sumtree:update",
    ("sumtree_sample", "cuda"): "sumtree:sumtree_sample_triton",
    ("sumtree_sample", "cpu"): "cpu.sumtree:draw",
    ("slice_windows", "cuda"): "slice:slice_windows_triton",
    ("slice_windows", "cpu"): "cpu.slice:slice_windows",
    ("sumtree_windows", "cuda"): "slice:sumtree_windows_triton",
    ("sumtree_windows", "cpu"): "cpu.slice:sumtree_windows",
    ("episode_append", "cuda"): "episodes:episode_append_triton",
    ("episode_append", "cpu"): "cpu.episodes:episode_append",
    ("start_exclusions", "cuda"): "episodes:start_exclusions_triton",
    ("start_exclusions", "cpu"): "cpu.episodes:start_exclusions_cpu",
    ("encode_rows", "cpu"): "cpu.encoder:encode_rows",
    ("match_frames", "cpu"): "cpu.framestack:match_roots",
}

#: The backend that serves each device type's row of :data:`KERNELS`.
_KERNEL_BACKEND = {"cuda": "triton", "cpu": "numba"}


def interpreter_enabled() -> bool:
    """True when Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``).

    The launchers' own check (``gpubuf_kernels._launch``) reads the same variable; it is not
    imported from there because ``import gpubuf`` imports nothing of ``gpubuf_kernels``.
    """
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


#: ``GPUBUF_NUMBA=0``: ``"auto"`` keeps the twins on CPU tensors (a plain install's paths). Read
#: once, when gpubuf is imported: a read of ``os.environ`` at every dispatch cost about 3 us, a
#: twentieth of a small sample.
NUMBA_SWITCHED_OFF = os.environ.get("GPUBUF_NUMBA") == "0"


def numba_enabled() -> bool:
    """True when ``"auto"`` may pick the CPU kernels: Numba imports, :data:`NUMBA_SWITCHED_OFF` is
    False, and ``torch.compile`` is not tracing (it cannot trace a Numba function; the torch twin
    it traces into its graph instead)."""
    return not NUMBA_SWITCHED_OFF and not torch.compiler.is_compiling() and numba_importable()


def has_kernel(op: str, device_type: str) -> bool:
    """True when :data:`KERNELS` holds a kernel of ``op`` for ``device_type`` (``"cuda"`` or ``"cpu"``)."""
    return (op, device_type) in KERNELS


def check_backend(backend: str) -> str:
    """Validates a component's backend setting before any data exists.

    ``"triton"`` needs Triton, and CUDA or Triton's interpreter; ``"numba"`` needs Numba. Where
    the data will live is only known later: an op on a tensor Triton cannot run on still raises.

    Returns:
        ``backend``.

    Raises:
        ValueError: not one of :data:`BACKENDS`.
        BackendUnavailableError: ``"triton"`` or ``"numba"`` that cannot run on this machine.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        if not _triton_importable():
            raise BackendUnavailableError("backend='triton' was requested but triton cannot be imported")
        if not (torch.cuda.is_available() or interpreter_enabled()):
            raise BackendUnavailableError(
                "backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels on CPU tensors); "
                "use backend='auto'"
            )
    if backend == "numba" and not numba_importable():
        raise BackendUnavailableError("backend='numba' was requested but numba cannot be imported (pip install gpubuf[cpu])")
    return backend


def resolve(op: str, tensor: torch.Tensor, backend: str = "auto") -> str:
    """Returns ``"torch"``, ``"triton"`` or ``"numba"``: what runs ``op`` on data where ``tensor`` lives.

    Args:
        op: a name of :data:`KERNELS` (an op without kernels always resolves to ``"torch"``).
        tensor: the op's main operand; its device decides.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"numba"``.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
        BackendUnavailableError: ``backend="triton"`` or ``"numba"`` where it cannot run: the op
            has no such kernel, Triton or Numba does not import, or the tensor is on a device
            the kernel cannot run on.
    """
    return resolve_backend(tensor, backend, has_cpu_kernel=has_kernel(op, "cpu"), has_cuda_kernel=has_kernel(op, "cuda"))


def resolve_backend(
    tensor: torch.Tensor, backend: str, *, has_cpu_kernel: bool = False, has_cuda_kernel: bool = True
) -> str:
    """:func:`resolve` for an op described by its kernels rather than named in :data:`KERNELS`.

    Args:
        tensor: the op's main operand; its device decides.
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"numba"``.
        has_cpu_kernel: the op has a kernel in ``gpubuf_kernels.cpu``.
        has_cuda_kernel: the op has a Triton kernel.

    Raises:
        ValueError, BackendUnavailableError: as :func:`resolve`.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if tensor.is_cuda and has_cuda_kernel and _triton_importable():
            return "triton"
        # is_cpu: no torch.device object made, as tensor.device would.
        if has_cpu_kernel and tensor.is_cpu and numba_enabled():
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
        if not has_cuda_kernel:
            raise BackendUnavailableError("backend='triton' was requested but this op has no Triton kernel")
        if not _triton_importable():
            raise BackendUnavailableError("backend='triton' was requested but triton cannot be imported")
        if tensor.is_cuda or (tensor.device.type == "cpu" and interpreter_enabled()):
            return "triton"
        raise BackendUnavailableError(
            f"backend='triton' cannot run on a tensor on {tensor.device}: Triton needs a CUDA tensor "
            "(or TRITON_INTERPRET=1 for CPU tensors); use backend='auto' or 'torch'"
        )
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def device_path(tensor: torch.Tensor, backend: str = "auto") -> bool:
    """True when data where ``tensor`` lives takes the device's route (Triton kernels, no host reads).

    A CUDA tensor does under ``"auto"``; any tensor Triton can run on does under ``"triton"``
    (CPU tensors under the interpreter: the forced device path of the tests). Components call
    this instead of testing ``tensor.is_cuda``, so a forced path takes every branch CUDA takes.

    Raises:
        BackendUnavailableError: ``backend="triton"`` for a tensor Triton cannot run on.
    """
    if backend == "triton":
        return resolve_backend(tensor, "triton") == "triton"
    return backend == "auto" and tensor.is_cuda and _triton_importable()


@functools.lru_cache(maxsize=None)
def implementation(op: str, which: str) -> Callable[..., Any]:
    """The kernel :data:`KERNELS` lists for ``op`` under backend ``which`` (``"triton"`` or ``"numba"``).

    Imported on first use and cached (the sample path asks on every call, and the lookup costs
    about a microsecond), so ``import gpubuf`` never imports Triton or Numba.

    Raises:
        KeyError: the op has no kernel for that backend.
    """
    device_type = next(d for d, b in _KERNEL_BACKEND.items() if b == which)
    module, name = KERNELS[(op, device_type)].split(":")
    return getattr(kernel_module(module), name)


@functools.lru_cache(maxsize=None)
def kernel_module(name: str):
    """Imports ``gpubuf_kernels.<name>`` on first use, so ``import gpubuf`` never imports Triton.

    Cached: the sample path asks for its kernels on every call, and ``import_module`` costs
    microseconds each time.
    """
    return importlib.import_module(f"gpubuf_kernels.{name}")
