"""Compact checkpointers for TED data: ``FlatStorageCheckpointer``, ``NestedStorageCheckpointer``,
``H5StorageCheckpointer`` (TorchRL's names).

TED ("TorchRL Episode Data") stores each step with its successor under ``"next"``: within a
trajectory, ``("next", "obs")`` at step ``t`` is ``"obs"`` at step ``t + 1``. Writing both doubles
the observations on disk. These checkpointers write every such pair once:

* For each column of the storage (``ndim > 1``: each index of dims ``1..ndim-1``), the written
  steps run along dim 0. A step *ends a run* when, for some paired key, its ``"next"`` value is
  not bit-for-bit the next step's root value (a trajectory end, a reset, the ring's wrap point),
  and at the column's last written step.
* A paired key (present at the root and under ``"next"`` with the same dtype and shape) is
  written as one array: each step's root value, followed, after a step that ends a run, by its
  ``"next"`` value. The end-of-run flags (flat) or the run lengths (nested) are written too.
* Root done keys that are all ``False`` are not written (they are rebuilt as zeros); other keys
  are written as they are.

Unlike TorchRL's, which assumes the TED conventions without checking them, the equality is
verified, so the compaction is lossless for any data: where the conventions do not hold, runs are
only shorter. Only the written rows (``[0, len)`` along dim 0) are kept; rows never written load
as zeros. Data without ``"next"`` entries, or with save/load hooks, is written as by
:class:`TensorStorageCheckpointer`.

``NestedStorageCheckpointer`` writes run lengths (the jagged "one row per trajectory" layout),
``H5StorageCheckpointer`` writes the same arrays as datasets of an HDF5 file (needs ``h5py``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from gpubuf.checkpoint.values import decode_layout, encode_layout
from gpubuf.checkpoint.tensor_storage import TensorStorageCheckpointer
from gpubuf.checkpoint.codecs import Context, H5Array, _array
from gpubuf.checkpoint.errors import CheckpointCorruptError
from gpubuf.checkpoint.format import require, require_int

__all__ = ["FlatStorageCheckpointer", "NestedStorageCheckpointer", "H5StorageCheckpointer"]

DEFAULT_DONE_KEYS = ("done", "truncated", "terminated")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def _as_key(key: Any) -> tuple:
    return tuple(key) if isinstance(key, (tuple, list)) else (key,)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` of shape ``[R, T, *feat]`` as integers ``[R, T, F]`` comparing equal iff bitwise equal."""
    x = x.reshape(x.shape[0], x.shape[1], -1).contiguous()
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        x = x.view(_INT_OF_SIZE[x.dtype.itemsize])
    return x


class FlatStorageCheckpointer(TensorStorageCheckpointer):
    """Writes TED data with each observation once and the end-of-run flags (see the module docstring).

    Args:
        done_keys: the done keys (under ``"next"``) whose root copies are dropped when all False;
            defaults to ``("done", "truncated", "terminated")``.
        reward_keys: accepted for TorchRL compatibility (rewards are written as they are).
    """

    name = "ted_flat"
    _runs = "ends"

    def __init__(self, done_keys: Any = None, reward_keys: Any = None) -> None:
        super().__init__()
        self.done_keys = tuple(_as_key(k) for k in (done_keys if done_keys is not None else DEFAULT_DONE_KEYS))
        self.reward_keys = tuple(_as_key(k) for k in (reward_keys if reward_keys is not None else ("reward",)))

    # ------------------------------------------------------------------ dump
    def _plain_state(self, storage: Any, state: dict) -> tuple[dict, dict]:
        layout = storage._layout
        keys = layout.keys
        if layout.kind not in ("tensordict", "tensorclass") or not any(k[0] == "next" for k in keys if k):
            return super()._plain_state(storage, state)
        ndim = storage.ndim
        n0 = storage._len_along_dim0
        leaves = dict(zip(keys, storage._leaves))
        specs = {spec.key: spec for spec in layout.leaves}
        rest = storage._rest_shape
        r = max(rest.numel(), 1)

        def seq(leaf: torch.Tensor) -> torch.Tensor:
            feat = leaf.shape[ndim:]
            return leaf[:n0].reshape(n0, r, *feat).transpose(0, 1)

        paired = [
            k[1:] for k in keys
            if k[0] == "next" and len(k) > 1 and k[1:] in specs and k[1:] not in self.done_keys
            and specs[k[1:]].dtype == specs[k].dtype and specs[k[1:]].shape == specs[k].shape
        ]
        zero = [
            k for k in keys
            if k in self.done_keys and ("next", *k) in specs and not bool(leaves[k][:n0].any())
        ]
        plain = [k for k in keys if k not in zero and k not in paired and not (k[0] == "next" and k[1:] in paired)]
        device = storage._leaves[0].device
        ends = torch.zeros(r, n0, dtype=torch.bool, device=device)
        if n0:
            ends[:, -1] = True
        for k in paired:
            root, nxt = seq(leaves[k]), seq(leaves[("next", *k)])
            if n0 > 1:
                ends[:, :-1] |= ~(_bits(nxt[:, :-1]) == _bits(root[:, 1:])).all(-1)
        arrays: dict[str, torch.Tensor] = {}
        if paired:
            root_pos = _root_positions(ends)
            flat_pos = root_pos.reshape(-1)
            end_pos = (root_pos + 1)[ends]
            total = int(n0 * r + int(ends.sum()))
            for i, k in enumerate(paired):
                root, nxt = seq(leaves[k]), seq(leaves[("next", *k)])
                values = torch.empty((total, *root.shape[2:]), dtype=root.dtype, device=device)
                values[flat_pos] = root.reshape(-1, *root.shape[2:])
                values[end_pos] = nxt[ends]
                arrays[f"paired_{i}"] = values
        for i, k in enumerate(plain):
            arrays[f"plain_{i}"] = seq(leaves[k])
        arrays.update(self._runs_arrays(ends))
        state["layout"] = encode_layout(layout)
        state["compact"] = {
            "cap0": int(storage._capacity_along_dim0),
            "rows": int(n0),
            "columns": int(r),
            "paired": [list(k) for k in paired],
            "plain": [list(k) for k in plain],
            "zero": [list(k) for k in zero],
            "runs": self._runs,
        }
        return state, arrays

    def _runs_arrays(self, ends: torch.Tensor) -> dict:
        return {"ends": ends}

    # ------------------------------------------------------------------ load
    def decode_content(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> tuple[Any, list]:
        compact = state.get("compact")
        if compact is None or "hooked" in state:
            return super().decode_content(storage, state, arrays, context)
        where = "storage state.compact"
        layout = decode_layout(require(state, "layout", dict, "storage state"), "storage state.layout")
        ndim = require_int(state, "ndim", "storage state", minimum=1)
        cap0 = require_int(compact, "cap0", where, minimum=1)
        n0 = require_int(compact, "rows", where)
        r = require_int(compact, "columns", where, minimum=1)
        if n0 > cap0:
            raise CheckpointCorruptError(f"{where}: {n0} rows written of a capacity of {cap0}")
        specs = {spec.key: spec for spec in layout.leaves}
        groups = {}
        for group in ("paired", "plain", "zero"):
            keys = [tuple(k) for k in require(compact, group, list, where)]
            for k in keys:
                needed = [k, ("next", *k)] if group == "paired" else [k]
                if any(n not in specs for n in needed):
                    raise CheckpointCorruptError(f"{where}.{group}: key {k!r} is not in the layout")
            groups[group] = keys
        covered = set(groups["plain"]) | set(groups["zero"]) | {x for k in groups["paired"] for x in (k, ("next", *k))}
        if covered != set(specs):
            raise CheckpointCorruptError(f"{where}: the key groups do not cover the layout's keys exactly")
        for spec in layout.leaves:
            rest = spec.shape[: ndim - 1]
            if rest.numel() != r and not (ndim == 1 and r == 1):
                raise CheckpointCorruptError(f"{where}: leaf {spec.key!r} has {rest.numel()} columns, expected {r}")
        # Checked before allocating the full-capacity leaves, which meta.json's numbers size.
        rest = layout.leaves[0].shape[: ndim - 1]
        self._check_capacity(storage, require_int(state, "max_size", "storage state", minimum=1), (cap0, rest))
        ends = self._read_runs(arrays, r, n0)
        out = {spec.key: torch.zeros((cap0, *spec.shape), dtype=spec.dtype) for spec in layout.leaves}

        def put(key: tuple, value: torch.Tensor) -> None:
            spec = specs[key]
            feat = spec.shape[ndim - 1 :]
            expected = torch.Size([r, n0, *feat])
            if value.shape != expected or value.dtype != spec.dtype:
                raise CheckpointCorruptError(
                    f"{where}: array of {key!r} is {list(value.shape)} x {value.dtype}, expected {list(expected)} x {spec.dtype}"
                )
            out[key][:n0] = value.transpose(0, 1).reshape(n0, *spec.shape)

        for i, k in enumerate(groups["plain"]):
            put(k, _array(arrays, f"plain_{i}"))
        if groups["paired"]:
            root_pos = _root_positions(ends)
            total = n0 * r + int(ends.sum())
            for i, k in enumerate(groups["paired"]):
                values = _array(arrays, f"paired_{i}")
                if values.shape[:1] != torch.Size([total]):
                    raise CheckpointCorruptError(f"{where}: paired array of {k!r} has {values.shape[:1]} rows, expected {total}")
                feat = values.shape[1:]
                put(k, values[root_pos.reshape(-1)].reshape(r, n0, *feat))
                put(("next", *k), values[(root_pos + 1).reshape(-1)].reshape(r, n0, *feat))
        return layout, [out[spec.key] for spec in layout.leaves]

    def _read_runs(self, arrays: Mapping[str, Any], r: int, n0: int) -> torch.Tensor:
        ends = _array(arrays, "ends")
        if ends.dtype != torch.bool or ends.shape != torch.Size([r, n0]):
            raise CheckpointCorruptError(f"end-of-run flags are {list(ends.shape)} x {ends.dtype}, expected [{r}, {n0}] x bool")
        return _check_ends(ends)


def _check_ends(ends: torch.Tensor) -> torch.Tensor:
    if ends.shape[1] and not bool(ends[:, -1].all()):
        raise CheckpointCorruptError("every column's last written step must end a run")
    return ends


def _root_positions(ends: torch.Tensor) -> torch.Tensor:
    """Where each step's root value sits in a paired array: its index plus the run ends before it,
    with the columns one after the other."""
    r, n0 = ends.shape
    per_column = n0 + ends.sum(1)
    column_start = torch.cumsum(per_column, 0) - per_column
    ends_before = torch.cumsum(ends.long(), 1) - ends.long()
    steps = torch.arange(n0, device=ends.device)
    return column_start[:, None] + steps[None, :] + ends_before


class NestedStorageCheckpointer(FlatStorageCheckpointer):
    """As :class:`FlatStorageCheckpointer`, with run (trajectory) lengths instead of end flags:
    each paired array is the concatenation of one row per run, which is the jagged layout of
    TorchRL's nested-tensor format."""

    name = "ted_nested"
    _runs = "lengths"

    def _runs_arrays(self, ends: torch.Tensor) -> dict:
        positions = ends.reshape(-1).nonzero().squeeze(-1)
        lengths = torch.diff(positions, prepend=positions.new_tensor([-1]))
        return {"run_lengths": lengths.to(torch.int64)}

    def _read_runs(self, arrays: Mapping[str, Any], r: int, n0: int) -> torch.Tensor:
        lengths = _array(arrays, "run_lengths")
        if lengths.dtype != torch.int64 or lengths.ndim != 1:
            raise CheckpointCorruptError("run lengths must be a 1-D int64 array")
        if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.sum()) != r * n0):
            raise CheckpointCorruptError(f"run lengths must be positive and add up to {r * n0}")
        if not lengths.numel() and r * n0:
            raise CheckpointCorruptError("run lengths are missing")
        ends = torch.zeros(r * n0, dtype=torch.bool)
        ends[torch.cumsum(lengths, 0) - 1] = True
        return _check_ends(ends.view(r, n0))


_H5_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.h5$")


class H5StorageCheckpointer(NestedStorageCheckpointer):
    """As :class:`NestedStorageCheckpointer`, with the storage's arrays as datasets of one HDF5
    file, ``storage/<checkpoint_file>`` inside the checkpoint directory (needs ``h5py``).

    Keyword Args:
        checkpoint_file: the HDF5 file's name (default ``"checkpoint.h5"``).
        done_keys, reward_keys: see :class:`FlatStorageCheckpointer`.
        h5_kwargs: passed to ``h5py.File.create_dataset`` (e.g. ``{"compression": "gzip"}``).

    The file is read with h5py only after its size and checksum were checked, and a dataset that
    is a link, virtual, or stored outside the file is refused.
    """

    name = "ted_h5"

    def __init__(
        self,
        *,
        checkpoint_file: str = "checkpoint.h5",
        done_keys: Any = None,
        reward_keys: Any = None,
        h5_kwargs: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(done_keys=done_keys, reward_keys=reward_keys)
        if not _H5_NAME.match(checkpoint_file):
            raise ValueError(f"checkpoint_file must be a plain file name ending in .h5, got {checkpoint_file!r}")
        self.checkpoint_file = checkpoint_file
        self.kwargs = dict(h5_kwargs or {})

    def to_checkpoint(self, storage: Any, context: Context) -> tuple[dict, dict]:
        try:
            import h5py  # noqa: F401
        except ImportError as err:
            raise ImportError("H5StorageCheckpointer needs h5py: pip install gpubuf[h5]") from err
        state, arrays = super().to_checkpoint(storage, context)
        return state, {name: H5Array(tensor, self.checkpoint_file, self.kwargs) for name, tensor in arrays.items()}
