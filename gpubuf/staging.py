"""Cross-device batches: a storage on one device, sampled batches on another.

Three ways a batch can leave a storage on another device than the one the user wants it on,
each built to move the batch in as few, as large and as asynchronous copies as possible:

- **host -> CUDA** (a CPU tensor or memmap storage feeding a GPU learner). The sampled rows of
  every leaf are gathered on the host, with ``index_select(out=...)``, straight into one slot of
  a small ring of page-locked (pinned) staging buffers. All leaves of a batch lie in that one
  buffer, at 16-byte aligned offsets (a :class:`PackPlan`), so the batch crosses PCIe as *one*
  non-blocking copy, issued on a side CUDA stream. An event recorded after the copy is what the
  consumer's stream waits on before the batch is handed out (:func:`hand_out`), and what the
  ring waits on before the slot is overwritten (:class:`PinnedRing`).
- **CUDA -> host** (a GPU storage feeding CPU-side consumers: logging, a CPU learner, export).
  One fused gather launch writes the rows into one device buffer, which is copied into a fresh
  pinned host buffer by one non-blocking copy; the host waits for that copy's event before the
  batch is built. Pinned memory comes from PyTorch's caching host allocator: the batch is handed
  to the user, so it cannot be recycled by gpubuf.
- **host -> pinned host** (``pin_memory=True`` on a CPU buffer, CUDA present): the rows are
  gathered straight into pinned memory instead of gathered and then pinned (one copy instead
  of two); the user's ``.to("cuda", non_blocking=True)`` is then truly asynchronous.

Anything else (e.g. ``cuda:0 -> cuda:1``) gathers on the source and copies with ``.to``.

Nothing here touches a CUDA API unless a CUDA device is involved: a CPU-only run only ever
uses :class:`PackPlan`, :func:`gather_packed_host` and :class:`PinnedRing` with ``pin=False``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from gpubuf.ops.gather_rows import gather_rows, gather_rows_ref

__all__ = [
    "ALIGN",
    "CrossDeviceGather",
    "PackPlan",
    "PinnedRing",
    "SideStream",
    "cuda_tensors",
    "default_slots",
    "gather_packed_host",
    "hand_out",
    "transfer_kind",
]

#: Byte alignment of every leaf inside a packed batch: the widest unit of the fused gather
#: kernel, and a multiple of every dtype's size (so any leaf can be viewed as its dtype).
ALIGN = 16

# Pinned slots grow in steps of this many bytes, so that batches of slightly different sizes
# (another batch size, a transform's extra key) do not reallocate page-locked memory each time.
_GROW = 1 << 20


def _pinned_empty(nbytes: int) -> torch.Tensor:
    """A page-locked host byte buffer from PyTorch's caching host allocator."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _before_copy() -> None:
    """Called on the copy's stream just before a cross-device copy is enqueued.

    A no-op; tests replace it with ``torch.cuda._sleep`` to make the producing stream slow and
    check that consumers still see the finished copy.
    """


# ------------------------------------------------------------------------------------------
# Packing: every leaf of a batch in one flat byte buffer
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackPlan:
    """Where each leaf of a batch lies inside one flat ``uint8`` buffer.

    Attributes:
        dtypes: the leaves' dtypes, in layout order.
        shapes: the leaves' full shapes, ``[B, *trail_i]``.
        offsets: byte offset of each leaf, a multiple of :data:`ALIGN`.
        nbytes: the buffer size the plan needs (the end of the last leaf).
    """

    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def for_leaves(cls, leaves: Sequence[tuple[torch.dtype, Sequence[int]]], batch: int) -> "PackPlan":
        """Lays out a batch of ``batch`` rows of leaves given as ``(dtype, per-row shape)``."""
        offsets = []
        shapes = []
        end = 0
        for dtype, trail in leaves:
            shape = torch.Size([batch, *trail])
            end = -(-end // ALIGN) * ALIGN
            offsets.append(end)
            shapes.append(shape)
            end += math.prod(shape) * dtype.itemsize
        return cls(tuple(d for d, _ in leaves), tuple(shapes), tuple(offsets), end)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The leaves as contiguous views of ``buffer`` (1-D ``uint8``, at least :attr:`nbytes`).

        The views share ``buffer``'s memory: writing them writes the buffer and the other way round.
        """
        if buffer.dtype != torch.uint8 or buffer.ndim != 1:
            raise TypeError(
                f"a packed batch lives in a 1-D uint8 buffer, got {buffer.dtype} of shape {list(buffer.shape)}"
            )
        if buffer.numel() < self.nbytes:
            raise ValueError(f"buffer of {buffer.numel()} bytes is smaller than the plan's {self.nbytes}")
        out = []
        for dtype, shape, offset in zip(self.dtypes, self.shapes, self.offsets):
            size = math.prod(shape) * dtype.itemsize
            out.append(buffer[offset : offset + size].view(dtype).view(shape))
        return out


def _plan_for(sources: Sequence[torch.Tensor | None], fills: dict[int, torch.Tensor], batch: int) -> PackPlan:
    specs = []
    for i, src in enumerate(sources):
        if src is None:
            fill = fills[i]
            specs.append((fill.dtype, tuple(fill.shape[1:])))
        else:
            specs.append((src.dtype, tuple(src.shape[1:])))
    return PackPlan.for_leaves(specs, batch)


def gather_packed_host(
    sources: Sequence[torch.Tensor | None],
    index: torch.Tensor,
    outs: Sequence[torch.Tensor],
    fills: dict[int, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Gathers rows ``index`` of host sources into host outputs (views of a staging buffer).

    For every ``i``: ``outs[i][b] = sources[i][index[b]]``, or ``outs[i] = fills[i]`` where
    ``sources[i]`` is None (a leaf whose value the caller computed instead, e.g. the sampled
    index itself). Duplicates and any order of ``index`` are allowed.

    Args:
        sources: CPU tensors ``[N, *trail_i]`` (only read), or None for filled leaves.
        index: 1-D int64/int32 CPU tensor of ``B`` rows in ``[0, N)``.
        outs: contiguous CPU tensors ``[B, *trail_i]`` of the sources' dtypes; overwritten.
        fills: position -> CPU tensor of shape ``[B, *trail_i]`` for the None sources.

    Returns:
        ``outs``.
    """
    fills = fills or {}
    pairs = [(s, o) for s, o in zip(sources, outs) if s is not None]
    if pairs:
        gather_rows_ref([s for s, _ in pairs], index, [o for _, o in pairs])
    for i, value in fills.items():
        outs[i].copy_(value)
    return list(outs)


# ------------------------------------------------------------------------------------------
# A ring of reusable pinned buffers
# ------------------------------------------------------------------------------------------


class _Slot:
    __slots__ = ("buffer", "event", "busy")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event: Any = None  # completes when the last copy reading `buffer` is done
        self.busy = False  # a host thread is filling `buffer`


class PinnedRing:
    """A small ring of reusable host staging buffers (page-locked when ``pin``).

    A slot is handed out by :meth:`acquire` only once the copy that last read it has completed
    (its event, given to :meth:`release`, is waited on first), so a buffer is never rewritten
    while a non-blocking copy may still be reading it. With ``slots`` at least the number of
    batches that can be in flight (prefetch depth + 2), that wait is almost never felt.

    Thread-safe: several prefetch workers may fill different slots at once.

    Args:
        slots: the number of buffers, at least 1.
        pin: allocate page-locked memory (needs CUDA); False gives ordinary host memory.
    """

    def __init__(self, slots: int, *, pin: bool = True) -> None:
        if slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {slots}")
        self._slots = [_Slot() for _ in range(slots)]
        self._next = 0
        self._pin = pin
        self._cond = threading.Condition()

    @property
    def slots(self) -> int:
        return len(self._slots)

    def acquire(self, nbytes: int) -> _Slot:
        """Returns a slot whose buffer holds at least ``nbytes`` and is free to be overwritten.

        Blocks while every slot is being filled by another thread, then until the copy that last
        read the chosen slot has completed.
        """
        with self._cond:
            while True:
                n = len(self._slots)
                for k in range(n):
                    i = (self._next + k) % n
                    if not self._slots[i].busy:
                        break
                else:
                    self._cond.wait()
                    continue
                slot = self._slots[i]
                slot.busy = True
                self._next = (i + 1) % n
                break
        try:
            if slot.event is not None:
                # Wait outside the lock: only this thread needs the slot's copy to be done.
                slot.event.synchronize()
                slot.event = None
            if slot.buffer is None or slot.buffer.numel() < nbytes:
                size = max(-(-nbytes // _GROW) * _GROW, _GROW)
                slot.buffer = None  # let the old buffer go before allocating the new one
                slot.buffer = _pinned_empty(size) if self._pin else torch.empty(size, dtype=torch.uint8)
        except BaseException:
            self.release(slot, None)
            raise
        return slot

    def release(self, slot: _Slot, event: Any) -> None:
        """Gives ``slot`` back; ``event`` (or None) completes when the copy reading it is done."""
        with self._cond:
            slot.event = event
            slot.busy = False
            self._cond.notify()


# ------------------------------------------------------------------------------------------
# Streams and hand-out (CUDA only)
# ------------------------------------------------------------------------------------------


class SideStream:
    """A CUDA stream beside the consumer's, on which batches are gathered and copied.

    The consumer's stream (the caller's current stream at :meth:`mark_ready` and at
    :func:`hand_out`) and the side stream are ordered by events only, so a copy on the side
    stream overlaps the training kernels queued on the consumer's stream.

    Args:
        device: a CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def mark_ready(self) -> Any:
        """An event on the caller's current stream: the side stream's work waits for it.

        Recorded right after indices are drawn (on the consumer's stream), it orders the gather
        after the draw and after every write the consumer enqueued before it.
        """
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def run(self, ready: Any = None) -> Iterator[None]:
        """Makes the side stream current (on this thread) for the block, after ``ready``."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            yield

    def record(self) -> Any:
        """An event on the side stream: completes when everything enqueued so far is done."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def cuda_tensors(data: Any) -> list[torch.Tensor]:
    """The CUDA tensors inside a batch (a tensor, a TensorDict or tensorclass, or a pytree)."""
    from tensordict import TensorDictBase, is_tensorclass

    if isinstance(data, torch.Tensor):
        leaves = [data]
    elif is_tensorclass(data):
        leaves = list(data._tensordict.values(include_nested=True, leaves_only=True))
    elif isinstance(data, TensorDictBase):
        leaves = list(data.values(include_nested=True, leaves_only=True))
    else:
        leaves = torch.utils._pytree.tree_leaves(data)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_cuda]


def hand_out(data: Any, done: Any, device: torch.device) -> Any:
    """Makes a batch produced on a side stream safe to use on the caller's current stream.

    The caller's stream waits (on the device, the host does not block) for ``done``, the event
    recorded after the batch's last copy; and each CUDA tensor of the batch is marked as used
    by that stream (``record_stream``), so that the caching allocator, which saw the memory
    allocated on the side stream, does not hand it out again while the consumer still reads it.

    Args:
        data: the batch; its tensors are not modified.
        done: a CUDA event, or None (nothing to wait for).
        device: the CUDA device of the batch.

    Returns:
        ``data``.
    """
    if done is None:
        return data
    stream = torch.cuda.current_stream(device)
    stream.wait_event(done)
    for tensor in cuda_tensors(data):
        tensor.record_stream(stream)
    return data


# ------------------------------------------------------------------------------------------
# The gather across devices
# ------------------------------------------------------------------------------------------


def transfer_kind(source: torch.device, target: torch.device, pin: bool = False) -> str | None:
    """How a batch goes from a storage on ``source`` to ``target``.

    Returns:
        ``"h2d"`` (host to CUDA), ``"d2h"`` (CUDA to host), ``"pin"`` (host to pinned host, when
        ``pin`` and CUDA is available), ``"generic"`` (any other pair of different devices), or
        None when no transfer is needed (same device, no pinning).
    """
    if source == target:
        if pin and source.type == "cpu" and torch.cuda.is_available():
            return "pin"
        return None
    if source.type == "cpu" and target.type == "cuda":
        return "h2d"
    if source.type == "cuda" and target.type == "cpu":
        return "d2h"
    return "generic"


class CrossDeviceGather:
    """Gathers rows of a storage's leaves on ``source`` into a batch on ``target``.

    One instance serves one buffer (and its prefetch workers, concurrently). The copies are
    enqueued on the caller's *current* stream; the buffer makes that a side stream
    (:class:`SideStream`) and hands the batch out with :func:`hand_out`.

    Args:
        source: where the storage's leaves live.
        target: where batches go.
        slots: pinned staging buffers of the host-to-CUDA path (prefetch depth + 2 is enough).
        pin: for a CPU target, gather into pinned memory (``pin_memory=True`` buffers).

    Raises:
        DeviceMismatchError: a CUDA end while CUDA is not available.
    """

    def __init__(self, source: torch.device, target: torch.device, *, slots: int = 2, pin: bool = False) -> None:
        from gpubuf.errors import DeviceMismatchError

        self.source = torch.device(source)
        self.target = torch.device(target)
        self.kind = transfer_kind(self.source, self.target, pin) or "none"
        if "cuda" in (self.source.type, self.target.type) and not torch.cuda.is_available():
            raise DeviceMismatchError(
                f"batches from {self.source} to {self.target} need CUDA, which is not available here"
            )
        self._ring = PinnedRing(slots, pin=True) if self.kind == "h2d" else None
        self._plans: dict[tuple, PackPlan] = {}

    @property
    def stream_device(self) -> torch.device | None:
        """The CUDA device whose side stream runs this transfer, or None (no CUDA stream involved)."""
        if self.kind == "h2d":
            return self.target
        if self.kind == "d2h":
            return self.source
        return None

    def _plan(self, sources: Sequence[torch.Tensor | None], fills: dict[int, torch.Tensor], batch: int) -> PackPlan:
        key = tuple(
            (s.dtype, s.shape[1:]) if s is not None else (fills[i].dtype, fills[i].shape[1:], "fill")
            for i, s in enumerate(sources)
        ) + (batch,)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            plan = self._plans[key] = _plan_for(sources, fills, batch)
        return plan

    def gather(
        self,
        sources: Sequence[torch.Tensor | None],
        index: torch.Tensor,
        fills: dict[int, torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """``out[i][b] = sources[i][index[b]]`` on the target device, every leaf at once.

        Args:
            sources: the storage's row views ``[N, *trail_i]`` on :attr:`source` (only read), with
                None at positions the caller fills itself.
            index: 1-D int64 tensor of ``B`` in-range rows, on :attr:`source`.
            fills: position -> tensor ``[B, *trail_i]`` on :attr:`source` for the None sources.

        Returns:
            One contiguous tensor ``[B, *trail_i]`` per source, on :attr:`target`. For a CUDA
            target they are views of one allocation, made on the current stream and valid on it
            once the copy completes: a consumer on another stream must go through
            :func:`hand_out`. For a CPU target they are ready to read.
        """
        fills = dict(fills or {})
        batch = int(index.shape[0])
        if self.kind == "h2d":
            return self._host_to_device(sources, index, fills, batch)
        if self.kind == "d2h":
            return self._device_to_host(sources, index, fills, batch)
        if self.kind == "pin":
            plan = self._plan(sources, fills, batch)
            return gather_packed_host(sources, index, plan.views(_pinned_empty(plan.nbytes)), fills)
        # generic: gather where the data is, then copy.
        live = [s for s in sources if s is not None]
        gathered = iter(gather_rows(live, index, check_bounds=False) if live else [])
        out = []
        for i, src in enumerate(sources):
            leaf = fills[i] if src is None else next(gathered)
            out.append(leaf.to(self.target))
        return out

    def _host_to_device(self, sources, index, fills, batch) -> list[torch.Tensor]:
        plan = self._plan(sources, fills, batch)
        slot = self._ring.acquire(plan.nbytes)
        event = None
        try:
            staged = slot.buffer[: plan.nbytes]
            gather_packed_host(sources, index, plan.views(staged), fills)
            # Allocated on the current (side) stream: the allocator then knows it is in use there
            # until the consumer's record_stream extends that at hand-out.
            device_buffer = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.target)
            _before_copy()
            device_buffer.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.target))
        finally:
            # Without an event (the copy was never enqueued) the slot is free at once.
            self._ring.release(slot, event)
        return plan.views(device_buffer)

    def _device_to_host(self, sources, index, fills, batch) -> list[torch.Tensor]:
        plan = self._plan(sources, fills, batch)
        device_buffer = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.source)
        views = plan.views(device_buffer)
        live = [(s, v) for s, v in zip(sources, views) if s is not None]
        if live:
            # One fused launch for every leaf (Triton on CUDA), into the packed device buffer.
            gather_rows([s for s, _ in live], index, [v for _, v in live], check_bounds=False)
        for i, value in fills.items():
            views[i].copy_(value)
        host = _pinned_empty(plan.nbytes)
        _before_copy()
        host.copy_(device_buffer, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.source))
        # The host reads the batch next (build, transforms): it must not before the copy lands.
        event.synchronize()
        return plan.views(host)


def default_slots(prefetch: int) -> int:
    """Pinned staging slots for a prefetch depth: every batch in flight plus one being filled."""
    return max(int(prefetch), 0) + 2
