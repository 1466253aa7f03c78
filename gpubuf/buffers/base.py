"""``ReplayBuffer``: a storage, a sampler and a writer composed behind TorchRL's API."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from gpubuf.buffers._transforms import TransformChain
from gpubuf.errors import BatchSizeError
from gpubuf.samplers.base import Sampler
from gpubuf.samplers.random import RandomSampler, _check_batch_size
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.base import Storage
from gpubuf.storages.list import ListStorage
from gpubuf.writers import RoundRobinWriter, Writer


def _stack_anything(items: list) -> Any:
    """The default collate of list storages: stack tensors / collections of one shape, else keep the list."""
    if not items:
        return items
    first = items[0]
    try:
        if isinstance(first, torch.Tensor) or is_tensor_collection(first):
            return torch.stack(items)
    except (RuntimeError, TypeError, ValueError):
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
    raise TypeError(f"{what} must be a {base.__name__} or a callable returning one, got {type(component).__name__}")


class ReplayBuffer:
    """A replay buffer: stores items, samples batches of them.

    Same API as ``torchrl.data.ReplayBuffer``: change the import and the code runs.

    Keyword Args:
        storage: a :class:`~gpubuf.storages.Storage` (or a callable making one). Defaults to
            ``ListStorage(max_size=1000)``.
        sampler: defaults to :class:`~gpubuf.samplers.RandomSampler`.
        writer: defaults to :class:`~gpubuf.writers.RoundRobinWriter`.
        collate_fn: applied to what the storage returns for a batch; defaults to identity for
            tensor storages and to stacking for list storages.
        pin_memory: pin sampled CPU batches (only when CUDA is available).
        prefetch: number of batches prepared ahead in background threads; needs ``batch_size``.
        transform: a callable (or TorchRL transform) applied to sampled batches.
        batch_size: the default batch size of :meth:`sample` and of iteration.
        dim_extend: the dim of extended data that runs along the storage's first dim; defaults
            to ``storage.ndim - 1``.
        checkpointer: kept on the storage for checkpointing.
        generator: a ``torch.Generator`` used by every random draw (sampling), for reproducibility.
        shared: accepted for TorchRL compatibility.
        compilable: accepted for TorchRL compatibility.

    Raises:
        BatchSizeError: ``prefetch`` without ``batch_size``, or a non-positive ``batch_size``.
    """

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
    ) -> None:
        if batch_size is not None:
            _check_batch_size(batch_size)
        if prefetch and batch_size is None:
            raise BatchSizeError(
                "prefetch needs a batch_size given to the constructor: batches are prepared ahead of sample()"
            )
        self._storage = _make(storage, lambda: ListStorage(max_size=1_000), Storage, "storage")
        self._sampler = _make(sampler, RandomSampler, Sampler, "sampler")
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
        if dim_extend is not None and dim_extend < 0:
            raise ValueError(f"dim_extend must be >= 0, got {dim_extend}")
        self._dim_extend = self._storage.ndim - 1 if dim_extend is None else dim_extend
        self._lock = threading.RLock()
        self._prefetch_cap = int(prefetch or 0)
        self._prefetch_queue: collections.deque = collections.deque()
        self._prefetch_executor = ThreadPoolExecutor(max_workers=self._prefetch_cap) if self._prefetch_cap else None
        self.set_rng(generator)

    _default_writer = RoundRobinWriter

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
        self._rng = generator
        self._storage._rng = generator
        self._sampler._rng = generator
        self._writer._rng = generator

    def set_storage(self, storage: Storage, collate_fn: Callable | None = None) -> Storage:
        previous, self._storage = self._storage, storage
        self._writer.register_storage(storage)
        if collate_fn is not None:
            self._collate_fn = collate_fn
        return previous

    def set_sampler(self, sampler: Sampler) -> Sampler:
        previous, self._sampler = self._sampler, sampler
        sampler._rng = self._rng
        return previous

    def set_writer(self, writer: Writer) -> Writer:
        previous, self._writer = self._writer, writer
        writer.register_storage(self._storage)
        return previous

    def __len__(self) -> int:
        return len(self._storage)

    # ------------------------------------------------------------------ writing
    def _transpose(self, data: Any) -> Any:
        if self._dim_extend == 0:
            return data
        if isinstance(data, torch.Tensor) or is_tensor_collection(data):
            return data.transpose(self._dim_extend, 0)
        return torch.utils._pytree.tree_map(lambda x: x.transpose(self._dim_extend, 0), data)

    def add(self, data: Any) -> int:
        """Writes one item and returns its index.

        Raises:
            SchemaMismatchError, DTypeMismatchError, DeviceMismatchError, UnsupportedDataError:
                the item does not fit the storage; the buffer is unchanged.
        """
        if len(self._transform):
            data = self._transform.inv(data)
        with self._lock:
            index = self._writer.add(data)
            self._sampler.add(index)
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

    def _extend(self, data: Any) -> torch.Tensor:
        with self._lock:
            data = self._transpose(data)
            index = self._writer.extend(data)
            self._sampler.extend(index)
            self._prefetch_queue.clear()
        return index

    def update_priority(self, index: Any, priority: Any) -> None:
        """Sets the priorities of items (prioritized samplers; a no-op for the others)."""
        if isinstance(index, tuple):
            index = torch.stack(index, -1)
        priority = torch.as_tensor(priority)
        if self._dim_extend > 0 and priority.ndim > 1:
            priority = self._transpose(priority).flatten()
        with self._lock:
            self._sampler.update_priority(index, priority, storage=self._storage)

    def empty(self, empty_write_count: bool = True) -> None:
        """Removes every item and resets the cursor (and the write count unless told otherwise)."""
        with self._lock:
            self._writer._empty(empty_write_count=empty_write_count)
            self._sampler._empty()
            self._storage._empty()
            self._prefetch_queue.clear()

    # ------------------------------------------------------------------ reading
    def _read(self, index: Any, fill: dict | None = None) -> Any:
        """Reads the items at a sampler's ``index``; the gather runs as one op over every leaf.

        ``fill`` maps a layout key to a tensor that replaces that leaf instead of gathering it.
        """
        storage = self._storage
        gather = getattr(storage, "_gather", None)
        if gather is None or not isinstance(index, (torch.Tensor, tuple)):
            return self._collate_fn(storage.get(index))
        flat = storage._flat_index(index)
        skip = None
        if fill:
            (key, value), = fill.items()
            skip = storage.layout.index_of(key)
        leaves = gather(flat, skip)
        if skip is not None:
            leaves[skip] = value
        return storage._build(leaves, [flat.shape[0]])

    def _sample(self, batch_size: int) -> tuple[Any, dict]:
        with self._lock:
            index, info = self._sampler.sample(self._storage, batch_size)
            info["index"] = index
            data = self._read(index)
        if len(self._transform):
            data = self._apply_transform(data)
        if self._pin_memory and torch.cuda.is_available():
            data = data.pin_memory()
        return data, info

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
        return _check_batch_size(batch_size)

    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        """Samples a batch.

        Args:
            batch_size: the number of items; defaults to the constructor's ``batch_size``.
            return_info: also return the sampler's info dict (``"index"``, and
                ``"priority_weight"`` for prioritized samplers).

        Returns:
            The batch, in the storage's container kind and on the storage's device; or
            ``(batch, info)`` when ``return_info`` is True.

        Raises:
            BatchSizeError: no batch size given anywhere, or a non-positive one.
            EmptyBufferError: the buffer holds no item.
        """
        batch_size = self._resolve_batch_size(batch_size)
        if not self._prefetch_cap:
            data, info = self._sample(batch_size)
        else:
            data, info = self._sample_prefetched(batch_size)
        if return_info:
            device = getattr(self._storage, "device", None)
            if isinstance(device, torch.device):
                info = {k: _to(v, device) for k, v in info.items()}
            return data, info
        return data

    def _sample_prefetched(self, batch_size: int) -> tuple[Any, dict]:
        # Batches are prepared by worker threads; a write clears the queue so that no batch
        # predating it is handed out.
        with self._lock:
            while self._prefetch_queue and self._prefetch_queue[0][0] != batch_size:
                self._prefetch_queue.popleft()
            future = self._prefetch_queue.popleft()[1] if self._prefetch_queue else None
            while len(self._prefetch_queue) < self._prefetch_cap:
                self._prefetch_queue.append((batch_size, self._prefetch_executor.submit(self._sample, batch_size)))
        if future is None:
            return self._sample(batch_size)
        return future.result()

    def __getitem__(self, index: Any) -> Any:
        """Reads items by index (int, slice, tensor, list), or a whole field by key (``rb["obs"]``)."""
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            return self[:][index]
        with self._lock:
            data = self._storage.get(index)
        if not isinstance(index, int):
            data = self._collate_fn(data)
        if len(self._transform):
            data = self._apply_transform(data)
        return data

    def __setitem__(self, index: Any, value: Any) -> None:
        if len(self._transform):
            value = self._transform.inv(value)
        with self._lock:
            self._storage.set(index, value, set_cursor=False)

    def __iter__(self):
        """Yields batches of ``batch_size`` until the sampler runs out (never, for random samplers)."""
        if self._batch_size is None:
            raise BatchSizeError("cannot iterate over a buffer built without a batch_size")
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
        self._storage.load_state_dict(state_dict["_storage"])
        self._sampler.load_state_dict(state_dict["_sampler"])
        self._writer.load_state_dict(state_dict["_writer"])
        self._transform.load_state_dict(state_dict.get("_transforms", {}))
        self._batch_size = state_dict["_batch_size"]
        rng = state_dict.get("_rng")
        if rng is not None:
            state, device = rng
            generator = torch.Generator(device=device)
            generator.set_state(state)
            self.set_rng(generator)

    def dumps(self, path: Any) -> None:
        """Writes a pickle-free, crash-safe checkpoint of the whole buffer to directory ``path``."""
        from gpubuf.checkpoint import dump_buffer

        with self._lock:
            dump_buffer(self, path)

    def loads(self, path: Any) -> None:
        """Restores the buffer from a checkpoint directory written by :meth:`dumps`; validated first."""
        from gpubuf.checkpoint import load_buffer

        with self._lock:
            load_buffer(self, path)
            self._prefetch_queue.clear()

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


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value
