"""Counting device work: kernel launches and host synchronisations of a block of code.

A replay step on the GPU is bound by launches (3 to 8 us each from Python) and by the points
where the host waits for the device, not by bytes. This module counts both:

- **Triton launches**: every launcher in ``gpubuf_kernels`` launches through
  ``gpubuf_kernels._launch.launch``, which tells the active counters.
- **Torch ops** that launch work on the device: a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
  sees every aten op; those that touch a tensor on the counted device count, except ops that
  launch nothing (views, ``empty``, ``detach``, scalar reads, which are counted as syncs).
- **Host syncs**: ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``, ``float()``
  of a device tensor), a blocking copy from the device to the host, ``.tolist()`` /
  ``.numpy()`` of a device tensor (which torch serves without an aten op), and ops whose output
  size depends on the data (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``,
  ``repeat_interleave`` without ``output_size``): CUDA reads that size back on the host. These
  also count as launches.
- **Host-to-device copies** (``c.host_to_device``), counted apart: each is a launch too, and a
  pageable one blocks the host until the copy is staged.

On CUDA the counted device is ``"cuda"``. On a CPU machine the device path runs on CPU tensors
(Triton's interpreter, ``backend="triton"``): count with ``device="cpu"``, and every CPU tensor
counts as a device tensor, so the counts are an upper bound of what CUDA would do.

Example:
    >>> with count_device_work("cpu") as work:
    ...     batch = rb.sample()
    >>> work.launches, work.triton_launches, work.torch_ops, work.host_syncs
    (2, 1, 1, 0)
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

from gpubuf_kernels import _launch

__all__ = ["DeviceWork", "count_device_work"]

_aten = torch.ops.aten

# Ops that touch a tensor yet launch no kernel: allocation and metadata. (Views are found by
# ``OpOverload.is_view``; these are the rest.)
_NO_LAUNCH = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    _aten.detach.default,
    _aten.lift_fresh.default,
    _aten.alias.default,
    _aten.set_.source_Storage_storage_offset,
    _aten.set_.source_Tensor,
    _aten.resize_.default,
    _aten.record_stream.default,
    _aten.is_same_size.default,
    _aten.sym_size.int,
    _aten.sym_stride.int,
    _aten.sym_numel.default,
    _aten.sym_storage_offset.default,
}
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten.copy.default}
# Ops whose output size depends on the data: on CUDA the host reads that size back before it
# can return (a sync with no ``_local_scalar_dense`` of its own). Boolean-mask indexing and a
# ``repeat_interleave`` without ``output_size`` are found by their arguments.
_SIZE_SYNCS = {
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
}


@dataclass
class DeviceWork:
    """What a block of code asked of the device; filled in while :func:`count_device_work` is active.

    Attributes:
        device_type: the device counted (``"cuda"``, or ``"cpu"`` for the device path on CPU tensors).
        triton_launches: Triton kernels launched.
        torch_ops: aten ops that launch device work (host-to-device copies included).
        host_syncs: points where the host waited for a value or copy from the device.
        host_to_device: copies from the host onto the device (also counted in ``torch_ops``).
        kernels: launches by name: ``"triton:<kernel>"`` and ``"aten:<op>"``.
        syncs: one description per host sync, in order.
    """

    device_type: str
    triton_launches: int = 0
    torch_ops: int = 0
    host_syncs: int = 0
    host_to_device: int = 0
    kernels: Counter = field(default_factory=Counter)
    syncs: list[str] = field(default_factory=list)

    @property
    def launches(self) -> int:
        """Every launch: Triton kernels plus torch ops."""
        return self.triton_launches + self.torch_ops

    def summary(self) -> str:
        """One line: the totals, then launches by name, most frequent first, and the syncs."""
        parts = ", ".join(f"{name} x{n}" for name, n in self.kernels.most_common())
        syncs = f"; syncs: {', '.join(self.syncs)}" if self.syncs else ""
        return (
            f"{self.launches} launches ({self.triton_launches} Triton, {self.torch_ops} torch), "
            f"{self.host_syncs} host syncs on {self.device_type}: {parts or 'none'}{syncs}"
        )

    # The counting hooks.
    def _triton(self, kernel: Any, args: tuple, kwargs: dict) -> None:
        self.triton_launches += 1
        self.kernels[f"triton:{_launch.kernel_name(kernel)}"] += 1

    def _sync(self, what: str) -> None:
        self.host_syncs += 1
        self.syncs.append(what)


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Counting(TorchDispatchMode):
    """Sorts every aten op into a launch, a sync, a host-to-device copy or nothing."""

    def __init__(self, work: DeviceWork) -> None:
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Skipped: the interpreter's own copies around a Triton launch, and the copy a counted
        # ``.tolist()`` makes of a CUDA tensor (one sync, counted once).
        if not (_launch.launching() or getattr(_reading, "depth", 0)):
            self._classify(func, args, kwargs, out)
        return out

    def _classify(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        work = self.work
        kind = work.device_type
        if func is _aten._local_scalar_dense.default:
            if _on(args, kind):
                work._sync(f"{func.__name__} (item/bool/int of a device tensor)")
            return
        if func.is_view or func in _NO_LAUNCH:
            return
        if _sizes_from_data(func, args, kwargs) and _on(args, kind):
            work._sync(f"{func.__name__} (output size read on the host)")
        if func in _COPIES and kind != "cpu":
            src, dst = _copy_ends(func, args, out)
            if src == kind and dst == "cpu" and not _non_blocking(func, args, kwargs):
                work._sync(f"{func.__name__} (blocking copy to the host)")
            if src == "cpu" and dst == kind:
                work.host_to_device += 1
        if _on(args, kind) or _on(kwargs, kind) or _on(out, kind):
            work.torch_ops += 1
            work.kernels[f"aten:{func.__name__}"] += 1


def _sizes_from_data(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in _SIZE_SYNCS:
        return True
    if func is _aten.index.Tensor:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return False


def _on(tree: Any, kind: str) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == kind for x in tree_iter(tree))


def _non_blocking(func: Any, args: tuple, kwargs: dict) -> bool:
    """The ``non_blocking`` flag of a copy op (positional for ``copy_``, keyword for ``_to_copy``)."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return bool(args[2]) if func is _aten.copy_.default and len(args) > 2 else False


def _copy_ends(func: Any, args: tuple, out: Any) -> tuple[str | None, str | None]:
    """(source device type, destination device type) of a copy op."""
    if func is _aten.copy_.default:
        return args[1].device.type, args[0].device.type
    return args[0].device.type, out.device.type if isinstance(out, torch.Tensor) else None


# ``.tolist()`` and ``.numpy()`` read a tensor's memory without an aten op: wrapped while any
# counter is active (reference-counted, so nested or concurrent counters share one wrap).
_active: list[DeviceWork] = []
_wrap_lock = threading.Lock()
_originals: dict[str, Any] = {}
_reading = threading.local()


def _reader(name: str, original: Any) -> Any:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        for work in tuple(_active):
            if self.device.type == work.device_type and not _launch.launching():
                work._sync(f"Tensor.{name}")
        _reading.depth = getattr(_reading, "depth", 0) + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _reading.depth -= 1

    read.__name__ = name
    read.__doc__ = original.__doc__
    return read


def _wrap_readers() -> None:
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)
        _originals[name] = original
        setattr(torch.Tensor, name, _reader(name, original))


def _unwrap_readers() -> None:
    for name, original in _originals.items():
        setattr(torch.Tensor, name, original)
    _originals.clear()


@contextlib.contextmanager
def count_device_work(device: str | torch.device | None = None) -> Iterator[DeviceWork]:
    """Counts the launches and host syncs of the block it wraps.

    Torch ops are those of this thread (a dispatch mode is per thread); Triton launches and
    ``.tolist()`` / ``.numpy()`` reads are those of every thread while the block runs (a
    prefetching buffer's workers included).

    Args:
        device: the device type whose work counts: ``"cuda"`` or ``"cpu"`` (the device path on
            CPU tensors under Triton's interpreter). Default: ``"cuda"`` where CUDA is
            available, else ``"cpu"``.

    Yields:
        A :class:`DeviceWork`, filled in as the block runs and complete when it exits.
    """
    kind = _default_device_type() if device is None else torch.device(device).type
    work = DeviceWork(kind)
    with _wrap_lock:
        if not _active:
            _wrap_readers()
        _active.append(work)
    _launch.add_launch_listener(work._triton)
    try:
        with _Counting(work):
            yield work
    finally:
        _launch.remove_launch_listener(work._triton)
        with _wrap_lock:
            _active.remove(work)
            if not _active:
                _unwrap_readers()
