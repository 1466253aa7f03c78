"""Ensembles in checkpoints: ``StorageEnsembleCheckpointer`` (each member storage through its own
checkpointer) and the codec of sampler and writer ensembles (each member through its own codec)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from gpubuf.checkpoint.base import StorageCheckpointerBase
from gpubuf.checkpoint.codecs import Apply, Codec, Context, StateDictCodec, _array, codec_for, register_codec, storage_codec
from gpubuf.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from gpubuf.checkpoint.format import require
from gpubuf.checkpoint.values import Decoder, Encoder
from gpubuf.storages.ensemble import StorageEnsemble

__all__ = ["StorageEnsembleCheckpointer"]


class StorageEnsembleCheckpointer(StorageCheckpointerBase):
    """Writes a ``StorageEnsemble``: each member through its own checkpointer, under ``m<i>/``.

    Transforms of the ensemble with a ``state_dict`` are written as values (TorchRL uses
    ``torch.save`` for them; here they carry no pickle either).
    """

    name = "storage_ensemble"

    @staticmethod
    def _members(storage: Any) -> list:
        if not isinstance(storage, StorageEnsemble):
            raise CheckpointMismatchError(f"{type(storage).__name__} is not a storage ensemble")
        return list(storage._storages)

    def to_checkpoint(self, storage: Any, context: Context) -> tuple[dict, dict]:
        members_state, arrays = _dump_members(self._members(storage), storage_codec, context)
        transforms = []
        encoder, tarrays = Encoder.collecting("x")
        for i, transform in enumerate(storage._transforms or []):
            sd = getattr(transform, "state_dict", None)
            transforms.append(None if transform is None or not callable(sd) else encoder.encode(sd(), f"transform {i}"))
        arrays.update({f"transforms/{k}": v for k, v in tarrays.items()})
        return {"members": members_state, "transforms": transforms}, arrays

    def from_checkpoint(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        recorded = require(state, "members", list, "storage state")
        applies = _load_members(self._members(storage), recorded, storage_codec, arrays, context, "StorageEnsemble")
        transforms = storage._transforms or []
        decoder = Decoder(lambda name: _array(arrays, f"transforms/{name}"))
        for i, (transform, value) in enumerate(zip(transforms, state.get("transforms") or [])):
            if transform is not None and value is not None and callable(getattr(transform, "load_state_dict", None)):
                decoded = decoder.decode(value, f"transform {i}")
                applies.append(lambda t=transform, v=decoded: t.load_state_dict(v))
        return _apply_all(applies)


register_codec("StorageEnsemble", StorageEnsembleCheckpointer)


class MemberEnsembleCodec(Codec):
    """A ``SamplerEnsemble`` or ``WriterEnsemble``: each member through its own codec, under ``m<i>/``.

    Every member's state is checked (each codec's ``from_checkpoint``) before any member changes,
    so a checkpoint refused for one member leaves all of them as they were. Checkpoints that
    stored the ensemble's ``state_dict`` as one value still load.
    """

    name = "member_ensemble"
    accepts = ("state_dict",)

    def __init__(self, attribute: str) -> None:
        self._attribute = attribute

    def _members(self, component: Any) -> list:
        return list(getattr(component, self._attribute))

    def to_checkpoint(self, component: Any, context: Context) -> tuple[dict, dict]:
        members_state, arrays = _dump_members(self._members(component), codec_for, context)
        return {"members": members_state}, arrays

    def from_checkpoint(self, component: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        if "members" not in state:  # written by the generic codec
            return StateDictCodec().from_checkpoint(component, state, arrays, context)
        what = type(component).__name__
        recorded = require(state, "members", list, f"{what} state")
        return _apply_all(_load_members(self._members(component), recorded, codec_for, arrays, context, what))


def _dump_members(members: list, codec_of: Callable[[Any], Codec], context: Context) -> tuple[list, dict]:
    """Each member's state through its codec, and their arrays under ``m<i>/``."""
    states, arrays = [], {}
    for i, member in enumerate(members):
        codec = codec_of(member)
        state, member_arrays = codec.to_checkpoint(member, context)
        states.append({"codec": codec.name, "codec_version": codec.version, "class": type(member).__qualname__, "state": state})
        arrays.update({f"m{i}/{name}": value for name, value in member_arrays.items()})
    return states, arrays


def _load_members(
    members: list, recorded: list, codec_of: Callable[[Any], Codec], arrays: Mapping[str, Any], context: Context, what: str
) -> list[Apply]:
    """Checks every member's recorded state through its codec (nothing changes); their applies."""
    if len(recorded) != len(members):
        raise CheckpointMismatchError(f"the checkpoint's {what} has {len(recorded)} members, the buffer's {len(members)}")
    applies = []
    for i, (member, entry) in enumerate(zip(members, recorded)):
        where = f"{what} members[{i}]"
        if not isinstance(entry, dict):
            raise CheckpointCorruptError(f"{where}: expected a JSON object, got {type(entry).__name__}")
        codec = codec_of(member)
        name = require(entry, "codec", str, where)
        if not codec.can_load(name):
            raise CheckpointMismatchError(f"{where}: the checkpoint holds a {name!r}, the buffer a {codec.name!r}")
        prefix = f"m{i}/"
        local = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        applies.append(codec.from_checkpoint(member, require(entry, "state", dict, where), local, context))
    return applies


def _apply_all(applies: list[Apply]) -> Apply:
    def apply() -> None:
        for fn in applies:
            fn()

    return apply


register_codec("SamplerEnsemble", lambda: MemberEnsembleCodec("_samplers"))
register_codec("WriterEnsemble", lambda: MemberEnsembleCodec("_writers"))
