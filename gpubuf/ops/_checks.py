"""Argument checks the gather ops share: the sources, the index and the outputs.

Each check raises the typed error of :mod:`gpubuf.errors` that the op documents, with a message
naming the argument the way the op names it ("source #1", "values #1", ...), so callers see
the same errors whichever op they call.
"""

from __future__ import annotations

from typing import Sequence

import torch

from gpubuf.errors import DeviceMismatchError, DTypeMismatchError, IndexOutOfRangeError, SchemaMismatchError

INDEX_DTYPES = (torch.int64, torch.int32)


def check_sources(tensors: Sequence[torch.Tensor], name: str, size: str, unit: str) -> torch.device:
    """Checks that the tensors share their leading size and their device.

    Args:
        tensors: the op's inputs, at least one, each of shape ``[size, ...]``.
        name: how the op calls one of them in messages ("source", "values").
        size: the name of the leading dimension in messages ("N", "M").
        unit: what the leading dimension counts, plural ("rows", "tokens").

    Returns:
        The device of ``tensors[0]``, which every other argument must be on too.

    Raises:
        SchemaMismatchError: a scalar, or a leading size other than ``tensors[0]``'s.
        DeviceMismatchError: a tensor on another device than ``tensors[0]``.
    """
    device = tensors[0].device
    first = tensors[0].shape[0] if tensors[0].ndim else None
    for i, t in enumerate(tensors):
        if t.ndim == 0:
            raise SchemaMismatchError(f"{name} #{i} is a scalar; expected a tensor of shape [{size}, ...]")
        if t.device != device:
            raise DeviceMismatchError(f"{name} #{i} is on {t.device}, expected {device} like {name} #0")
        if t.shape[0] != first:
            raise SchemaMismatchError(f"{name} #{i} has {t.shape[0]} {unit}, expected {first} like {name} #0")
    return device


def check_devices(named: Sequence[tuple[str, torch.Tensor]], device: torch.device, owners: str) -> None:
    """Checks that every named tensor is on ``device``, the inputs' device.

    Args:
        named: ``(name, tensor)`` pairs, checked in order.
        device: the device of the op's inputs.
        owners: how the op calls its inputs, plural ("sources", "values").

    Raises:
        DeviceMismatchError: the first tensor on another device.
    """
    for name, t in named:
        if t.device != device:
            raise DeviceMismatchError(f"{name} is on {t.device}, expected the {owners}' device {device}")


def check_out_count(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], inputs_name: str) -> None:
    """Checks that there is one output per input.

    Args:
        outs: the outputs.
        inputs: the op's inputs.
        inputs_name: how the op calls its inputs in messages, plural ("sources", "values tensors").

    Raises:
        ValueError: another number of outputs than of inputs.
    """
    if len(outs) != len(inputs):
        raise ValueError(f"got {len(outs)} outputs for {len(inputs)} {inputs_name}")


def check_out_like(i: int, out: torch.Tensor, like: torch.Tensor, device: torch.device) -> None:
    """Checks output ``#i``'s dtype against its input's, then its device.

    Args:
        i: the output's position, for the message.
        out: the output.
        like: the input it receives.
        device: the device of the op's inputs.

    Raises:
        DTypeMismatchError: another dtype than ``like``'s.
        DeviceMismatchError: another device than ``device``.
    """
    if out.dtype != like.dtype:
        raise DTypeMismatchError(f"out #{i} has dtype {out.dtype}, expected {like.dtype}")
    if out.device != device:
        raise DeviceMismatchError(f"out #{i} is on {out.device}, expected {device}")


def check_index_range(index: torch.Tensor, rows: int) -> None:
    """Checks ``0 <= index < rows``; synchronises on CUDA.

    Args:
        index: 1-D integer tensor of row numbers.
        rows: the number of rows it may name.

    Raises:
        IndexOutOfRangeError: naming the smallest index if it is negative, else the largest.
    """
    if index.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(index))
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise IndexOutOfRangeError(f"row index {bad} is out of range for {rows} rows (expected 0 <= index < {rows})")
