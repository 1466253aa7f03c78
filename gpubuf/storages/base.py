"""The storage interface shared by every gpubuf storage (TorchRL's ``Storage``)."""

from __future__ import annotations

import operator
import os
from typing import Any, Callable

import torch

from gpubuf.errors import CapacityError, InvalidDeviceError

#: Indices are int64 tensors.
MAX_CAPACITY = 2**63 - 1


def check_max_size(max_size: Any, what: str = "max_size") -> int:
    """Returns ``max_size`` as an int, or raises :class:`CapacityError` when it is not a positive
    integer of at most ``2**63 - 1`` (indices are int64)."""
    if isinstance(max_size, bool) or not hasattr(max_size, "__index__"):
        raise CapacityError(f"{what} must be a positive integer, got {max_size!r} ({type(max_size).__name__})")
    value = operator.index(max_size)
    if value <= 0:
        raise CapacityError(f"{what} must be a positive integer, got {value}")
    if value > MAX_CAPACITY:
        raise CapacityError(f"{what} must be at most 2**63 - 1 (indices are int64), got {value}")
    return value


def check_device(device: Any, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that exists here.

    Raises:
        InvalidDeviceError: a malformed device (``"gpu0"``, ``3.5``), or a CUDA device when CUDA is
            not available (or an ordinal past the GPUs present).
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidDeviceError(
            f"{what}={device!r} is not a device: expected 'cpu', 'cuda', 'cuda:N' or a torch.device"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidDeviceError(f"{what}={device} was asked for, but CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidDeviceError(
                f"{what}={device}: expected an ordinal below the {torch.cuda.device_count()} GPUs present"
            )
    return device


def device_memory_bytes(device: torch.device, *, available: bool = False) -> int | None:
    """The physical memory of ``device`` in bytes (host RAM for the CPU), or None when unknown.

    With ``available``, the memory that can be allocated now instead (``MemAvailable`` of the
    host, the free memory of a GPU): the bound of a transient allocation such as a batch.
    """
    try:
        if device.type == "cpu":
            if available:
                with open("/proc/meminfo", encoding="ascii") as meminfo:
                    for line in meminfo:
                        if line.startswith("MemAvailable:"):
                            return int(line.split()[1]) * 1024
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            if available:
                return int(torch.cuda.mem_get_info(index)[0])
            return int(torch.cuda.get_device_properties(index).total_memory)
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None


def check_fits_memory(
    nbytes: int,
    device: torch.device,
    what: str,
    *,
    available: bool = False,
    expected: str = "a capacity whose rows fit in the device's memory (use LazyMemmapStorage for rows kept on disk)",
) -> None:
    """Refuses an allocation of ``nbytes`` that exceeds the physical memory of ``device``.

    The rule of in-memory storages: an allocation that cannot fit in the device's memory, even
    with nothing else on it, is refused before it is attempted (with overcommit, a host
    allocation larger than RAM would succeed and the process be killed at the first touch).
    Whether it fits beside what is already allocated is left to the allocator, except with
    ``available`` (transient allocations, such as a sampled batch).

    Raises:
        CapacityError: ``nbytes`` is larger than the device's memory.
    """
    total = device_memory_bytes(device, available=available)
    if total is not None and nbytes > total:
        has = "has available" if available else "has"
        raise CapacityError(f"{what} needs {nbytes:,} bytes on {device}, which {has} {total:,}: expected {expected}")


class Storage:
    """A container of items addressed by integer indices.

    Subclasses implement :meth:`set`, :meth:`get`, :meth:`__len__` and :meth:`_empty`.

    Args:
        max_size: the capacity, a positive int.
        compilable: accepted for TorchRL compatibility; gpubuf storages keep plain Python
            counters either way.
    """

    ndim = 1
    device: torch.device | str | None = None

    def __init__(self, max_size: int, *, compilable: bool = False) -> None:
        self.max_size = check_max_size(max_size)
        self._compilable = compilable
        self._rng: torch.Generator | None = None
        self._attached_entities: list = []
        self._save_hooks: list[Callable] = []
        self._load_hooks: list[Callable] = []
        self._checkpointer = None

    # ------------------------------------------------------------------ the interface
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        raise NotImplementedError

    def get(self, index: Any) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def _empty(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared behaviour
    def __getitem__(self, item: Any) -> Any:
        return self.get(item)

    def __setitem__(self, index: Any, value: Any) -> None:
        self.set(index, value, set_cursor=False)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def attach(self, buffer: Any) -> None:
        """Registers a buffer (or other entity) that wants to hear about writes."""
        if buffer not in self._attached_entities:
            self._attached_entities.append(buffer)

    @property
    def _is_full(self) -> bool:
        return len(self) == self.max_size

    @property
    def shape(self) -> torch.Size | None:
        return torch.Size([len(self)])

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        return self.max_size

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        return torch.randint(0, len(self), (batch_size,), generator=self._rng)

    def flatten(self) -> "Storage":
        return self

    def register_save_hook(self, hook: Callable[[Any], Any]) -> None:
        """Adds a hook applied to the data before it is saved by a checkpointer."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook: Callable[[Any], Any]) -> None:
        """Adds a hook applied to the data after it is loaded by a checkpointer."""
        self._load_hooks.append(hook)

    def dumps(self, path: Any) -> None:
        """Writes a pickle-free, crash-safe checkpoint of this storage to directory ``path``."""
        from gpubuf.checkpoint import dump_storage

        dump_storage(self, path)

    def loads(self, path: Any) -> None:
        """Restores this storage from a checkpoint written by :meth:`dumps` (validated first)."""
        from gpubuf.checkpoint import load_storage

        load_storage(self, path)

    def save(self, path: Any) -> None:
        """Alias of :meth:`dumps`."""
        self.dumps(path)

    def dump(self, path: Any) -> None:
        """Alias of :meth:`dumps`."""
        self.dumps(path)

    def load(self, path: Any) -> None:
        """Alias of :meth:`loads`."""
        self.loads(path)

    @property
    def checkpointer(self):
        return self._checkpointer

    @checkpointer.setter
    def checkpointer(self, value) -> None:
        self._checkpointer = value

    def contains(self, item: int) -> bool:
        return 0 <= int(item) < len(self)

    def __contains__(self, item: int) -> bool:
        return self.contains(item)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError
