"""``StoreStorage``: items kept in a Redis-compatible key-value server (TorchRL's ``StoreStorage``).

The rows live in a :class:`tensordict.store.TensorDictStore` (``redis`` package), created on the
first write from the structure of the data, as in TorchRL: a buffer's data can then outlive the
process, or be shared by processes that talk to one server.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from tensordict import TensorDict, is_tensor_collection

from gpubuf.errors import EmptyBufferError, UnsupportedDataError
from gpubuf.storages.base import Storage
from gpubuf.storages.items import is_int


def _has_store() -> bool:
    return importlib.util.find_spec("redis") is not None and importlib.util.find_spec("tensordict.store") is not None


class StoreStorage(Storage):
    """A storage whose items live in a key-value server (Redis, Dragonfly, KeyDB, ...).

    Args:
        max_size: the capacity.

    Keyword Args:
        backend: the server kind, ``"redis"`` (default) or any Redis-wire-compatible name.
        host: the server's host (default ``"localhost"``).
        port: the server's port (default 6379).
        db: the database number (default 0).
        compilable: accepted for TorchRL compatibility.
        **store_kwargs: passed to :class:`tensordict.store.TensorDictStore`.

    Raises:
        ModuleNotFoundError: the ``redis`` package (or ``tensordict.store``) is missing.

    Examples:
        >>> storage = StoreStorage(max_size=1000, host="localhost", port=6379)
        >>> rb = ReplayBuffer(storage=storage, batch_size=32)
        >>> rb.extend(TensorDict({"obs": torch.randn(10, 4)}, [10]))
        >>> rb.sample()["obs"].shape
        torch.Size([32, 4])
    """

    def __init__(
        self,
        max_size: int,
        *,
        backend: str = "redis",
        host: str = "localhost",
        port: int = 6379,
        db: int = 0,
        compilable: bool = False,
        **store_kwargs: Any,
    ) -> None:
        if not _has_store():
            raise ModuleNotFoundError(
                "StoreStorage requires both the `redis` package and a version of tensordict that includes "
                "`tensordict.store`. Install redis with: pip install redis"
            )
        super().__init__(max_size, compilable=compilable)
        self._backend = backend
        self._host = host
        self._port = port
        self._db = db
        self._store_kwargs = store_kwargs
        self._storage: Any = None
        self._len = 0
        self._is_tensor = False
        self._tensorclass_type: type | None = None

    @property
    def initialized(self) -> bool:
        """Whether the server-side store exists (after the first write)."""
        return self._storage is not None

    def _connect(self, item: Any) -> None:
        """Creates the server-side store from one item's structure."""
        from tensordict.store import TensorDictStore

        where = {"backend": self._backend, "host": self._host, "port": self._port, "db": self._db}
        if isinstance(item, torch.Tensor):
            # A tensor is kept under one key of the store.
            template = TensorDict(
                {"_tensor": torch.empty(self.max_size, *item.shape, dtype=item.dtype)}, batch_size=[self.max_size]
            )
            self._storage = TensorDictStore.from_tensordict(template, **where, **self._store_kwargs)
            self._is_tensor = True
            return
        if not is_tensor_collection(item):
            raise UnsupportedDataError(
                f"StoreStorage does not support data of type {type(item)}. Use TensorDict, tensorclass, or torch.Tensor."
            )
        from tensordict import is_tensorclass

        self._tensorclass_type = type(item) if is_tensorclass(item) else None
        self._storage = TensorDictStore(batch_size=[self.max_size], **where, **self._store_kwargs)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes ``data`` at ``cursor`` (an int, a sequence or tensor of indices, or a slice).

        Raises:
            UnsupportedDataError: data that is neither a tensor nor a tensor collection.
        """
        if isinstance(data, list):
            data = torch.stack(data) if data and isinstance(data[0], torch.Tensor) else TensorDict.lazy_stack(data)
        if not isinstance(data, torch.Tensor) and not is_tensor_collection(data):
            raise UnsupportedDataError(f"StoreStorage does not support data of type {type(data)}.")
        single = is_int(cursor)
        if self._storage is None:
            self._connect(data if single else data[0])
        if isinstance(cursor, range):
            cursor = torch.as_tensor(list(cursor), dtype=torch.long)
        if isinstance(cursor, torch.Tensor) and cursor.ndim == 1 and cursor.numel() > 1:
            # A batch longer than the capacity wraps onto its own rows: the last write of a slot
            # wins, as in memory (the store's scatter of repeated keys does not order them).
            last = {int(slot): row for row, slot in enumerate(cursor.tolist())}
            if len(last) < cursor.numel():
                rows = torch.tensor(sorted(last.values()), dtype=torch.long)
                cursor, data = cursor[rows], data[rows]
        if self._is_tensor:
            # Written through the store's own indexing: ``store["_tensor"]`` is a copy read from the
            # server, so writing into it would be lost.
            batch = [] if single else [data.shape[0]]
            self._storage[cursor] = TensorDict({"_tensor": data}, batch_size=batch)
        else:
            self._storage[cursor] = data
        if set_cursor:
            count = 1 if single or not data.shape else data.shape[0]
            self._len = min(self._len + count, self.max_size)

    def get(self, index: Any) -> Any:
        """Reads the items at ``index`` from the server.

        Raises:
            EmptyBufferError: nothing was ever written (a RuntimeError, TorchRL's class).
        """
        if self._storage is None:
            raise EmptyBufferError("Cannot get elements out of a non-initialized storage.")
        if self._is_tensor:
            return self._storage[index].get("_tensor")
        result = self._storage[index]
        if self._tensorclass_type is not None:
            result = self._tensorclass_type.from_tensordict(result)
        return result

    def __len__(self) -> int:
        return self._len

    def _empty(self) -> None:
        self._len = 0

    def contains(self, item: Any) -> Any:
        if isinstance(item, int):
            if item < 0:
                item += self._len
            return 0 <= item < self._len
        if isinstance(item, torch.Tensor):
            if item.ndim:
                return torch.tensor([self.contains(int(i)) for i in item], dtype=torch.bool, device=item.device)
            return torch.tensor(self.contains(int(item)), device=item.device)
        raise NotImplementedError(f"type {type(item)} is not supported yet.")

    def state_dict(self) -> dict[str, Any]:
        """The server address and the store's id: loading attaches to the same server-side rows."""
        return {
            "initialized": self.initialized,
            "_len": self._len,
            "_backend": self._backend,
            "_host": self._host,
            "_port": self._port,
            "_db": self._db,
            "_td_id": None if self._storage is None else self._storage._td_id,
            "_is_tensor": self._is_tensor,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        td_id = state_dict.get("_td_id")
        self._len = int(state_dict["_len"])
        self._is_tensor = bool(state_dict.get("_is_tensor", False))
        if td_id is not None and state_dict["initialized"]:
            from tensordict.store import TensorDictStore

            self._storage = TensorDictStore.from_store(
                backend=state_dict["_backend"],
                host=state_dict["_host"],
                port=state_dict["_port"],
                db=state_dict["_db"],
                td_id=td_id,
            )

    def __repr__(self) -> str:
        data = "<empty>" if self._storage is None else f"TensorDictStore(td_id={self._storage._td_id!r})"
        return (
            f"{type(self).__name__}(data={data}, len={len(self)}, max_size={self.max_size}, backend={self._backend!r}, "
            f"host={self._host!r}, port={self._port})"
        )


__all__ = ["StoreStorage"]
