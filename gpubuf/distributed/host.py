"""``BufferHost``: the object a Ray actor holds, a gpubuf buffer behind a small remote interface.

The class is plain Python; :func:`remote_host_class` makes the Ray actor class from it. One host
serves a :class:`~gpubuf.distributed.RayReplayBuffer` or one shard of a
:class:`~gpubuf.distributed.ShardedReplayBuffer`. When the actor was given a GPU, Ray sets
``CUDA_VISIBLE_DEVICES`` for it, so a storage built with ``device="cuda"`` lands on that GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from gpubuf.buffers import ReplayBuffer
from gpubuf.distributed._ray import require_ray
from gpubuf.distributed.wire import pack
from gpubuf.samplers.prioritized import PrioritizedSampler

#: The file every checkpoint directory written by ``ReplayBuffer.dumps`` holds.
_CHECKPOINT_META = "meta.json"


class BufferHost:
    """A replay buffer living in this process, driven by remote calls.

    Args:
        replay_buffer_cls: the buffer class (``ReplayBuffer`` or any subclass).
        args, kwargs: its constructor arguments. Storages, samplers and writers are best given
            as classes or callables (``functools.partial(LazyTensorStorage, 1000)``), so each
            actor builds its own.
        delayed_init: build the buffer at the first call instead of now (TorchRL's
            ``delayed_init``).
        checkpoint_dir: where :meth:`checkpoint` writes; when it already holds a checkpoint,
            the buffer is restored from it as it is built (an actor restarted after a crash
            comes back with the rows of its last checkpoint).
        seed: seeds torch's default generator in the actor's process (the draws of a buffer
            built without ``generator``).
    """

    def __init__(
        self,
        replay_buffer_cls: type = ReplayBuffer,
        args: tuple = (),
        kwargs: dict | None = None,
        delayed_init: bool = False,
        checkpoint_dir: str | None = None,
        seed: int | None = None,
    ) -> None:
        if seed is not None:
            torch.manual_seed(seed)
        self._cls = replay_buffer_cls
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self._checkpoint_dir = None if checkpoint_dir is None else str(checkpoint_dir)
        self._buffer: Any = None
        if not delayed_init:
            self._build()

    # ------------------------------------------------------------------ the buffer
    def _build(self) -> Any:
        if self._buffer is None:
            buffer = self._cls(*self._args, **self._kwargs)
            if self._checkpoint_dir is not None and (Path(self._checkpoint_dir) / _CHECKPOINT_META).exists():
                buffer.loads(self._checkpoint_dir)
            self._buffer = buffer
        return self._buffer

    @property
    def buffer(self) -> Any:
        return self._build()

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Calls ``buffer.<name>(*args, **kwargs)`` and returns its result."""
        return getattr(self.buffer, name)(*args, **(kwargs or {}))

    def call_in_place(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        """Calls ``buffer.<name>(*args, **kwargs)`` for its effect: the buffer it returns (for
        chaining) is not sent back."""
        getattr(self.buffer, name)(*args, **(kwargs or {}))

    def get_attr(self, name: str) -> Any:
        return getattr(self.buffer, name)

    def initialized(self) -> bool:
        """Whether the buffer and its components are built (asking does not build them)."""
        return self._buffer is not None and bool(getattr(self._buffer, "initialized", True))

    def component_attr(self, component: str, attr: str) -> tuple[str, Any]:
        """``("method", None)`` when ``buffer.<component>.<attr>`` is a method, else ``("value", it)``."""
        value = getattr(getattr(self.buffer, component), attr)
        is_method = callable(value) and not isinstance(value, (torch.Tensor, TensorDictBase, type))
        return ("method", None) if is_method else ("value", value)

    def component_call(self, component: str, method: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Calls ``buffer.<component>.<method>(*args, **kwargs)``; a result that is the component
        itself (a chained call) comes back as None."""
        target = getattr(self.buffer, component)
        out = getattr(target, method)(*args, **(kwargs or {}))
        return None if out is target else out

    def pid(self) -> int:
        """The actor's process id (to tell processes apart, or to stop one in a test)."""
        return os.getpid()

    # ------------------------------------------------------------------ shard interface
    def stats(self) -> dict[str, Any]:
        """What a sharded client needs to choose among shards, in one round trip.

        Returns:
            ``size`` (items held), ``write_count``, ``capacity`` (the storage's ``max_size``),
            ``ndim``, ``prioritized``, and for prioritized samplers ``mass`` (the sum of the
            transformed priorities), ``min`` (the smallest positive one) and ``beta``.
        """
        buffer = self.buffer
        storage = buffer.storage
        out: dict[str, Any] = {
            "size": len(buffer),
            "write_count": buffer.write_count,
            "capacity": int(storage.max_size),
            "ndim": int(storage.ndim),
            "prioritized": False,
        }
        sampler = buffer.sampler
        if isinstance(sampler, PrioritizedSampler):
            tree = sampler.tree
            out.update(prioritized=True, mass=float(tree.total()), min=float(tree.min()), beta=float(sampler.beta))
        return out

    # The shard calls answer with the shard's :meth:`stats` after the call, so that a sharded
    # client splits its next sample among shards without a round trip of its own.
    def extend_shard(self, data: Any, offset: int, kwargs: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Extends the buffer; returns the indices written plus ``offset`` (global indices), and the stats."""
        index = self.buffer.extend(data, **(kwargs or {}))
        return torch.as_tensor(index) + offset, self.stats()

    def sample_shard(self, batch_size: int, offset: int, global_min: float | None) -> tuple[Any, dict, dict]:
        """Samples ``batch_size`` items, with global indices and importance weights.

        Args:
            batch_size: the number of items to draw from this shard; 0 draws nothing (the
                call then only reports the stats).
            offset: added to the indices (``info["index"]`` and a TensorDict's ``"index"``).
            global_min: the smallest transformed priority over every shard; the weights
                ``(P_i / P_min,shard) ** -beta`` are rescaled to ``(P_i / global_min) ** -beta``.
                None for samplers without priorities.

        Returns:
            ``(data, info, stats)``; ``(None, {}, stats)`` for ``batch_size == 0`` and when
            the shard holds nothing that can be drawn.
        """
        stats = self.stats()
        if batch_size == 0 or stats["size"] == 0 or (stats["prioritized"] and not stats["mass"] > 0):
            # Nothing asked, or nothing to draw from (the client's view of this shard was old):
            # the client draws again with these stats.
            return None, {}, stats
        buffer = self.buffer
        data, info = buffer.sample(batch_size, return_info=True)
        info = dict(info)
        if "index" in info and isinstance(info["index"], torch.Tensor):
            info["index"] = info["index"] + offset
        sampler = buffer.sampler
        if global_min is not None and "priority_weight" in info and isinstance(sampler, PrioritizedSampler):
            local_min = float(sampler.tree.min())
            beta = float(sampler.beta)
            if beta != 0.0 and local_min != global_min:
                scale = (local_min / global_min) ** (-beta)
                weight = info["priority_weight"]
                info["priority_weight"] = (weight.to(torch.float64) * scale).to(weight.dtype)
        if isinstance(data, TensorDictBase):
            for key in ("index", "priority_weight"):
                if key in info and key in data.keys():
                    data.set(key, info[key].to(data.get(key).device))
        return data, info, self.stats()

    def sample_shard_packed(self, batch_size: int, offset: int, global_min: float | None, chunks: int) -> Any:
        """:meth:`sample_shard` in the compact wire format (:func:`gpubuf.distributed.wire.pack`),
        as ``chunks`` returns (one value when ``chunks == 1``): ``(header, stats, first chunk)``,
        then the other chunks. The header is None when nothing was drawn."""
        data, info, stats = self.sample_shard(batch_size, offset, global_min)
        if data is None:
            parts = [None] * chunks
            header = None
        else:
            header, *parts = pack(data, info, chunks)
        out = ((header, stats, parts[0]), *parts[1:])
        return out if chunks > 1 else out[0]

    def update_priority_shard(self, index: torch.Tensor, priority: torch.Tensor) -> dict:
        self.buffer.update_priority(index, priority)
        return self.stats()

    def update_tensordict_priority_shard(self, data: TensorDictBase) -> dict:
        self.buffer.update_tensordict_priority(data)
        return self.stats()

    def checkpoint(self) -> str:
        """Writes the buffer to ``checkpoint_dir`` (pickle-free, atomic) and returns the path."""
        if self._checkpoint_dir is None:
            raise ValueError("this buffer was built without a checkpoint_dir")
        self.buffer.dumps(self._checkpoint_dir)
        return self._checkpoint_dir


def remote_host_class(remote_config: dict[str, Any]) -> Any:
    """The Ray actor class of :class:`BufferHost` with ``remote_config`` (``num_cpus``, ``num_gpus``,
    ``memory``, ``max_restarts``, ...)."""
    ray = require_ray()
    options = {k: v for k, v in remote_config.items() if v is not None}
    return ray.remote(**options)(BufferHost) if options else ray.remote(BufferHost)
