"""``RayReplayBuffer``: a gpubuf buffer inside a Ray actor, TorchRL's ``RayReplayBuffer`` API."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Iterator

from gpubuf.buffers import ReplayBuffer
from gpubuf.distributed._ray import RuntimeLease, default_remote_config, get, require_ray, to_cpu
from gpubuf.distributed.component import RemoteComponent
from gpubuf.distributed.host import remote_host_class
from gpubuf.distributed.rate_limiter import LimiterHandle, RateLimiter, admit_sample
from gpubuf.distributed.remote import actor_class

__all__ = ["RayReplayBuffer", "RayReplayBufferClient"]


def _count(data: Any, dim: int = 0) -> int:
    """The number of items in a batch given to ``extend``."""
    if isinstance(data, (list, tuple)) and not hasattr(data, "shape"):
        return len(data)
    shape = getattr(data, "batch_size", None)
    if shape is None:
        shape = getattr(data, "shape", None)
    if shape is not None and len(shape) > dim:
        return int(shape[dim])
    if hasattr(data, "__len__"):
        return len(data)
    raise TypeError(f"cannot tell how many items a {type(data).__name__} holds")


def _client(actor: Any, has_gpu: bool, limiter: LimiterHandle | None) -> "RayReplayBufferClient":
    return RayReplayBufferClient(actor, has_gpu=has_gpu, limiter=limiter)


class RayReplayBufferClient:
    """A handle on a remote buffer: every call is a method call on its actor.

    Picklable, so it can be handed to Ray tasks and actors (and so can a
    :class:`RayReplayBuffer`, which pickles as one of these); it cannot stop the actor.

    Args:
        actor: the Ray actor holding the buffer (a :class:`~gpubuf.distributed.host.BufferHost`).
        has_gpu: whether the actor was given a GPU; when not, tensors are moved to the CPU
            before they are sent.
        limiter: the rate limiter's handle, or None.
    """

    def __init__(self, actor: Any, *, has_gpu: bool = False, limiter: LimiterHandle | None = None) -> None:
        self._actor = actor
        self.has_gpu = has_gpu
        self._limiter = limiter

    # ------------------------------------------------------------------ plumbing
    def _send(self, value: Any) -> Any:
        return value if self.has_gpu else to_cpu(value)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._host("call", name, args, kwargs)

    def _host(self, method: str, *args: Any) -> Any:
        """``host.<method>(*args)`` on the actor, waited for."""
        return get(getattr(self._actor, method).remote(*(self._send(a) for a in args)))

    def _in_place(self, name: str, *args: Any, **kwargs: Any) -> "RayReplayBufferClient":
        """A buffer method that returns the buffer (for chaining): called on the actor, returns this client."""
        self._host("call_in_place", name, args, kwargs)
        return self

    def __reduce__(self) -> tuple:
        return (_client, (self._actor, self.has_gpu, self._limiter))

    @property
    def rate_limiter(self) -> RateLimiter | None:
        """The rate limiter's rule, or None."""
        return None if self._limiter is None else self._limiter.limiter

    # ------------------------------------------------------------------ writing
    def extend(self, data: Any, *, timeout: float | None = None, **kwargs: Any) -> Any:
        """``buffer.extend(data, **kwargs)`` on the actor; returns the indices written.

        With a rate limiter, blocks until the insert is admitted.

        Raises:
            RateLimitTimeoutError: the limiter did not admit the insert within ``timeout`` s.
            Every error of the buffer's ``extend``, with the buffer unchanged.
        """
        if self._limiter is None:
            return self._call("extend", data, **kwargs)
        n = _count(data)
        self._limiter.reserve_insert(n, timeout)
        try:
            index = self._call("extend", data, **kwargs)
        except BaseException:
            self._limiter.cancel_insert(n)
            raise
        self._limiter.commit_insert(n)
        return index

    def add(self, data: Any, *, timeout: float | None = None) -> int:
        """``buffer.add(data)`` on the actor (one item; blocks for a rate limiter as :meth:`extend`)."""
        if self._limiter is None:
            return self._call("add", data)
        self._limiter.reserve_insert(1, timeout)
        try:
            index = self._call("add", data)
        except BaseException:
            self._limiter.cancel_insert(1)
            raise
        self._limiter.commit_insert(1)
        return index

    def update_priority(self, index: Any, priority: Any) -> None:
        return self._call("update_priority", index, priority)

    def update_tensordict_priority(self, data: Any) -> None:
        return self._call("update_tensordict_priority", data)

    def empty(self, empty_write_count: bool = True) -> None:
        self._call("empty", empty_write_count=empty_write_count)
        if self._limiter is not None:
            self._limiter.reset()

    def __setitem__(self, index: Any, value: Any) -> None:
        self._call("__setitem__", index, value)

    # ------------------------------------------------------------------ reading
    def sample(
        self,
        batch_size: int | None = None,
        return_info: bool = False,
        *,
        wait: bool = False,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """``buffer.sample(batch_size, return_info)`` on the actor.

        Args:
            batch_size: defaults to the buffer's ``batch_size``.
            return_info: also return the sampler's info dict.
            wait: with a rate limiter, wait until it admits the sample (up to ``timeout`` s);
                without ``wait`` the sample is admitted now or refused.
            timeout: seconds to wait; None waits for ever.

        Raises:
            RateLimitTimeoutError: the rate limiter refused the sample (nothing was drawn).
            ValueError: ``wait=True`` on a buffer without a rate limiter.
            Every error of the buffer's ``sample``.
        """
        n = batch_size if batch_size is not None or self._limiter is None else self.batch_size
        admit_sample(self._limiter, int(n or 0), wait, timeout)  # n = 0: the buffer raises its BatchSizeError
        return self._call("sample", batch_size=batch_size, return_info=return_info, **kwargs)

    def can_sample(self, batch_size: int | None = None) -> bool:
        """Whether a sample of ``batch_size`` items would be admitted now (by the rate limiter;
        without one, whether the buffer holds any item)."""
        if self._limiter is None:
            return len(self) > 0
        n = batch_size if batch_size is not None else (self.batch_size or 1)
        return self._limiter.can_sample(int(n))

    def __len__(self) -> int:
        return self._call("__len__")

    def __getitem__(self, index: Any) -> Any:
        return self._call("__getitem__", index)

    @property
    def batch_size(self) -> int | None:
        return get(self._actor.get_attr.remote("batch_size"))

    @property
    def write_count(self) -> int:
        return get(self._actor.get_attr.remote("write_count"))

    @property
    def dim_extend(self) -> int:
        return get(self._actor.get_attr.remote("dim_extend"))

    def stats(self) -> dict[str, Any]:
        """Size, write count, capacity (and the priority mass for prioritized samplers) in one round
        trip, plus the rate limiter's counters when there is one."""
        out = get(self._actor.stats.remote())
        if self._limiter is not None:
            out["rate_limiter"] = self._limiter.snapshot()
        return out

    # ------------------------------------------------------------------ state and the rest
    def dumps(self, path: Any) -> None:
        """Writes the remote buffer's pickle-free checkpoint to ``path`` (on the actor's machine)."""
        self._call("dumps", str(path))

    def loads(self, path: Any) -> None:
        """Restores the remote buffer from the checkpoint at ``path`` (on the actor's machine)."""
        self._call("loads", str(path))

    dump = save = dumps
    load = loads

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._call("load_state_dict", state_dict)

    def append_transform(self, transform: Callable, *, invert: bool = False) -> None:
        self._call("append_transform", transform, invert=invert)

    def insert_transform(self, index: int, transform: Callable, *, invert: bool = False) -> None:
        self._call("insert_transform", index, transform, invert=invert)

    def mark_update(self, index: Any) -> None:
        self._call("mark_update", index)

    def register_save_hook(self, hook: Callable[[Any], Any]) -> None:
        self._call("register_save_hook", hook)

    def register_load_hook(self, hook: Callable[[Any], Any]) -> None:
        self._call("register_load_hook", hook)

    def set_rng(self, generator: Any) -> None:
        self._call("set_rng", generator)

    def set_storage(self, storage: Any, collate_fn: Callable | None = None) -> None:
        self._call("set_storage", storage, collate_fn)

    def set_sampler(self, sampler: Any) -> None:
        self._call("set_sampler", sampler)

    def set_writer(self, writer: Any) -> None:
        self._call("set_writer", writer)

    # ------------------------------------------------------------------ components
    @property
    def initialized(self) -> bool:
        """Whether the remote buffer is built (False only while a ``delayed_init`` buffer is unused)."""
        return get(self._actor.initialized.remote())

    @property
    def sampler(self) -> RemoteComponent:
        """The remote buffer's sampler, used through the actor (see :class:`RemoteComponent`)."""
        return RemoteComponent(self._host, "sampler")

    @property
    def storage(self) -> RemoteComponent:
        """The remote buffer's storage, used through the actor (``len(rb.storage)``,
        ``rb.storage.max_size``, ``rb.storage[i]``)."""
        return RemoteComponent(self._host, "storage")

    @property
    def writer(self) -> RemoteComponent:
        """The remote buffer's writer, used through the actor."""
        return RemoteComponent(self._host, "writer")

    @property
    def transform(self) -> RemoteComponent:
        """The remote buffer's transform, used through the actor (``rb.transform(data)`` runs there)."""
        return RemoteComponent(self._host, "transform")

    # ------------------------------------------------------------------ bulk and in-place writes
    def write_all(self, data: Any, end: int | None = None) -> None:
        """``buffer.write_all(data, end)`` on the actor: replaces the contents by ``data``."""
        self._call("write_all", data, end)

    def read_all_in_order(self, end: int | None = None) -> Any:
        """``buffer.read_all_in_order(end)`` on the actor: the items, oldest first."""
        return self._call("read_all_in_order", end)

    def set_(self, key: Any, value: Any) -> "RayReplayBufferClient":
        """``buffer.set_(key, value)`` on the actor; returns this client."""
        return self._in_place("set_", key, value)

    def set_at_(self, key: Any, value: Any, index: Any) -> "RayReplayBufferClient":
        """``buffer.set_at_(key, value, index)`` on the actor; returns this client."""
        return self._in_place("set_at_", key, value, index)

    def update_(
        self, input_dict_or_td: Any, clone: bool = False, *, keys_to_update: Any = None
    ) -> "RayReplayBufferClient":
        """``buffer.update_(...)`` on the actor; returns this client."""
        return self._in_place("update_", input_dict_or_td, clone, keys_to_update=keys_to_update)

    def share(self, shared: bool = True) -> "RayReplayBufferClient":
        """``buffer.share(shared)`` on the actor (the actor already serves every process); returns this client."""
        return self._in_place("share", shared)

    def update_if_present(
        self,
        *,
        index: Any,
        generation: Any,
        patch: Any,
        version_key: Any = None,
        version: Any = None,
        require_newer: bool = False,
    ) -> Any:
        """``buffer.update_if_present(...)`` on the actor: validation, the generation and version
        checks and the write all happen there, in one round trip."""
        return self._call(
            "update_if_present", index=index, generation=generation, patch=patch, version_key=version_key,
            version=version, require_newer=require_newer,
        )

    def submit_update_if_present(
        self,
        *,
        index: Any,
        generation: Any,
        patch: Any,
        version_key: Any = None,
        version: Any = None,
        require_newer: bool = False,
    ) -> Future:
        """:meth:`update_if_present` sent now and answered later: returns a future of its result.

        Calls from one client run on the actor in the order they were made.
        """
        kwargs = dict(
            index=index, generation=generation, patch=patch, version_key=version_key, version=version,
            require_newer=require_newer,
        )
        ref = self._actor.call.remote("update_if_present", (), self._send(kwargs))
        future: Future = Future()

        def settle(done: Future) -> None:
            try:
                future.set_result(get(ref))
            except BaseException as err:  # the remote error, re-raised by result()
                future.set_exception(err)

        ref.future().add_done_callback(settle)
        return future

    def synchronize(self) -> None:
        """Waits for the remote buffer's pending work (its prefetched batches)."""
        self._call("synchronize")

    # ------------------------------------------------------------------ iteration and queries
    def next(self) -> Any:
        """The next batch of iterating over the remote buffer, or None once it ran out."""
        return self._call("next")

    def __iter__(self) -> Iterator[Any]:
        """Batches from :meth:`next` until it returns None (never, for random samplers)."""
        while True:
            data = self.next()
            if data is None:
                return
            yield data

    def query(self, predicate: Any = None, *, trajectory_key: Any = None) -> list:
        """``buffer.query(predicate, trajectory_key=...)`` on the actor: the matching trajectories."""
        return self._call("query", predicate, trajectory_key=trajectory_key)

    def __getattr__(self, name: str) -> Any:
        # Any other public method of the buffer, called on the actor.
        if name.startswith("_"):
            raise AttributeError(name)

        def remote_call(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, *args, **kwargs)

        remote_call.__name__ = name
        return remote_call


class RayReplayBuffer(RayReplayBufferClient):
    """A replay buffer in a Ray actor, extended and sampled from anywhere in the cluster.

    TorchRL's ``RayReplayBuffer`` with a gpubuf buffer inside: the same arguments, the buffer's
    methods (``extend``, ``add``, ``sample``, ``update_priority``,
    ``update_tensordict_priority``, ``__len__``, ``__getitem__``, ``dumps``/``loads``, ...)
    forwarded to the actor. Hand the buffer (or :meth:`client`) to Ray tasks and actors: it
    pickles as a :class:`RayReplayBufferClient` on the same actor.

    Keyword Args:
        replay_buffer_cls: the buffer class built inside the actor; defaults to
            :class:`~gpubuf.ReplayBuffer`.
        ray_init_config: ``ray.init`` arguments, used when no Ray runtime is running yet
            (defaults to a local cluster without dashboard). A runtime started here is shut down
            by :meth:`close` of the last buffer using it.
        remote_config: the actor's options (``num_cpus``, ``num_gpus``, ``memory``,
            ``max_restarts``, ...). Defaults to TorchRL's: one CPU, 2 GiB, and 0.2 GPU where
            CUDA is available. With ``num_gpus > 0`` the actor sees its GPU as ``"cuda"``, so a
            storage given ``device="cuda"`` lives there; without, tensors are sent as CPU tensors.
        transport: ``"auto"`` or ``"ray"`` (the same thing: Ray's object store). TorchRL's
            ``"distributed"`` transport (torch.distributed) is not offered.
        transport_options: accepted for TorchRL compatibility; must be empty.
        delayed_init: build the buffer at its first use inside the actor.
        rate_limiter: (gpubuf) a :class:`~gpubuf.distributed.SampleToInsertRatio` or
            :class:`~gpubuf.distributed.MinSize` shared by every client: inserts and samples
            wait for it (see :meth:`extend` and :meth:`sample`).
        **kwargs: the buffer's own arguments. Give storages, samplers and writers as classes or
            callables (``storage=functools.partial(LazyTensorStorage, 100_000)``), as TorchRL
            asks: they are built inside the actor.

    Raises:
        ImportError: Ray is not installed.
        NotImplementedError: ``transport="distributed"``.

    Examples:
        >>> from functools import partial
        >>> rb = RayReplayBuffer(storage=partial(LazyTensorStorage, 10_000), batch_size=256,
        ...                      remote_config={"num_cpus": 1})
        >>> rb.extend(torch.randn(1000, 4))
        >>> rb.sample().shape
        torch.Size([256, 4])
        >>> rb.close()
    """

    def __init__(
        self,
        *args: Any,
        replay_buffer_cls: type = ReplayBuffer,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        transport: str = "auto",
        transport_options: dict[str, Any] | None = None,
        delayed_init: bool = False,
        rate_limiter: RateLimiter | None = None,
        **kwargs: Any,
    ) -> None:
        if transport not in ("auto", "ray", "distributed"):
            raise ValueError(f"RayReplayBuffer transport must be 'auto', 'ray' or 'distributed', got {transport!r}")
        if transport == "distributed":
            raise NotImplementedError("transport='distributed' (torch.distributed) is not supported; use 'auto' or 'ray'")
        if transport_options:
            raise ValueError("transport_options are not used by the Ray transport")
        if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
            raise TypeError(
                f"rate_limiter must be a RateLimiter (SampleToInsertRatio, MinSize), got {type(rate_limiter).__name__}"
            )
        require_ray()
        config = default_remote_config() if remote_config is None else dict(remote_config)
        self._lease = RuntimeLease.acquire(ray_init_config)
        actor = None
        limiter = None
        try:
            actor = remote_host_class(config).remote(replay_buffer_cls, args, kwargs, delayed_init)
            if not delayed_init:
                get(actor.pid.remote())  # surfaces a constructor error here, not at the first call
            if rate_limiter is not None:
                capacity = get(actor.stats.remote())["capacity"] if not delayed_init else None
                limiter = LimiterHandle.start(rate_limiter, capacity)
        except BaseException:
            ray = require_ray()
            if actor is not None:
                ray.kill(actor, no_restart=True)
            self._lease.release()
            raise
        super().__init__(actor, has_gpu=(config.get("num_gpus") or 0) > 0, limiter=limiter)
        self.replay_buffer_cls = replay_buffer_cls

    @classmethod
    def as_remote(cls, remote_config: dict[str, Any] | None = None) -> Any:
        """The Ray actor class of this class (TorchRL's ``RayReplayBuffer`` has it as every buffer
        does): an actor that owns a buffer actor of its own."""
        return actor_class(cls, remote_config)

    @property
    def is_alive(self) -> bool:
        """Whether this owner has not closed its actor."""
        return self._actor is not None

    @property
    def service_backend(self) -> str:
        return "ray"

    @property
    def transport_kind(self) -> str:
        return "ray"

    def start(self) -> "RayReplayBuffer":
        """The buffer is started when built; returns it (TorchRL's lifecycle API)."""
        if not self.is_alive:
            raise RuntimeError("a closed RayReplayBuffer cannot be restarted")
        return self

    def client(self) -> RayReplayBufferClient:
        """A picklable client on the same actor, without the right to stop it."""
        if not self.is_alive:
            raise RuntimeError("RayReplayBuffer is closed")
        return RayReplayBufferClient(self._actor, has_gpu=self.has_gpu, limiter=self._limiter)

    def clients(self, num_clients: int) -> list[RayReplayBufferClient]:
        """One client per consumer."""
        if isinstance(num_clients, bool) or not isinstance(num_clients, int):
            raise TypeError("num_clients must be an integer")
        if num_clients < 1:
            raise ValueError("num_clients must be at least 1")
        return [self.client() for _ in range(num_clients)]

    def close(self) -> None:
        """Stops the actor (and the rate limiter's), and the Ray runtime if this buffer started it."""
        if self._actor is None:
            return
        ray = require_ray()
        try:
            ray.kill(self._actor, no_restart=True)
        except (ValueError, RuntimeError):  # the runtime is already down
            pass
        if self._limiter is not None:
            self._limiter.stop()
        self._actor = None
        self._lease.release()

    def shutdown(self, timeout: float | None = None) -> None:
        """Alias of :meth:`close` (TorchRL's lifecycle API)."""
        del timeout
        self.close()

    def __reduce__(self) -> tuple:
        # A pickled owner becomes a client: only the process that built it may stop the actor.
        return self.client().__reduce__()


def ray_service(buffer_cls: type, args: tuple, kwargs: dict[str, Any], options: dict[str, Any]) -> RayReplayBuffer:
    """``buffer_cls(*args, service_backend="ray", service_backend_options=options, **kwargs)``:
    the buffer built in a Ray actor (TorchRL's ``service_backend`` dispatch).

    Args:
        buffer_cls: the buffer class built in the actor.
        args, kwargs: its constructor arguments (``transport`` and ``transport_options`` go to
            :class:`RayReplayBuffer`).
        options: ``ray_init_config`` and ``remote_config`` (see :class:`RayReplayBuffer`).

    Raises:
        TypeError: another option.
    """
    options = dict(options)
    ray_init_config = options.pop("ray_init_config", None)
    remote_config = options.pop("remote_config", None)
    if options:
        raise TypeError(f"Unexpected Ray replay-buffer service options: {sorted(options)}")
    return RayReplayBuffer(
        *args, replay_buffer_cls=buffer_cls, ray_init_config=ray_init_config, remote_config=remote_config, **kwargs
    )
