"""``ReplayBufferEnsemble``: several buffers sampled together in given proportions (TorchRL's)."""

from __future__ import annotations

import textwrap
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import unravel_key

from gpubuf._ensemble import member_positions
from gpubuf.buffers.base import ReplayBuffer, _identity, _stack_anything
from gpubuf.samplers.ensemble import SamplerEnsemble
from gpubuf.samplers.slice import SliceSampler
from gpubuf.storages.ensemble import StorageEnsemble
from gpubuf.storages.list import ListStorage
from gpubuf.writers.ensemble import WriterEnsemble
from gpubuf.writers.round_robin import RoundRobinWriter
from gpubuf.buffers._state_check import check_buffer_state
from gpubuf.errors import (
    ArgumentConflictError,
    ComponentTypeError,
    DTypeMismatchError,
    ImmutableStorageError,
    InvalidArgumentError,
    InvalidIndexError,
    MissingKeyError,
    SchemaMismatchError,
    StateDictError,
    StateDictKeyError,
    UnsupportedDataError,
    UnsupportedOptionError,
)

__all__ = ["ReplayBufferEnsemble"]


def _default_collate(storage: Any) -> Callable:
    return _stack_anything if isinstance(storage, ListStorage) else _identity


class ReplayBufferEnsemble(ReplayBuffer):
    """An ensemble of replay buffers, read and sampled as one.

    A batch of ``B`` items is made of ``num_buffer_sampled`` chunks of ``B // num_buffer_sampled``
    items, each chunk drawn from one member buffer chosen with probabilities ``p`` (with
    replacement), uniformly when ``p`` is None, or one chunk from every member with
    ``sample_from_all=True``. Each chunk is read and collated by its member (member transforms
    included), then the chunks are collated together (``torch.stack`` by default), so a
    sample has batch size ``[num_buffer_sampled, B // num_buffer_sampled]``. A TensorDict sample
    carries ``("index", "index")`` (rows in each member) and ``("index", "buffer_ids")``.

    The ensemble takes no writes (:class:`~gpubuf.writers.immutable.ImmutableStorageError`):
    extend its members, ``ensemble[i].extend(data)``.

    Args:
        *rbs: the member buffers; or, instead, ``storages``, ``samplers`` and ``writers``.

    Keyword Args:
        storages: a :class:`~gpubuf.storages.StorageEnsemble` (when no ``rbs``).
        samplers: a :class:`~gpubuf.samplers.ensemble.SamplerEnsemble` (when no ``rbs``).
        writers: a :class:`~gpubuf.writers.ensemble.WriterEnsemble` (when no ``rbs``).
        transform: applied to the collated sample (after the members' own transforms).
        batch_size: the default batch size of :meth:`sample`.
        collate_fn: collates the members' chunks (default: stack when they stack).
        collate_fns: one collate function per member; taken from the members by default.
        p: relative weight of each member; excludes ``sample_from_all``.
        sample_from_all: one chunk from every member per batch.
        num_buffer_sampled: chunks per batch (default: the number of members).
        generator: a ``torch.Generator`` for every draw (members' samplers included).
        shared: accepted for TorchRL compatibility.
        **kwargs: passed to :class:`ReplayBuffer`.

    Raises:
        ArgumentConflictError: both ``rbs`` and components, neither, components of different
            lengths, ``p`` with ``sample_from_all``, ``routing_key`` with ``routing_dim`` (a
            ``RuntimeError`` and a ``ValueError``).
        ComponentTypeError: a member that is not a buffer, components of the wrong kind.

    Examples:
        >>> rb0 = ReplayBuffer(storage=LazyTensorStorage(10))
        >>> rb1 = ReplayBuffer(storage=LazyTensorStorage(10))
        >>> rb = ReplayBufferEnsemble(rb0, rb1, p=[0.25, 0.75], num_buffer_sampled=4)
        >>> rb[0].extend(torch.zeros(10, 3)); rb[1].extend(torch.ones(10, 3))
        >>> rb.sample(8).shape
        torch.Size([4, 2, 3])
    """

    def __init__(
        self,
        *rbs: ReplayBuffer,
        storages: StorageEnsemble | None = None,
        samplers: SamplerEnsemble | None = None,
        writers: WriterEnsemble | None = None,
        transform: Callable | None = None,
        batch_size: int | None = None,
        collate_fn: Callable | None = None,
        collate_fns: Sequence[Callable] | None = None,
        p: Sequence[float] | torch.Tensor | None = None,
        sample_from_all: bool = False,
        num_buffer_sampled: int | None = None,
        routing_key: Any = None,
        routing_dim: int | None = None,
        generator: torch.Generator | None = None,
        shared: bool = False,
        **kwargs: Any,
    ) -> None:
        if routing_key is not None and routing_dim is not None:
            raise ArgumentConflictError("routing_key and routing_dim are mutually exclusive.")
        if routing_dim is not None and (isinstance(routing_dim, bool) or not isinstance(routing_dim, int)):
            raise ComponentTypeError("routing_dim must be an integer.")
        for i, rb in enumerate(rbs):
            if not isinstance(rb, ReplayBuffer):
                raise ComponentTypeError(f"ReplayBufferEnsemble member #{i} is a {type(rb).__name__}: expected a replay buffer")
        self.routing_key = unravel_key(routing_key) if routing_key is not None else None
        self.routing_dim = routing_dim
        if rbs:
            if storages is not None or samplers is not None or writers is not None:
                raise ArgumentConflictError("pass either replay buffers or storages/samplers/writers, not both")
            storages = StorageEnsemble(*[rb._storage for rb in rbs], transforms=[rb._transform for rb in rbs])
            samplers = SamplerEnsemble(
                *[rb._sampler for rb in rbs], p=p, sample_from_all=sample_from_all, num_buffer_sampled=num_buffer_sampled
            )
            writers = WriterEnsemble(*[rb._writer for rb in rbs])
            if collate_fns is None:
                collate_fns = [rb._collate_fn for rb in rbs]
        else:
            if storages is None or samplers is None or writers is None:
                raise ArgumentConflictError("an ensemble needs replay buffers, or storages, samplers and writers")
            if not isinstance(storages, StorageEnsemble) or not isinstance(samplers, SamplerEnsemble) or not isinstance(
                writers, WriterEnsemble
            ):
                raise ComponentTypeError(
                    "storages, samplers and writers must be a StorageEnsemble, a SamplerEnsemble and a WriterEnsemble"
                )
            if not len(storages._storages) == len(samplers._samplers) == len(writers._writers):
                raise ArgumentConflictError(
                    f"{len(storages._storages)} storages, {len(samplers._samplers)} samplers and {len(writers._writers)} "
                    "writers: expected one of each per member"
                )
            if collate_fns is None:
                collate_fns = [_default_collate(storage) for storage in storages._storages]
            transforms = storages._transforms or [None] * len(storages._storages)
            rbs = tuple(
                ReplayBuffer(storage=storage, sampler=sampler, writer=writer, transform=member_transform, collate_fn=collate)
                for storage, sampler, writer, member_transform, collate in zip(
                    storages._storages, samplers._samplers, writers._writers, transforms, collate_fns
                )
            )
        self._rbs = tuple(rbs)
        self._collate_fns = list(collate_fns)
        super().__init__(
            storage=storages,
            sampler=samplers,
            writer=writers,
            transform=transform,
            batch_size=batch_size,
            collate_fn=collate_fn if collate_fn is not None else _stack_anything,
            generator=generator,
            shared=shared,
            **kwargs,
        )

    # ------------------------------------------------------------------ writing is refused
    def add(self, data: Any) -> Any:
        """With ``routing_key``: writes one record to the member it names; returns its metadata
        (``"buffer_ids"``, ``"index"``). Otherwise refused: write to a member."""
        if self.routing_key is None and self.routing_dim is None:
            raise ImmutableStorageError("a ReplayBufferEnsemble is written through its members: ensemble[i].add(...)")
        if self.routing_dim is not None:
            raise ArgumentConflictError("Use extend() for routing_dim writes.")
        if not isinstance(data, TensorDictBase):
            raise UnsupportedDataError(f"Routed replay writes require a TensorDict input, got {type(data).__name__}.")
        if data.ndim:
            raise SchemaMismatchError(f"add() expects a scalar TensorDict record, got batch size {tuple(data.batch_size)}.")
        return self.extend(data.unsqueeze(0))[0]

    def extend(self, data: Any, *, update_priority: bool | None = None) -> Any:
        """With ``routing_key`` or ``routing_dim``: writes each record to the member it is routed to
        and returns a flat TensorDict of ``"buffer_ids"`` and member-local ``"index"``, aligned
        with ``data.reshape(-1)``. Otherwise refused (``ImmutableStorageError``): write to a member.

        Raises:
            UnsupportedDataError: not a TensorDict (a ``TypeError``).
            DTypeMismatchError: member ids that are not integers (a ``TypeError``).
            MissingKeyError: no ``routing_key`` entry.
            SchemaMismatchError: ids of another shape than the records', or a routing dim whose
                size is not the member count (a ``ValueError``).
            InvalidArgumentError: ids out of range (a ``ValueError``).
            Every error of a member's ``extend`` for its part. Each member checks its part before
            any member writes, so in every case no member changes.
        """
        if self.routing_key is None and self.routing_dim is None:
            raise ImmutableStorageError("a ReplayBufferEnsemble is written through its members: ensemble[i].extend(...)")
        if update_priority is not None:
            raise UnsupportedOptionError("update_priority is not supported by routed ensemble writes.")
        flat, buffer_ids = self._routing(data)
        local = torch.empty(buffer_ids.numel(), dtype=torch.long, device=buffer_ids.device)
        parts = []
        for member_id, member in enumerate(self._rbs):
            positions = (buffer_ids == member_id).nonzero().flatten()
            if positions.numel():
                part = flat[positions]
                # Every member checks its part before any member writes: a part that one member
                # refuses leaves all of them as they were.
                member._check_extend(member._transform.inv(part) if len(member._transform) else part)
                parts.append((positions, member, part))
        with self._lock:
            for positions, member, part in parts:
                local[positions] = torch.as_tensor(member.extend(part)).reshape(-1).to(local.device)
        return TensorDict({"buffer_ids": buffer_ids, "index": local}, batch_size=[buffer_ids.numel()])

    # ------------------------------------------------------------------ restarted producers
    def end_streams(
        self,
        *,
        end_key: Any = ("next", "done"),
        terminated_key: Any = ("next", "terminated"),
        truncated_key: Any = ("next", "truncated"),
    ) -> None:
        """Ends each member's stream at its last row, so that what producers restarted from scratch
        append next starts a new trajectory (TorchRL's ``end_streams``).

        Each member must be one chronological stream: a one-dimensional tensor storage, a
        round-robin writer that tracks slot generations, and a slice sampler (streaming or not)
        that reads ``end_key``; with a ``traj_key``, every stored record must carry the same id
        (a per-stream key such as the environment's number). The last row written to each
        non-empty member gets ``end_key`` set and, where the member stores ``truncated_key`` and
        the row is neither done nor terminated, ``truncated_key`` too: a conditional update, so
        write counts and slot generations do not change. Each sampler then treats the stream as
        ended (a streaming sampler drops its unfinished window). Batches being prefetched and
        conditional updates submitted are waited for first.

        Keyword Args:
            end_key: the stored boolean end flag, read by the samplers.
            terminated_key: the stored terminal flag (read, never written; absent means False),
                or None.
            truncated_key: the stored flag set on an unfinished tail, or None for no such patch.

        Raises:
            InvalidArgumentError: the three keys are not distinct.
            UnsupportedOptionError: a member is not one stream as described (a
                ``RuntimeError``, as TorchRL's).
            DTypeMismatchError: a member's end flag is not boolean.
            Every member is checked before any row changes.
        """
        keys = [unravel_key(key) for key in (end_key, terminated_key, truncated_key) if key is not None]
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("end_key, terminated_key and truncated_key must be distinct")
        end_key = unravel_key(end_key)
        terminated_key = None if terminated_key is None else unravel_key(terminated_key)
        truncated_key = None if truncated_key is None else unravel_key(truncated_key)
        self.synchronize()
        for member in self._rbs:
            member.synchronize()
        with self._lock:
            patches = [patch for patch in (self._stream_end(m, end_key, terminated_key, truncated_key) for m in self._rbs)
                       if patch is not None]
            for member, index, generation, values in patches:
                member.update_if_present(index=index, generation=generation, patch=values)
                member.sampler._end_stream(member.storage)

    @staticmethod
    def _stream_end(member: ReplayBuffer, end_key: Any, terminated_key: Any, truncated_key: Any) -> tuple | None:
        """``(member, index, generation, patch)`` ending ``member``'s stream at its last row, or
        None for an empty member; raises for a member that is not one stream."""
        storage, writer, sampler = member.storage, member.writer, member.sampler
        if (
            storage.ndim != 1
            or not storage.supports_conditional_update
            or not isinstance(writer, RoundRobinWriter)
            or not writer.tracks_generations
            or not isinstance(sampler, SliceSampler)
            or end_key not in [unravel_key(key) for key in (sampler.end_keys or (sampler.end_key,))]
        ):
            raise UnsupportedOptionError(
                "end_streams requires one-dimensional conditional-update storage, generation-tracking round-robin "
                f"writers and slice samplers reading end_key={end_key!r}"
            )
        size = len(member)
        if not size:
            return None
        if sampler.traj_key is not None:
            stored = storage.get(torch.arange(size, device=storage.device))
            ids = stored.get(sampler.traj_key, None) if isinstance(stored, TensorDictBase) else None
            if ids is None or not bool((ids == ids[0]).all()):
                raise UnsupportedOptionError(
                    "end_streams supports trajectory-keyed slice samplers only when every record of a member carries "
                    "the same trajectory id (a per-stream key such as the environment index): restarted producers "
                    "may otherwise reuse old ids"
                )
        index = torch.tensor([(int(writer._cursor) - 1) % size], device=storage.device)
        last = storage.get(index)
        done = last.get(end_key)
        if done.dtype != torch.bool:
            raise DTypeMismatchError(f"end_streams requires a boolean {end_key!r} field, got {done.dtype}")
        patch = {end_key: torch.ones_like(done)}
        if truncated_key is not None and truncated_key in last.keys(True):
            unfinished = ~done
            terminated = None if terminated_key is None else last.get(terminated_key, None)
            if terminated is not None:
                unfinished = unfinished & ~terminated
            patch[truncated_key] = last.get(truncated_key) | unfinished
        return member, index, writer.generations_of(index), patch

    def _routing(self, data: Any) -> tuple[Any, torch.Tensor]:
        if not isinstance(data, TensorDictBase):
            raise UnsupportedDataError(f"Routed replay writes require a TensorDict input, got {type(data).__name__}.")
        if len(self._transform):
            data = self._transform.inv(data)
        flat = data.reshape(-1)
        members = len(self._rbs)
        if self.routing_key is not None:
            if self.routing_key not in flat.keys(True):
                raise MissingKeyError(f"the records have no routing_key {self.routing_key!r}: expected one member id per record")
            buffer_ids = flat.get(self.routing_key)
            while buffer_ids.ndim > 1 and buffer_ids.shape[-1] == 1:
                buffer_ids = buffer_ids.squeeze(-1)
            if buffer_ids.shape != flat.batch_size:
                raise SchemaMismatchError(
                    f"routing_key {self.routing_key!r} must contain one member id per record, got shape "
                    f"{tuple(buffer_ids.shape)} for batch size {tuple(flat.batch_size)}."
                )
        else:
            if not data.ndim:
                raise SchemaMismatchError("routing_dim requires batched input.")
            dim = self.routing_dim % data.ndim
            if data.shape[dim] != members:
                raise SchemaMismatchError(
                    f"routing_dim {self.routing_dim} has size {data.shape[dim]}, expected {members} ensemble members."
                )
            shape = [1] * data.ndim
            shape[dim] = members
            buffer_ids = torch.arange(members, device=data.device or "cpu").reshape(shape).expand(data.batch_size)
            buffer_ids = buffer_ids.reshape(-1)
        if buffer_ids.dtype == torch.bool or buffer_ids.is_floating_point():
            raise DTypeMismatchError("ReplayBufferEnsemble member ids must be integers.")
        buffer_ids = buffer_ids.to(torch.long)
        if buffer_ids.numel() and ((buffer_ids < 0).any() or (buffer_ids >= members).any()):
            raise InvalidArgumentError(f"ReplayBufferEnsemble member ids must lie in [0, {members - 1}].")
        return flat, buffer_ids

    def __setitem__(self, index: Any, value: Any) -> None:
        raise ImmutableStorageError("a ReplayBufferEnsemble is written through its members: ensemble[i][rows] = ...")

    # ------------------------------------------------------------------ reading
    def _sample(self, batch_size: int) -> tuple[Any, dict]:
        with self._lock:
            index, info = self._sampler.sample(self._storage, batch_size)
            chunks = self._storage.get(index)
            data = self._collate_fn([self._collate_fns[i](chunk) for i, chunk in chunks])
        buffer_ids = index.get("buffer_ids")
        # TorchRL's info: a TensorDict whose "index" entry holds "buffer_ids" and the members' rows
        # "index", beside the members' other info entries (priority weights), stacked per chunk.
        entries = {k: v for k, v in info.items() if isinstance(v, torch.Tensor) and v.shape[:1] == buffer_ids.shape}
        if isinstance(data, TensorDictBase) and data.batch_dims >= 2:
            lead = data.batch_size[:2]
            rows = index.get("index")
            marks = TensorDict(
                {
                    "index": rows.to(data.device) if data.device is not None else rows,
                    "buffer_ids": buffer_ids.reshape(-1, 1).expand(lead).to(rows.device),
                },
                batch_size=lead,
            )
            data.set("index", marks)
            info = TensorDict({"index": marks, **{k: v for k, v in entries.items() if v.shape[:2] == lead}}, batch_size=lead)
        else:
            info = TensorDict({"index": index, **entries}, batch_size=buffer_ids.shape)
        if len(self._transform):
            data = self._apply_transform(data)
        return data, info

    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """Samples ``batch_size`` items as ``[num_buffer_sampled, batch_size // num_buffer_sampled]``.

        Returns:
            The collated sample; with ``return_info``, also ``info``, a TensorDict as TorchRL's:
            ``("index", "buffer_ids")`` and ``("index", "index")`` (the rows in each member) and the
            members' other info entries (``"priority_weight"``), of batch size
            ``[num_buffer_sampled]`` (``[num_buffer_sampled, B // num_buffer_sampled]`` for
            TensorDict members, whose samples carry the same ``"index"`` entry).

        Raises:
            BatchSizeError: no batch size, or one that is not a multiple of ``num_buffer_sampled``
                (an :class:`~gpubuf.samplers.ensemble.EnsembleBatchSizeError`, also a ValueError).
            EmptyBufferError: a drawn member is empty.
        """
        batch_size = self._resolve_batch_size(batch_size)
        data, info = self._sample(batch_size)
        return (data, info) if return_info else data

    def __getitem__(self, index: Any) -> Any:
        """``ensemble[i]`` is member buffer ``i``; a slice, list or tensor gives a sub-ensemble;
        ``ensemble[i, rows]`` reads rows of member ``i``; ``ensemble[:, rows]`` reads them from every member."""
        if isinstance(index, tuple):
            if not index:
                raise InvalidIndexError("an empty tuple index: expected a member index, then the rows to read")
            if index[0] is Ellipsis:
                index = (slice(None), *index[1:])
            picked = self[index[0]]
            if len(index) == 1:
                return picked
            rest = index[1] if len(index) == 2 else index[1:]
            if picked is self:
                return self._collate_fn([rb[rest] for rb in self._rbs])
            if isinstance(picked, ReplayBufferEnsemble):
                return picked[(slice(None), *index[1:])]
            return picked[rest]
        if isinstance(index, str):
            raise InvalidIndexError("a ReplayBufferEnsemble is indexed by member; read a key from a member: ensemble[i][key]")
        picked = member_positions(index, len(self._rbs), type(self).__name__)
        if picked is None:
            return self
        if isinstance(picked, int):
            return self._rbs[picked]
        sampler = self._sampler
        return ReplayBufferEnsemble(
            *[self._rbs[i] for i in picked],
            transform=self._transform if len(self._transform) else None,
            batch_size=self._batch_size,
            collate_fn=self._collate_fn,
            collate_fns=[self._collate_fns[i] for i in picked],
            sample_from_all=sampler.sample_from_all,
            num_buffer_sampled=sampler._num_buffer_sampled,
            p=sampler.p if sampler.p is None or isinstance(sampler.p, str) else sampler.p[picked],
        )

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`, all or nothing.

        Every member's part (its storage, sampler and writer states, under ``str(i)``) is checked
        whole against that member, as a member buffer's own state would be, before any member
        changes; then the members load one by one, and a member that still refuses its part
        has the members loaded before it restored.

        Raises:
            StateDictKeyError: a key is missing (a member's part included).
            StateDictError: any other part that does not fit this ensemble or one of its members.
        """
        check_buffer_state(self, state_dict)
        parts = [self._member_state(state_dict, i) for i in range(len(self._rbs))]
        for i, (member, part) in enumerate(zip(self._rbs, parts)):
            try:
                check_buffer_state(member, part)
            except StateDictError as err:
                raise type(err)(f"member {i}: {err}") from None
        with self._lock:
            self._invalidate_prefetch()
            previous = [member.state_dict() for member in self._rbs]
            loaded = []
            try:
                for member, part in zip(self._rbs, parts):
                    member.load_state_dict(part)
                    loaded.append(member)
                self._transform.load_state_dict(state_dict.get("_transforms") or {})
            except Exception as err:
                for member, state in zip(loaded, previous):
                    member.load_state_dict(state)
                if isinstance(err, StateDictError):
                    raise
                raise StateDictError(f"the state dict does not fit this ensemble: {type(err).__name__}: {err}") from err
            self._batch_size = state_dict["_batch_size"]
            rng = state_dict.get("_rng")
            if rng is not None:
                generator = torch.Generator(device=rng[1])
                generator.set_state(rng[0])
                self.set_rng(generator)

    def _member_state(self, state_dict: dict, i: int) -> dict:
        """Member ``i``'s part of an ensemble state, as that member buffer's own state dict."""
        member = self._rbs[i]
        part = {"_batch_size": member._batch_size, "_transforms": member._transform.state_dict(), "_rng": None}
        for key in ("_storage", "_sampler", "_writer"):
            states = state_dict[key]
            if not isinstance(states, dict):
                raise StateDictError(f"state dict {key}: expected a dict of the members' states, got {type(states).__name__}")
            if str(i) not in states:
                raise StateDictKeyError(
                    f"state dict {key}: missing member {str(i)!r} (expected the keys {[str(j) for j in range(len(self._rbs))]})"
                )
            part[key] = states[str(i)]
        return part

    def __len__(self) -> int:
        """The number of member buffers (TorchRL's meaning)."""
        return len(self._rbs)

    def __repr__(self) -> str:
        storages = textwrap.indent(f"storages={self._storage}", " " * 4)
        samplers = textwrap.indent(f"samplers={self._sampler}", " " * 4)
        writers = textwrap.indent(f"writers={self._writer}", " " * 4)
        return (
            f"ReplayBufferEnsemble(\n{storages},\n{samplers},\n{writers},\nbatch_size={self._batch_size},\n"
            f"transform={list(self._transform)})"
        )
