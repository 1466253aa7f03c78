"""Ring write: a batch's rows of every field into a storage at consecutive rows, one launch on CUDA.

This is the op under every round-robin extend: a storage keeps each field (leaf) as a tensor of
shape ``[N, *trail]``, and an extend writes the same ``B`` consecutive rows (wrapping round
``N``) of all of them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from gpubuf.errors import DTypeMismatchError, SchemaMismatchError
from gpubuf.ops import _checks
from gpubuf.ops._dispatch import device_path, implementation, resolve

__all__ = ["write_rows", "write_rows_ref", "write_rows_trusted"]


def write_rows_ref(dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], first: int) -> None:
    """Pure-torch twin of the ring write; the op's specification.

    For every ``i`` and ``b < B``: ``dests[i][(first + b) % N] = sources[i][b]``: one or two slice
    copies per field (two where the rows wrap past ``N``).

    Args:
        dests: tensors ``[N, *trail_i]`` (any dtype, any trailing shape per field), all with the
            same ``N``, on one device. Mutated: rows ``first, first + 1, ...`` (mod ``N``).
        sources: tensors ``[B, *trail_i]``, ``B <= N``, each of its destination's dtype and
            trailing shape, on the same device; only read. They must not overlap ``dests``.
        first: the destination row of source row 0, in ``[0, N)``.
    """
    for dst, src in zip(dests, sources):
        count = src.shape[0]
        head = min(count, dst.shape[0] - first)
        dst[first : first + head].copy_(src[:head])
        if head < count:
            dst[: count - head].copy_(src[head:])


def _check(dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], first: int) -> None:
    if not dests:
        raise ValueError("write_rows needs at least one destination tensor")
    if len(sources) != len(dests):
        raise ValueError(f"got {len(sources)} sources for {len(dests)} destinations: one source per destination")
    device = _checks.check_sources(dests, "destination", "N", "rows")
    _checks.check_sources(sources, "source", "B", "rows")
    for i, (dst, src) in enumerate(zip(dests, sources)):
        if src.dtype != dst.dtype:
            raise DTypeMismatchError(f"source #{i} has dtype {src.dtype}, expected {dst.dtype} like destination #{i}")
        if src.shape[1:] != dst.shape[1:]:
            raise SchemaMismatchError(
                f"source #{i} has rows of shape {list(src.shape[1:])}, expected {list(dst.shape[1:])} like destination #{i}"
            )
    _checks.check_devices([(f"source #{i}", src) for i, src in enumerate(sources)], device, "destinations")
    capacity, count = dests[0].shape[0], sources[0].shape[0]
    if count > capacity:
        raise SchemaMismatchError(f"{count} source rows do not fit {capacity} destination rows: write the last {capacity}")
    if not isinstance(first, int) or not 0 <= first < capacity:
        raise ValueError(f"first must be an int in [0, {capacity}), got {first!r}")


def write_rows(
    dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], first: int, *, backend: str = "auto"
) -> None:
    """Writes every source's rows into its destination from row ``first`` on, wrapping; see
    :func:`write_rows_ref` for the specification.

    CUDA tensors go to one Triton launch for all fields; on CPU the twin copies them (two
    slice copies per field at most: a copy is what a compiled loop would do).

    Args:
        dests, sources, first: as in :func:`write_rows_ref`.
        backend: ``"auto"`` (by device), ``"torch"`` or ``"triton"`` (see
            :mod:`gpubuf.ops._dispatch`).

    Raises:
        ValueError, SchemaMismatchError, DTypeMismatchError, DeviceMismatchError: malformed
            arguments, before anything is written.
        BackendUnavailableError: ``backend="triton"`` where it cannot run, or ``"numba"`` (the
            op has no compiled CPU kernel).
    """
    _check(dests, sources, first)
    if resolve("write_rows", dests[0], backend) == "triton":
        implementation("write_rows", "triton")(list(dests), list(sources), first)
    else:
        write_rows_ref(dests, sources, first)


def write_rows_trusted(
    dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], first: int, *, backend: str = "auto"
) -> None:
    """The write path's entry: no argument checks, dispatch by device only.

    For storages that prepared the batch themselves (its fields of their leaves' dtypes and row
    shapes, ``B <= N``, ``first`` in range). Sources on another device than the destinations
    (a host batch into a CUDA storage) take the twin's copies, which move them across.

    Args:
        dests, sources, first: as in :func:`write_rows_ref`, except for the sources' device.
        backend: the storage's backend; ``"triton"`` takes the device path whatever the device,
            as CUDA tensors do under ``"auto"``.
    """
    if device_path(dests[0], backend) and all(src.device == dests[0].device for src in sources):
        implementation("write_rows", "triton")(dests, sources, first, checked=False)
    else:
        write_rows_ref(dests, sources, first)
