"""Per-component codecs and their registry.

A codec turns one component (a storage, sampler or writer) into a checkpoint entry and back:

* ``to_checkpoint(component, context) -> (state, arrays)``: ``state`` is a JSON-able dict,
  ``arrays`` maps local names (``[A-Za-z0-9_.-]`` segments joined by ``/``) to tensors, or to
  :class:`LiveFile` / :class:`H5Array` placements. Nothing is mutated.
* ``from_checkpoint(component, state, arrays, context) -> apply``: validates everything against
  the target component and prepares the new state without touching the component, then returns
  a thunk that installs it and cannot fail (it assigns attributes). ``arrays`` are verified host
  tensors (or :class:`~gpubuf.checkpoint.arrays.LiveArray`).

Codecs are registered by class (or by ``"module.QualName"``, for classes whose module may not
exist yet): :func:`codec_for` walks the component's MRO. A subclass that overrides
``state_dict`` does not inherit its parent's codec, since it has state the parent's codec would
silently drop; it, like any unregistered component with ``state_dict`` / ``load_state_dict``,
gets :class:`StateDictCodec`, which writes its state dict through :mod:`gpubuf.checkpoint.values`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from gpubuf.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, UnserializableDataError
from gpubuf.checkpoint.format import require, require_int
from gpubuf.checkpoint.values import Decoder, Encoder, device_here
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.base import Storage
from gpubuf.storages.compressed import CompressedListStorage
from gpubuf.storages.list import ListStorage
from gpubuf.storages.memmap import LazyMemmapStorage

Apply = Callable[[], None]


@dataclass
class LiveFile:
    """A tensor that is the content of ``path`` from byte ``offset`` on (a memory-mapped storage).

    When ``path`` lies inside the directory being dumped to, the dump lists it instead of copying
    it; elsewhere it is copied like any tensor.
    """

    tensor: torch.Tensor
    path: Any
    offset: int = 0


@dataclass
class H5Array:
    """A tensor to be written as dataset of the HDF5 file ``file`` (relative to the component)."""

    tensor: torch.Tensor
    file: str
    kwargs: dict


@dataclass
class Context:
    """What a codec may need besides its component.

    Attributes:
        buffer: the buffer being dumped or loaded, or None for a storage on its own.
        target: the checkpoint directory (final path).
        scratch: a directory where save hooks may write temporary files (deleted after the dump).
        batch_size: the buffer's batch size, when known (TorchRL imports).
        staging: where a load copied a memory-mapped storage's files while verifying them
            (:class:`~gpubuf.checkpoint.staging.Staging`), or None.
    """

    buffer: Any = None
    target: Any = None
    scratch: Any = None
    batch_size: int | None = None
    staging: Any = None


class Codec:
    """Base class of codecs; see the module docstring for the protocol.

    Attributes:
        name: recorded in ``meta.json`` as the component's ``codec``.
        version: recorded as ``codec_version``; loading a higher one raises.
        accepts: other codec names whose entries this codec can load.
    """

    name = "codec"
    version = 1
    accepts: tuple[str, ...] = ()

    def to_checkpoint(self, component: Any, context: Context) -> tuple[dict, dict]:
        raise NotImplementedError

    def from_checkpoint(self, component: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        raise NotImplementedError

    def can_load(self, codec_name: str) -> bool:
        return codec_name == self.name or codec_name in self.accepts


def shadow_of(component: Any) -> tuple[Any, Apply]:
    """A shallow copy to prepare new state on, and the thunk that moves its attributes over."""
    shadow = copy.copy(component)

    def apply() -> None:
        component.__dict__.update(shadow.__dict__)

    return shadow, apply


def check_kind(component: Any, cls: type, state_name: str) -> None:
    if not isinstance(component, cls):
        raise CheckpointMismatchError(
            f"the checkpoint holds the state of a {state_name}, but the buffer's component is a {type(component).__name__}"
        )


# ---------------------------------------------------------------------- registry
_REGISTRY: dict[str, Callable[[], Codec]] = {}


def _key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_codec(cls: type | str, factory: Callable[[], Codec]) -> None:
    """Registers the codec of a component class.

    Args:
        cls: the class, or its ``"module.QualName"`` (so that a codec can be registered before
            the module defining the class is imported, or exists), or a bare class name, which
            matches the gpubuf class of that name wherever it is defined.
        factory: a callable returning a :class:`Codec` (a codec class with a no-argument
            constructor will do). Storages' factories are checkpointer classes.
    """
    _REGISTRY[cls if isinstance(cls, str) else _key(cls)] = factory


def codec_for(component: Any) -> Codec:
    """The codec of ``component``: registered for its class or an ancestor, else :class:`StateDictCodec`.

    Raises:
        UnserializableDataError: nothing is registered and the component has no state dict.
    """
    own = type(component)
    for cls in own.__mro__:
        factory = _REGISTRY.get(_key(cls))
        if factory is None and cls.__module__.startswith("gpubuf."):
            factory = _REGISTRY.get(cls.__name__)
        if factory is None:
            continue
        if cls is own or not _overrides_state(own, cls):
            return factory()
        break
    if callable(getattr(component, "state_dict", None)) and callable(getattr(component, "load_state_dict", None)):
        return StateDictCodec()
    raise UnserializableDataError(
        f"no checkpoint codec is registered for {own.__qualname__} and it has no state_dict(): register one with "
        "gpubuf.checkpoint.register_codec"
    )


def _overrides_state(own: type, ancestor: type) -> bool:
    return any(getattr(own, m, None) is not getattr(ancestor, m, None) for m in ("state_dict", "load_state_dict"))


# ---------------------------------------------------------------------- generic
class StateDictCodec(Codec):
    """Any component with ``state_dict()`` / ``load_state_dict()`` whose state holds tensors and
    JSON-like values (see :mod:`gpubuf.checkpoint.values`); loads only into the same class.

    ``load_state_dict`` runs on a shallow copy of the component, whose attributes are moved over
    once it returned: a state dict it rejects leaves the component unchanged.
    """

    name = "state_dict"

    def to_checkpoint(self, component: Any, context: Context) -> tuple[dict, dict]:
        encoder, arrays = Encoder.collecting("s")
        try:
            raw = component.state_dict()
        except NotImplementedError:
            raise UnserializableDataError(
                f"{type(component).__qualname__} has neither a registered checkpoint codec nor a state_dict(): it cannot "
                "be checkpointed yet (see gpubuf.checkpoint.register_codec)"
            ) from None
        state = encoder.encode(raw, f"{type(component).__name__}.state_dict()")
        return {"class": _key(type(component)), "state": state}, arrays

    def from_checkpoint(self, component: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        recorded = require(state, "class", str, "state_dict codec")
        if recorded != _key(type(component)):
            raise CheckpointMismatchError(
                f"the checkpoint holds the state dict of a {recorded}, the buffer's component is a {_key(type(component))}"
            )
        value = Decoder(lambda name: _array(arrays, name)).decode(state.get("state"), "state")
        shadow, apply = shadow_of(component)
        try:
            shadow.load_state_dict(value)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:
            raise CheckpointMismatchError(f"{type(component).__name__}.load_state_dict refused the state: {err}") from err
        buffer = context.buffer
        if buffer is not None and isinstance(component, Storage) and buffer._tensordict_items and _holds_other_items(shadow):
            raise CheckpointMismatchError(
                f"the checkpoint's storage holds items that are not TensorDicts, and a {type(buffer).__name__} holds "
                "TensorDicts: load it into a buffer of the kind that wrote it"
            )
        return apply


def _holds_other_items(storage: Any) -> bool:
    """Whether a storage holds items other than TensorDicts and tensorclasses."""
    layout = storage.layout
    if layout is not None:
        return layout.kind not in ("tensordict", "tensorclass")
    if isinstance(storage, CompressedListStorage):
        return any(meta is not None and meta.get("type") != "tensordict" for meta in storage._metadata)
    if isinstance(storage, ListStorage):
        return not all(is_tensor_collection(item) for item in storage._storage)
    return False


def _array(arrays: Mapping[str, Any], name: str) -> torch.Tensor:
    try:
        return arrays[name]
    except KeyError:
        raise CheckpointCorruptError(f"array {name!r} is referenced but not in the checkpoint") from None


# ---------------------------------------------------------------------- samplers
class RandomSamplerCodec(Codec):
    """``RandomSampler``: no state (its draws come from the buffer's generator)."""

    name = "random_sampler"

    def to_checkpoint(self, component: Any, context: Context) -> tuple[dict, dict]:
        return {}, {}

    def from_checkpoint(self, component: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        return lambda: None


class SamplerWithoutReplacementCodec(Codec):
    """``SamplerWithoutReplacement``: the epoch's remaining permutation and its bookkeeping."""

    name = "sampler_without_replacement"

    def to_checkpoint(self, component: Any, context: Context) -> tuple[dict, dict]:
        sample_list = component._sample_list
        state = {
            "drop_last": bool(component.drop_last),
            "shuffle": bool(component.shuffle),
            "len_storage": int(component.len_storage),
            "ran_out": bool(component._ran_out),
            "remaining": int(component._remaining),
            "sample_list": None if sample_list is None else "sample_list",
            "device": None if sample_list is None else str(sample_list.device),
        }
        return state, ({} if sample_list is None else {"sample_list": sample_list})

    def from_checkpoint(self, component: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        from gpubuf.samplers.random import SamplerWithoutReplacement

        check_kind(component, SamplerWithoutReplacement, "SamplerWithoutReplacement")
        where = "sampler state"
        drop_last = require(state, "drop_last", bool, where)
        shuffle = require(state, "shuffle", (bool, type(None)), where)
        len_storage = require_int(state, "len_storage", where)
        ran_out = require(state, "ran_out", bool, where)
        remaining = require_int(state, "remaining", where)
        sample_list = None
        if require(state, "sample_list", (str, type(None)), where) is not None:
            sample_list = _array(arrays, state["sample_list"])
            if sample_list.dtype != torch.int64 or sample_list.ndim != 1:
                raise CheckpointCorruptError(f"{where}: the sample list must be a 1-D int64 array")
            if sample_list.numel() and (int(sample_list.min()) < 0 or int(sample_list.max()) >= max(len_storage, 1)):
                raise CheckpointCorruptError(f"{where}: the sample list holds indices outside [0, {len_storage})")
            device = device_here(require(state, "device", str, where))
            sample_list = sample_list.to(device, copy=True)
        shadow, apply = shadow_of(component)
        shadow.drop_last = drop_last
        if shuffle is not None:
            shadow.shuffle = shuffle
        shadow.len_storage = len_storage
        shadow._ran_out = ran_out
        shadow._remaining = remaining
        shadow._sample_list = sample_list
        return apply


# ---------------------------------------------------------------------- writers
class RoundRobinWriterCodec(Codec):
    """``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``: the cursor and the write count."""

    name = "round_robin_writer"

    def to_checkpoint(self, component: Any, context: Context) -> tuple[dict, dict]:
        state = {"cursor": int(component._cursor), "write_count": int(component._write_count)}
        generation = component._generation if component.tracks_generations else None
        if generation is None:
            return state, {}
        # The slot generations of a writer that tracks them (absent from older checkpoints).
        state["generation"] = "generation"
        return state, {"generation": generation}

    def from_checkpoint(self, component: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        from gpubuf.writers.round_robin import RoundRobinWriter

        check_kind(component, RoundRobinWriter, "round-robin writer")
        cursor = require_int(state, "cursor", "writer state")
        write_count = require_int(state, "write_count", "writer state", nullable=True)
        storage = component._storage
        if storage is not None and cursor >= max(storage.max_size, 1):
            raise CheckpointCorruptError(f"writer state: cursor {cursor} is past the storage's capacity {storage.max_size}")

        generation = None
        if state.get("generation") is not None and component.tracks_generations:
            generation = _array(arrays, require(state, "generation", str, "writer state"))
            if generation.dtype != torch.int64 or generation.ndim != 1:
                raise CheckpointCorruptError("writer state: the slot generations must be a 1-D int64 array")
            generation = generation.clone()

        def apply() -> None:
            # Assigned on the writer itself, at commit time: with a storage that shares its write
            # state between processes (LazyMemmapStorage), these properties write that state.
            component._cursor = cursor
            if write_count is not None:
                component._write_count = write_count
            if generation is not None:
                component._generation = generation

        return apply


def _register_builtin() -> None:
    register_codec("gpubuf.samplers.random.RandomSampler", RandomSamplerCodec)
    register_codec("gpubuf.samplers.random.SamplerWithoutReplacement", SamplerWithoutReplacementCodec)
    register_codec("gpubuf.writers.round_robin.RoundRobinWriter", RoundRobinWriterCodec)
    register_codec("gpubuf.writers.round_robin.TensorDictRoundRobinWriter", RoundRobinWriterCodec)


_register_builtin()


# ---------------------------------------------------------------------- storages
def storage_codec(storage: Any) -> Codec:
    """The checkpointer of ``storage``: ``storage.checkpointer`` when set, else the registered one.

    Raises:
        CheckpointMismatchError: ``storage.checkpointer`` is set to something that is not a gpubuf
            checkpointer (e.g. one of TorchRL's, which writes pickles).
    """
    checkpointer = storage.checkpointer
    if checkpointer is None:
        return codec_for(storage)
    if not isinstance(checkpointer, Codec):
        raise CheckpointMismatchError(
            f"storage.checkpointer is a {type(checkpointer).__module__}.{type(checkpointer).__qualname__}; gpubuf "
            "storages take gpubuf.checkpoint checkpointers"
        )
    return checkpointer


def is_memmap(storage: Any) -> bool:
    """A memory-mapped storage (``LazyMemmapStorage``): its leaves are files in ``scratch_dir``."""
    return isinstance(storage, LazyMemmapStorage)
