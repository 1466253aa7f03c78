"""The codec of ``PrioritizedSampler`` (and the import of TorchRL's prioritized sampler state).

It is registered by bare class name, which matches the gpubuf class of that name wherever it is
defined; the sampler's module is imported only when one of its samplers is dumped or loaded.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from gpubuf.checkpoint.codecs import Apply, Codec, Context, _array, check_kind, register_codec, shadow_of
from gpubuf.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from gpubuf.checkpoint.format import dtype_name, parse_dtype, require, require_int
from gpubuf.checkpoint.values import device_here

__all__ = ["PrioritizedSamplerCodec", "torchrl_prioritized_state"]


def _number(state: dict, key: str, where: str, *, nullable: bool = False) -> float | None:
    value = require(state, key, (int, float, type(None)) if nullable else (int, float), where)
    if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value < 0):
        raise CheckpointCorruptError(f"{where}.{key}: expected a finite number >= 0, got {value!r}")
    return None if value is None else float(value)


class PrioritizedSamplerCodec(Codec):
    """``PrioritizedSampler``: exponents, options, the tracked maximum, and the sum tree as three
    whole arrays (leaves in the tree's dtype, ``float64`` sums and mins, padding included).

    Loading restores the tree bit for bit (no rebuild, so sampling continues exactly as before).
    A tree given by its leaves alone (a TorchRL checkpoint) is rebuilt from them. The tree goes
    to the sampler's explicit ``device``, else to the recorded one when this machine has it. A
    ``SharedPrioritizedSampler`` keeps its shared tree: the values are copied into it.
    """

    name = "prioritized_sampler"

    def to_checkpoint(self, sampler: Any, context: Context) -> tuple[dict, dict]:
        tree = sampler._tree
        value, index = sampler._max_priority
        state = {
            "max_capacity": int(sampler._max_capacity),
            "alpha": float(sampler._alpha),
            "beta": float(sampler._beta),
            "eps": float(sampler._eps),
            "dtype": dtype_name(sampler.dtype),
            "reduction": sampler.reduction,
            "max_priority_within_buffer": bool(sampler._max_priority_within_buffer),
            "stratified": bool(sampler.stratified),
            "fanout": int(tree.fanout),
            "device": str(tree.device),
            "max_priority": None if value is None else float(value),
            "max_priority_index": None if index is None else int(index),
            "tree": {"leaves": "leaves", "sums": "sums", "mins": "mins"},
        }
        return state, {"leaves": tree.leaves, "sums": tree.sums, "mins": tree.mins}

    def from_checkpoint(self, sampler: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        from gpubuf.ops.sumtree import SumTree
        from gpubuf.samplers.prioritized import PrioritizedSampler

        check_kind(sampler, PrioritizedSampler, "PrioritizedSampler")
        where = "sampler state"
        capacity = require_int(state, "max_capacity", where, minimum=1)
        if capacity != sampler._max_capacity:
            raise CheckpointMismatchError(
                f"the checkpoint's PrioritizedSampler has max_capacity={capacity}, the buffer's {sampler._max_capacity}"
            )
        alpha, beta, eps = (_number(state, k, where) for k in ("alpha", "beta", "eps"))
        dtype = parse_dtype(state["dtype"], where) if "dtype" in state else sampler.dtype
        if dtype != sampler.dtype:
            raise CheckpointMismatchError(f"the checkpoint's priority tree is {dtype}, the buffer's sampler {sampler.dtype}")
        fanout = require_int(state, "fanout", where, minimum=2) if "fanout" in state else sampler._tree.fanout
        if sampler._device is not None:
            device = sampler._device
        elif isinstance(state.get("device"), str):
            device = device_here(state["device"])
        else:
            device = sampler._tree.device
        try:
            tree = SumTree(capacity, dtype=dtype, device="cpu", fanout=fanout)
        except (ValueError, TypeError) as err:
            raise CheckpointCorruptError(f"{where}: invalid tree shape: {err}") from None
        names = require(state, "tree", dict, where)
        leaves = _array(arrays, require(names, "leaves", str, f"{where}.tree"))
        if names.get("sums") is None:
            # Leaves only: the capacity's leaves, any float dtype; the tree is rebuilt from them.
            if leaves.shape != torch.Size([capacity]) or not leaves.dtype.is_floating_point:
                raise CheckpointCorruptError(f"{where}: expected {capacity} float leaves, got {list(leaves.shape)} x {leaves.dtype}")
            _check_values(leaves, "leaves")
            tree.fill_(leaves.to(torch.float64))
        elif (
            _array(arrays, require(names, "sums", str, f"{where}.tree")).shape == (tree.sums.numel() - fanout + 1,)
            and leaves.shape == tree.leaves.shape
            and leaves.dtype == tree.leaves.dtype
        ):
            # Internal levels in the layout of older versions (the root's level one entry long,
            # not a whole row): rebuilt from the leaves.
            _check_values(leaves, "leaves")
            tree.fill_(leaves[:capacity].to(torch.float64))
        else:
            sums = _array(arrays, require(names, "sums", str, f"{where}.tree"))
            mins = _array(arrays, require(names, "mins", str, f"{where}.tree"))
            for label, got, want in (("leaves", leaves, tree.leaves), ("sums", sums, tree.sums), ("mins", mins, tree.mins)):
                if got.shape != want.shape or got.dtype != want.dtype:
                    raise CheckpointCorruptError(
                        f"{where}: tree {label} is {list(got.shape)} x {got.dtype}, expected {list(want.shape)} x {want.dtype}"
                    )
            _check_values(leaves, "leaves")
            _check_values(sums, "sums")
            if bool(torch.isnan(mins).any()) or bool((mins < 0).any()):
                raise CheckpointCorruptError(f"{where}: tree mins hold NaN or negative values")
            total = float(leaves.to(torch.float64).sum())
            if abs(float(sums[0]) - total) > 1e-6 * max(1.0, total):
                raise CheckpointCorruptError(f"{where}: the tree's root {float(sums[0])} is not the sum of its leaves {total}")
            tree.leaves.copy_(leaves)
            tree.sums.copy_(sums)
            tree.mins.copy_(mins)
        # Read in the geometry it was saved in, kept in the sampler's (where it is read decides
        # the fanout, see gpubuf.ops.sumtree.fanout_for): the same leaves, the nodes rebuilt.
        tree = tree.with_fanout(sampler._tree.fanout).to(device)
        value = _number(state, "max_priority", where, nullable=True) if "max_priority" in state else None
        index = require_int(state, "max_priority_index", where, nullable=True) if "max_priority_index" in state else None
        if not _transform_fits(1.0 if value is None else value, alpha, eps, dtype):
            # New items get the maximum priority: its transformed value must fit the leaves.
            raise CheckpointCorruptError(
                f"{where}: with alpha={alpha}, the maximum priority {value} overflows {dtype} once transformed; "
                "expected exponents under which every priority stays finite"
            )
        max_priority = (
            None if value is None else torch.tensor(value, dtype=torch.float64, device=device),
            None if index is None else torch.tensor(index, dtype=torch.long, device=device),
        )
        reduction = state.get("reduction", sampler.reduction)
        if reduction not in ("max", "min", "median", "mean"):
            raise CheckpointCorruptError(f"{where}: unknown reduction {reduction!r}")
        if sampler.shares_memory:
            return _apply_shared(sampler, tree, (alpha, beta, eps), max_priority, reduction, state)
        shadow, apply = shadow_of(sampler)
        shadow._tree = tree
        _set_loaded(shadow, (alpha, beta, eps), max_priority, reduction, state)
        return apply


def _set_loaded(sampler: Any, exponents: tuple, max_priority: tuple, reduction: str, state: dict) -> None:
    """Sets a checkpoint's exponents, running maximum, reduction and flags on a sampler (or its shadow)."""
    sampler._alpha, sampler._beta, sampler._eps = exponents
    sampler._max_priority = max_priority
    sampler.reduction = reduction
    if isinstance(state.get("max_priority_within_buffer"), bool):
        sampler._max_priority_within_buffer = state["max_priority_within_buffer"]
    if isinstance(state.get("stratified"), bool):
        sampler.stratified = state["stratified"]


def _apply_shared(sampler: Any, tree: Any, exponents: tuple, max_priority: tuple, reduction: str, state: dict) -> Apply:
    """A ``SharedPrioritizedSampler``: other processes map its tree, so the loaded values are
    copied into that tree (under its lock, at commit time) instead of replacing it."""
    shared = sampler._tree
    for label in ("leaves", "sums", "mins"):
        if getattr(shared, label).shape != getattr(tree, label).shape:
            raise CheckpointMismatchError(
                f"the checkpoint's priority tree has another shape than the shared sampler's ({label}): another fanout"
            )
    tree = tree.to("cpu")

    def apply() -> None:
        with sampler._lock:
            shared.leaves.copy_(tree.leaves)
            shared.sums.copy_(tree.sums)
            shared.mins.copy_(tree.mins)
            _set_loaded(sampler, exponents, max_priority, reduction, state)

    return apply


def _transform_fits(priority: float, alpha: float, eps: float, dtype: torch.dtype) -> bool:
    try:
        value = (priority + eps) ** alpha
    except OverflowError:
        return False
    return math.isfinite(value) and value <= torch.finfo(dtype).max


def _check_values(values: torch.Tensor, label: str) -> None:
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise CheckpointCorruptError(f"sampler state: tree {label} must be finite and non-negative")


def torchrl_prioritized_state(reader: Any) -> tuple[dict, dict]:
    """A TorchRL ``PrioritizedSampler`` directory (``sampler_metadata.json`` and the leaves of its
    sum tree in ``sumtree.memmap``) as a native sampler entry; the tree is rebuilt on load."""
    meta = reader.json("sampler/sampler_metadata.json")
    where = "sampler/sampler_metadata.json"
    capacity = require_int(meta, "_max_capacity", where, minimum=1) if not isinstance(meta.get("_max_capacity"), float) \
        else int(meta["_max_capacity"])
    if capacity < 1:
        raise CheckpointCorruptError(f"{where}: invalid capacity")
    reader.array("sampler/leaves", "sampler/sumtree.memmap", torch.float64, torch.Size([capacity]))
    if (reader.root / "sampler" / "mintree.memmap").exists():
        # The min tree's leaves are the same priorities: the rebuilt tree recomputes its mins.
        reader.consumed.add("sampler/mintree.memmap")
    max_priority = meta.get("_max_priority")
    value = index = None
    if isinstance(max_priority, (list, tuple)) and len(max_priority) == 2:
        value, index = max_priority
    elif isinstance(max_priority, (int, float)):
        value = max_priority
    state = {
        "max_capacity": capacity,
        "alpha": meta.get("_alpha"),
        "beta": meta.get("_beta"),
        "eps": meta.get("_eps"),
        "max_priority": value,
        "max_priority_index": None if index is None else int(index),
        "tree": {"leaves": "leaves", "sums": None, "mins": None},
    }
    return {"codec": PrioritizedSamplerCodec.name, "codec_version": 1, "class": "torchrl", "state": state}, {}


register_codec("PrioritizedSampler", PrioritizedSamplerCodec)
register_codec("SharedPrioritizedSampler", PrioritizedSamplerCodec)
