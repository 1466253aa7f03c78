"""``ReplayBuffer``: a storage, a sampler and a writer composed behind TorchRL's API."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass

from gpubuf.buffers._prefetch import Prefetcher
from gpubuf import staging
from gpubuf.buffers._torchrl_api import BufferExtras, DelayedInitMeta
from gpubuf.buffers._transforms import TransformChain
from gpubuf.buffers.sample_units import SampleUnit
from gpubuf.ops._dispatch import check_backend
from gpubuf.buffers._state_check import check_buffer_state
from gpubuf.buffers._validate import (
    check_dim_extend,
    check_item_data,
    check_priority_index,
    check_priority_values,
    check_read_index,
)
from gpubuf.errors import (
    BatchSizeError,
    BufferShutDownError,
    CapacityError,
    ComponentTypeError,
    GpubufError,
    InvalidArgumentError,
    InvalidIndexError,
    MissingKeyError,
    SchemaMismatchError,
    StateDictError,
)
from gpubuf.samplers.base import Sampler
from gpubuf.samplers.random import RandomSampler, _check_batch_size
from gpubuf.storages._layout import expand_as_batch, is_tensor_collection
from gpubuf.storages.base import Storage, check_device, check_fits_memory
from gpubuf.storages.list import ListStorage
from gpubuf.storages.items import element_coordinates, is_int
from gpubuf.storages.tensor import TensorStorage
from gpubuf.writers import RoundRobinWriter, Writer


def _stack_anything(items: list) -> Any:
    """The default collate of list storages: stack tensors / collections of one shape, else keep the list.

    A storage that returns something other than a list (``LazyStackStorage``'s lazy stack) has
    collated the batch itself: it passes through.
    """
    if not isinstance(items, list) or not items:
        return items
    first = items[0]
    try:
        if isinstance(first, torch.Tensor) or is_tensor_collection(first):
            return torch.stack(items)
    except (RuntimeError, TypeError, ValueError, AttributeError):
        # Items of different shapes cannot be stacked: the batch stays a list.
        return items
    return items


def _identity(data: Any) -> Any:
    return data


def _make(component: Any, default: Callable[[], Any], base: type, what: str) -> Any:
    if component is None:
        return default()
    if isinstance(component, base):
        return component
    if callable(component):
        component = component()
        if isinstance(component, base):
            return component
    raise ComponentTypeError(
        f"{what} must be a {base.__name__} or a callable returning one, got {type(component).__name__}"
    )


class ReplayBuffer(BufferExtras, metaclass=DelayedInitMeta):
    """A replay buffer: stores items, samples batches of them.

    Same API as ``torchrl.data.ReplayBuffer``: change the import and the code runs.

    Keyword Args:
        storage: a :class:`~gpubuf.storages.Storage` (or a callable making one). Defaults to
            ``ListStorage(max_size=1000)``.
        sampler: defaults to :class:`~gpubuf.samplers.RandomSampler`.
        writer: defaults to :class:`~gpubuf.writers.RoundRobinWriter`.
        collate_fn: applied to what the storage returns for a batch; defaults to identity for
            tensor storages and to stacking for list storages.
        pin_memory: pin sampled CPU batches (only when CUDA is available). The rows are
            gathered straight into pinned memory, so ``batch.to("cuda", non_blocking=True)``
            is asynchronous without a second host copy.
        prefetch: number of batches prepared ahead; needs ``batch_size``. The indices of every
            batch are drawn in the thread that calls :meth:`sample`, in order, so for the same
            ``generator`` seed the batches are exactly those of ``prefetch=None``; only the
            reads (gather, cross-device copy, transform) run ahead, in ``prefetch`` worker
            threads and, on CUDA, on a side stream. A write (``add``, ``extend``, ``empty``,
            ``__setitem__``, loading) drops the batches drawn before it and undoes their draws,
            so no batch older than a write is returned. See :mod:`gpubuf.buffers._prefetch`.
        transform: a callable (or TorchRL transform) applied to sampled batches.
        batch_size: the default batch size of :meth:`sample` and of iteration.
        dim_extend: the dim of extended data that runs along the storage's first dim; defaults
            to ``storage.ndim - 1``.
        checkpointer: kept on the storage for checkpointing.
        generator: a ``torch.Generator`` used by every random draw (sampling), for reproducibility.
        shared: accepted for TorchRL compatibility.
        compilable: accepted for TorchRL compatibility.
        sample_unit: a :class:`~gpubuf.buffers.sample_units.SampleUnit` expanding each drawn index
            into the records read (default: one record per index).
        transform_factory: a callable returning the transform, called when the buffer is built
            (at its first use: it implies ``delayed_init``); excludes ``transform``.
        consume_after_n_samples: items are consumed (no longer sampled, their slots rewritten
            first) after being returned this many times: the default sampler becomes a
            :class:`~gpubuf.samplers.ConsumingSampler`. Excludes ``prefetch``.
        delayed_init: build the components at the first use of the buffer, not here
            (default: True with ``transform_factory``, else False).
        batch_device: (gpubuf extension) the device sampled batches are returned on, when it is
            not where the storage keeps its rows. ``None`` (default) follows TorchRL: batches go
            to ``storage.device`` (for a tensor storage, where the rows are; for a memmap
            storage, its ``device`` argument). With a host storage and ``batch_device="cuda"``
            the rows are gathered into pinned staging memory and copied by one non-blocking
            copy per batch on a side stream, which the caller's stream waits for before the
            batch is returned (see :mod:`gpubuf.staging`); with a CUDA storage and
            ``batch_device="cpu"`` the gather is one kernel launch and one copy into pinned host
            memory. Applies to :meth:`sample` and iteration; ``rb[index]`` reads stay on the
            storage's device.
        backend: (gpubuf extension) the ops' backend, handed to the storage and the sampler:
            ``"auto"`` (default: Triton kernels for CUDA rows, compiled CPU kernels or the torch
            twins for host rows), ``"triton"``, ``"numba"`` or ``"torch"``. ``"triton"`` with
            CPU rows under Triton's interpreter (``TRITON_INTERPRET=1``) runs exactly the ops
            CUDA rows run: how the tests check the device path without a GPU. See
            :mod:`gpubuf.ops._dispatch`.
        service_backend: ``"direct"`` (default: the buffer lives in this process) or ``"ray"``:
            the constructor then returns the buffer built in a Ray actor, a
            :class:`~gpubuf.distributed.RayReplayBuffer` (TorchRL's dispatch).
        service_backend_options: for ``"ray"``: ``ray_init_config`` and ``remote_config`` (see
            :class:`~gpubuf.distributed.RayReplayBuffer`).
        transport, transport_options: the remote buffer's transport; a direct buffer takes
            ``"auto"`` or ``"direct"`` and no options.

    Raises:
        BatchSizeError: ``prefetch`` without ``batch_size``, or a non-positive ``batch_size``.
        DeviceMismatchError: ``batch_device`` is a CUDA device and CUDA is not available.
        ValueError: an unknown ``backend``, ``service_backend`` or direct ``transport``, or
            ``service_backend_options`` / ``transport_options`` given to a direct buffer.
        BackendUnavailableError: ``backend`` names kernels that cannot run on this machine.

    Examples:
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(1_000_000), batch_size=4096, prefetch=2,
        ...                   batch_device="cuda")  # host rows, GPU batches
        >>> rb.extend(transitions)  # on the host
        >>> batch = rb.sample()  # on cuda, already copied when the next kernel reads it
    """

    #: ``(storage, layout, batch size)`` of the largest batch checked to fit in memory, or None.
    _batch_checked: tuple | None = None

    def __init__(
        self,
        *,
        storage: Storage | Callable[[], Storage] | None = None,
        sampler: Sampler | Callable[[], Sampler] | None = None,
        writer: Writer | Callable[[], Writer] | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        prefetch: int | None = None,
        transform: Callable | None = None,
        batch_size: int | None = None,
        dim_extend: int | None = None,
        checkpointer: Any = None,
        generator: torch.Generator | None = None,
        shared: bool = False,
        compilable: bool | None = None,
        sample_unit: SampleUnit | None = None,
        transform_factory: Callable[[], Callable] | None = None,
        consume_after_n_samples: int | None = None,
        delayed_init: bool | None = None,
        batch_device: torch.device | str | None = None,
        backend: str = "auto",
        service_backend: str = "direct",
        service_backend_options: dict[str, Any] | None = None,
        transport: str = "auto",
        transport_options: dict[str, Any] | None = None,
    ) -> None:
        # Checked and dispatched by DelayedInitMeta before this runs: here they are "direct" and None.
        del service_backend, service_backend_options
        if transport not in ("auto", "direct"):
            raise ValueError(f"A direct ReplayBuffer only supports transport='auto' or 'direct', got {transport!r}")
        if transport_options:
            raise ValueError("transport_options are only valid for a remote ReplayBuffer (service_backend='ray')")
        transform, sampler = self._torchrl_options(
            transform, sampler, prefetch, sample_unit, transform_factory, consume_after_n_samples
        )
        if batch_size is not None:
            _check_batch_size(batch_size)
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
            raise InvalidArgumentError(f"prefetch must be None or an int >= 0 (batches prepared ahead), got {prefetch!r}")
        if dim_extend is not None and (
            isinstance(dim_extend, bool) or not isinstance(dim_extend, int) or dim_extend < 0
        ):
            raise InvalidArgumentError(f"dim_extend must be None or an int >= 0, got {dim_extend!r}")
        if prefetch and batch_size is None:
            raise BatchSizeError(
                "prefetch needs a batch_size given to the constructor: batches are prepared ahead of sample()"
            )
        self._storage = _make(storage, lambda: ListStorage(max_size=1_000), Storage, "storage")
        self._sampler = _make(sampler, RandomSampler, Sampler, "sampler")
        if self._sampler.drop_last and batch_size is None:
            raise BatchSizeError(
                "Samplers with drop_last=True must work with a predictable batch-size: pass batch_size to the "
                "buffer's constructor (an epoch is counted in batches of that size)"
            )
        self._writer = _make(writer, self._default_writer, Writer, "writer")
        self._writer.register_storage(self._storage)
        self._storage.attach(self)
        if checkpointer is not None:
            self._storage.checkpointer = checkpointer
        self._batch_size = batch_size
        self._pin_memory = pin_memory
        self.shared = shared
        self._compilable = compilable
        if collate_fn is not None:
            self._collate_fn = collate_fn
        elif isinstance(self._storage, ListStorage):
            self._collate_fn = _stack_anything
        else:
            self._collate_fn = _identity
        self._transform = TransformChain()
        if transform is not None:
            if isinstance(transform, TransformChain):
                self._transform = transform
            else:
                self._transform.append(transform)
        self._dim_extend = self._storage.ndim - 1 if dim_extend is None else dim_extend
        self._lock = threading.RLock()
        self._batch_device = _as_batch_device(batch_device)
        self._route_cache: _Route | None = None
        self._side_streams: dict = {}
        self._prefetch_cap = int(prefetch or 0)
        self._prefetch_executor = ThreadPoolExecutor(max_workers=self._prefetch_cap) if self._prefetch_cap else None
        self._prefetcher = Prefetcher(self._prefetch_cap, self._prefetch_executor) if self._prefetch_cap else None
        self.set_rng(generator)
        self.set_backend(backend)

    _default_writer = RoundRobinWriter
    #: ``service_backend`` name -> ``factory(buffer_cls, args, kwargs, options)`` of a buffer served
    #: elsewhere: installed by the package from :mod:`gpubuf.distributed` ("ray"); see
    #: :class:`~gpubuf.buffers._torchrl_api.DelayedInitMeta`.
    _services: dict[str, Callable[..., Any]] = {}
    #: ``(dump(buffer, path), load(buffer, path))``: installed by the package from
    #: :mod:`gpubuf.checkpoint`, which reads the buffer's state (the buffer never imports it).
    _checkpoint_io: tuple[Callable[[Any, Any], None], Callable[[Any, Any], None]] | None = None
    # TensorDict buffers report each drawn row's slot generation (info["index_generation"]).
    _reports_generations = False
    #: Whether the buffer holds TensorDicts (or tensorclasses) only: a state of plain tensors is refused.
    _tensordict_items = False

    # ------------------------------------------------------------------ components
    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    @property
    def writer(self) -> Writer:
        return self._writer

    @property
    def transform(self) -> TransformChain:
        return self._transform

    @property
    def batch_size(self) -> int | None:
        """The default batch size of :meth:`sample`, or None."""
        return self._batch_size

    @property
    def dim_extend(self) -> int:
        return self._dim_extend

    @property
    def write_count(self) -> int:
        """The total number of items written through :meth:`add` and :meth:`extend` since the last :meth:`empty`."""
        return self._writer._write_count

    def set_rng(self, generator: torch.Generator | None) -> None:
        """Makes every component draw from ``generator`` (None: torch's default generator)."""
        self._invalidate_prefetch()
        self._rng = generator
        self._storage._rng = generator
        self._sampler._rng = generator
        self._writer._rng = generator

    @property
    def backend(self) -> str:
        """The ops' backend the storage and sampler use (see ``backend`` of the constructor)."""
        return self._backend

    def set_backend(self, backend: str) -> None:
        """Makes the storage and the sampler run their ops on ``backend``.

        Raises:
            ValueError, BackendUnavailableError: as the constructor's ``backend``.
        """
        self._backend = check_backend(backend)
        self._storage._backend = backend
        self._sampler._backend = backend
        self._sampler._bind(self._storage)

    def set_storage(self, storage: Storage, collate_fn: Callable | None = None) -> Storage:
        self._invalidate_prefetch()
        previous, self._storage = self._storage, storage
        if self in previous._attached_entities:
            previous._attached_entities.remove(self)  # writes there are no longer this buffer's rows
        storage.attach(self)
        storage._backend = self._backend
        self._writer.register_storage(storage)
        self._sampler._bind(storage)
        if collate_fn is not None:
            self._collate_fn = collate_fn
        return previous

    def set_sampler(self, sampler: Sampler) -> Sampler:
        self._invalidate_prefetch()
        previous, self._sampler = self._sampler, sampler
        sampler._rng = self._rng
        sampler._backend = self._backend
        sampler._bind(self._storage)
        return previous

    def set_writer(self, writer: Writer) -> Writer:
        previous, self._writer = self._writer, writer
        writer.register_storage(self._storage)
        return previous

    def __len__(self) -> int:
        return self._sampler._visible_len(self._storage)

    # ------------------------------------------------------------------ writing
    def _transpose(self, data: Any) -> Any:
        if self._dim_extend == 0:
            return data
        if isinstance(data, torch.Tensor) or is_tensor_collection(data):
            return data.transpose(self._dim_extend, 0)
        return torch.utils._pytree.tree_map(lambda x: x.transpose(self._dim_extend, 0), data)

    def _check_item(self, data: Any, method: str) -> None:
        """Refuses data no storage holds (see :func:`check_item_data`); tensor storages check
        devices themselves, with the storage's device in the message."""
        own_devices = isinstance(self._storage, TensorStorage)
        check_item_data(data, f"{type(self).__name__}.{method}", check_meta=not own_devices)

    def add(self, data: Any) -> int:
        """Writes one item and returns its index.

        Raises:
            SchemaMismatchError, DTypeMismatchError, DeviceMismatchError, UnsupportedDataError:
                the item does not fit the storage; the buffer is unchanged.
        """
        if len(self._transform):
            data = self._transform.inv(data)
        self._check_item(data, "add")
        with self._lock:
            self._sampler._check_new_items(self._storage, data, batched=False)
            self._invalidate_prefetch()
            index = self._write_consumed(data, batched=False)
            if index is None:
                index = self._writer.add(data)
            self._sampler.add(index)
        self._tell_sharers(index)
        return index

    def extend(self, data: Any, *, update_priority: bool | None = None) -> torch.Tensor:
        """Writes a batch of items (a tensor, TensorDict, tensorclass or pytree with a leading
        batch dim, or a list of items) and returns their indices.

        Returns:
            A 1-D int64 tensor of the indices written (``[n, ndim]`` coordinates for ``ndim > 1``).

        Raises:
            SchemaMismatchError: a missing or extra key, or a wrong trailing shape.
            DTypeMismatchError: a leaf of another dtype than the storage's.
            DeviceMismatchError: a batch on another device than the one fixed by the first batch.
            UnsupportedDataError: a non-tensor into a tensor storage.
            In every case nothing is written: length, contents, cursor and write count are unchanged.
        """
        if update_priority is not None:
            raise NotImplementedError(
                "update_priority is not supported by ReplayBuffer.extend; see TensorDictReplayBuffer.extend"
            )
        if len(self._transform):
            data = self._transform.inv(data)
        if data is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        return self._extend(data)

    def _check_extend(self, data: Any) -> None:
        """The checks ``extend`` makes before it writes, on data already through the inverse
        transforms. Raises what ``extend`` raises; changes nothing."""
        self._check_item(data, "extend")
        check_dim_extend(self._dim_extend, data)
        data = self._transpose(data)
        self._sampler._check_new_items(self._storage, data)
        self._storage._check_rows(data)

    def _extend(self, data: Any) -> torch.Tensor:
        self._check_item(data, "extend")
        check_dim_extend(self._dim_extend, data)
        with self._lock:
            data = self._transpose(data)
            self._sampler._check_new_items(self._storage, data)
            self._invalidate_prefetch()
            index = self._write_consumed(data, batched=True)
            if index is None:
                index = self._writer.extend(data)
            self._sampler.extend(index)
        self._tell_sharers(index)
        return index

    def _tell_sharers(self, index: Any) -> None:
        """Tells the other entities attached to the storage (buffers sharing it) of the rows this
        buffer wrote at ``index``, as TorchRL's writers tell every attached entity: their samplers
        then know the rows (a prioritized sampler gives them the default priority). Called after
        this buffer's lock is released, so two buffers writing at once never wait on each other."""
        for entity in self._storage._attached_entities:
            if entity is not self:
                entity.mark_update(index)

    def update_priority(self, index: Any, priority: Any) -> None:
        """Sets the priorities of items (prioritized samplers; a no-op for the others).

        Raises:
            InvalidIndexError: indices that are not ints.
            PriorityError: priorities that are not numbers, or that the sampler refuses.
            In every case no priority changes.
        """
        check_priority_index(index)
        check_priority_values(priority)
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(part).reshape(-1) for part in index], -1) if index else index
        if not isinstance(priority, torch.Tensor):
            # Python and numpy numbers as float64 (an int past int64 is still a number).
            priority = torch.as_tensor(np.asarray(priority, dtype=np.float64))
        if self._dim_extend > 0 and priority.ndim > 1:
            priority = self._transpose(priority).flatten()
        with self._lock:
            self._sampler.update_priority(index, priority, storage=self._storage)

    def empty(self, empty_write_count: bool = True) -> None:
        """Removes every item and resets the cursor (and the write count unless told otherwise)."""
        with self._lock:
            self._invalidate_prefetch()
            self._writer._empty(empty_write_count=empty_write_count)
            self._sampler._empty()
            self._storage._empty()

    # ------------------------------------------------------------------ reading
    # A sample is a *draw* (the sampler's indices, under the lock, in the caller's thread) and a
    # *read* (gather, cross-device copy, transforms), which prefetch runs ahead in workers.
    def _read(
        self, index: Any, route: "_Route", fills: dict[int, torch.Tensor] | None = None, extra: dict | None = None
    ) -> Any:
        """Reads the items at a sampler's ``index``: gather, build, collate, onto the batch device.

        ``route`` is :meth:`_route`'s, taken once per sample by the caller. ``fills`` maps positions
        of the storage's layout to tensors that replace those leaves instead of gathering them (one entry per item, on the storage's device). ``extra`` maps
        keys to tensors of one entry per item (the sampler's info) that a TensorDict batch gets
        as entries. The batch lands on the buffer's batch device (see ``batch_device``); a CUDA
        batch made on a side stream is only valid there until :meth:`_hand_out`.
        """
        storage = self._storage
        rows = storage._flat_index(index)
        lead = [rows.shape[0]] if isinstance(rows, torch.Tensor) else []
        fills = fills or {}
        if route.transfer is None:
            leaves = storage._gather(rows, fills.keys())
            for position, value in fills.items():
                leaves[position] = value
            data = self._collate_fn(storage._build(leaves, lead))
            if route.target is not None and route.source is None:
                # A storage that gathers for itself, asked for batches elsewhere.
                data = _move(data, route.target)
        else:
            # Rows on one device, batches on another: staged (see gpubuf.staging). A sampler may
            # hand out indices on the batch's device: the gather reads them where the rows are.
            sources: list = list(route.sources)
            for position in fills:
                sources[position] = None
            source = route.transfer.source
            leaves = route.transfer.gather(sources, rows.to(source), {p: v.to(source) for p, v in fills.items()})
            data = self._collate_fn(storage._build(leaves, lead, device=route.target))
        return _attach(data, extra) if extra else data

    def _draw(self, batch_size: int) -> tuple[Any, dict]:
        """The sampler's indices and info for one batch. Called with the lock held."""
        index, info = self._sampler.sample(self._storage, batch_size)
        if self._sample_unit is not None:
            index, info = self._sample_unit.expand(index, info, self._storage)
        info["index"] = index
        if self._reports_generations and self._writer.tracks_generations:
            # The handles of update_if_present, in the sample as TorchRL puts them.
            info["index_generation"] = self._writer.generations_of(index)
        return index, info

    def _read_drawn(self, index: Any, info: dict, batch_size: int, route: "_Route") -> Any:
        """Reads the batch of a draw, as a container on the batch device (subclasses add info)."""
        return self._read(index, route)

    def _finish(self, data: Any) -> Any:
        """Transforms and pins a read batch."""
        if len(self._transform):
            data = self._apply_transform(data)
        if self._pin_memory and torch.cuda.is_available() and _holds_tensors(data):
            device = data.device
            if device is None or torch.device(device).type == "cpu":
                data = data.pin_memory()  # a no-op for rows gathered into pinned memory already
        return data

    def _route(self) -> "_Route":
        """How batches of the buffer's storage travel from its rows to the caller.

        Cached per storage and rows' device: recomputed only when the storage is replaced or
        first allocated.
        """
        storage = self._storage
        sources = storage._row_sources
        source = sources[0].device if sources else None
        route = self._route_cache
        if route is not None and route.storage is storage and route.sources is sources:
            return route
        target = self._batch_device
        if target is None and source is not None:
            device = storage.device
            target = device if isinstance(device, torch.device) else source
        transfer = None
        if source is not None:
            if _same_device(source, target):
                target = source
            if staging.transfer_kind(source, target, self._pin_memory) is not None:
                slots = staging.default_slots(self._prefetch_cap)
                transfer = staging.CrossDeviceGather(source, target, slots=slots, pin=self._pin_memory)
        cuda_rows = source is not None and source.type == "cuda"
        with self._lock:
            route = self._route_cache = _Route(storage, sources, source, target, transfer, cuda_rows)
        return route

    def _side_stream(self, route: "_Route", prefetching: bool) -> Any:
        """The side CUDA stream a read runs on, or None to run on the caller's current stream.

        Cross-device reads always use one (a host-to-CUDA copy then overlaps the kernels still
        queued on the caller's stream); same-device CUDA reads only when prefetching.
        """
        if route.transfer is not None:
            device = route.transfer.stream_device
        elif prefetching and route.source is not None and route.source.type == "cuda":
            device = route.source
        else:
            return None
        if device is None:
            return None
        side = self._side_streams.get(device)
        if side is None:
            with self._lock:
                side = self._side_streams.get(device)
                if side is None:
                    side = self._side_streams[device] = staging.SideStream(device)
        return side

    def _mark_ready(self, prefetching: bool = False, route: "_Route | None" = None) -> Any:
        """After a draw, in the drawing thread: the event a side-stream read waits for, or None.

        Only a read of CUDA rows needs one: the indices were drawn, and earlier writes enqueued,
        on the caller's stream.
        """
        route = self._route() if route is None else route
        if not route.cuda_rows:
            return None
        side = self._side_stream(route, prefetching)
        return None if side is None else side.mark_ready()

    def _produce(
        self,
        index: Any,
        info: dict,
        batch_size: int,
        ready: Any,
        *,
        prefetching: bool = False,
        lock: Any = None,
        route: "_Route | None" = None,
    ) -> tuple[Any, Any]:
        """Reads and finishes a drawn batch; returns ``(data, done)``.

        ``done`` is the CUDA event the consumer's stream must wait for (:meth:`_hand_out`), or
        None when the batch is ready as returned. ``lock``, when given, is held by the caller
        and released right after the read (it covers the draw and the read, not the transforms).
        """
        route = self._route() if route is None else route
        side = self._side_stream(route, prefetching) if route.transfer is not None or route.cuda_rows else None
        if side is None:
            try:
                data = self._read_drawn(index, info, batch_size, route)
            finally:
                if lock is not None:
                    lock.release()
            return self._finish(data), None
        with side.run(ready):
            try:
                # The index was allocated on the caller's stream and is read on the side stream:
                # keep the allocator from reusing it before that read is done.
                for tensor in index if isinstance(index, tuple) else (index,):
                    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                        tensor.record_stream(side.stream)
                data = self._read_drawn(index, info, batch_size, route)
            finally:
                if lock is not None:
                    lock.release()
            data = self._finish(data)
            # A host batch is complete once read (the copy was waited for); a CUDA batch is
            # complete for the consumer once its stream has waited for this event.
            done = side.record() if route.target is not None and route.target.type == "cuda" else None
        return data, done

    def _hand_out(self, data: Any, done: Any) -> Any:
        """Makes a batch read on a side stream usable on the caller's current stream."""
        if done is None:
            return data
        return staging.hand_out(data, done, self._route().target)

    def _sample(self, batch_size: int) -> tuple[Any, dict]:
        """Draws and reads one batch: the one read path (prefetch runs the same steps ahead)."""
        lock = self._lock
        lock.acquire()
        try:
            index, info = self._draw(batch_size)
            route = self._route()
            ready = self._mark_ready(route=route) if route.cuda_rows else None
        except BaseException:
            lock.release()
            raise
        # _produce releases the lock once the batch is read.
        data, done = self._produce(index, info, batch_size, ready, lock=lock, route=route)
        return (data if done is None else self._hand_out(data, done)), info

    def _apply_transform(self, data: Any) -> Any:
        if isinstance(data, TensorDictBase) and data.is_locked:
            data = data.unlock_()
        return self._transform(data)

    def _resolve_batch_size(self, batch_size: int | None) -> int:
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise BatchSizeError(
                "batch_size not specified: pass it to the constructor (ReplayBuffer(batch_size=...)) or to "
                "sample(batch_size)"
            )
        batch_size = _check_batch_size(batch_size)
        if batch_size >= _SMALL_BATCH:
            self._check_batch_fits(batch_size)
        return batch_size

    def _check_batch_fits(self, batch_size: int) -> None:
        """Refuses a batch of at least ``_SMALL_BATCH`` items whose indices and rows cannot fit in
        memory, before anything is drawn."""
        storage = self._storage
        layout = storage.layout
        checked = self._batch_checked
        if checked is not None and checked[0] is storage and checked[1] is layout and batch_size <= checked[2]:
            return  # a batch this large was checked already for these rows
        if layout is not None:
            row_bytes = sum(spec.row_bytes for spec in layout.leaves)
        else:
            # Items of a list storage: a reference, and the first item's bytes when it is a tensor.
            # (A stacked storage that packs its items keeps none in its list.)
            first = storage._storage[0] if isinstance(storage, ListStorage) and storage._storage else None
            row_bytes = 64 + (first.nbytes if isinstance(first, torch.Tensor) else 0)
        device = storage.data_device or torch.device("cpu")
        try:
            check_fits_memory(
                batch_size * (8 + row_bytes),
                device,
                f"a batch of {batch_size:,} items",
                available=True,
                expected="a batch_size whose batch fits in the memory available",
            )
        except CapacityError as err:
            raise BatchSizeError(str(err)) from None
        self._batch_checked = (storage, layout, batch_size)

    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """Samples a batch.

        Args:
            batch_size: the number of items; defaults to the constructor's ``batch_size``.
            return_info: also return the sampler's info dict (``"index"``, and
                ``"priority_weight"`` for prioritized samplers).

        Returns:
            The batch, in the storage's container kind and on the batch device (the storage's
            device unless ``batch_device`` says otherwise); or ``(batch, info)`` when
            ``return_info`` is True. A CUDA batch is ready for the caller's current stream.

        Raises:
            BatchSizeError: no batch size given anywhere, or a non-positive one.
            EmptyBufferError: the buffer holds no item.
            BufferShutDownError: :meth:`shutdown` was called.
        """
        if self._shut_down:
            raise BufferShutDownError("a shut down replay buffer cannot be sampled: build a new one")
        batch_size = self._resolve_batch_size(batch_size)
        if not self._prefetch_cap:
            data, info = self._sample(batch_size)
        else:
            data, info = self._sample_prefetched(batch_size)
        if return_info:
            device = self._storage.device
            if isinstance(device, torch.device):
                info = {k: _to(v, device) for k, v in info.items()}
            return data, info
        return data

    def _sample_prefetched(self, batch_size: int) -> tuple[Any, dict]:
        return self._prefetcher.sample(self, batch_size)

    # The prefetcher's hooks: the state a draw changes, and undoing it.
    def _draw_state(self) -> tuple:
        sampler, rng = self._sampler, self._rng
        sampler_state = sampler._prefetch_state()
        return sampler, sampler_state, rng, None if rng is None else rng.get_state()

    def _restore_draw_state(self, state: tuple) -> None:
        sampler, sampler_state, rng, rng_state = state
        if sampler is not self._sampler:
            return  # the sampler was replaced since: nothing of the old one to undo
        sampler._prefetch_restore(sampler_state)
        if rng is not None and rng is self._rng:
            rng.set_state(rng_state)

    def _invalidate_prefetch(self) -> None:
        """Drops prefetched batches drawn before a write (and undoes their draws); call before writing."""
        prefetcher = self._prefetcher
        if prefetcher is not None:
            with self._lock:
                prefetcher.invalidate(self)

    def mark_update(self, index: Any) -> None:
        """Tells the buffer that items at ``index`` were written behind its back (directly into
        its storage): prefetched batches are dropped, and the sampler is told (TorchRL's hook)."""
        with self._lock:
            self._invalidate_prefetch()
            self._sampler.mark_update(index, storage=self._storage)

    @property
    def batch_device(self) -> torch.device | None:
        """The device sampled batches are returned on when set explicitly (``batch_device``), else None."""
        return self._batch_device

    def __getitem__(self, index: Any) -> Any:
        """Reads items by index (int, slice, tensor, list), or a whole field by key (``rb["obs"]``)."""
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            return self._field(index)
        check_read_index(index, len(self))
        try:
            return self._getitem(index)
        except GpubufError:
            raise
        except (IndexError, TypeError, ValueError, RuntimeError) as err:
            # A read changes nothing: whatever torch refuses in an index is the index's fault.
            raise InvalidIndexError(
                f"index {_describe(index)} cannot address this buffer's items ({type(err).__name__}: {err}); "
                "expected an int, a slice with a positive step, a sequence or tensor of ints, or a boolean mask"
            ) from None

    def _getitem(self, index: Any) -> Any:
        with self._lock:
            if isinstance(index, tuple) and self._dim_extend > 0:
                # Elements of the buffer's view (rb[0, 3:5]: the first row of the data as
                # extended; dims 0 and dim_extend of the storage exchanged, as rb[:] shows them).
                coords, shape = element_coordinates(self._storage.shape, index, self._dim_extend)
                data = self._storage.get(coords)
                data = data.reshape(shape) if is_tensor_collection(data) else data.reshape(*shape, *data.shape[1:])
            elif self._dim_extend > 0:
                # As in TorchRL: the index runs along the dim the data was extended along, and the
                # result comes back in the layout it was given in (an int drops that dim).
                data = self._storage.get((slice(None),) * self._dim_extend + (index,))
                if not is_int(index):
                    data = self._transpose(data)
            else:
                data = self._storage.get(index)
        if not isinstance(index, int):
            data = self._collate_fn(data)
        if len(self._transform):
            data = self._apply_transform(data)
        return data

    def __setitem__(self, index: Any, value: Any) -> None:
        # A writer may refuse writes that bypass it (ImmutableDatasetWriter).
        self._writer._check_writable()
        if len(self._transform):
            value = self._transform.inv(value)
        check_read_index(index, len(self))
        self._check_item(value, "__setitem__")
        with self._lock:
            if isinstance(index, tuple) and self._dim_extend > 0:
                # Elements of the buffer's view, as _getitem reads them; a collection is broadcast
                # over the picked elements (rb[:, 10:20] = td of batch [10]).
                try:
                    index, shape = element_coordinates(self._storage.shape, index, self._dim_extend)
                except (IndexError, TypeError, ValueError, RuntimeError) as err:
                    raise InvalidIndexError(
                        f"index {_describe(index)} cannot address this buffer's elements ({type(err).__name__}: {err}); "
                        "expected a tuple of ints, slices, index sequences or masks over the buffer's dims"
                    ) from None
                if is_tensor_collection(value) and value.batch_size != shape:
                    try:
                        value = value.expand(shape)
                    except RuntimeError:
                        raise SchemaMismatchError(
                            f"a value of batch size {list(value.batch_size)} for {list(shape)} elements: expected that "
                            "batch size, or one that broadcasts to it"
                        ) from None
                if is_tensor_collection(value):
                    value = value.reshape(-1)
                else:
                    value = value.reshape(-1, *value.shape[len(shape) :])
            self._invalidate_prefetch()
            self._storage.set(index, value, set_cursor=False)

    def _field(self, key: Any) -> Any:
        """``rb["obs"]``: one field of every item, or :class:`MissingKeyError` when items have no such key."""
        data = self[:]
        if not is_tensor_collection(data):
            raise MissingKeyError(
                f"key {key!r}: this buffer holds {type(data).__name__} items, which have no keys (expected an int, "
                "slice or index tensor)"
            )
        td = data._tensordict if not isinstance(data, TensorDictBase) else data
        keys = list(td.keys(True))
        if key not in keys and not (isinstance(key, tuple) and len(key) == 1 and key[0] in keys):
            raise MissingKeyError(f"key {key!r} not found: the items have keys {sorted(map(str, keys))}")
        return data[key]

    def __iter__(self):
        """Yields batches of ``batch_size`` until the sampler runs out (never, for random samplers)."""
        if self._batch_size is None:
            raise BatchSizeError(
                "Cannot iterate over the replay buffer. Batch_size was not specified during construction of the "
                "replay buffer."
            )
        self._sampler.ran_out = False
        while not self._sampler.ran_out:
            yield self.sample()

    # ------------------------------------------------------------------ transforms
    def append_transform(self, transform: Callable, *, invert: bool = False) -> "ReplayBuffer":
        """Appends a transform applied to sampled batches (inverted on write when ``invert``)."""
        self._transform.append(transform, invert)
        return self

    def insert_transform(self, index: int, transform: Callable, *, invert: bool = False) -> "ReplayBuffer":
        """Inserts a transform at position ``index`` of the transform list."""
        self._transform.insert(index, transform, invert)
        return self

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "_storage": self._storage.state_dict(),
            "_sampler": self._sampler.state_dict(),
            "_writer": self._writer.state_dict(),
            "_transforms": self._transform.state_dict(),
            "_batch_size": self._batch_size,
            "_rng": None if self._rng is None else (self._rng.get_state().clone(), str(self._rng.device)),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`, all or nothing.

        The state is checked whole first (keys, types, ranges, capacity, the kind of items,
        cursor and priorities against the storage's rows; see
        :mod:`gpubuf.buffers._state_check`). The components then load, the storage last; if a
        component still refuses its part, the sampler, writer and transforms get their previous
        state back, so the buffer is as it was.

        Raises:
            StateDictKeyError: a key is missing.
            StateDictError: any other part that does not fit this buffer.
            Storage errors (``StorageMismatchError``, ``DiskFullError``) of a memory-mapped storage.
        """
        checked = check_buffer_state(self, state_dict)
        with self._lock:
            self._invalidate_prefetch()
            previous = (self._sampler.state_dict(), self._writer.state_dict(), self._transform.state_dict())
            try:
                self._sampler.load_state_dict(state_dict["_sampler"])
                self._writer.load_state_dict(state_dict["_writer"])
                self._transform.load_state_dict(state_dict.get("_transforms") or {})
                self._storage.load_state_dict(state_dict["_storage"])
            except Exception as err:
                self._sampler.load_state_dict(previous[0])
                self._writer.load_state_dict(previous[1])
                self._transform.load_state_dict(previous[2])
                if isinstance(err, GpubufError):
                    raise
                raise StateDictError(f"the state dict does not fit this buffer: {type(err).__name__}: {err}") from err
            self._batch_size = state_dict["_batch_size"]
            if checked.generator is not None:
                self.set_rng(checked.generator)

    def dumps(self, path: Any) -> None:
        """Writes a pickle-free, crash-safe checkpoint of the whole buffer to directory ``path``."""
        with self._lock:
            self._checkpoint_io[0](self, path)

    def loads(self, path: Any) -> None:
        """Restores the buffer from a checkpoint directory written by :meth:`dumps`; validated first."""
        with self._lock:
            self._invalidate_prefetch()
            self._checkpoint_io[1](self, path)

    # ------------------------------------------------------------------ pickling (multiprocessing)
    def __getstate__(self) -> dict[str, Any]:
        """The buffer's state for pickling (spawned workers): locks, threads and streams are
        process-local, so they are dropped here and made anew on the other side. Prefetched
        batches are dropped first (their draws undone), as for any write."""
        self._invalidate_prefetch()
        state = dict(self.__dict__)
        for name in ("_lock", "_prefetch_executor", "_prefetcher", "_side_streams", "_route_cache", "_update_executor",
                     "_pending_updates", "_iterator"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._route_cache = None
        self._side_streams = {}
        cap = self._prefetch_cap
        self._prefetch_executor = ThreadPoolExecutor(max_workers=cap) if cap else None
        self._prefetcher = Prefetcher(cap, self._prefetch_executor) if cap else None

    def register_save_hook(self, hook: Callable[[Any], Any]) -> None:
        """Adds a hook applied by the storage's checkpointer to the data before it is saved."""
        self._storage.register_save_hook(hook)

    def register_load_hook(self, hook: Callable[[Any], Any]) -> None:
        """Adds a hook applied by the storage's checkpointer to the data after it is loaded."""
        self._storage.register_load_hook(hook)

    def dump(self, path: Any) -> None:
        """Alias of :meth:`dumps`."""
        self.dumps(path)

    def save(self, path: Any) -> None:
        """Alias of :meth:`dumps`."""
        self.dumps(path)

    def load(self, path: Any) -> None:
        """Alias of :meth:`loads`."""
        self.loads(path)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(storage={self._storage!r}, sampler={self._sampler!r}, writer={self._writer!r}, "
            f"batch_size={self._batch_size})"
        )


def _describe(value: Any) -> str:
    """A short description of an index for an error message (never a whole tensor)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, shape={list(value.shape)})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        # to() returns the tensor itself when it is there already, after a dispatch that costs
        # more than the comparison.
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


class _Route(NamedTuple):
    """How batches of one storage travel: rows of ``sources`` on ``source``, batches to ``target``,
    through ``transfer`` (a :class:`~gpubuf.staging.CrossDeviceGather`) when those differ or
    batches are pinned, else None. ``source`` is None for a storage that gathers for itself;
    ``target`` is then the ``batch_device``, when one was given."""

    storage: Any
    sources: Any
    source: torch.device | None
    target: torch.device | None
    transfer: Any
    #: ``source`` is a CUDA device: a read waits for the draw's stream (see ``_mark_ready``).
    cuda_rows: bool


#: Batches below this many items are not checked against the memory available (reading it costs
#: a file read; such a batch cannot exhaust memory unless its items are huge).
_SMALL_BATCH = 1 << 16

#: The key under which a TensorDict batch carries the drawn indices.
_INDEX_KEY = ("index",)

def _info_entries(info: dict, index_filled: bool) -> dict:
    """The entries a TensorDict batch gets from a draw's ``info``: every tensor (per-dim index
    tuples stacked on a last dim), except ``"index"`` when the stored index column holds it."""
    entries = {}
    for key, value in info.items():
        if key == "index" and index_filled:
            continue
        if isinstance(value, tuple):
            value = torch.stack(value, -1)
        if isinstance(value, torch.Tensor):
            entries[key] = value
    return entries


def _as_batch_device(device: Any) -> torch.device | None:
    """Validates a ``batch_device`` argument; ``"cuda"`` gets the current device's ordinal."""
    if device is None:
        return None
    device = check_device(device, "batch_device")
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" without an ordinal means the current device, as tensors report it.
    if a.type != b.type:
        return False
    if a.type == "cuda" and (a.index is None or b.index is None):
        current = torch.cuda.current_device()
        return (current if a.index is None else a.index) == (current if b.index is None else b.index)
    return a.index == b.index or a.type == "cpu"


def _attach(data: Any, extra: dict | None) -> Any:
    """Sets ``extra``'s entries on a TensorDict batch, on its device and batch size; other batches pass."""
    if extra and isinstance(data, TensorDictBase):
        device = data.device
        batch_size = data.batch_size
        # The entries are made to fit here (one per item, broadcast, on the batch's device), so a
        # plain TensorDict takes them unvalidated: a validated set costs as much as building the batch.
        plain = type(data) is TensorDict
        parents: dict = {}  # the sub-TensorDicts nested keys go under, looked up once per batch
        for key, value in extra.items():
            value = expand_as_batch(value if device is None or value.device == device else value.to(device), batch_size)
            if plain and isinstance(key, str):
                data._set_str(key, value, inplace=False, validated=True)
                continue
            if plain and isinstance(key, tuple) and len(key) > 1 and isinstance(key[-1], str):
                node = parents.get(key[:-1])
                if node is None:
                    node = parents[key[:-1]] = _plain_parent(data, key[:-1], batch_size)
                if node is not False:
                    node._set_str(key[-1], value, inplace=False, validated=True)
                    continue
            # A nested key (a slice sampler's ("next", "truncated")) under parents of another kind.
            data.set(key, value)
    return data


def _plain_parent(data: TensorDict, path: tuple, batch_size: torch.Size) -> TensorDict | bool:
    """The sub-TensorDict at ``path`` of a plain TensorDict when it and every parent on the way are
    plain, unlocked TensorDicts of the batch's size (a value that fits the batch fits them, so it
    is set unvalidated); False otherwise."""
    node = data
    for part in path:
        node = node._tensordict.get(part) if isinstance(part, str) else None
        if type(node) is not TensorDict or node.batch_size != batch_size or node.is_locked:
            return False
    return node


def _holds_tensors(data: Any) -> bool:
    """Whether a batch is a tensor, TensorDict or tensorclass (not a list of arbitrary objects)."""
    return isinstance(data, (torch.Tensor, TensorDictBase)) or is_tensorclass(data)


def _move(data: Any, device: torch.device) -> Any:
    """A batch of tensors on ``device``; other batches (lists of objects) as they are."""
    return data.to(device) if _holds_tensors(data) else data
