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
from gpubuf.host_memory import LARGE_OUTPUT_BYTES, empty_host
from gpubuf.ops._dispatch import device_path, implementation, numba_enabled, resolve
from gpubuf.ops._memo import LastByIdentity

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

    CUDA tensors go to one Triton launch for all sources. On CPU the twin copies the rows, after
    the compiled kernel has prefetched them where that pays (:func:`_gather_host`).

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
    if which == "numba":
        _prefetch_if_it_pays(sources, index)
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
    if device_path(index, backend):
        return implementation("gather_rows", "triton")(list(sources), index, None)
    if index.is_cuda or backend == "torch":
        return [torch.index_select(src, 0, index) for src in sources]
    b = index.shape[0]
    # Contiguous rows: ``stride(0)`` elements each (cheaper than forming the shape).
    widths = [src.stride(0) * src.element_size() for src in sources]
    if _prefetch_pays(b) and numba_enabled():
        _prefetch_rows(sources, widths, index)
    return [
        torch.index_select(src, 0, index) if b * width < LARGE_OUTPUT_BYTES else _index_select_host(src, index)
        for src, width in zip(sources, widths)
    ]


#: A CPU gather of fewer rows than this copies them without prefetching: below it the call costs
#: about what it saves (1.00 to 1.02 times the time at 64 rows, 1.02 to 1.05 at 16).
PREFETCH_MIN_ROWS = 128

#: A CPU gather of more rows than this copies them without prefetching: ``index_select`` then
#: has enough independent reads in flight by itself, and the prefetch loop is time added.
#: Measured side by side against plain ``index_select``, default torch threads, fresh random
#: rows per call: on 1M rows of 277 B over five fields, 0.58x the time at 256 rows, 0.51x at
#: 1,024, 0.70x at 4,096, 0.94x at 16,384 and 1.29x at 65,536; on a memory-mapped storage of
#: 64M rows of 48 B just filled, 0.85x at 4,096, 1.7x at 16,384 and at 65,536.
PREFETCH_MAX_ROWS = 4096


def _prefetch_pays(rows: int) -> bool:
    """Whether a CPU gather of ``rows`` rows is in the range where a prefetch first pays."""
    return PREFETCH_MIN_ROWS <= rows <= PREFETCH_MAX_ROWS


def _prefetch_if_it_pays(sources: Sequence[torch.Tensor], index: torch.Tensor) -> None:
    """Prefetches the rows of a checked CPU gather when its size is in the range where that pays."""
    if _prefetch_pays(index.shape[0]) and all(src.is_contiguous() for src in sources):
        widths = [src.stride(0) * src.element_size() for src in sources]
        _prefetch_rows(sources, widths, index.to(torch.int64))


def _prefetch_rows(sources: Sequence[torch.Tensor], widths: list[int], index: torch.Tensor) -> None:
    """Asks the processor to fetch rows ``index`` of every source (``widths`` bytes each) into its caches.

    A sample of a few hundred rows from a large storage misses the cache on nearly every line;
    ``index_select`` overlaps only the few misses its reorder window reaches, where prefetches
    issued first overlap many. Rows that come in runs (a slice sampler's windows) read
    sequentially, and the kernel leaves them to the processor's own prefetcher. Changes nothing;
    a prefetch never faults, whatever the address.
    """
    kernel = implementation("gather_rows", "numba")
    kernel(_targets(sources, widths), index.numpy(), PREFETCH_MIN_ROWS)


def _targets(sources: Sequence[torch.Tensor], widths: list[int]) -> np.ndarray:
    """Per source: row 0's address, the row stride and the row's length, in bytes (contiguous
    rows: the stride), as the prefetch kernel takes them.

    Kept while the same tensor objects come back (a storage hands its leaves from one sample to
    the next until it allocates anew): building the array costs about as much as the prefetch
    of a few hundred rows.
    """
    return _TARGETS.get(tuple(sources), lambda: np.array(
        [(src.data_ptr(), width, width) for src, width in zip(sources, widths)], dtype=np.int64
    ))


#: The address table of the last sources :func:`_targets` was given.
_TARGETS = LastByIdentity()


def _index_select_host(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``index_select`` of CPU rows; a large result goes on huge pages (see :mod:`~gpubuf.host_memory`)."""
    shape = (index.shape[0], *src.shape[1:])
    if math.prod(shape) * src.dtype.itemsize < LARGE_OUTPUT_BYTES:
        return torch.index_select(src, 0, index)
    return torch.index_select(src, 0, index, out=empty_host(shape, src.dtype))
