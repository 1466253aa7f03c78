"""Shared helpers of the checkpoint tests: buffers to round-trip, and exact state snapshots."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass, tensorclass

from gpubuf import (
    LazyTensorStorage,
    ListStorage,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
    TensorStorage,
)


@tensorclass
class RewardData:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rewards: torch.Tensor
    end_scores: torch.Tensor


CAPACITY = 8


def make_items(kind: str, n: int, start: int = 0, *, rest: tuple = ()) -> Any:
    """A batch of ``n`` items of container ``kind`` whose values depend on ``start`` (distinct batches)."""
    lead = (n, *rest)
    base = torch.arange(start, start + int(np.prod(lead)), dtype=torch.float32).reshape(lead)
    if kind == "tensor":
        return torch.stack([base, -base], -1)
    if kind == "tensordict":
        return TensorDict(
            {
                "obs": base.unsqueeze(-1).expand(*lead, 3).clone(),
                "action": base.long() % 3,
                "next": {"obs": base.unsqueeze(-1).expand(*lead, 3) + 1, "done": (base.long() % 4 == 0).unsqueeze(-1)},
                ("nested", "bf16"): base.to(torch.bfloat16),
            },
            batch_size=lead,
        )
    if kind == "tensorclass":
        return RewardData(
            input_ids=base.long().unsqueeze(-1).expand(*lead, 5).clone(),
            attention_mask=torch.ones(*lead, 5, dtype=torch.bool),
            rewards=base.unsqueeze(-1),
            end_scores=base * 0.5,
            batch_size=lead,
        )
    if kind == "pytree":
        return (base, {"x": base.long(), "y": [base.double().unsqueeze(-1)]})
    raise ValueError(kind)


def list_items(n: int, start: int = 0) -> list:
    """Heterogeneous Python items for a ListStorage."""
    out = []
    for i in range(start, start + n):
        choice = i % 6
        if choice == 0:
            out.append(torch.full((2, i % 3 + 1), float(i)))
        elif choice == 1:
            out.append({"step": i, "name": f"item-{i}", "score": i / 7, "flags": (True, None)})
        elif choice == 2:
            out.append(TensorDict({"a": torch.tensor([i, i + 1]), "meta": {"b": torch.tensor(float(i))}}, []))
        elif choice == 3:
            out.append([i, float("nan"), "x", b"\x00\xff", np.arange(3, dtype=np.int16) + i])
        elif choice == 4:
            out.append(RewardData(input_ids=torch.arange(4) + i, attention_mask=torch.ones(4, dtype=torch.bool),
                                  rewards=torch.tensor([float(i)]), end_scores=torch.tensor(0.5 * i), batch_size=[]))
        else:
            out.append(i)
    return out


def make_buffer(storage: str, sampler: str, writer: str, *, seed: int, kind: str = "tensordict", batch_size: int = 3,
                checkpointer: Any = None) -> ReplayBuffer:
    """A buffer of the given components; ``storage`` is list / tensor / lazy / lazy2d."""
    if storage == "list":
        store = ListStorage(CAPACITY)
    elif storage == "tensor":
        store = TensorStorage(_zeros_like_kind(kind, CAPACITY, with_index=writer == "tdrr"))
    elif storage == "lazy":
        store = LazyTensorStorage(CAPACITY)
    elif storage == "lazy2d":
        store = LazyTensorStorage(CAPACITY * 2, ndim=2)
    else:
        raise ValueError(storage)
    if checkpointer is not None:
        store.checkpointer = checkpointer
    samp = {"random": RandomSampler, "swr": SamplerWithoutReplacement,
            "swr_drop": lambda: SamplerWithoutReplacement(drop_last=True)}[sampler]()
    wri = {"rr": RoundRobinWriter, "tdrr": TensorDictRoundRobinWriter}[writer]()
    cls = TensorDictReplayBuffer if writer == "tdrr" else ReplayBuffer
    # Heterogeneous list items are sampled as lists: the default collate stacks what it can.
    collate = as_list if storage == "list" else None
    return cls(storage=store, sampler=samp, writer=wri, batch_size=batch_size, collate_fn=collate,
               generator=torch.Generator().manual_seed(seed), dim_extend=0)


def as_list(items: list) -> list:
    return list(items)


def _zeros_like_kind(kind: str, n: int, with_index: bool = False) -> Any:
    items = make_items(kind, n)
    if isinstance(items, torch.Tensor):
        return torch.zeros_like(items)
    if isinstance(items, tuple):
        return torch.utils._pytree.tree_map(torch.zeros_like, items)
    zeros = items.apply(torch.zeros_like)
    if with_index:
        # TensorDictRoundRobinWriter stores each item's index under "index".
        zeros["index"] = torch.zeros(n, dtype=torch.long)
    return zeros


def fill(rb: ReplayBuffer, storage: str, kind: str) -> None:
    """Writes enough to wrap round the capacity, and samples a little (moves sampler and generator)."""
    rest = (2,) if storage == "lazy2d" else ()
    if storage == "list":
        rb.extend(list_items(5))
        rb.extend(list_items(6, 100))
        rb.add({"last": True})
    else:
        rb.extend(make_items(kind, 5, 0, rest=rest))
        rb.extend(make_items(kind, 6, 100, rest=rest))
    for _ in range(2):
        rb.sample()


def snapshot(rb: ReplayBuffer) -> dict:
    """Everything checkpointing must restore, as plain values and tensor clones."""
    storage = rb.storage
    snap: dict[str, Any] = {"len": len(rb), "batch_size": rb.batch_size, "type": type(storage).__name__}
    if isinstance(storage, ListStorage):
        snap["items"] = list(storage._storage)
    else:
        snap["initialized"] = storage.initialized
        snap["max_size"] = storage.max_size
        if storage.initialized:
            snap["layout"] = repr(storage.layout)
            # Rows past the written range hold whatever memory the allocation had.
            rows = storage._len_along_dim0
            snap["leaves"] = [leaf[:rows].clone() for leaf in storage._leaves]
            snap["capacity"] = [leaf.shape for leaf in storage._leaves]
            snap["device"] = str(storage._leaves[0].device)
    snap["writer"] = (rb.writer._cursor, rb.writer._write_count, type(rb.writer).__name__)
    snap["sampler"] = (type(rb.sampler).__name__, rb.sampler.state_dict(), getattr(rb.sampler, "shuffle", None))
    snap["rng"] = None if rb._rng is None else rb._rng.get_state().clone()
    return snap


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Exact equality of nested values: tensors bitwise (dtype, shape, device), NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, (where, a, b)
        if a.dtype.is_floating_point or a.dtype.is_complex:
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a.contiguous().view(_int(a)),
                               b.contiguous().view(_int(b)) if b.dtype.itemsize != 1 else b.view(torch.uint8)), where
        else:
            assert torch.equal(a, b), (where, a, b)
    elif is_tensorclass(a) or isinstance(a, TensorDictBase):
        assert type(a) is type(b), where
        ta = a._tensordict if is_tensorclass(a) else a
        tb = b._tensordict if is_tensorclass(b) else b
        assert ta.batch_size == tb.batch_size, where
        assert set(ta.keys(True, True)) == set(tb.keys(True, True)), where
        for key in ta.keys(True, True):
            assert_same(ta.get(key), tb.get(key), f"{where}[{key}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


def _int(t: torch.Tensor) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}[t.dtype.itemsize]


def same_batches(a: ReplayBuffer, b: ReplayBuffer, n: int = 4) -> None:
    """The next ``n`` samples of both buffers are identical (data and indices)."""
    for i in range(n):
        xa, ia = a.sample(return_info=True)
        xb, ib = b.sample(return_info=True)
        assert_same(ia["index"], ib["index"], f"sample {i} index")
        assert_same(xa, xb, f"sample {i}")
