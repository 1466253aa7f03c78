"""Row gather: copy rows ``index`` of several tensors into batches, one launch on CUDA.

This is the op under every sample: a storage keeps each field (leaf) as a tensor of shape
``[N, *trail]``, and a sample gathers the same B rows of all of them.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from gpubuf.errors import SchemaMismatchError
from gpubuf.ops import _checks
from gpubuf.ops._dispatch import device_path, implementation, kernel_module, numba_enabled, resolve
from gpubuf.ops.host_memory import LARGE_OUTPUT_BYTES, empty_host

__all__ = ["gather_rows", "gather_rows_ref"]

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

    CUDA tensors go to one Triton launch for all sources; CPU tensors to the compiled CPU
    kernel from :data:`ORDERED_GATHER_MIN_ROWS` rows on (it reads the rows in address order),
    else to the torch twin.

    Args:
        sources, index, outs: as in :func:`gather_rows_ref`.
        backend: ``"auto"`` (by device), ``"torch"``, ``"triton"`` or ``"numba"`` (see
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
    if which == "numba" and (backend == "numba" or _ordered_gather_applies(sources, index)):
        if all(src.is_contiguous() for src in sources):
            return _gather_ordered(sources, index, outs)
    return gather_rows_ref(sources, index, outs)


def gather_rows_trusted(
    sources: Sequence[torch.Tensor],
    index: torch.Tensor,
    targets: np.ndarray | None = None,
    *,
    backend: str = "auto",
) -> list[torch.Tensor]:
    """The sample path's entry: no argument checks, dispatch by device only.

    For callers that built ``sources`` and ``index`` themselves and guarantee the contract of
    :func:`gather_rows_ref` (same device, 1-D integer index in range, rows contiguous). It skips
    the per-call validation, which costs more than the gather itself for small batches on CPU.

    Args:
        sources, index: as in :func:`gather_rows_ref`.
        targets: the sources' :func:`row_targets`, kept by the caller between calls. Given, a
            CPU gather of :data:`PREFETCH_MIN_ROWS` rows or more prefetches its rows first
            (:func:`prefetch_rows`). Only a hint: stale targets cost time, never a wrong row.
        backend: the storage's backend; ``"triton"`` takes the device path (one Triton launch)
            whatever the device, as CUDA tensors do under ``"auto"``.
    """
    if device_path(index, backend):
        return implementation("gather_rows", "triton")(list(sources), index, None)
    if index.is_cuda or backend == "torch":
        return [torch.index_select(src, 0, index) for src in sources]
    b = index.shape[0]
    if b >= ORDERED_GATHER_MIN_ROWS and _ordered_gather_applies(sources, index):
        return _gather_ordered(sources, index, None)
    # (numba_enabled again: GPUBUF_NUMBA=0 set after the targets were kept still stops it.)
    if targets is not None and b >= PREFETCH_MIN_ROWS and numba_enabled():
        prefetch_rows(targets, index)
    # (Contiguous rows: ``stride(0)`` elements each. Cheaper than forming the shape.)
    return [
        torch.index_select(src, 0, index)
        if b * src.stride(0) * src.element_size() < LARGE_OUTPUT_BYTES
        else _index_select_host(src, index)
        for src in sources
    ]


#: From this many rows on, a host gather given its sources' :func:`row_targets` prefetches the
#: rows before copying them (:func:`prefetch_rows`). Below it the call costs about what it saves
#: (measured as in :func:`prefetch_rows`: 1.00 to 1.02 times the time at 64 rows, 1.02 to 1.05
#: at 16).
PREFETCH_MIN_ROWS = 128


def row_targets(sources: Sequence[torch.Tensor]) -> np.ndarray | None:
    """What :func:`prefetch_rows` needs of ``sources``: per source, row 0's address, the row
    stride and the row's length, in bytes (int64 ``[len(sources), 3]``).

    None where there is nothing to prefetch: the compiled kernels are off, or a source is not
    a CPU tensor. The addresses are those of the tensors now; a caller keeps the result only as
    long as it keeps the same tensors.
    """
    if not sources or not numba_enabled() or any(src.device.type != "cpu" or src.ndim == 0 for src in sources):
        return None
    return np.array(
        [(src.data_ptr(), src.stride(0) * src.element_size(), math.prod(src.shape[1:]) * src.element_size()) for src in sources],
        dtype=np.int64,
    ).reshape(len(sources), 3)


def prefetch_rows(targets: np.ndarray, index: torch.Tensor) -> None:
    """Asks the processor to fetch rows ``index`` of every source of ``targets`` into its caches.

    A sample of a few hundred rows from a large storage misses the cache on nearly every line;
    ``index_select`` overlaps only the few misses its reorder window reaches, where prefetches
    issued first overlap many. Measured on 1M rows of 292 B over five fields, interleaved call
    by call with the prefetch off: a uniform sample of 128 to 256 rows in 0.95 to 0.97 times the
    time, of 1,024 rows in 0.87 to 0.96; a prioritized cycle of 256 in 0.97. Changes nothing; a
    prefetch never faults, whatever the address.

    Args:
        targets: :func:`row_targets` of the sources.
        index: 1-D int64 CPU tensor of rows in range.
    """
    kernel_module("cpu.prefetch").prefetch_rows(targets, index.numpy())


#: From this many rows on, a CPU gather with the compiled kernels reads the rows in address
#: order (``gpubuf_kernels.cpu.gather_rows``). Measured side by side against ``index_select`` on
#: 1M rows of 292 B over five fields: 1.4 times the time at 1,024 rows (the ordering does not
#: pay), 0.87 times at 4,096, 0.76 at 8,192, 0.72 at 65,536.
ORDERED_GATHER_MIN_ROWS = 4096


def _ordered_gather_applies(sources: Sequence[torch.Tensor], index: torch.Tensor) -> bool:
    return (
        index.shape[0] >= ORDERED_GATHER_MIN_ROWS
        and index.device.type == "cpu"
        and all(src.is_contiguous() and src.device.type == "cpu" for src in sources)
        and numba_enabled()
    )


def _bytes(tensor: torch.Tensor, rows: int) -> np.ndarray:
    """A contiguous CPU tensor of ``rows`` rows as a uint8 ``[rows, row_bytes]`` array (no copy)."""
    return tensor.reshape(rows, -1).view(torch.uint8).numpy()


def _gather_ordered(
    sources: Sequence[torch.Tensor], index: torch.Tensor, outs: Sequence[torch.Tensor] | None
) -> list[torch.Tensor]:
    """The twin's gather, done by the compiled kernel in address order (contiguous CPU sources)."""
    kernels = kernel_module("cpu.gather_rows")
    b = index.shape[0]
    if outs is None:
        outs = [empty_host((b, *src.shape[1:]), src.dtype) for src in sources]
    index64 = index.to(torch.int64).contiguous().numpy()
    order = kernels.row_order(index64, sources[0].shape[0])
    kernels.gather_rows(
        tuple(_bytes(src, src.shape[0]) for src in sources), tuple(_bytes(out, b) for out in outs), index64, order
    )
    return list(outs)


def _index_select_host(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``index_select`` of CPU rows; a large result goes on huge pages (see :mod:`~gpubuf.ops.host_memory`)."""
    shape = (index.shape[0], *src.shape[1:])
    if math.prod(shape) * src.dtype.itemsize < LARGE_OUTPUT_BYTES:
        return torch.index_select(src, 0, index)
    return torch.index_select(src, 0, index, out=empty_host(shape, src.dtype))

