"""The workloads: their data, their ops, and the providers that run them.

Data: ``N`` transitions ``{obs: f32[32], action: f32[4], reward: f32[1], done: bool[1],
next_obs: f32[32]}`` (277 bytes a row). Ops: ``extend`` a chunk of rows into a full buffer of
capacity ``N`` (round robin, so it overwrites), ``sample`` a uniform batch of ``B`` rows,
``cycle``: a prioritized sample of ``B`` rows followed by an update of their priorities, and
the cycle's two sampler steps alone: ``draw`` (``B`` indices and weights, no rows) and
``update`` (``B`` new priorities). See :mod:`gpubuf.tools.bench.prioritized`.

Providers run the same op on the same data; each runs the op kinds in its ``kinds``:

- ``gpubuf`` and ``torchrl``: ``TensorDictReplayBuffer`` (the main comparison) and plain
  ``ReplayBuffer``, each over ``LazyTensorStorage(N)``, for extend and sample;
  ``TensorDictPrioritizedReplayBuffer`` and ``PrioritizedReplayBuffer`` for the cycle, and
  the former's sampler for ``draw`` and ``update``;
- ``raw``: the floor in plain torch, one preallocated tensor per field; extend is a slice
  ``copy_`` per field, sample is ``randint`` + ``index_select`` per field, the cycle is
  :func:`~gpubuf.tools.bench.prioritized.raw_cycle`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import TensorDict

from gpubuf.tools.bench import prioritized, torchrl_compat
from gpubuf.tools.synthetic import ROW_KINDS

#: name -> (dtype, per-row shape), in storage order.
FIELDS: dict[str, tuple[torch.dtype, tuple[int, ...]]] = ROW_KINDS["wide"]

#: Payload bytes of one row (the five fields; TensorDictReplayBuffer's extra "index" is not counted).
ROW_BYTES = sum(dtype.itemsize * torch.Size(shape).numel() for dtype, shape in FIELDS.values())

TDRB = "TensorDictReplayBuffer"
RB = "ReplayBuffer"
TDPRB = prioritized.TDPRB
PRB = prioritized.PRB
#: The op kinds, in the order a configuration runs them.
KINDS = ("extend", "sample", "cycle", "draw", "update")
#: The kinds that time a prioritized sampler alone (see :mod:`gpubuf.tools.bench.prioritized`).
SAMPLER_KINDS = ("draw", "update")
_SHORT = {TDRB: "TDRB", RB: "RB", TDPRB: "TDPRB", PRB: "PRB"}

# Rows per extend while filling a buffer before timing: bounds the temporaries of the fill.
_FILL_CHUNK = 100_000


@dataclass(frozen=True)
class OpSpec:
    """One timed operation.

    Attributes:
        kind: ``"extend"`` (write ``size`` rows), ``"sample"`` (draw a uniform batch of ``size``
            rows), ``"cycle"`` (a prioritized sample of ``size`` rows, then new priorities
            for them), ``"draw"`` (a prioritized sampler draws ``size`` indices and their
            weights) or ``"update"`` (it takes ``size`` new priorities).
        size: the chunk length or the batch size.
    """

    kind: str
    size: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op kind must be one of {KINDS}, got {self.kind!r}")
        if self.size <= 0:
            raise ValueError(f"op size must be positive, got {self.size}")

    @property
    def label(self) -> str:
        return f"{self.kind} {'chunk' if self.kind == 'extend' else 'B'}={self.size:,}"

    @property
    def items(self) -> int:
        """Rows handled by one call."""
        return self.size

    @property
    def bytes_moved(self) -> int:
        """Payload bytes read plus written by one call: every row is read once and written once.

        A cycle counts its batch's rows only; its priorities are a few bytes per row. A draw or
        an update moves no rows: 0.
        """
        if self.kind in SAMPLER_KINDS:
            return 0
        return 2 * self.size * ROW_BYTES


def make_transitions(rows: int, device: torch.device | str = "cpu", seed: int = 0) -> TensorDict:
    """Generates ``rows`` random transitions of the workload's schema.

    Args:
        rows: the number of rows ``N``.
        device: where the returned TensorDict lives.
        seed: the seed of the CPU generator used (data is generated on CPU, then moved, so every
            device sees the same values).

    Returns:
        A TensorDict of batch size ``[rows]`` with the fields of :data:`FIELDS`.
    """
    gen = torch.Generator().manual_seed(seed)
    data = {
        "obs": torch.randn(rows, 32, generator=gen),
        "action": torch.rand(rows, 4, generator=gen) * 2 - 1,
        "reward": torch.randn(rows, 1, generator=gen),
        "done": torch.rand(rows, 1, generator=gen) < 0.01,
        "next_obs": torch.randn(rows, 32, generator=gen),
    }
    return TensorDict(data, batch_size=[rows]).to(device)


class Provider:
    """Something that can run the workload's ops: built once over the data, then called repeatedly.

    Attributes:
        library: ``"gpubuf"``, ``"torchrl"`` or ``"raw"``.
        buffer: the buffer class name, or None for the raw floor.
        optional: True when a failure must be reported as "unavailable" rather than raised.
        kinds: the op kinds it runs.
    """

    library: str = ""
    buffer: str | None = None
    optional: bool = False
    kinds: tuple[str, ...] = KINDS

    @property
    def label(self) -> str:
        """A short display name."""
        short = _SHORT.get(self.buffer or "", self.buffer or "")
        return f"{self.library} {short}".strip()

    def setup(self, data: TensorDict) -> None:
        """Builds the provider's storage and fills it with ``data`` (all ``N`` rows)."""
        raise NotImplementedError

    def make_call(self, op: OpSpec, data: TensorDict) -> Callable[[], Any]:
        """Returns a no-argument callable doing ``op`` once; inputs are prepared here, untimed."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases the storage."""


class BufferProvider(Provider):
    """A replay buffer of gpubuf or TorchRL (same class names and arguments in both).

    Args:
        library: ``"gpubuf"`` or ``"torchrl"``.
        buffer: ``"TensorDictReplayBuffer"`` or ``"ReplayBuffer"``.
        classes: returns a namespace with ``LazyTensorStorage`` and the buffer class; called in
            :meth:`setup`, so a TorchRL import error surfaces there.
        optional: see :class:`Provider`.
    """

    kinds = ("extend", "sample")

    def __init__(self, library: str, buffer: str, classes: Callable[[], Any], optional: bool = False) -> None:
        self.library = library
        self.buffer = buffer
        self.optional = optional
        self._classes = classes
        self._rb: Any = None

    def setup(self, data: TensorDict) -> None:
        ns = self._classes()
        capacity = data.batch_size[0]
        storage = ns.LazyTensorStorage(capacity, device=data.device)
        self._rb = self._build(ns, storage)
        for start in range(0, capacity, _FILL_CHUNK):
            self._rb.extend(self._feed(data[start : start + _FILL_CHUNK]))

    def _build(self, ns: Any, storage: Any) -> Any:
        return getattr(ns, self.buffer)(storage=storage)

    def _feed(self, chunk: TensorDict) -> TensorDict:
        # TorchRL's TensorDictReplayBuffer.extend writes an "index" entry into the TensorDict it is
        # given: a shallow copy (no tensor copied) keeps that entry out of the data the other
        # providers read, and gives every provider the same keys on input.
        return chunk.clone(recurse=False)

    def make_call(self, op: OpSpec, data: TensorDict) -> Callable[[], Any]:
        rb = self._rb
        if op.kind == "extend":
            chunk = self._feed(data[: op.size])
            return lambda: rb.extend(chunk)
        size = op.size
        return lambda: rb.sample(size)

    def close(self) -> None:
        self._rb = None


class PrioritizedProvider(BufferProvider):
    """A prioritized replay buffer of gpubuf or TorchRL, for the cycle (and its sampler's steps).

    Args:
        library: ``"gpubuf"`` or ``"torchrl"``.
        buffer: ``"TensorDictPrioritizedReplayBuffer"`` or ``"PrioritizedReplayBuffer"``.
        classes: as in :class:`BufferProvider` (``torchrl_compat.prioritized_namespace`` for
            TorchRL, which also checks its C++ extension).
        optional: see :class:`Provider`.
    """

    kinds = ("cycle",)

    def __init__(self, library: str, buffer: str, classes: Callable[[], Any], optional: bool = False) -> None:
        super().__init__(library, buffer, classes, optional)
        self.kinds = self.kinds_for(buffer)

    @staticmethod
    def kinds_for(buffer: str) -> tuple[str, ...]:
        """The cycle for both buffers; the sampler's steps once, under ``TensorDictPrioritizedReplayBuffer``
        (both buffers hold the same sampler class)."""
        return ("cycle", *SAMPLER_KINDS) if buffer == TDPRB else ("cycle",)

    def _build(self, ns: Any, storage: Any) -> Any:
        return prioritized.build_prioritized(ns, self.buffer, storage)

    def setup(self, data: TensorDict) -> None:
        super().setup(data)
        prioritized.fill_priorities(self._rb, data)

    def make_call(self, op: OpSpec, data: TensorDict) -> Callable[[], Any]:
        if op.kind == "draw":
            return prioritized.sampler_draw(self._rb, op.size)
        if op.kind == "update":
            return prioritized.sampler_update(self._rb, op.size, data.device)
        return prioritized.buffer_cycle(self._rb, self.buffer, op.size, data.device)


class RawTorchProvider(Provider):
    """The floor: one preallocated tensor per field and plain torch ops, no buffer logic.

    No floor for the sampler's steps alone: without a tree to keep, it would time nothing
    comparable.
    """

    library = "raw"
    buffer = None
    kinds = ("extend", "sample", "cycle")

    def __init__(self) -> None:
        self._stores: list[torch.Tensor] = []
        self._cursor = 0
        self._priorities: prioritized.RawCycleState | None = None

    def setup(self, data: TensorDict) -> None:
        self._stores = [data[name].clone() for name in FIELDS]
        self._cursor = 0
        self._priorities = None

    def make_call(self, op: OpSpec, data: TensorDict) -> Callable[[], Any]:
        stores = self._stores
        capacity = stores[0].shape[0]
        if op.kind == "cycle":
            if self._priorities is None:
                self._priorities = prioritized.RawCycleState(capacity, stores[0].device)
            return prioritized.raw_cycle(stores, self._priorities, op.size)
        if op.kind == "extend":
            chunk = [data[name][: op.size] for name in FIELDS]
            return lambda: self._extend(chunk, capacity)
        size = op.size
        device = stores[0].device

        def sample() -> list[torch.Tensor]:
            index = torch.randint(0, capacity, (size,), device=device)
            return [torch.index_select(store, 0, index) for store in stores]

        return sample

    def _extend(self, chunk: list[torch.Tensor], capacity: int) -> None:
        start, n = self._cursor, chunk[0].shape[0]
        head = min(n, capacity - start)
        for store, src in zip(self._stores, chunk):
            store[start : start + head].copy_(src[:head])
            if head < n:
                store[: n - head].copy_(src[head:])
        self._cursor = (start + n) % capacity

    def close(self) -> None:
        self._stores = []
        self._priorities = None


class UnavailableProvider(Provider):
    """A provider known to be unusable before anything runs (TorchRL missing or disabled)."""

    optional = True

    def __init__(self, library: str, buffer: str | None, reason: str, kinds: tuple[str, ...] = KINDS) -> None:
        self.library = library
        self.buffer = buffer
        self.reason = reason
        self.kinds = kinds


def _gpubuf_classes() -> Any:
    import gpubuf

    return gpubuf


def default_providers(include_torchrl: bool = True) -> list[Provider]:
    """The providers of the comparison, in display order (each op shows those that run it).

    Args:
        include_torchrl: when False, TorchRL's providers are listed as unavailable
            ("not requested") and TorchRL is not imported.
    """
    providers: list[Provider] = []
    raw = RawTorchProvider()
    families = (
        (BufferProvider, (TDRB, RB), torchrl_compat.namespace),
        (PrioritizedProvider, (TDPRB, PRB), torchrl_compat.prioritized_namespace),
    )
    for kind, buffers, torchrl_classes in families:
        for buffer in buffers:
            providers.append(kind("gpubuf", buffer, _gpubuf_classes))
            if include_torchrl:
                providers.append(kind("torchrl", buffer, torchrl_classes, optional=True))
            else:
                kinds = kind.kinds_for(buffer) if kind is PrioritizedProvider else kind.kinds
                providers.append(UnavailableProvider("torchrl", buffer, "not requested (--no-torchrl)", kinds))
            if buffer == TDRB:
                providers.append(raw)
    return providers


__all__ = [
    "FIELDS",
    "KINDS",
    "PRB",
    "ROW_BYTES",
    "RB",
    "SAMPLER_KINDS",
    "TDPRB",
    "TDRB",
    "BufferProvider",
    "OpSpec",
    "PrioritizedProvider",
    "Provider",
    "RawTorchProvider",
    "UnavailableProvider",
    "default_providers",
    "make_transitions",
]
