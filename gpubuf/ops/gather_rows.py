"""Row gather: copy rows ``index`` of several tensors into batches, one launch on CUDA.

This is the op under every sample: a storage keeps each field (leaf) as a tensor of shape
``[N, *trail]``, and a sample gathers the same B rows of all of them. On CPU the compiled
kernel (:mod:`gpubuf_kernels.cpu.rows`) copies every field's rows in one call, prefetching the
rows ahead; ``index_select`` per field (the twin) serves what it cannot take.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from gpubuf.errors import SchemaMismatchError
from gpubuf.ops import _checks
from gpubuf.host_memory import LARGE_OUTPUT_BYTES, empty_host
from gpubuf.ops._dispatch import device_path, implementation, resolve, resolve_backend
from gpubuf.ops._memo import LastByWeakIdentity

__all__ = ["gather_rows", "gather_rows_ref"]

#: Batches of more bytes than this go to ``index_select``, which copies on all of torch's threads:
#: past the last-level cache, write bandwidth decides, and a second thread adds to it. (Measured
#: side by side on 1M rows of 277 B, 2 threads: the compiled gather took 0.92 times the time of
#: ``index_select`` for 32,768 rows, 9 MB, and 1.18 times for 65,536, 18 MB.)
COMPILED_GATHER_BYTES = 12 << 20

def gather_rows_ref(
    sources: Sequence[torch.Tensor],
    index: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Pure-torch twin of the row gather; the op's specification.

    For every ``i`` and ``b``: ``result[i][b] = sources[i][index[b]]``.

    Args:
        sources: tensors of shape ``[N, *trail_i]`` (any dtype, any trailing shape, possibly
            different per source), all with the same ``N`` and on the same device. They are only
            read.
        index: 1-D ``int64`` or ``int32`` tensor of ``B`` row numbers in ``[0, N)`` on the same
            device. Duplicates and any order are allowed; each output row is an independent copy.
        outs: optional preallocated outputs of shape ``[B, *trail_i]`` with the sources' dtypes,
            on the same device, contiguous. They are overwritten and returned.

    Returns:
        One contiguous tensor of shape ``[B, *trail_i]`` per source (``outs`` when given).
    """
    if outs is None:
        return [torch.index_select(src, 0, index) for src in sources]
    for src, out in zip(sources, outs):
        torch.index_select(src, 0, index, out=out)
    return list(outs)


def _check(sources: Sequence[torch.Tensor], index: torch.Tensor, outs: Sequence[torch.Tensor] | None) -> None:
    if not sources:
        raise ValueError("gather_rows needs at least one source tensor")
    if not isinstance(index, torch.Tensor) or index.ndim != 1 or index.dtype not in _checks.INDEX_DTYPES:
        raise TypeError(
            f"index must be a 1-D int64 or int32 tensor, got "
            f"{type(index).__name__ if not isinstance(index, torch.Tensor) else f'{index.dtype} of shape {list(index.shape)}'}"
        )
    device = _checks.check_sources(sources, "source", "N", "rows")
    _checks.check_devices((("index", index),), device, "sources")
    if outs is not None:
        _checks.check_out_count(outs, sources, "sources")
        for i, (src, out) in enumerate(zip(sources, outs)):
            expected = torch.Size([index.shape[0], *src.shape[1:]])
            if out.shape != expected:
                raise SchemaMismatchError(f"out #{i} has shape {list(out.shape)}, expected {list(expected)}")
            _checks.check_out_like(i, out, src, device)
            if not out.is_contiguous():
                raise ValueError(f"out #{i} must be contiguous")


def gather_rows(
    sources: Sequence[torch.Tensor],
    index: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
    *,
    backend: str = "auto",
    check_bounds: bool = True,
) -> list[torch.Tensor]:
    """Gathers rows ``index`` of every source; see :func:`gather_rows_ref` for the specification.

    CUDA tensors go to one Triton launch for all sources, CPU tensors to one compiled call
    (contiguous sources; the twin's ``index_select`` per source otherwise).

    Args:
        sources, index, outs: as in :func:`gather_rows_ref`.
        backend: ``"auto"`` (by device), ``"torch"`` or ``"triton"`` (see
            :mod:`gpubuf.ops._dispatch`).
        check_bounds: verify ``0 <= index < N`` first and raise
            :class:`~gpubuf.errors.IndexOutOfRangeError` otherwise. On CUDA this synchronises;
            callers that produce indices in range by construction (samplers) pass ``False``.

    Raises:
        TypeError, ValueError, SchemaMismatchError, DTypeMismatchError, DeviceMismatchError:
            malformed arguments, before anything is written.
        IndexOutOfRangeError: an index outside ``[0, N)`` with ``check_bounds=True``.
        BackendUnavailableError: ``backend="triton"`` or ``"numba"`` where it cannot run.
    """
    _check(sources, index, outs)
    which = resolve("gather_rows", sources[0], backend)
    if check_bounds:
        _checks.check_index_range(index, sources[0].shape[0])
    if which == "triton":
        return implementation("gather_rows", "triton")(list(sources), index, None if outs is None else list(outs))
    if which == "numba":
        gathered = _gather_compiled(sources, index, outs)
        if gathered is not None:
            return gathered
    return gather_rows_ref(sources, index, outs)


def gather_rows_trusted(sources: Sequence[torch.Tensor], index: torch.Tensor, *, backend: str = "auto") -> list[torch.Tensor]:
    """The sample path's entry: no argument checks, dispatch by device only.

    For callers that built ``sources`` and ``index`` themselves and guarantee the contract of
    :func:`gather_rows_ref` (same device, 1-D integer index in range, rows contiguous). It skips
    the per-call validation, which costs more than the gather itself for small batches on CPU.

    Args:
        sources, index: as in :func:`gather_rows_ref`.
        backend: the storage's backend; ``"triton"`` takes the device path (one Triton launch)
            whatever the device, as CUDA tensors do under ``"auto"``.
    """
    if not sources:  # every field filled by the caller (a TensorDict of only its "index")
        return []
    if device_path(index, backend):
        return implementation("gather_rows", "triton")(list(sources), index, None)
    if resolve_backend(index, backend, has_cpu_kernel=True) == "numba":
        gathered = _gather_compiled(sources, index, None)
        if gathered is not None:
            return gathered
    # The twin, for CUDA rows under another backend, "torch", and what the kernel does not take.
    return gather_rows_ref(sources, index, None if index.is_cuda else [_empty_rows(src, index.shape[0]) for src in sources])


def _empty_rows(source: torch.Tensor, batch: int) -> torch.Tensor:
    """A new CPU output for ``batch`` rows of ``source``."""
    return _empty_rows_of(tuple(source.shape[1:]), source.dtype, batch, math.prod(source.shape[1:]) * source.element_size())


def _empty_rows_of(tail: tuple[int, ...], dtype: torch.dtype, batch: int, row_bytes: int) -> torch.Tensor:
    """A new CPU tensor ``[batch, *tail]`` of rows of ``row_bytes``: on huge pages when large
    and the process asked for them (see :mod:`~gpubuf.host_memory`)."""
    if batch * row_bytes < LARGE_OUTPUT_BYTES:
        return torch.empty((batch, *tail), dtype=dtype)
    return empty_host((batch, *tail), dtype)


class _RowPlan:
    """What the compiled gather needs of a set of sources: their addresses and row widths, and
    how to allocate each output. Made once while the same tensors come back
    (:class:`~gpubuf.ops._memo.LastByWeakIdentity`, which does not keep them alive).

    Attributes:
        contiguous: every source is contiguous (the kernel reads rows as back-to-back bytes).
        addresses: int64 ``[L]``, each source's first byte.
        widths: int64 ``[L]``, each source's bytes per row.
        row_bytes: the bytes of one row over all sources.
    """

    __slots__ = ("contiguous", "pointers", "addresses", "widths", "row_bytes", "_outputs")

    def __init__(self, sources: Sequence[torch.Tensor]) -> None:
        self.contiguous = all(src.is_contiguous() for src in sources)
        widths = [math.prod(src.shape[1:]) * src.element_size() for src in sources]
        self.pointers = tuple(map(torch.Tensor.data_ptr, sources))
        self.addresses = np.array(self.pointers, dtype=np.int64)
        self.widths = np.array(widths, dtype=np.int64)
        self.row_bytes = sum(widths)
        # A NumPy block handed over as a tensor costs half of torch.empty's dispatch; dtypes
        # NumPy lacks (bfloat16, float8) take torch.empty.
        self._outputs = [
            (tuple(src.shape[1:]), src.dtype, _numpy_dtype(src.dtype), width) for src, width in zip(sources, widths)
        ]

    def empty_outputs(self, batch: int) -> list[torch.Tensor]:
        """New contiguous CPU outputs of ``batch`` rows, one per source (large ones as
        :func:`_empty_rows` makes them)."""
        return [
            torch.from_numpy(np.empty((batch, *tail), numpy_dtype))
            if numpy_dtype is not None and batch * width < LARGE_OUTPUT_BYTES
            else _empty_rows_of(tail, dtype, batch, width)
            for tail, dtype, numpy_dtype, width in self._outputs
        ]


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


_plans = LastByWeakIdentity()


def _gather_compiled(
    sources: Sequence[torch.Tensor], index: torch.Tensor, outs: Sequence[torch.Tensor] | None
) -> list[torch.Tensor] | None:
    """The compiled CPU gather (:func:`gpubuf_kernels.cpu.rows.gather_rows`) of CPU tensors.

    Returns None, with nothing written, where the kernel does not apply: a source not
    contiguous (the kernel reads rows as back-to-back bytes), a batch of more than
    :data:`COMPILED_GATHER_BYTES`, or an index outside ``[0, N)`` (the twin then raises
    ``index_select``'s error, as it would have).
    """
    sources = tuple(sources)
    plan = _plans.get(sources, lambda: _RowPlan(sources))
    if tuple(map(torch.Tensor.data_ptr, sources)) != plan.pointers:
        # The same tensors over new memory (set_, resize_): the kernel copies through raw
        # addresses, so a kept plan is only used while they still hold.
        plan = _RowPlan(sources)
        _plans.put(sources, plan)
    batch = index.shape[0]
    if not plan.contiguous or batch * plan.row_bytes > COMPILED_GATHER_BYTES:
        return None
    if index.dtype != torch.int64 or not index.is_contiguous():
        index = index.to(torch.int64).contiguous()
    if outs is None:
        outs = plan.empty_outputs(batch)
    # The tensors stay referenced here, so their memory outlives the call.
    args = (
        plan.addresses,
        plan.widths,
        sources[0].shape[0],
        np.array([out.data_ptr() for out in outs], dtype=np.int64),
        index.data_ptr(),
        batch,
    )
    kernel = implementation("gather_rows", "numba")
    if torch.autograd._profiler_enabled():
        # No aten op runs: a named range shows the gather in a profiler's trace.
        with torch.profiler.record_function("gpubuf::gather_rows"):
            copied = kernel(*args)
    else:
        copied = kernel(*args)
    return list(outs) if copied else None
