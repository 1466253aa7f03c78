"""TorchRL's buffer members beyond writing and sampling: delayed construction, in-place writes,
whole-storage reads and writes, conditional updates, trajectory queries, consumed-slot reuse,
``can_sample``, ``stats``, ``next``, ``share``, ``synchronize``.

:class:`~gpubuf.buffers.ReplayBuffer` inherits them from :class:`BufferExtras`; they only use the
buffer's public behaviour and its components, so they work for every buffer class.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, TensorDictBase, is_tensor_collection
from tensordict.utils import unravel_key

from gpubuf.buffers.conditional import ConditionalUpdateResult
from gpubuf.buffers.query import _query_source
from gpubuf.buffers.sample_units import SampleUnit, _last_written
from gpubuf.errors import BatchSizeError, BufferShutDownError
from gpubuf.samplers.consuming import ConsumingSampler
from gpubuf.samplers.random import RandomSampler
from gpubuf.storages.base import Storage
from gpubuf.storages.items import batch_length

# The constructor arguments of a buffer whose construction is delayed, until its first use.
_PENDING = "_pending_init"


class DelayedInitMeta(type):
    """Builds a buffer's components at its first use when asked (TorchRL's ``delayed_init``), and
    hands a buffer asked for as a service to that service (TorchRL's ``service_backend``).

    ``Buffer(..., delayed_init=True)`` (or ``transform_factory=...`` with ``delayed_init`` left
    to None) returns an object that only holds its constructor arguments; the first access to
    anything that needs the components runs the constructor (see
    :meth:`BufferExtras.__getattr__`). So a buffer built in one process and handed to another
    makes its transforms (``transform_factory()``) where it is used.

    ``Buffer(..., service_backend="ray", service_backend_options={"ray_init_config": ...,
    "remote_config": ...})`` returns the buffer built in a Ray actor (a
    :class:`~gpubuf.distributed.RayReplayBuffer`), through the factory the package installs
    in ``ReplayBuffer._services`` (buffers never import the distributed code).
    """

    def __call__(
        cls, *args: Any, service_backend: str = "direct", service_backend_options: dict | None = None, **kwargs: Any
    ) -> Any:
        if service_backend != "direct":
            # TorchRL's dispatch: Buffer(..., service_backend="ray") is the buffer in a Ray actor.
            service = cls._services.get(service_backend)
            if service is None:
                raise ValueError(
                    f"{cls.__name__} supports service_backend='direct' or 'ray', not {service_backend!r}"
                )
            return service(cls, args, kwargs, dict(service_backend_options or {}))
        if service_backend_options:
            raise ValueError("service_backend_options are only valid for non-direct services (service_backend='ray')")
        delayed = kwargs.get("delayed_init", _declared_default(cls))
        if delayed is None:
            delayed = kwargs.get("transform_factory") is not None
        if not delayed:
            return super().__call__(*args, **kwargs)
        if kwargs.get("transform") is not None and kwargs.get("transform_factory") is not None:
            raise TypeError("transform and transform_factory are mutually exclusive")
        instance = cls.__new__(cls)
        kwargs["delayed_init"] = False
        instance.__dict__[_PENDING] = (args, kwargs)
        return instance


def _declared_default(cls: type) -> bool | None:
    """The ``delayed_init`` default a buffer class declares (TorchRL's prioritized buffers: False)."""
    cached = cls.__dict__.get("_delayed_init_default", _UNSET)
    if cached is _UNSET:
        parameter = inspect.signature(cls.__init__).parameters.get("delayed_init")
        cached = None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default
        setattr(cls, "_delayed_init_default", cached)
    return cached


_UNSET = object()


class BufferExtras:
    """TorchRL's remaining buffer members (mixed into :class:`~gpubuf.buffers.ReplayBuffer`)."""

    # ------------------------------------------------------------------ delayed construction
    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that do not exist yet: those of a buffer whose construction
        # is pending. Dunder lookups (copy, pickle probing) must not construct it.
        pending = self.__dict__.get(_PENDING)
        if pending is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._init()
        return getattr(self, name)

    def _init(self) -> None:
        """Runs the delayed constructor now (a no-op once the buffer is built)."""
        pending = self.__dict__.pop(_PENDING, None)
        if pending is None:
            return
        args, kwargs = pending
        try:
            type(self).__init__(self, *args, **kwargs)
        except BaseException:
            self.__dict__[_PENDING] = pending
            raise

    @property
    def initialized(self) -> bool:
        """Whether the components are built (False only while a ``delayed_init`` buffer is unused)."""
        return _PENDING not in self.__dict__

    def _torchrl_options(
        self,
        transform: Any,
        sampler: Any,
        prefetch: int | None,
        sample_unit: Any,
        transform_factory: Any,
        consume_after_n_samples: int | None,
    ) -> tuple[Any, Any]:
        """Validates and applies the constructor's ``sample_unit``, ``transform_factory`` and
        ``consume_after_n_samples``; returns the transform and sampler to build the buffer with."""
        if sample_unit is not None and not isinstance(sample_unit, SampleUnit):
            raise TypeError(f"sample_unit must be a SampleUnit instance, got {type(sample_unit).__name__}.")
        self._sample_unit = sample_unit
        if transform_factory is not None:
            if transform is not None:
                raise TypeError(
                    f"transform and transform_factory are mutually exclusive. Got transform={transform} and "
                    f"transform_factory={transform_factory}."
                )
            transform = transform_factory()
        if consume_after_n_samples is not None:
            if isinstance(consume_after_n_samples, bool) or not isinstance(consume_after_n_samples, (int, np.integer)):
                raise TypeError("consume_after_n_samples must be a positive integer.")
            if consume_after_n_samples < 1:
                raise ValueError("consume_after_n_samples must be a positive integer.")
            if prefetch:
                raise ValueError("Prefetching is not supported when consume_after_n_samples is set.")
            if isinstance(sampler, ConsumingSampler):
                if sampler.max_sample_count != consume_after_n_samples:
                    raise ValueError(
                        "consume_after_n_samples conflicts with the provided ConsumingSampler.max_sample_count."
                    )
            elif sampler is None or type(sampler) is RandomSampler:
                sampler = ConsumingSampler(max_sample_count=int(consume_after_n_samples))
            else:
                raise ValueError(
                    "consume_after_n_samples only supports the default RandomSampler or an explicit ConsumingSampler. "
                    "Prioritized, slice and without-replacement samplers are not supported."
                )
        if isinstance(sampler, ConsumingSampler) and prefetch:
            raise ValueError("Prefetching is not supported with ConsumingSampler.")
        return transform, sampler

    def _write_consumed(self, data: Any, batched: bool) -> Any:
        """With a :class:`ConsumingSampler` that freed slots: writes into them first (then from the
        writer's cursor, skipping them) and returns the indices; else None (an ordinary write)."""
        sampler = self._sampler
        if not isinstance(sampler, ConsumingSampler):
            return None
        n = batch_length(data) if batched else 1
        freed = sampler._pop_consumed_indices(self._storage, n)
        if not freed.numel():
            return None
        if not batched:
            return self._writer.write_at(int(freed[0]), data)
        if freed.numel() < n:
            cap0 = self._storage._max_size_along_dim0(batched_data=data)
            skip = set(freed.tolist())
            cursor, rest, scanned = self._writer._cursor, [], 0
            while len(rest) < n - freed.numel():
                if cursor not in skip or scanned >= cap0:
                    rest.append(cursor)
                cursor, scanned = (cursor + 1) % cap0, scanned + 1
            self._writer._cursor = cursor
            freed = torch.cat([freed, torch.tensor(rest, dtype=torch.long)])
        return self._writer.write_at(freed, data)

    # ------------------------------------------------------------------ reading and writing in bulk
    def can_sample(self, batch_size: int | None = None) -> bool:
        """Whether :meth:`sample` can serve a batch of ``batch_size`` (default: the buffer's) now.

        Raises:
            BatchSizeError: no batch size here nor on the buffer (also a RuntimeError).
        """
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise BatchSizeError(
                "batch_size not specified. Configure it on the replay buffer or pass it to can_sample()."
            )
        with self._lock:
            return bool(self._sampler.can_sample(self._storage, batch_size))

    def read_all_in_order(self, end: int | None = None) -> Any:
        """The stored items in storage order: ``rb[:]``, or ``rb[:end]``."""
        return self[:] if end is None else self[:end]

    def write_all(self, data: Any, end: int | None = None) -> None:
        """Writes ``data`` over the first items in storage order: ``rb[:end] = data``.

        ``end`` defaults to the length of ``data``; a full buffer takes ``rb[:] = data``.
        """
        if end is None:
            max_size = self._storage.max_size
            if len(self) == max_size:
                self[:] = self._with_index_column(data, max_size)
                return
            end = data.shape[0] if is_tensor_collection(data) else len(data)
        self[:end] = self._with_index_column(data, end)

    def _with_index_column(self, data: Any, end: int) -> Any:
        # A TensorDict buffer stores each row's "index"; data written back in storage order
        # without it gets it here (TorchRL's storage keeps the old column instead).
        layout = self._storage.layout
        if (
            isinstance(data, TensorDictBase)
            and "index" not in data.keys()
            and layout is not None
            and ("index",) in layout.keys
        ):
            data = data.copy()
            data.set("index", torch.arange(end, device=data.device).reshape((end,) + (1,) * (data.batch_dims - 1))
                     .expand(data.batch_size))
        return data

    def set_(self, key: Any, value: torch.Tensor) -> "BufferExtras":
        """Writes ``value`` into entry ``key`` of every stored item, in place (TensorDict storages)."""
        return self._update_stored(lambda stored: stored.set_(key, value))

    def set_at_(self, key: Any, value: torch.Tensor, index: Any) -> "BufferExtras":
        """Writes ``value`` into entry ``key`` of the items at ``index``, in place."""
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        return self._update_stored(lambda stored: stored.set_at_(key, value, index))

    def update_(self, input_dict_or_td: Any, clone: bool = False, *, keys_to_update: Any = None) -> "BufferExtras":
        """Updates the stored items in place from a dict or TensorDict spanning the whole buffer."""
        return self._update_stored(
            lambda stored: stored.update_(input_dict_or_td, clone=clone, keys_to_update=keys_to_update)
        )

    def _update_stored(self, write: Any) -> "BufferExtras":
        # The stored items are read as one TensorDict, written in place there, then written back
        # through the storage, so that every storage kind (device, memmap, spill) takes it.
        with self._lock:
            self._invalidate_prefetch()
            stored = self._storage.get(slice(None))
            write(stored)
            self._storage.set(slice(0, len(self._storage)), stored, set_cursor=False)
        return self

    def next(self) -> Any:
        """The next batch of iterating over the buffer, or None (and a reset) once it ran out."""
        iterator = self.__dict__.get("_iterator")
        try:
            if iterator is None:
                iterator = self.__dict__["_iterator"] = iter(self)
            return next(iterator)
        except StopIteration:
            self.__dict__["_iterator"] = None
            return None

    # ------------------------------------------------------------------ process sharing and state
    def share(self, shared: bool = True) -> "BufferExtras":
        """Marks the buffer as shared between processes (TorchRL's flag); returns the buffer.

        Writes already go through one lock per buffer and, on a memmap storage, through its
        shared cursor (see the README's Multiprocess use).
        """
        self.shared = shared
        return self

    def synchronize(self) -> None:
        """Waits for the batches being prefetched and the conditional updates submitted
        (:meth:`submit_update_if_present`); the first error of one of them is raised here.

        Prefetched batches stay queued for the next samples.
        """
        prefetcher = self.__dict__.get("_prefetcher")
        futures = []
        if prefetcher is not None:
            with self._lock:
                futures = [entry.future for entry in prefetcher._queue if entry.future is not None]
        updates = self.__dict__.get("_pending_updates")
        if updates:
            # Waited for in submission order; each is dropped once waited for, so an update's
            # error is raised once.
            futures += list(updates)
            updates.clear()
        # Waited for outside the lock: a read may need it.
        errors = []
        for future in futures:
            try:
                future.result()
            except BaseException as err:  # noqa: BLE001 - the first is raised once all are done
                errors.append(err)
        if errors:
            raise errors[0]

    # ------------------------------------------------------------------ lifecycle (TorchRL's direct service)
    #: ``actor_class(buffer_cls, remote_config)``: installed by the package from
    #: :mod:`gpubuf.distributed.remote` (buffers never import the distributed code).
    _actor_class: Any = None
    #: Set by :meth:`shutdown` (a class default: a delayed buffer is not built to read it).
    _shut_down = False

    @classmethod
    def as_remote(cls, remote_config: dict[str, Any] | None = None) -> Any:
        """The Ray actor class of this buffer class (TorchRL's ``as_remote``): ``.remote(**kwargs)``
        builds one.

        Args:
            remote_config: the actor's options; defaults to TorchRL's (one CPU, 2 GiB, 0.2 GPU
                where CUDA is available).

        Raises:
            ImportError: Ray is not installed.
        """
        return cls._actor_class(cls, remote_config)

    @property
    def service_backend(self) -> str:
        """``"direct"``: the buffer lives in the caller's process (a ``RayReplayBuffer`` says ``"ray"``)."""
        return "direct"

    @property
    def is_alive(self) -> bool:
        """Whether :meth:`shutdown` has not been called."""
        return not self._shut_down

    def start(self) -> "BufferExtras":
        """Returns the buffer, which serves from its construction on (TorchRL's lifecycle API).

        Raises:
            BufferShutDownError: the buffer was shut down.
        """
        if not self.is_alive:
            raise BufferShutDownError("a shut down replay buffer cannot be restarted: build a new one")
        return self

    def client(self) -> "BufferExtras":
        """The buffer itself: callers in this process use it directly."""
        return self

    def shutdown(self, timeout: float | None = None) -> None:
        """Waits for the batches being prefetched and the conditional updates submitted, then
        stops their threads. Later samples and submitted updates raise
        :class:`~gpubuf.errors.BufferShutDownError`; writes, reads by index and checkpoints
        keep working, as in TorchRL. A second call does nothing.

        Args:
            timeout: accepted for TorchRL compatibility; the wait is not bounded (nor is it there).

        Raises:
            The first error of a prefetched read or a submitted update, once both threads are stopped.
        """
        del timeout
        if self._shut_down:
            return
        self._shut_down = True
        error = None
        try:
            self.synchronize()
        except BaseException as err:  # noqa: BLE001 - raised once the threads are stopped
            error = err
        for name in ("_update_executor", "_prefetch_executor"):
            executor = self.__dict__.get(name)
            if executor is not None:
                executor.shutdown(wait=True)
        if error is not None:
            raise error

    def stats(self) -> dict[str, int | float | bool]:
        """A cheap snapshot of counters: ``size``, ``write_count``, ``prefetch_queue_size``,
        ``initialized``, and ``capacity`` and ``utilization`` when the storage has a capacity.

        An unused ``delayed_init`` buffer reports zeros and ``initialized=False`` without being built.
        """
        if not self.initialized:
            args, kwargs = self.__dict__[_PENDING]
            stats: dict[str, Any] = {"size": 0, "write_count": 0, "prefetch_queue_size": 0, "initialized": False}
            storage = kwargs.get("storage")
            # The storage may still be a factory: a capacity is known only for a built one.
            capacity = storage.max_size if isinstance(storage, Storage) else None
            if isinstance(capacity, int):
                stats["capacity"] = capacity
                stats["utilization"] = 0.0
            return stats
        with self._lock:
            size = len(self)
            capacity = self._storage.max_size
            write_count = self._writer._write_count
            prefetcher = self._prefetcher
            queued = len(prefetcher) if prefetcher is not None else 0
        stats = {"size": int(size), "write_count": int(write_count), "prefetch_queue_size": int(queued), "initialized": True}
        if capacity is not None:
            stats["capacity"] = int(capacity)
            stats["utilization"] = float(size) / capacity if capacity else 0.0
        return stats

    # ------------------------------------------------------------------ conditional updates
    def update_if_present(
        self,
        *,
        index: torch.Tensor,
        generation: torch.Tensor,
        patch: Any,
        version_key: Any = None,
        version: int | torch.Tensor | None = None,
        require_newer: bool = False,
    ) -> ConditionalUpdateResult:
        """Patches the records whose ``(index, generation)`` handle is still live.

        A slot rewritten (or emptied) since the handle was taken has moved to another generation:
        its record is skipped. With ``version_key`` and ``version``, a live record is patched only
        when the incoming version is ``>=`` (``>`` with ``require_newer``) the stored one, and the
        accepted version is written into ``version_key``; a slot addressed several times takes the
        row with the highest version (the last on ties). Everything is validated before writing.

        Keyword Args:
            index: storage indices (from :meth:`extend` or a sample's ``"index"``).
            generation: the slots' generations when the handles were taken
                (``writer.generations_of(index)``).
            patch: a mapping (or TensorDict) of stored keys to one row per index.
            version_key: a stored scalar field holding each record's version (tuple form for
                nested keys).
            version: the incoming version, a scalar or one per index.
            require_newer: strict comparison.

        Returns:
            A :class:`~gpubuf.buffers.conditional.ConditionalUpdateResult` aligned with ``index``.

        Raises:
            RuntimeError: the storage cannot patch records in place or the writer does not track
                generations.
            KeyError: a patch key or ``version_key`` that is not stored.
            ValueError: mismatched lengths, shapes or dtypes; only one of ``version_key`` and
                ``version``; ``version_key`` in ``patch`` or a dotted string.
        """
        storage, writer = self._storage, self._writer
        if not storage.supports_conditional_update or not writer.tracks_generations:
            raise RuntimeError(
                f"Conditional updates are not supported by {type(storage).__name__} with {type(writer).__name__}: the "
                "storage must support conditional updates and the writer must track slot generations."
            )
        index = torch.as_tensor(index, dtype=torch.long)
        slots = (index[..., 0] if index.ndim > 1 else index.reshape(-1)).cpu()
        generation = torch.as_tensor(generation, dtype=torch.long).reshape(-1).cpu()
        if generation.numel() != slots.numel():
            raise ValueError(
                f"index and generation must address the same number of records, got {slots.numel()} indices and "
                f"{generation.numel()} generations."
            )
        if (version_key is None) != (version is None):
            raise ValueError("version_key and version must be provided together.")
        items = patch.items(include_nested=True, leaves_only=True) if isinstance(patch, TensorDictBase) else patch.items()
        patch = {unravel_key(key): value for key, value in items}
        with self._lock:
            stored = storage.get(slice(None))
            for key, value in patch.items():
                if key not in stored.keys(include_nested=True, leaves_only=True):
                    raise KeyError(f"patch key {key!r} is not stored")
                target = stored.get(key)
                value = torch.as_tensor(value)
                if value.shape[1:] != target.shape[1:] or value.shape[0] != slots.numel() or value.dtype != target.dtype:
                    raise ValueError(
                        f"patch entry {key!r} has shape {list(value.shape)} and dtype {value.dtype}, expected "
                        f"[{slots.numel()}, *{list(target.shape[1:])}] and {target.dtype}"
                    )
            live = (slots >= 0) & (slots < len(storage))
            live &= writer.generations_of(slots) == generation
            rejected = None
            accept = live.clone()
            incoming = None
            if version_key is not None:
                if isinstance(version_key, str) and "." in version_key:
                    raise ValueError(
                        f"Dotted-string version keys are not supported: got {version_key!r}. Pass the nested key in "
                        f"tuple form, e.g. {tuple(version_key.split('.'))!r}."
                    )
                version_key = unravel_key(version_key)
                if version_key in patch:
                    raise ValueError(f"version_key {version_key!r} may not appear in patch.")
                current = stored.get(version_key)
                if any(d != 1 for d in current.shape[1:]):
                    raise ValueError(f"version_key {version_key!r} must hold one scalar per record")
                current = current.reshape(current.shape[0])
                incoming = torch.as_tensor(version).to(current.dtype).cpu().expand(slots.shape).clone()
                stored_version = current.cpu()[slots.clamp(0, max(len(storage) - 1, 0))]
                newer = incoming > stored_version if require_newer else incoming >= stored_version
                accept = live & newer
                # A slot addressed several times: only its highest version (the last on ties) wins.
                order = sorted(range(slots.numel()), key=lambda i: (int(incoming[i]), i))
                winner = {int(slots[i]): i for i in order if bool(accept[i])}
                keep = torch.zeros_like(accept)
                keep[list(winner.values())] = True
                rejected = live & ~keep
                accept = keep
            rows = accept.nonzero().flatten()
            if rows.numel():
                target_slots = slots[rows]
                records = stored[target_slots]
                for key, value in patch.items():
                    records.set(key, torch.as_tensor(value)[rows.to(torch.as_tensor(value).device)].to(records.device))
                if incoming is not None:
                    shape = stored.get(version_key).shape[1:]
                    records.set(version_key, incoming[rows].reshape(-1, *shape).to(records.device))
                self._invalidate_prefetch()
                storage.set(target_slots, records, set_cursor=False)
        return ConditionalUpdateResult(updated=accept, version_rejected=rejected, batch_size=[slots.numel()])

    def submit_update_if_present(
        self,
        *,
        index: torch.Tensor,
        generation: torch.Tensor,
        patch: Any,
        version_key: Any = None,
        version: int | torch.Tensor | None = None,
        require_newer: bool = False,
    ) -> Future:
        """Runs :meth:`update_if_present` on a background thread, in submission order.

        Returns:
            A :class:`concurrent.futures.Future` of the :class:`ConditionalUpdateResult`. The inputs
            must not be mutated until it completes. :meth:`synchronize` waits for it too.

        Raises:
            BufferShutDownError: the buffer was shut down.
        """
        if self._shut_down:
            raise BufferShutDownError("a shut down replay buffer cannot accept updates: build a new one")
        executor = self.__dict__.get("_update_executor")
        if executor is None:
            executor = self.__dict__["_update_executor"] = ThreadPoolExecutor(max_workers=1)
        pending = self.__dict__.setdefault("_pending_updates", [])
        # Updates that succeeded are forgotten; the others wait for synchronize, which raises the
        # first error among them.
        pending[:] = [f for f in pending if not f.done() or f.cancelled() or f.exception() is not None]
        future = executor.submit(
            self.update_if_present,
            index=index,
            generation=generation,
            patch=patch,
            version_key=version_key,
            version=version,
            require_newer=require_newer,
        )
        pending.append(future)
        return future

    # ------------------------------------------------------------------ trajectory queries
    def query(self, predicate: Any = None, *, trajectory_key: Any = None) -> list:
        """The stored trajectories matching ``predicate``, oldest first.

        Args:
            predicate: a :class:`~gpubuf.buffers.query.TrajectoryPredicate` built from
                :data:`~gpubuf.traj` (only the keys it reads are fetched), or any callable mapping a
                :class:`~gpubuf.Trajectory` to a bool; None returns every trajectory.

        Keyword Args:
            trajectory_key: the entry of per-transition trajectory ids (default: found among
                ``("collector", "traj_ids")``, ``"traj_ids"``, ``"episode"``, else the done flags).

        Returns:
            A list of :class:`~gpubuf.Trajectory` views, with the buffer's transforms applied. Past
            the ring's wrap, a trajectory written across it is returned whole, in time order.

        Raises:
            TypeError: a storage that does not hold TensorDicts.

        Examples:
            >>> good = rb.query((traj.reward.sum() > 100) & (traj.length >= 50))
        """
        storage = self._storage
        if not len(storage):
            return []
        with self._lock:
            source = storage.get(slice(None))
        if isinstance(source, (list, tuple)):
            if not all(is_tensor_collection(item) for item in source):
                raise TypeError(
                    f"ReplayBuffer.query requires a tensordict-backed storage, got items of type {type(source[0])}."
                )
            if any(item.batch_dims for item in source):
                raise TypeError("ReplayBuffer.query on a list-based storage expects single-transition (scalar) items.")
            source = LazyStackedTensorDict.lazy_stack(list(source))
        elif not is_tensor_collection(source):
            raise TypeError(f"ReplayBuffer.query requires a tensordict-backed storage, got content of type {type(source)}.")
        transforms = [t if not inverted else _Inverted(t) for t, inverted in self._transform._items]
        return _query_source(
            source,
            transforms=transforms,
            predicate=predicate,
            trajectory_key=trajectory_key,
            at_capacity=bool(storage._is_full),
            cursor=_last_written(storage),
        )


class _Inverted:
    """A transform applied in its write direction (``append_transform(..., invert=True)``)."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, data: Any) -> Any:
        inv = getattr(self.transform, "inv", None)
        return data if inv is None else inv(data)
