"""``CompressedTensorStorage``: a tensor storage whose large leaves are kept compressed on its device.

Chosen leaves (by default every leaf of at least ``min_row_bytes`` bytes per item, such as image
observations) are stored row by row, each row compressed on its own, in one flat ``uint8`` arena
on the storage's device with a small row table; sampling decodes only the sampled rows. The codec
depends on the device:

- on the host, zstd (level 3, :mod:`gpubuf.ops.zstd_rows`): on real Atari frames it stores rows in
  about half the bytes of the row codec;
- on CUDA (and with ``backend="triton"``), the row codec of :mod:`gpubuf.codec.format` (lines of
  run-length codes, copies of the line above and, for stacked planes, copies of or residuals
  against the first plane), encoded on the GPU and decoded by the Triton kernels in the op that
  gathers the sampled rows.

A state saved with one codec and loaded into a storage using the other is re-encoded on load.
Every read verifies each row (length, structure and checksum) and raises
:class:`~gpubuf.codec.errors.CorruptRowError` naming the row rather than return a corrupt one.

Other leaves are kept as plain preallocated tensors, exactly as in
:class:`~gpubuf.storages.tensor.LazyTensorStorage`. Compression is lossless for every dtype.
"""

from __future__ import annotations

from typing import Any, Collection, Sequence

import numpy as np
import torch

from gpubuf.ops.encode_rows import EncodedBatch, encode_planes
from gpubuf.codec.format import RowGeometry
from gpubuf.storages._row_store import RowStore
from gpubuf.errors import (
    DeviceMismatchError,
    EmptyBufferError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    SchemaMismatchError,
    StateDictError,
)
from gpubuf.ops.decode_rows import RowTable, decode_rows
from gpubuf.ops.zstd_rows import zstd_decode_rows, zstd_encode_rows
from gpubuf.storages._layout import Layout
from gpubuf.storages.base import Storage, check_max_size
from gpubuf.storages.items import as_device, is_int, leading_size, stack_items
from gpubuf.storages.checks import check_state_keys

__all__ = ["CompressedTensorStorage", "EncodedStorageBase"]

_ENCODE_CHUNK_BYTES = 1 << 22  # input bytes per encode call, to bound temporaries


def keys_argument(keys: Any, what: str) -> list:
    """``keys`` (a list or tuple of keys, each a str or a tuple of str) as a list.

    Raises:
        InvalidArgumentError: anything else (a ``ValueError``).
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)) or not all(
        isinstance(k, str) or (isinstance(k, tuple) and all(isinstance(part, str) for part in k)) for k in keys
    ):
        raise InvalidArgumentError(f"{what} must be a list of keys (each a str or a tuple of str), got {keys!r}")
    return list(keys)


def _norm_key(key: Any) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def encode_rows(rows: torch.Tensor, geometry: RowGeometry, **kwargs):
    """Encodes ``[n, *shape]`` rows in chunks of a few MiB; returns one :class:`EncodedBatch`."""
    n = rows.shape[0]
    chunk = max(1, _ENCODE_CHUNK_BYTES // max(geometry.raw_bytes, 1))
    if n <= chunk:
        return encode_planes(geometry.to_planes(rows), geometry, **kwargs)
    parts = []
    for first in range(0, n, chunk):
        part = {k: (v[first : first + chunk] if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        parts.append(encode_planes(geometry.to_planes(rows[first : first + chunk]), geometry, **part))
    lengths = torch.cat([p.lengths for p in parts])
    return EncodedBatch(
        torch.cat([p.data for p in parts]),
        torch.cumsum(lengths, 0) - lengths,
        lengths,
        torch.cat([p.checksums for p in parts]),
    )


def store_state(store: RowStore) -> dict[str, torch.Tensor]:
    """Copies of a :class:`RowStore`'s used arena and row table."""
    state = {
        "arena": store.arena[: store.used].clone(),
        "offsets": store.offsets.clone(),
        "lengths": store.lengths.clone(),
        "checksums": store.checksums.clone(),
    }
    if store.refs is not None:
        state["refs"] = store.refs.clone()
    return state


def load_store_state(store: RowStore, saved: dict[str, torch.Tensor]) -> None:
    """Restores :func:`store_state` into ``store`` (on the store's device).

    Raises:
        StateDictError: tables of another row count or dtype than the store's, or row extents
            past the arena; the store is unchanged then.
    """
    device = store.device
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), torch.Tensor) for k in ("arena", "offsets", "lengths", "checksums")):
        raise StateDictError("encoded rows state: expected the tensors arena, offsets, lengths and checksums")
    tables = [("offsets", store.offsets), ("lengths", store.lengths), ("checksums", store.checksums)]
    if store.refs is not None:
        if not isinstance(saved.get("refs"), torch.Tensor):
            raise StateDictError("encoded rows state: missing the refs tensor")
        tables.append(("refs", store.refs))
    for name, own in tables:
        if saved[name].shape != own.shape or saved[name].dtype != own.dtype:
            raise StateDictError(
                f"encoded rows state: {name} is {saved[name].dtype}{list(saved[name].shape)}, expected "
                f"{own.dtype}{list(own.shape)} (the state of a storage of another capacity or layout)"
            )
    arena = saved["arena"]
    if arena.dtype != torch.uint8 or arena.ndim != 1:
        raise StateDictError(f"encoded rows state: the arena must be a 1-D uint8 tensor, got {arena.dtype}{list(arena.shape)}")
    ends = saved["offsets"].to(torch.int64) + saved["lengths"].to(torch.int64)
    if ends.numel() and (bool((saved["offsets"] < 0).any()) or bool((saved["lengths"] < 0).any()) or int(ends.max()) > arena.numel()):
        raise StateDictError("encoded rows state: row extents lie outside the arena")
    store.arena = saved["arena"].to(device).clone()
    store.used = store.arena.numel()
    store.offsets = saved["offsets"].to(device).clone()
    store.lengths = saved["lengths"].to(device).clone()
    store.checksums = saved["checksums"].to(device).clone()
    if "refs" in saved:
        store.refs = saved["refs"].to(device).clone()


class EncodedStorageBase(Storage):
    """Shared machinery of the storages that keep some leaves encoded (one item per row, ``ndim=1``).

    Subclasses choose the encoded leaves (:meth:`_choose`), write them (:meth:`_write_encoded`)
    and decode them (:meth:`_read_encoded`); this class handles the layout, plain leaves,
    cursors, validation (everything is checked before anything is written) and reads.
    """

    def __init__(self, max_size: int, *, device: Any = "cpu", verify: bool = True, compilable: bool = False) -> None:
        super().__init__(check_max_size(max_size), compilable=compilable)
        self._auto_device = device in ("auto", None)
        self.device = "auto" if self._auto_device else as_device(device)
        self.verify = bool(verify)
        self._layout: Layout | None = None
        self._plain: dict[int, torch.Tensor] = {}  # leaf position -> [max_size, *shape] tensor
        self._encoded: list[int] = []  # leaf positions kept encoded
        self._len = 0

    # ------------------------------------------------------------------ subclass hooks
    def _choose(self, layout: Layout) -> list[int]:
        raise NotImplementedError

    def _init_encoded(self, layout: Layout, device: torch.device) -> None:
        raise NotImplementedError

    def _write_encoded(self, ids: torch.Tensor, leaves: list[torch.Tensor], sequential: bool) -> None:
        """Writes rows ``ids`` (distinct, int64) of every encoded leaf; ``leaves[k]`` is ``[n, *shape]``."""
        raise NotImplementedError

    def _read_encoded(self, index: torch.Tensor) -> list[torch.Tensor]:
        """Decodes rows ``index`` of every encoded leaf, in ``self._encoded`` order."""
        raise NotImplementedError

    def _empty_encoded(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ bookkeeping
    @property
    def initialized(self) -> bool:
        return self._layout is not None

    def __len__(self) -> int:
        return self._len

    @property
    def shape(self) -> torch.Size | None:
        return torch.Size([self._len]) if self.initialized else None

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        return self.max_size

    def _flat_index(self, index: Any) -> torch.Tensor:
        return index[0] if isinstance(index, tuple) else index

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        device = self._device_now()
        return torch.randint(0, self._len, (batch_size,), generator=self._rng, device=device)

    def _device_now(self) -> torch.device | None:
        return None if self.device == "auto" else self.device

    # ------------------------------------------------------------------ writing
    def _prepare(self, data: Any, n: int | None) -> tuple[Layout, list[torch.Tensor], bool]:
        """Validates ``data`` (a batch of ``n`` items, or one item when ``n`` is None) and returns its leaves.

        Leaves come back with a leading dim of ``n`` (1 for a single item) on the storage's
        device. Nothing is modified.
        """
        needs_init = self._layout is None
        lead = [] if n is None else [n]
        layout = Layout.from_batch(data, leading=len(lead)) if needs_init else self._layout
        fixed = self.device if (not needs_init and self._auto_device) else None
        leaves = layout.split(data, leading=lead, device=fixed)
        device = leaves[0].device if (needs_init and self._auto_device) else self.device
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceMismatchError(f"this storage's device is {device} but CUDA is not available here")
        leaves = [leaf.to(device) if leaf.device != device else leaf for leaf in leaves]
        if n is None:
            leaves = [leaf.unsqueeze(0) for leaf in leaves]
        return layout, leaves, needs_init

    def _install(self, layout: Layout, device: torch.device) -> None:
        if self._auto_device:
            self.device = device
        encoded = self._choose(layout)
        self._encoded = encoded
        self._plain = {
            i: torch.empty((self.max_size, *spec.shape), dtype=spec.dtype, device=device)
            for i, spec in enumerate(layout.leaves)
            if i not in encoded
        }
        self._layout = layout
        self._init_encoded(layout, device)

    def _write(self, ids: torch.Tensor, leaves: list[torch.Tensor], sequential: bool) -> None:
        for i, store in self._plain.items():
            store.index_copy_(0, ids, leaves[i])
        if self._encoded:
            self._write_encoded(ids, [leaves[i] for i in self._encoded], sequential)

    def _write_rows(self, start: int, data: Any) -> int:
        """Round-robin write of a batch from row ``start`` on (the writers' path); returns its length."""
        if isinstance(data, list):
            data = stack_items(data)
        n = leading_size(data)
        layout, leaves, needs_init = self._prepare(data, n)
        if needs_init:
            self._install(layout, leaves[0].device)
        skip = max(n - self.max_size, 0)
        count = n - skip
        device = leaves[0].device
        ids = (torch.arange(count, device=device) + start + skip) % self.max_size
        self._write(ids, [leaf[skip:] for leaf in leaves], sequential=True)
        self._len = min(self._len + n, self.max_size)
        return n

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes ``data`` at ``cursor`` (an int for one item; a slice, sequence or 1-D tensor for a batch).

        When a batch names a row twice, the last item for it is kept.

        Raises:
            SchemaMismatchError, DTypeMismatchError, DeviceMismatchError, UnsupportedDataError:
                the data does not fit; nothing is written.
            IndexOutOfRangeError: a cursor outside ``[-max_size, max_size)``; nothing is written.
        """
        if isinstance(data, list):
            data = stack_items(data)
        if is_int(cursor):
            if not -self.max_size <= int(cursor) < self.max_size:
                raise IndexOutOfRangeError(f"cursor {int(cursor)} out of range for a storage of {self.max_size} rows")
            rows = torch.tensor([int(cursor)])
            n = None
        else:
            if isinstance(cursor, slice):
                rows = torch.arange(self.max_size)[cursor]
            elif isinstance(cursor, tuple):
                rows = torch.as_tensor(cursor[0]).reshape(-1)
            else:
                rows = torch.as_tensor(np.asarray(cursor) if not isinstance(cursor, torch.Tensor) else cursor.cpu())
                rows = rows.reshape(-1)
            n = rows.numel()
        rows = rows.to(torch.int64)
        if rows.numel() and (int(rows.min()) < -self.max_size or int(rows.max()) >= self.max_size):
            raise IndexOutOfRangeError(f"cursor out of range for a storage of {self.max_size} rows")
        rows = rows % self.max_size
        layout, leaves, needs_init = self._prepare(data, n)
        if n is not None and rows.numel() == 0:
            return
        if needs_init:
            self._install(layout, leaves[0].device)
        device = leaves[0].device
        # Keep the last item written to each row.
        order = torch.arange(rows.numel())
        last = torch.full((self.max_size,), -1, dtype=torch.int64).scatter_reduce_(0, rows, order, "amax")
        keep = (last[rows] == order).nonzero().squeeze(1)
        ids = rows[keep].to(device)
        keep_d = keep.to(device)
        self._write(ids, [leaf.index_select(0, keep_d) for leaf in leaves], sequential=False)
        if set_cursor:
            self._len = min(self._len + rows.numel(), self.max_size)

    # ------------------------------------------------------------------ reading
    def _check_readable(self) -> None:
        if self._layout is None or self._len == 0:
            raise EmptyBufferError("cannot read from an empty storage: write data to it first")

    def _gather(self, index: torch.Tensor, skip: Collection[int] = ()) -> list:
        """The sample path: ``index`` is a 1-D int64 tensor of in-range rows on the storage's device."""
        leaves: list = [None] * len(self._layout.leaves)
        for i, store in self._plain.items():
            if i not in skip:
                leaves[i] = store.index_select(0, index)
        if self._encoded:
            for i, value in zip(self._encoded, self._read_encoded(index)):
                leaves[i] = None if i in skip else value
        return leaves

    def get(self, index: Any) -> Any:
        """Reads items: an int gives one item; a slice, sequence or 1-D tensor gives a batch.

        Negative indices count from the end of the written range.

        Raises:
            EmptyBufferError: nothing was written yet.
            IndexOutOfRangeError: an index outside the written range.
            CorruptRowError: a stored row failed verification.
        """
        self._check_readable()
        n = self._len
        single = is_int(index)
        if single:
            rows = torch.tensor([int(index)])
        elif isinstance(index, slice):
            rows = torch.arange(n)[index]
        elif isinstance(index, tuple):
            if len(index) != 1:
                raise IndexOutOfRangeError(f"{type(self).__name__} has one dimension; got an index of {len(index)}")
            return self.get(index[0])
        else:
            rows = index if isinstance(index, torch.Tensor) else torch.as_tensor(np.asarray(index))
            if rows.dtype == torch.bool:
                rows = rows.nonzero().squeeze(1)
            rows = rows.reshape(-1)
        rows = rows.to(torch.int64)
        if rows.numel():
            lo, hi = int(rows.min()), int(rows.max())
            if lo < -n or hi >= n:
                bad = lo if lo < -n else hi
                raise IndexOutOfRangeError(f"index {bad} is out of range for a storage of length {n}")
        rows = torch.where(rows < 0, rows + n, rows).to(self.device)
        leaves = self._gather(rows)
        out = self._build(leaves, [rows.numel()])
        return out[0] if single else out

    # ------------------------------------------------------------------ state
    def _encoded_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_encoded_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The storage's content: plain leaves, and the encoded leaves' arenas (trimmed) and tables.

        The layout (keys, dtypes, shapes, container type) is kept as a Python object; the
        tensors are copies, so the state does not change when the storage does.
        """
        if self._layout is None:
            return {"_len": 0, "_layout": None}
        return {
            "_len": self._len,
            "_layout": self._layout,
            "_encoded": list(self._encoded),
            "plain": {i: t.clone() for i, t in self._plain.items()},
            "encoded": self._encoded_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned (onto this storage's device), all or nothing.

        The state is installed on fresh tensors and every stored row is then read back (decoded
        and verified); if anything does not fit, the storage keeps its previous content.

        Raises:
            StateDictKeyError: a key of :meth:`state_dict` is missing.
            StateDictError: a length that is not an int in ``[0, max_size]``, parts of the wrong
                type, plain leaves of another shape or dtype than the layout's, or rows that do
                not read back.
            SchemaMismatchError: the state encodes other leaves than this storage would.
        """
        check_state_keys(state_dict, ("_len", "_layout"), "encoded storage state")
        layout, length = state_dict["_layout"], state_dict["_len"]
        if not is_int(length) or not 0 <= int(length) <= self.max_size:
            raise StateDictError(f"encoded storage state: _len must be an int in [0, {self.max_size}], got {length!r}")
        length = int(length)
        if layout is None:
            if length:
                raise StateDictError(f"encoded storage state: _len is {length} but the state holds no layout (expected 0)")
            self._layout, self._plain, self._encoded, self._len = None, {}, [], 0
            return
        check_state_keys(state_dict, ("_encoded", "plain", "encoded"), "encoded storage state")
        plain = state_dict["plain"]
        if not isinstance(layout, Layout) or not isinstance(plain, dict) or not isinstance(state_dict["_encoded"], (list, tuple)):
            raise StateDictError("encoded storage state: _layout must be a Layout, plain a dict and _encoded a list")
        for i, t in plain.items():
            spec = layout.leaves[int(i)] if is_int(i) and 0 <= int(i) < len(layout.leaves) else None
            if spec is None or not isinstance(t, torch.Tensor) or t.dtype != spec.dtype or tuple(t.shape) != (
                self.max_size,
                *spec.shape,
            ):
                raise StateDictError(
                    f"encoded storage state: plain leaf {i!r} is not a tensor of the layout's dtype and shape [max_size="
                    f"{self.max_size}, ...]"
                )
        previous = dict(self.__dict__)
        try:
            device = self.device if not self._auto_device else (next(iter(plain.values())).device if plain else torch.device("cpu"))
            self._install(layout, torch.device(device))
            if list(self._encoded) != list(state_dict["_encoded"]):
                raise SchemaMismatchError(
                    f"the saved storage encodes leaves {state_dict['_encoded']}, this one would encode {self._encoded}"
                )
            for i, t in plain.items():
                self._plain[int(i)].copy_(t)
            self._load_encoded_state(state_dict["encoded"])
            self._len = length
            if length:  # every stored row decodes and verifies
                self._gather(torch.arange(length, device=self.device))
        except Exception as err:  # noqa: BLE001 - the previous content comes back whatever failed
            self.__dict__.clear()
            self.__dict__.update(previous)
            if isinstance(err, SchemaMismatchError):
                raise
            raise StateDictError(f"encoded storage state does not fit: {type(err).__name__}: {err}") from None

    # ------------------------------------------------------------------ misc
    def _empty(self) -> None:
        self._len = 0
        if self._layout is not None:
            self._empty_encoded()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_size={self.max_size}, len={len(self)}, device={self.device}, layout={self._layout})"


class CompressedTensorStorage(EncodedStorageBase):
    """A lazily allocated tensor storage whose large leaves are stored compressed, row by row.

    Same interface as :class:`~gpubuf.storages.tensor.LazyTensorStorage` (``ndim=1``): store
    tensors, TensorDicts (nested keys), tensorclasses or pytrees of tensors; sample through a
    :class:`~gpubuf.buffers.ReplayBuffer`. Compressed leaves decode bit for bit (every dtype,
    any item shape, including empty ones). See :mod:`gpubuf.codec.format` for the row format.

    Args:
        max_size: capacity in items.

    Keyword Args:
        device: where data, compressed rows and sampled batches live: ``"cpu"`` (default,
            zstd rows), ``"cuda"`` (row codec), a ``torch.device``, or ``"auto"``/``None`` for
            the first batch's device. Encoding runs there (on the GPU for a CUDA storage); so
            does decoding.
        compress_keys: leaves to compress (keys of a TensorDict/tensorclass, e.g.
            ``["observation", ("next", "observation")]``; ``()`` for a plain tensor). By default
            every leaf of at least ``min_row_bytes`` bytes per item.
        min_row_bytes: the default's threshold (1024).
        verify: verify the checksum of every row read (length and structure are always checked;
            zstd rows always check their checksum).
        compilable: accepted for TorchRL compatibility.

    Examples:
        >>> storage = CompressedTensorStorage(100_000, device="cuda")
        >>> rb = ReplayBuffer(storage=storage, batch_size=256)
        >>> rb.extend(TensorDict(observation=frames_u8, action=actions, batch_size=[n]))
        >>> storage.stats()["ratio"]  # raw bytes / stored bytes of the compressed leaves
    """

    def __init__(
        self,
        max_size: int,
        *,
        device: Any = "cpu",
        compress_keys: Sequence[Any] | None = None,
        min_row_bytes: int = 1024,
        verify: bool = True,
        compilable: bool = False,
    ) -> None:
        if isinstance(min_row_bytes, bool) or not is_int(min_row_bytes) or int(min_row_bytes) < 0:
            raise InvalidArgumentError(f"min_row_bytes must be an int >= 0, got {min_row_bytes!r}")
        super().__init__(max_size, device=device, verify=verify, compilable=compilable)
        self.compress_keys = None if compress_keys is None else [_norm_key(k) for k in keys_argument(compress_keys, "compress_keys")]
        self.min_row_bytes = int(min_row_bytes)
        self._stores: list[RowStore] = []
        self._codec = "zstd"  # or "rows" (the row codec); fixed when the stores are made

    def _choose(self, layout: Layout) -> list[int]:
        if self.compress_keys is None:
            return [i for i, spec in enumerate(layout.leaves) if spec.row_bytes >= self.min_row_bytes]
        chosen = []
        for key in self.compress_keys:
            pos = layout.index_of(key)
            if pos is None:
                raise SchemaMismatchError(f"compress_keys names {key!r}, which the data does not have")
            chosen.append(pos)
        return sorted(chosen)

    def _init_encoded(self, layout: Layout, device: torch.device) -> None:
        self._codec = "zstd" if device.type == "cpu" and self._backend != "triton" else "rows"
        self._stores = [
            RowStore(RowGeometry.of(layout.leaves[i].dtype, layout.leaves[i].shape), self.max_size, device)
            for i in self._encoded
        ]

    def _live(self) -> torch.Tensor:
        # Every slot written so far may be read; unwritten slots have length 0 and cost nothing.
        return self._stores[0].lengths > 0 if self._stores else torch.zeros(0, dtype=torch.bool)

    def _write_encoded(self, ids: torch.Tensor, leaves: list[torch.Tensor], sequential: bool) -> None:
        for store, leaf in zip(self._stores, leaves):
            self._write_encoded_store(store, ids, leaf)

    def _write_encoded_store(self, store: RowStore, ids: torch.Tensor, leaf: torch.Tensor) -> None:
        encoded = zstd_encode_rows(leaf) if self._codec == "zstd" else encode_rows(leaf, store.geometry)
        store.write(ids, encoded, lambda: store.lengths > 0)

    def _read_encoded(self, index: torch.Tensor) -> list[torch.Tensor]:
        return [self._decode(store, index, self._codec) for store in self._stores]

    def _decode(self, store: RowStore, index: torch.Tensor, codec: str) -> torch.Tensor:
        if codec == "zstd":
            table = store.table()
            if table.device.type != "cpu":  # zstd rows saved on the host, loaded on a GPU
                table = RowTable(*(t.cpu() for t in (table.arena, table.offsets, table.lengths, table.checksums)), None, table.geometry)
            return zstd_decode_rows(table, index.cpu()).to(index.device)
        return decode_rows(store.table(), index, verify=self.verify, check_bounds=False, backend=self._backend)

    def _empty_encoded(self) -> None:
        for store in self._stores:
            store.empty()

    # ------------------------------------------------------------------ sizes
    def stats(self) -> dict[str, Any]:
        """Sizes of the compressed leaves over the rows currently held.

        Returns:
            ``rows``; ``raw_bytes`` (what the compressed leaves would take uncompressed);
            ``stored_bytes`` (their row bytes plus the row table, 16 bytes per row: offset,
            length, checksum); ``arena_bytes`` (memory allocated for row bytes, garbage and
            headroom included); ``ratio`` = raw / stored; ``per_key``: the same per leaf.
        """
        per_key = {}
        total_raw = total_stored = total_arena = 0
        for pos, store in zip(self._encoded, self._stores):
            live = store.lengths > 0
            rows = int(live.sum())
            raw = rows * store.geometry.raw_bytes
            stored = store.live_bytes(live) + rows * 16
            per_key[self._layout.leaves[pos].key] = {"rows": rows, "raw_bytes": raw, "stored_bytes": stored}
            total_raw += raw
            total_stored += stored
            total_arena += store.arena.numel()
        return {
            "rows": self._len,
            "raw_bytes": total_raw,
            "stored_bytes": total_stored,
            "arena_bytes": total_arena,
            "ratio": total_raw / total_stored if total_stored else float("nan"),
            "per_key": per_key,
        }

    def bytes(self) -> int:
        """Stored bytes of the compressed leaves (as ``CompressedListStorage.bytes()`` reports)."""
        return self.stats()["stored_bytes"]

    # ------------------------------------------------------------------ state
    def _encoded_state(self) -> dict[str, Any]:
        return {"codec": self._codec, "stores": [store_state(s) for s in self._stores]}

    def _load_encoded_state(self, state: dict[str, Any]) -> None:
        saved_codec = state.get("codec", "rows")
        for store, saved in zip(self._stores, state["stores"]):
            load_store_state(store, saved)
            if saved_codec != self._codec:  # saved by a storage on another device: re-encoded here
                ids = (store.lengths > 0).nonzero().squeeze(1)
                rows = self._decode(store, ids, saved_codec)
                store.empty()
                if ids.numel():
                    self._write_encoded_store(store, ids, rows)
