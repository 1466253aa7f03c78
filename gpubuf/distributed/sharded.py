"""``ShardedReplayBuffer``: one replay buffer spread over N Ray actors, sampled as one.

Each shard is a gpubuf buffer in its own actor (a :class:`~gpubuf.distributed.host.BufferHost`)
with the same constructor arguments, so the total capacity is ``num_shards`` times the
storage's. Global indices name their shard: ``index = shard * shard_capacity + local_index``
(:meth:`ShardedReplayBuffer.split_index` takes one apart).

Sampling is correct for the buffer as a whole, not shard by shard: one round trip reads every
shard's size and, for prioritized samplers, its priority mass (the sum of its transformed
priorities) and smallest priority; the batch is split among shards by a multinomial draw in
proportion to those masses (to sizes for uniform samplers); each shard draws its part with its
own sampler; importance weights are rescaled from the shard's minimum to the global one. So an
item is drawn with probability ``p_i / sum_j p_j`` over all shards, and weighs
``(p_i / min_j p_j) ** -beta``, as in one prioritized buffer. Rows of a batch come in random
order (not grouped by shard).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDictBase

from gpubuf.buffers import ReplayBuffer
from gpubuf.distributed._ray import RuntimeLease, actor_gone_errors, get, require_ray, to_cpu
from gpubuf.distributed.host import remote_host_class
from gpubuf.distributed.ray_buffer import RayReplayBufferClient, _count
from gpubuf.distributed.rate_limiter import LimiterHandle, RateLimiter, admit_sample
from gpubuf.distributed.wire import _concat, _take, assemble, chunk_count
from gpubuf.errors import BatchSizeError, EmptyBufferError, IndexOutOfRangeError, ShardUnavailableError
from gpubuf.samplers.random import _check_batch_size
from gpubuf.storages._layout import is_tensor_collection

__all__ = ["ShardedReplayBuffer"]

_FORMAT = "gpubuf-sharded-buffer"
_FORMAT_VERSION = 1
_META_FILE = "sharding.json"
#: How long :meth:`ShardedReplayBuffer.restart_shard` waits for Ray to release a dead shard's name.
_NAME_RELEASE_TIMEOUT_S = 60.0


def _shard_dir(root: Any, shard: int) -> str:
    return str(Path(root) / f"shard-{shard:03d}")


def _rows(value: Any, start: int, count: int) -> Any:
    """Rows ``[start, start + count)`` of a batch, or of an info entry (a tensor or a list)."""
    if isinstance(value, (torch.Tensor, list)) or is_tensor_collection(value):
        return value[start : start + count]
    return value


def _as_list(refs: Any) -> list:
    """The object refs of a call: a list whether it has one return or several."""
    return refs if isinstance(refs, list) else [refs]


@dataclass
class _Round:
    """One sample's requests, sent and not yet read."""

    batch_size: int
    positions: dict[int, torch.Tensor]  # per shard, the positions of the batch its rows fill
    calls: dict[int, Callable[[Any], Any]]
    refs: dict[int, list]


class ShardedReplayBuffer:
    """A replay buffer sharded over ``num_shards`` Ray actors, with globally correct sampling.

    Writes go to one shard per call, round robin (or row by row by the integer ``shard_key``
    of the data, modulo ``num_shards``); samples are drawn across shards in proportion to their
    sizes (uniform samplers) or priority masses (prioritized samplers); priority updates go to
    the shards that own the indices. A shard whose actor dies raises
    :class:`~gpubuf.errors.ShardUnavailableError` naming it for the calls that need it, while
    sampling and round-robin writes go on with the others; :meth:`restart_shard` brings it back
    from its last :meth:`checkpoint`.

    Hand the buffer to Ray tasks and actors: it pickles as a client of the same shards (which
    cannot close them). Each client writes round robin from its own starting shard.

    Args:
        *args: the buffer's positional arguments.

    Keyword Args:
        num_shards: the number of shard actors, ``>= 1``.
        replay_buffer_cls: the buffer class of each shard (default :class:`~gpubuf.ReplayBuffer`;
            :class:`~gpubuf.TensorDictPrioritizedReplayBuffer`, ...). Its storage must be 1-D.
        shard_key: route each row to shard ``data[shard_key] % num_shards`` (TensorDict data);
            None (default) sends each ``extend`` whole to the next shard, round robin.
        rate_limiter: a :class:`~gpubuf.distributed.SampleToInsertRatio` or
            :class:`~gpubuf.distributed.MinSize` over the whole buffer.
        checkpoint_dir: where :meth:`checkpoint` writes each shard (``shard-000``, ...). A shard
            built while its directory holds a checkpoint (a restart, or a new buffer on an old
            directory) starts from it.
        ray_init_config: ``ray.init`` arguments, used when no Ray runtime runs yet.
        remote_config: each shard actor's options. Defaults to no reserved CPU (shards serve
            calls; the machine's CPUs stay with the workers) and ``1 / num_shards`` of a GPU
            where CUDA is available.
        seed: seeds this client's choice of shards and row order, and each shard's draws
            (shard ``i`` seeds its process with ``seed + 1 + i``). Do not give the shards one
            ``generator``: each would draw the same numbers.
        prefetch: batches drawn ahead (None or 0: none, every :meth:`sample` waits for its own
            draw). With ``prefetch=n``, the client asks each shard for its rows of the next
            ``n`` batches (of the size asked) in one request, and keeps the next such round in
            flight while it hands them out: the shards draw and send while this client
            assembles and its caller learns, and each request's cost is shared by ``n``
            batches. As with TorchRL's ``prefetch``, a batch is drawn when it is requested, up
            to ``2 n`` batches before it is handed out: it does not see the rows written nor the
            priorities updated after that (updates are never lost: a shard applies them after
            the draws already asked of it, in the order this client sent them), and its
            importance weights are those of that moment. :meth:`empty`, :meth:`loads` and
            :meth:`restart_shard` drop what was drawn ahead; so does a sample of another size.
            A rate limiter counts a batch when :meth:`sample` hands it out.
        **kwargs: every argument of ``replay_buffer_cls`` (``storage``, ``sampler``, ``alpha``,
            ``beta``, ``batch_size``, ...), with storages, samplers and writers given as classes
            or callables (``storage=partial(LazyTensorStorage, 100_000)``): each shard builds its
            own, so ``max_size`` is per shard.

    Raises:
        ImportError: Ray is not installed.
        ValueError: ``num_shards < 1``, or ``prefetch`` not a count.
        NotImplementedError: a storage with more than one dim.

    Examples:
        >>> rb = ShardedReplayBuffer(num_shards=4, replay_buffer_cls=TensorDictPrioritizedReplayBuffer,
        ...                          alpha=0.7, beta=0.5, storage=partial(LazyTensorStorage, 250_000),
        ...                          batch_size=256)
        >>> rb.extend(TensorDict({"obs": torch.randn(1000, 8)}, [1000]))
        >>> batch = rb.sample()           # batch["index"] names the shard: rb.split_index(batch["index"])
        >>> batch["td_error"] = torch.rand(256)
        >>> rb.update_tensordict_priority(batch)
        >>> rb.close()
    """

    def __init__(
        self,
        *args: Any,
        num_shards: int = 2,
        replay_buffer_cls: type = ReplayBuffer,
        shard_key: Any = None,
        rate_limiter: RateLimiter | None = None,
        checkpoint_dir: Any = None,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        seed: int | None = None,
        prefetch: int | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}")
        if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
            raise TypeError(
                f"rate_limiter must be a RateLimiter (SampleToInsertRatio, MinSize), got {type(rate_limiter).__name__}"
            )
        batch_size = kwargs.get("batch_size")
        if batch_size is not None:
            _check_batch_size(batch_size)
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0):
            raise ValueError(f"prefetch must be None or an integer >= 0 (rounds kept in flight), got {prefetch!r}")
        self._prefetch = prefetch or 0
        ray = require_ray()
        if remote_config is None:
            remote_config = {"num_cpus": 0, "num_gpus": 1 / num_shards if torch.cuda.is_available() else None}
        self._num_shards = num_shards
        self._cls = replay_buffer_cls
        self._args = tuple(args)
        self._kwargs = dict(kwargs)
        self._shard_key = shard_key
        self._checkpoint_dir = None if checkpoint_dir is None else str(Path(checkpoint_dir).absolute())
        self._remote_config = dict(remote_config)
        self._has_gpu = (self._remote_config.get("num_gpus") or 0) > 0
        self._batch_size = batch_size
        self._seed = seed
        self._lease: RuntimeLease | None = RuntimeLease.acquire(ray_init_config)
        self._owner = True
        self._limiter: LimiterHandle | None = None
        self._namespace = ray.get_runtime_context().namespace
        prefix = f"gpubuf-shard-{uuid.uuid4().hex[:12]}"
        self._names = [f"{prefix}-{i:03d}" for i in range(num_shards)]
        self._handles: list[Any] = []
        try:
            self._handles = [self._spawn(i) for i in range(num_shards)]
            stats = [get(h.stats.remote()) for h in self._handles]
            self._check_layout(stats)
            self._stride = stats[0]["capacity"]
            if rate_limiter is not None:
                self._limiter = LimiterHandle.start(rate_limiter, self._stride * num_shards)
        except BaseException:
            self._kill_all()
            self._lease.release()
            self._lease = None
            raise
        self._dead: set[int] = set()
        self._init_client(seed)

    # ------------------------------------------------------------------ construction helpers
    def _init_client(self, seed: int | None) -> None:
        self._generator = torch.Generator()
        self._generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else seed)
        self._next_shard = int(torch.randint(self._num_shards, (), generator=self._generator))
        if not hasattr(self, "_dead"):
            self._dead = set()
        # The last stats each shard sent this client (see _issue).
        self._shard_stats: dict[int, dict] = {}
        # The bytes of a sampled row, as the shards last reported it: sizes their replies' chunks.
        self._row_bytes: int | None = None
        self._in_flight: deque[_Round] = deque()
        self._ready: deque[tuple[int, tuple[Any, dict]]] = deque()  # (batch size, (data, info)) drawn ahead
        self._lock = threading.Lock()

    def _spawn(self, shard: int) -> Any:
        """Starts shard ``shard``'s actor under its name (restoring its checkpoint if there is one)."""
        actor_cls = remote_host_class(self._remote_config)
        checkpoint = None if self._checkpoint_dir is None else _shard_dir(self._checkpoint_dir, shard)
        return actor_cls.options(name=self._names[shard], namespace=self._namespace).remote(
            self._cls, self._args, self._kwargs, False, checkpoint, None if self._seed is None else self._seed + 1 + shard
        )

    def _check_layout(self, stats: list[dict]) -> None:
        if any(s["ndim"] != 1 for s in stats):
            raise NotImplementedError("ShardedReplayBuffer needs 1-D storages (ndim=1)")
        capacities = {s["capacity"] for s in stats}
        if len(capacities) != 1:
            raise ValueError(f"the shards' storages have different capacities {sorted(capacities)}; give one storage")

    def _kill_all(self) -> None:
        ray = require_ray()
        for handle in self._handles:
            try:
                ray.kill(handle, no_restart=True)
            except (ValueError, RuntimeError):
                pass
        if self._limiter is not None:
            self._limiter.stop()

    def __reduce__(self) -> tuple:
        state = {
            name: getattr(self, name)
            for name in (
                "_num_shards", "_cls", "_args", "_kwargs", "_shard_key", "_checkpoint_dir", "_remote_config",
                "_has_gpu", "_batch_size", "_seed", "_limiter", "_namespace", "_names", "_handles",
                "_stride", "_prefetch",
            )
        }
        return (_rebuild_client, (state,))

    # ------------------------------------------------------------------ shard handles and faults
    @property
    def num_shards(self) -> int:
        return self._num_shards

    @property
    def shard_capacity(self) -> int:
        """Items each shard holds at most (its storage's ``max_size``)."""
        return self._stride

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def shard_key(self) -> Any:
        """The key routing rows to shards (``data[shard_key] % num_shards``), or None for round
        robin; may be changed between writes."""
        return self._shard_key

    @shard_key.setter
    def shard_key(self, key: Any) -> None:
        self._shard_key = key

    @property
    def rate_limiter(self) -> RateLimiter | None:
        return None if self._limiter is None else self._limiter.limiter

    @property
    def unavailable_shards(self) -> list[int]:
        """The shards this client found down (and has not seen back since)."""
        return sorted(self._dead)

    def shard(self, shard: int) -> RayReplayBufferClient:
        """A client on shard ``shard`` alone: its local indices, its rows (``rb.shard(0)[:]``)."""
        self._check_shard(shard)
        return RayReplayBufferClient(self._handles[shard], has_gpu=self._has_gpu)

    def shard_pid(self, shard: int) -> int:
        """The process id of shard ``shard``'s actor."""
        self._check_shard(shard)
        return self._on(shard, lambda h: h.pid.remote())

    def split_index(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Global indices to ``(shard, local_index)``, both int64 tensors of ``index``'s shape."""
        index = torch.as_tensor(index, dtype=torch.long)
        return torch.div(index, self._stride, rounding_mode="floor"), torch.remainder(index, self._stride)

    def _check_shard(self, shard: int) -> None:
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < self._num_shards:
            raise IndexOutOfRangeError(f"shard must be an integer in [0, {self._num_shards}), got {shard!r}")

    def _unavailable(self, shard: int, cause: BaseException | None = None) -> ShardUnavailableError:
        self._dead.add(shard)
        detail = f": {type(cause).__name__}" if cause is not None else ""
        return ShardUnavailableError(
            f"shard {shard} of {self._num_shards} ({self._names[shard]}) is unavailable: its actor died or is "
            f"restarting{detail}. The other shards keep serving; restart_shard({shard}) brings it back from its "
            "last checkpoint",
            shard=shard,
        )

    def _resolve(self, shard: int) -> bool:
        """Looks the shard's actor up by name; True when a live actor other than the one held answers
        (restarted by another process), which then replaces it."""
        ray = require_ray()
        try:
            handle = ray.get_actor(self._names[shard], namespace=self._namespace)
        except ValueError:
            return False
        if handle._actor_id == self._handles[shard]._actor_id:
            return False
        self._handles[shard] = handle
        self._dead.discard(shard)
        self._shard_stats.pop(shard, None)
        return True

    def _gather(
        self, calls: dict[int, Callable[[Any], Any]], into_stats: bool = False
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """Runs one remote call per shard, concurrently; returns the results and the shards that failed.

        A shard whose actor is gone is looked up again by name once (another process may have
        restarted it) and the call retried there. With ``into_stats`` the results are shard
        stats, kept for the next sample.
        """
        return self._wait(calls, {i: call(self._handles[i]) for i, call in calls.items()}, into_stats)

    def _wait(
        self, calls: dict[int, Callable[[Any], Any]], refs: dict[int, Any], into_stats: bool = False
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """The results of the calls :meth:`_gather` made (``refs``: an object ref, or a list of them
        for a call of several returns, per shard)."""
        ray = require_ray()
        results: dict[int, Any] = {}
        failed: dict[int, BaseException] = {}
        flat = [r for ref in refs.values() for r in (ref if isinstance(ref, list) else [ref])]
        try:
            # Every shard answered: one wait for all of them.
            values = ray.get(flat)
        except Exception:  # a shard failed: its error is told apart below, shard by shard
            values = None
        if values is not None:
            at = 0
            for i, ref in refs.items():
                n = len(ref) if isinstance(ref, list) else 1
                results[i] = values[at : at + n] if isinstance(ref, list) else values[at]
                at += n
                self._dead.discard(i)
        else:
            gone = actor_gone_errors()
            for i, ref in refs.items():
                try:
                    results[i] = get(ref)
                    self._dead.discard(i)
                except gone as err:
                    if self._resolve(i):
                        try:
                            results[i] = get(calls[i](self._handles[i]))
                            continue
                        except gone as again:
                            err = again
                    failed[i] = err
                    self._dead.add(i)
        if into_stats:
            self._shard_stats.update(results)
        return results, failed

    def _on(self, shard: int, call: Callable[[Any], Any]) -> Any:
        results, failed = self._gather({shard: call})
        if failed:
            raise self._unavailable(shard, failed[shard])
        return results[shard]

    def _live(self) -> list[int]:
        for shard in list(self._dead):
            self._resolve(shard)
        return [i for i in range(self._num_shards) if i not in self._dead]

    def _send(self, value: Any) -> Any:
        return value if self._has_gpu else to_cpu(value)

    # ------------------------------------------------------------------ writing
    def extend(self, data: Any, *, timeout: float | None = None, **kwargs: Any) -> torch.Tensor:
        """Writes a batch; returns its global indices (1-D int64, in the order of ``data``).

        Round robin: the batch goes whole to the next live shard. With ``shard_key``: each row
        goes to shard ``data[shard_key] % num_shards``. With a rate limiter, waits until the
        insert is admitted.

        Raises:
            ShardUnavailableError: every shard is down (round robin), or a row's shard is down
                (``shard_key``; the rows of the other shards are written).
            RateLimitTimeoutError: the rate limiter did not admit the insert within ``timeout`` s.
            Every error of the shard buffer's ``extend``, with the buffer unchanged.
        """
        n = _count(data)
        if self._limiter is not None:
            self._limiter.reserve_insert(n, timeout)
        written = 0
        try:
            index = self._extend_round_robin(data, kwargs) if self._shard_key is None else self._extend_by_key(data, kwargs)
            written = n
        except ShardUnavailableError as err:
            written = getattr(err, "written", 0)
            raise
        finally:
            if self._limiter is not None:
                if written:
                    self._limiter.commit_insert(written)
                if written < n:
                    self._limiter.cancel_insert(n - written)
        return index

    def add(self, data: Any, *, timeout: float | None = None) -> int:
        """Writes one item; returns its global index."""
        if isinstance(data, TensorDictBase):
            batch = data.unsqueeze(0)
        elif isinstance(data, torch.Tensor):
            batch = data.unsqueeze(0)
        else:
            batch = [data]
        return int(self.extend(batch, timeout=timeout)[0])

    def _extend_round_robin(self, data: Any, kwargs: dict) -> torch.Tensor:
        data = self._send(data)
        last: BaseException | None = None
        for _ in range(self._num_shards):
            live = self._live()
            if not live:
                break
            shard = min(live, key=lambda i: (i - self._next_shard) % self._num_shards)
            self._next_shard = (shard + 1) % self._num_shards
            offset = shard * self._stride
            results, failed = self._gather({shard: lambda h: h.extend_shard.remote(data, offset, kwargs)})
            if not failed:
                index, self._shard_stats[shard] = results[shard]
                return index
            last = failed[shard]
        raise self._unavailable(min(self._dead) if self._dead else 0, last)

    def _extend_by_key(self, data: Any, kwargs: dict) -> torch.Tensor:
        if not isinstance(data, TensorDictBase):
            raise TypeError(f"shard_key routing needs TensorDict data, got {type(data).__name__}")
        keys = data.get(self._shard_key)
        if keys.dtype.is_floating_point or keys.dtype == torch.bool:
            raise TypeError(f"data[{self._shard_key!r}] must hold integers to route rows, got {keys.dtype}")
        n = data.batch_size[0]
        owner = torch.remainder(keys.reshape(n, -1)[:, 0].to(torch.long).cpu(), self._num_shards)
        masks = {i: owner == i for i in range(self._num_shards)}
        parts = {i: self._send(data[m]) for i, m in masks.items() if bool(m.any())}
        offsets = {i: i * self._stride for i in parts}
        calls = {i: (lambda h, i=i: h.extend_shard.remote(parts[i], offsets[i], kwargs)) for i in parts}
        results, failed = self._gather(calls)
        index = torch.full((n,), -1, dtype=torch.long)
        for i, (local, self._shard_stats[i]) in results.items():
            index[masks[i]] = local.reshape(-1).to(torch.long)
        if failed:
            shard = min(failed)
            err = self._unavailable(shard, failed[shard])
            err.written = int(sum(int(masks[i].sum()) for i in results))
            raise err
        return index

    def update_priority(self, index: Any, priority: Any) -> None:
        """Sets priorities of items by global index, each on the shard that owns it.

        Negative indices are ignored (TorchRL's convention).

        Raises:
            IndexOutOfRangeError: an index past the last shard; nothing is updated.
            ShardUnavailableError: an owning shard is down (the other shards are updated).
        """
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1).cpu()
        priority = torch.as_tensor(priority).cpu()
        priority = priority.expand(index.shape) if priority.numel() == 1 else priority.reshape(-1)
        if priority.shape != index.shape:
            raise ValueError(f"{index.numel()} indices but {priority.numel()} priorities")
        keep = index >= 0
        index, priority = index[keep], priority[keep]
        shard, local = self.split_index(index)
        if index.numel() and int(shard.max()) >= self._num_shards:
            raise IndexOutOfRangeError(
                f"index {int(index.max())} is past the last shard: {self._num_shards} shards of {self._stride}"
            )
        calls = {}
        for i in torch.unique(shard).tolist():
            m = shard == i
            calls[i] = lambda h, li=local[m], pi=priority[m]: h.update_priority_shard.remote(li, pi)
        self._raise_failed(self._gather(calls, into_stats=True)[1])

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Reads ``data["index"]`` (global) and ``data[priority_key]`` and updates each owning shard.

        Raises:
            ShardUnavailableError: an owning shard is down (the other shards are updated).
        """
        index = data.get("index").reshape(data.batch_size[0], -1)[:, 0].to(torch.long).cpu()
        shard, local = self.split_index(index)
        data = self._send(data)
        calls = {}
        for i in torch.unique(shard[index >= 0]).tolist():
            if not 0 <= i < self._num_shards:
                raise IndexOutOfRangeError(f"index of shard {i}: there are {self._num_shards} shards")
            m = shard == i
            part = data[m].clone(False)
            part.set("index", local[m].to(data.get("index").device))
            calls[i] = lambda h, part=part: h.update_tensordict_priority_shard.remote(part)
        self._raise_failed(self._gather(calls, into_stats=True)[1])

    def _raise_failed(self, failed: dict[int, BaseException]) -> None:
        if failed:
            shard = min(failed)
            raise self._unavailable(shard, failed[shard])

    def empty(self) -> None:
        """Empties every shard (and resets the rate limiter)."""
        self._drop_prefetched()
        self._raise_failed(self._gather({i: lambda h: h.call.remote("empty") for i in range(self._num_shards)})[1])
        if self._limiter is not None:
            self._limiter.reset()

    # ------------------------------------------------------------------ reading
    def stats(self) -> dict[str, Any]:
        """Per shard: size, write count, capacity (and priority mass, minimum); plus the rate
        limiter's counters. Shards that are down are listed under ``"unavailable"``."""
        results, failed = self._gather({i: lambda h: h.stats.remote() for i in self._live()}, into_stats=True)
        out: dict[str, Any] = {"shards": results, "unavailable": sorted(set(failed) | self._dead)}
        if self._limiter is not None:
            out["rate_limiter"] = self._limiter.snapshot()
        return out

    def _live_stats(self) -> list[dict]:
        results, _ = self._gather({i: lambda h: h.stats.remote() for i in self._live()}, into_stats=True)
        return list(results.values())

    def __len__(self) -> int:
        """Items held by the shards that are up."""
        return sum(s["size"] for s in self._live_stats())

    @property
    def write_count(self) -> int:
        """Items written to the shards that are up since their last ``empty``."""
        return sum(s["write_count"] for s in self._live_stats())

    def can_sample(self, batch_size: int | None = None) -> bool:
        """Whether a sample would be admitted now (by the rate limiter; without one, whether any
        shard that is up holds an item)."""
        if self._limiter is None:
            return len(self) > 0
        n = batch_size if batch_size is not None else (self._batch_size or 1)
        return self._limiter.can_sample(int(n))

    def sample(
        self, batch_size: int | None = None, return_info: bool = False, *, wait: bool = False, timeout: float | None = None
    ) -> Any:
        """Samples a batch across the shards that are up.

        Args:
            batch_size: defaults to the constructor's ``batch_size``.
            return_info: also return the info dict (``"index"``: global indices;
                ``"priority_weight"``: importance weights against the global minimum).
            wait: with a rate limiter, wait until it admits the sample (up to ``timeout`` s).
            timeout: seconds to wait; None waits for ever.

        Returns:
            The batch (rows in random order), or ``(batch, info)``.

        Raises:
            BatchSizeError: no batch size anywhere.
            EmptyBufferError: no shard that is up holds an item.
            ShardUnavailableError: every shard is down.
            RateLimitTimeoutError: the rate limiter refused the sample.
            ValueError: ``wait=True`` without a rate limiter.
        """
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise BatchSizeError("batch_size not specified: pass it to the constructor or to sample(batch_size)")
        batch_size = _check_batch_size(batch_size)
        admit_sample(self._limiter, batch_size, wait, timeout)
        drawn = self._sample_prefetched(batch_size) if self._prefetch else None
        for _ in range(self._num_shards + 1):
            if drawn is not None:
                break
            drawn = self._sample_once(batch_size)
        if drawn is None:
            raise self._unavailable(0) if not self._live() else EmptyBufferError("every shard is empty")
        data, info = drawn
        return (data, info) if return_info else data

    def _sample_prefetched(self, batch_size: int) -> tuple[Any, dict] | None:
        """The next batch drawn ahead; None when a shard went down on the way (the caller draws
        again).

        Batches are drawn ``prefetch`` at a time: one round asks each shard for its rows of the
        next ``prefetch`` batches at once (one request per shard for all of them), and one more
        round is kept in flight while they are handed out, so that the shards draw and send it
        while this client assembles and its caller learns.
        """
        rows = batch_size * self._prefetch
        with self._lock:
            if self._ready and self._ready[0][0] != batch_size:
                self._ready.clear()  # drawn for another size: dropped
            if self._ready:
                return self._ready.popleft()[1]
            while self._in_flight and self._in_flight[0].batch_size != rows:
                self._in_flight.popleft()
            pending = self._in_flight.popleft() if self._in_flight else self._issue(rows)
            if pending is not None and not self._in_flight:
                # Sent before this round is read: a shard runs one client's calls in the order sent.
                following = self._issue(rows)
                if following is not None:
                    self._in_flight.append(following)
        drawn = None if pending is None else self._collect(pending)
        if drawn is None:
            return None
        data, info = drawn
        batches = [
            (_rows(data, j * batch_size, batch_size), {k: _rows(v, j * batch_size, batch_size) for k, v in info.items()})
            for j in range(self._prefetch)
        ]
        with self._lock:
            self._ready.extend((batch_size, batch) for batch in batches[1:])
        return batches[0]

    def _drop_prefetched(self) -> None:
        """Forgets the rounds in flight (their rows were drawn before the buffer's contents changed)."""
        with self._lock:
            self._in_flight.clear()
            self._ready.clear()

    def _sample_once(self, batch_size: int) -> tuple[Any, dict] | None:
        """One attempt: None when a shard went down on the way (the caller draws again)."""
        pending = self._issue(batch_size)
        return None if pending is None else self._collect(pending)

    def _issue(self, batch_size: int) -> _Round | None:
        """Sends one sample's requests to every live shard; None when no shard is up.

        The batch is split among the shards by the sizes and masses they reported with their
        last answer to this client (this client's writes and updates included); shards not
        heard from yet are asked first. Every live shard is part of each sample call (with 0
        items when the split gives it none), so their reports stay current: a shard filled by
        other processes is seen from the next sample on. Each row of the batch draws its shard,
        and the shard's rows fill the positions that drew it: the batch comes in random order
        with no shuffle of its own.

        Raises:
            EmptyBufferError: every live shard is empty (or holds only zero priorities).
        """
        live = self._live()
        if not live:
            return None
        unknown = [i for i in live if i not in self._shard_stats]
        if unknown:
            if self._gather({i: lambda h: h.stats.remote() for i in unknown}, into_stats=True)[1]:
                return None
        stats = {i: self._shard_stats[i] for i in live}
        shards = sorted(stats)
        prioritized = any(stats[i]["prioritized"] for i in shards)
        weights = torch.tensor([stats[i]["mass"] if prioritized else stats[i]["size"] for i in shards], dtype=torch.float64)
        if not float(weights.sum()) > 0:
            # Reports may be old (other processes write too): ask once more before giving up.
            if not unknown:
                self._shard_stats.clear()
                return self._issue(batch_size)
            raise EmptyBufferError(
                "every shard that is up is empty" + (" or has only zero priorities" if prioritized else "")
            )
        # Each position of the batch draws its shard by inverse transform sampling (a multinomial
        # draw, cheaper than torch.multinomial for a few categories and many draws); a shard of
        # zero weight has an empty interval and is never drawn.
        bounds = torch.cumsum(weights, 0)
        uniform = torch.rand(batch_size, dtype=torch.float64, generator=self._generator) * bounds[-1]
        drawn = torch.searchsorted(bounds, uniform, right=True)
        last = int(torch.nonzero(weights > 0)[-1])
        drawn.clamp_(max=last)  # rounding at the top end stays on a shard that holds something
        positions = {shard: torch.nonzero(drawn == j).reshape(-1) for j, shard in enumerate(shards)}
        counts = torch.tensor([len(positions[shard]) for shard in shards])
        global_min = None
        if prioritized:
            global_min = min(stats[i]["min"] for i in shards if stats[i]["mass"] > 0)
        calls = {}
        for shard, k in zip(shards, counts.tolist()):
            chunks = chunk_count(k, self._row_bytes)
            calls[shard] = lambda h, k=k, off=shard * self._stride, c=chunks: _as_list(
                h.sample_shard_packed.options(num_returns=c).remote(k, off, global_min, c)
            )
        refs = {i: call(self._handles[i]) for i, call in calls.items()}
        return _Round(batch_size, positions, calls, refs)

    def _collect(self, pending: _Round) -> tuple[Any, dict] | None:
        """Waits for a round's answers and assembles its batch; None when a shard went down or had
        less to draw from than reported (the caller draws again)."""
        results, failed = self._wait(pending.calls, pending.refs)
        for shard, reply in results.items():
            self._shard_stats[shard] = reply[0][1]
        asked = {shard for shard, where in pending.positions.items() if where.numel()}
        if failed or any(results[s][0][0] is None for s in asked):
            return None
        replies = [(results[s][0][0], [results[s][0][2], *results[s][1:]]) for s in sorted(asked)]
        sizes = [h[4] for h, _ in replies if h[0] != "pickled"]
        if sizes:
            self._row_bytes = max(sizes)
        return assemble(replies, [pending.positions[s] for s in sorted(asked)], pending.batch_size)

    def __getitem__(self, index: Any) -> Any:
        """Reads items by global index (an int, or a 1-D tensor or list of ints)."""
        if isinstance(index, int) and not isinstance(index, bool):
            shard, local = self.split_index(index)
            self._check_shard(int(shard))
            return self._on(int(shard), lambda h: h.call.remote("__getitem__", (int(local),)))
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        shard, local = self.split_index(index)
        if index.numel() and (int(shard.max()) >= self._num_shards or int(index.min()) < 0):
            raise IndexOutOfRangeError(f"indices must lie in [0, {self._num_shards * self._stride})")
        groups = {i: shard == i for i in torch.unique(shard).tolist()}
        results, failed = self._gather(
            {i: (lambda h, li=local[m]: h.call.remote("__getitem__", (li,))) for i, m in groups.items()}
        )
        self._raise_failed(failed)
        order = torch.cat([torch.nonzero(groups[i]).reshape(-1) for i in sorted(results)])
        data = _concat([results[i] for i in sorted(results)])
        return _take(data, torch.argsort(order))

    # ------------------------------------------------------------------ checkpoints and restarts
    def checkpoint(self) -> str:
        """Writes every shard that is up to ``checkpoint_dir/shard-NNN`` (pickle-free, atomic);
        returns ``checkpoint_dir``. A shard restarted later starts from its last one.

        Raises:
            ValueError: the buffer was built without ``checkpoint_dir``.
            ShardUnavailableError: a shard is down (the others are written).
        """
        if self._checkpoint_dir is None:
            raise ValueError("checkpoint() needs the checkpoint_dir given to the constructor")
        self._write_meta(self._checkpoint_dir)
        self._raise_failed(self._gather({i: lambda h: h.checkpoint.remote() for i in self._live()})[1])
        return self._checkpoint_dir

    def dumps(self, path: Any) -> None:
        """Writes every shard's pickle-free checkpoint under ``path`` (``shard-NNN``) and the layout
        in ``path/sharding.json``. Paths are on the shards' machines (a shared file system)."""
        self._write_meta(path)
        calls = {i: (lambda h, i=i: h.call.remote("dumps", (_shard_dir(path, i),))) for i in range(self._num_shards)}
        self._raise_failed(self._gather(calls)[1])

    def loads(self, path: Any) -> None:
        """Restores every shard from a checkpoint written by :meth:`dumps` or :meth:`checkpoint`.

        Raises:
            ValueError: the checkpoint holds another number of shards or shard capacity.
        """
        meta = json.loads((Path(path) / _META_FILE).read_text())
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{path} is not a sharded gpubuf checkpoint (no {_META_FILE} of format {_FORMAT!r})")
        if meta["num_shards"] != self._num_shards or meta["shard_capacity"] != self._stride:
            raise ValueError(
                f"{path} holds {meta['num_shards']} shards of {meta['shard_capacity']}, expected {self._num_shards} "
                f"of {self._stride}"
            )
        self._drop_prefetched()
        calls = {i: (lambda h, i=i: h.call.remote("loads", (_shard_dir(path, i),))) for i in range(self._num_shards)}
        self._raise_failed(self._gather(calls)[1])

    dump = save = dumps
    load = loads

    def _write_meta(self, path: Any) -> None:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "num_shards": self._num_shards,
            "shard_capacity": self._stride,
        }
        tmp = root / f".{_META_FILE}.tmp"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, root / _META_FILE)

    def restart_shard(self, shard: int) -> None:
        """Replaces shard ``shard``'s actor by a new one, which restores the shard's last
        checkpoint (an empty shard without one). Rows written to it after that checkpoint are
        lost. Other clients find the new actor by name at their next call to the shard.
        """
        self._check_shard(shard)
        self._drop_prefetched()
        ray = require_ray()
        try:
            ray.kill(self._handles[shard], no_restart=True)
        except (ValueError, RuntimeError):
            pass
        deadline = time.monotonic() + _NAME_RELEASE_TIMEOUT_S
        while True:
            try:
                handle = self._spawn(shard)
                break
            except ValueError as err:
                # Ray releases a dead actor's name shortly after its death is recorded.
                if "already taken" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        get(handle.pid.remote())  # ready, checkpoint loaded
        self._handles[shard] = handle
        self._dead.discard(shard)
        self._shard_stats.pop(shard, None)

    def close(self) -> None:
        """Stops every shard actor (and the rate limiter's), and the Ray runtime if this buffer
        started it. Only the buffer that built the shards can close them."""
        if not self._owner:
            raise RuntimeError("a client of a ShardedReplayBuffer cannot close it; close the buffer that built it")
        if self._lease is None:
            return
        self._kill_all()
        self._lease.release()
        self._lease = None

    shutdown = close


def _rebuild_client(state: dict[str, Any]) -> ShardedReplayBuffer:
    client = ShardedReplayBuffer.__new__(ShardedReplayBuffer)
    client.__dict__.update(state)
    client._owner = False
    client._lease = None
    client._dead = set()
    client._init_client(None)
    return client
