"""``FrameStackStorage``: stacked observations stored once per frame, compressed, decoded on sampling.

Atari-style pipelines store ``obs[t] = frames[t-3 .. t]`` and ``next_obs[t] = obs[t+1]``: every
frame appears up to eight times. This storage keeps each distinct frame once, compressed (see
:mod:`gpubuf.codec.format`), and each stacked row as references to its frames; sampling decodes
the referenced frames straight into the stacked output in one fused op.

**Which frames are shared** is decided by comparing bytes (:func:`gpubuf.ops.match_frames.match_frames`):
a slot of a new row reuses a stored frame only when its bytes are identical to it, so the result
is exact whatever the episode structure (episode starts that repeat their first frame, resets,
truncations) and whatever the data. Candidates are the previous row (the last one written before,
for the first row of a batch) and the row itself; rows written in another order (for example
interleaved environments) are stored correctly but share fewer frames.

**Key frames.** A new frame is coded against a recent *key frame* of the same stream (its
predecessor's key, found through the frame before it in its stack), which makes most of its
lines free copies or small residuals; every ``key_interval``-th frame of a stream is a key,
coded on its own. A key frame is kept as long as a stored frame refers to it.

Non-stacked leaves (actions, rewards, flags) are plain tensors as in
:class:`~gpubuf.storages.tensor.LazyTensorStorage`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from gpubuf.ops.encode_rows import encode_planes_at
from gpubuf.codec.format import RowGeometry
from gpubuf.ops.match_frames import match_frames
from gpubuf.storages._row_store import RowStore
from gpubuf.errors import InvalidArgumentError, SchemaMismatchError, StateDictError
from gpubuf.ops._dispatch import kernel_module, resolve
from gpubuf.ops.decode_rows import decode_rows, empty_output
from gpubuf.storages._layout import Layout
from gpubuf.storages.items import is_int
from gpubuf.storages.codec_storage import EncodedStorageBase, _norm_key, encode_rows, keys_argument, load_store_state, store_state

__all__ = ["FrameStackStorage"]


def _gather_frames(stacks: list[torch.Tensor], slots: torch.Tensor, J: int, S: int, FB: int) -> torch.Tensor:
    """Bytes ``[m, FB]`` of the batch frame slots ``slots`` (ascending, past the tail row), in their order.

    Leaf by leaf into one buffer grouped by leaf, then one reordering gather: two row copies
    through ``index_select``, where assigning rows through an index (``out[sel] = ...``) costs
    about ten times more on the CPU.
    """
    n = stacks[0].shape[0]
    m = slots.numel()
    device = slots.device
    row = slots // (J * S) - 1
    leaf = (slots // S) % J
    frame = row * S + slots % S
    if J == 1:
        return stacks[0].view(n * S, FB).index_select(0, frame)
    order = torch.argsort(leaf, stable=True)
    counts = torch.bincount(leaf, minlength=J).tolist()
    grouped = torch.empty(m, FB, dtype=torch.uint8, device=device)
    at = 0
    for j, count in enumerate(counts):
        if count:
            sel = order[at : at + count]
            torch.index_select(stacks[j].view(n * S, FB), 0, frame.index_select(0, sel), out=grouped[at : at + count])
            at += count
    place = torch.empty_like(order)
    place[order] = torch.arange(m, device=device)
    return grouped.index_select(0, place)


def _base_of(key: tuple, keys: list[tuple]) -> int | None:
    """Position in ``keys`` of the base leaf of a next leaf: ``("next", *k)`` or ``"next_<name>"``."""
    if len(key) > 1 and key[0] == "next" and key[1:] in keys:
        return keys.index(key[1:])
    if len(key) == 1 and isinstance(key[0], str) and key[0].startswith("next_") and (key[0][5:],) in keys:
        return keys.index((key[0][5:],))
    return None


class FrameStackStorage(EncodedStorageBase):
    """A storage of stacked observations that stores each frame once, compressed.

    Same interface as :class:`~gpubuf.storages.tensor.LazyTensorStorage` (``ndim=1``). Sampled
    batches equal, bit for bit, what a plain storage of the same rows returns.

    Args:
        max_size: capacity in items (transitions).

    Keyword Args:
        stack_keys: the stacked leaves, each of item shape ``[S, *frame_shape]`` (the stack is the
            first item dim, as TorchRL's ``CatFrames(dim=-3)`` gives ``[4, 84, 84]``). A next leaf,
            ``("next", *key)`` or ``"next_<name>"``, whose base leaf is also stacked is matched
            against it. By default every
            leaf whose items have at least 3 dims. All stacked leaves share dtype, ``S`` and
            frame shape.
        key_interval: a stream's frames are coded against a key frame; every
            ``key_interval``-th frame is a key (1 codes every frame on its own).
        device: ``"cpu"`` (default), ``"cuda"``, a ``torch.device``, or ``"auto"``/``None``.
            Matching, encoding and decoding run there.
        verify: verify the checksum of every frame read (length and structure are always checked).
        compilable: accepted for TorchRL compatibility.

    Raises:
        SchemaMismatchError: on the first write, when no leaf is stacked or the stacked leaves
            differ in dtype, stack size or frame shape.
    """

    def __init__(
        self,
        max_size: int,
        *,
        stack_keys: Sequence[Any] | None = None,
        key_interval: int = 4,
        device: Any = "cpu",
        verify: bool = True,
        compilable: bool = False,
    ) -> None:
        super().__init__(max_size, device=device, verify=verify, compilable=compilable)
        if isinstance(key_interval, bool) or not isinstance(key_interval, int) or key_interval < 1:
            raise InvalidArgumentError(f"key_interval must be a positive int, got {key_interval!r}")
        self.stack_keys = None if stack_keys is None else [_norm_key(k) for k in keys_argument(stack_keys, "stack_keys")]
        self.key_interval = key_interval
        self._tail: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (slot, frame ids [J, S], bytes [J, S, FB])
        self._scratch: list[torch.Tensor] | None = None  # reused copies of the batch for matching
        self._encode_out: torch.Tensor | None = None  # reused output of the compiled encoder (fresh pages fault)

    # ------------------------------------------------------------------ layout
    def _choose(self, layout: Layout) -> list[int]:
        if self.stack_keys is None:
            chosen = [i for i, spec in enumerate(layout.leaves) if len(spec.shape) >= 3]
        else:
            chosen = []
            for key in self.stack_keys:
                pos = layout.index_of(key)
                if pos is None:
                    raise SchemaMismatchError(f"stack_keys names {key!r}, which the data does not have")
                chosen.append(pos)
            chosen.sort()
        if not chosen:
            raise SchemaMismatchError("no stacked leaf: give stack_keys, or leaves of item shape [S, H, W]")
        specs = [layout.leaves[i] for i in chosen]
        first = specs[0]
        if len(first.shape) < 1:
            raise SchemaMismatchError(f"stacked leaf {first.key!r} has no stack dim")
        for spec in specs[1:]:
            if spec.dtype != first.dtype or spec.shape != first.shape:
                raise SchemaMismatchError(
                    f"stacked leaves must share dtype and shape: {first.key!r} is {first.dtype}{list(first.shape)}, "
                    f"{spec.key!r} is {spec.dtype}{list(spec.shape)}"
                )
        return chosen

    def _init_encoded(self, layout: Layout, device: torch.device) -> None:
        specs = [layout.leaves[i] for i in self._encoded]
        keys = [spec.key for spec in specs]
        self._pairs = [_base_of(key, keys) for key in keys]
        self._stack = specs[0].shape[0]
        self._frame_geometry = RowGeometry.of(specs[0].dtype, specs[0].shape[1:])
        self._frame_bytes = self._frame_geometry.raw_bytes
        J, S = len(specs), self._stack
        capacity = self.max_size * 2 + 1024
        self._frames = RowStore(self._frame_geometry, capacity, device, with_refs=True)
        self._age = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._n_frames = 0
        # Frame numbers of every stacked slot of every row (-1: not written), int32 to keep
        # references at 4 bytes each.
        self._refs = torch.full((J, self.max_size, S), -1, dtype=torch.int32, device=device)
        self._tail = None

    # ------------------------------------------------------------------ liveness and renumbering
    def _live_frames(self, extra: torch.Tensor | None = None) -> torch.Tensor:
        """bool ``[frame slots]``: frames referenced by a stored row, the tail or ``extra``, and their keys."""
        # index_fill_ / masked_select rather than indexing with tensors: see RowStore.write.
        live = torch.zeros(self._frames.rows, dtype=torch.bool, device=self._refs.device)
        ids = self._refs.view(-1)
        live.index_fill_(0, ids.masked_select(ids >= 0).to(torch.int64), True)
        if self._tail is not None:
            live.index_fill_(0, self._tail[1].view(-1).to(torch.int64), True)
        if extra is not None and extra.numel():
            live.index_fill_(0, extra, True)
        key_of_live = self._frames.refs.masked_select(live).to(torch.int64)
        live.index_fill_(0, key_of_live.masked_select(key_of_live >= 0), True)
        return live

    def _compact_frames(self, room: int) -> None:
        """Renumbers live frames to ``0..k-1`` and makes room for ``room`` more frame slots."""
        kept = self._live_frames().nonzero().squeeze(1)
        k = kept.numel()
        capacity = self._frames.rows
        if 2 * (k + room) > capacity:
            capacity = 2 * (k + room)
        device = self._refs.device
        new_of_old = torch.full((self._frames.rows,), -1, dtype=torch.int64, device=device)
        new_of_old.index_copy_(0, kept, torch.arange(k, device=device))
        self._frames.keep_rows(kept, capacity)
        age = torch.zeros(capacity, dtype=torch.int32, device=device)
        age[:k] = self._age.index_select(0, kept)
        self._age = age
        renumbered = new_of_old.index_select(0, self._refs.clamp_min(0).view(-1).to(torch.int64)).view(self._refs.shape)
        self._refs = torch.where(self._refs >= 0, renumbered, -1).to(torch.int32)
        if self._tail is not None:
            slot, ids, frames = self._tail
            self._tail = (slot, new_of_old.index_select(0, ids.view(-1).to(torch.int64)).view(ids.shape).to(torch.int32), frames)
        self._n_frames = k

    # ------------------------------------------------------------------ writing
    def _write_encoded(self, ids: torch.Tensor, leaves: list[torch.Tensor], sequential: bool) -> None:
        n = ids.numel()
        J, S, FB = len(leaves), self._stack, self._frame_bytes
        stacks = [leaf.contiguous().view(torch.uint8).reshape(n, S, FB) for leaf in leaves]
        tail = self._tail
        if tail is not None and not torch.equal(self._refs[:, tail[0]], tail[1]):
            tail = None  # its row was rewritten since: its frames may be gone
        if self._n_frames + n * J * S > self._frames.rows:
            self._tail = tail
            self._compact_frames(n * J * S)
            tail = self._tail

        tail_frames = None if tail is None else [tail[2][j] for j in range(J)]
        if resolve("match_frames", stacks[0], "auto") == "numba" and self._frame_geometry.itemsize == 1:
            fid = self._write_compiled(stacks, tail_frames, None if tail is None else tail[1])
        else:
            fid = self._write_steps(stacks, tail_frames, None if tail is None else tail[1])
        self._refs.index_copy_(1, ids, fid.view(n + 1, J, S)[1:].permute(1, 0, 2).to(torch.int32))
        last = n - 1
        # torch.stack copies: the tail outlives the caller's batch.
        self._tail = (int(ids[last]), fid.view(n + 1, J, S)[n].to(torch.int32), torch.stack([x[last] for x in stacks]))

    def _write_compiled(self, stacks: list[torch.Tensor], tail_frames, tail_ids) -> torch.Tensor:
        """Matches, numbers, keys and encodes the batch's new frames with the compiled kernels; returns the slots' frame numbers.

        The new frames and their keys are read inside the batch where they lie (no gathering
        copy), and only the few key frames of earlier batches are decoded.

        Args:
            stacks: uint8 ``[n, S, FB]`` per stacked leaf (contiguous).
            tail_frames: the tail row's frames per leaf, or None.
            tail_ids: int32 ``[J, S]``, the tail row's frame numbers, or None.

        Returns:
            int64 ``[(n + 1) * J * S]``, the frame number of every slot (see :func:`match_frames`).
        """
        J, S, FB = len(stacks), self._stack, self._frame_bytes
        roots = match_frames(stacks, self._pairs, tail_frames, backend="numba")
        first_id = self._n_frames
        has_tail = tail_ids is not None
        tail_ids = tail_ids.contiguous() if has_tail else torch.full((J, S), -1, dtype=torch.int32)
        fid, src, off, keys, ages, key_src, key_off, stored = kernel_module("cpu.framestack").plan_frames(
            roots.numpy(), tail_ids.view(-1).numpy(), has_tail, J, S, FB, first_id,
            self._age.numpy(), self._frames.refs.numpy(), self.key_interval,
        )
        fid = torch.from_numpy(fid)
        m = keys.shape[0]
        if m == 0:
            return fid
        sources = [x.view(-1) for x in stacks]
        # Keys written by earlier batches (a few, at the batch start): decoded, after the batch's
        # frames. The source is there even when empty: the compiled encoder is specialised on
        # the number of sources, and a second compile in the middle of a fill costs seconds.
        decoded = decode_rows(self._frames.table(), torch.from_numpy(stored), verify=self.verify, check_bounds=False)
        sources.append(decoded.contiguous().view(torch.uint8).view(-1))
        keys = torch.from_numpy(keys)
        refs = keys.to(torch.int32)
        if self._encode_out is None or self._encode_out.numel() < m * FB:
            self._encode_out = torch.empty(m * FB, dtype=torch.uint8)
        encoded = encode_planes_at(
            sources, torch.from_numpy(src), torch.from_numpy(off), torch.from_numpy(key_src), torch.from_numpy(key_off),
            keys >= 0, refs, self._frame_geometry, inrow=False, out=self._encode_out, backend="numba",
        )
        new_ids = torch.arange(first_id, first_id + m)
        self._frames.write(new_ids, encoded, lambda: self._live_frames(fid.masked_select(fid >= 0)), refs=refs)
        self._age[first_id : first_id + m] = torch.from_numpy(ages)
        self._n_frames = first_id + m
        return fid

    def _write_steps(self, stacks: list[torch.Tensor], tail_frames, tail_ids) -> torch.Tensor:
        """:meth:`_write_compiled` as torch steps (any device, any dtype; the specification)."""
        n = stacks[0].shape[0]
        J, S, FB = len(stacks), self._stack, self._frame_bytes
        device = stacks[0].device
        # The compiled matcher reads the frames in place; only the torch steps need the scratch copy.
        backend = "numba" if resolve("match_frames", stacks[0], "auto") == "numba" else "torch"
        buffers = None
        if backend == "torch":
            need = (n + 1) * S * FB
            if self._scratch is None or self._scratch[0].numel() < need or self._scratch[0].device != device:
                self._scratch = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(J)]
            buffers = self._scratch
        roots = match_frames(stacks, self._pairs, tail_frames, buffers=buffers, backend=backend)
        slots = (n + 1) * J * S
        slot_ids = torch.arange(slots, device=device)
        is_new = (roots == slot_ids) & (slot_ids >= J * S)
        new_slots = is_new.nonzero().squeeze(1)
        m = new_slots.numel()
        first_id = self._n_frames
        fid = torch.full((slots,), -1, dtype=torch.int64, device=device)
        if tail_ids is not None:
            fid[: J * S] = tail_ids.view(-1).to(torch.int64)
        fid[new_slots] = first_id + torch.arange(m, device=device)
        fid = fid.index_select(0, roots)

        if m:
            new_bytes = _gather_frames(stacks, new_slots, J, S, FB)
            keys, ages = self._assign_keys(fid, new_slots, first_id, m)
            self._encode_new(new_bytes, keys, first_id, m, fid)
            self._age[first_id : first_id + m] = ages
            self._n_frames = first_id + m
        return fid

    def _assign_keys(self, fid: torch.Tensor, new_slots: torch.Tensor, first_id: int, m: int):
        """Key frame and age of each new frame (a short host loop over the new frames of the batch)."""
        S = self._stack
        device = fid.device
        k = new_slots % S
        pred_slot = torch.where(k > 0, new_slots - 1, new_slots)
        pred = torch.where(k > 0, fid.index_select(0, pred_slot), -1)
        own = first_id + torch.arange(m, device=device)
        pred = torch.where(pred == own, -1, pred)
        stored = pred[(pred >= 0) & (pred < first_id)].unique()
        stored_age = dict(zip(stored.tolist(), self._age.index_select(0, stored).tolist()))
        stored_key = dict(zip(stored.tolist(), self._frames.refs.index_select(0, stored).tolist()))
        interval = self.key_interval
        keys, ages = [], []
        for i, p in enumerate(pred.tolist()):
            if p < 0 or p >= first_id + i:
                keys.append(-1)
                ages.append(0)
                continue
            if p >= first_id:
                age, key = ages[p - first_id], keys[p - first_id]
            else:
                age, key = stored_age[p], stored_key[p]
            age += 1
            if age >= interval:
                keys.append(-1)
                ages.append(0)
            else:
                keys.append(p if key < 0 else key)
                ages.append(age)
        return torch.tensor(keys, dtype=torch.int64, device=device), torch.tensor(ages, dtype=torch.int32, device=device)

    def _encode_new(self, new_bytes: torch.Tensor, keys: torch.Tensor, first_id: int, m: int, fid: torch.Tensor) -> None:
        g = self._frame_geometry
        device = new_bytes.device
        has_key = keys >= 0
        # Each frame's key frame, gathered in one index_select (a row copy; assigning rows through
        # an index costs ten times more on the CPU). A key in this batch is one of its new
        # frames; rows without a key take their own frame, which the encoder never reads.
        own = torch.arange(m, device=device)
        in_batch = keys >= first_id
        key_bytes = new_bytes.index_select(0, torch.where(in_batch, keys - first_id, own))
        stored = has_key & ~in_batch
        if bool(stored.any()):
            # Keys written by earlier batches (a few, at the batch start): decoded.
            s_sel = stored.nonzero().squeeze(1)
            decoded = decode_rows(self._frames.table(), keys.index_select(0, s_sel), verify=self.verify, check_bounds=False)
            key_bytes.index_copy_(0, s_sel, decoded.contiguous().view(torch.uint8).view(-1, self._frame_bytes))
        frames = new_bytes.view(g.dtype).view(m, *g.shape)
        key_planes = g.to_planes(key_bytes.view(g.dtype).view(m, *g.shape))
        encoded = encode_rows(
            frames, g, key_planes=key_planes, has_key=has_key, ref_rows=keys.to(torch.int32), intra=False, inrow=False
        )
        new_ids = first_id + torch.arange(m, device=device)
        self._frames.write(new_ids, encoded, lambda: self._live_frames(fid[fid >= 0]), refs=keys.to(torch.int32))

    # ------------------------------------------------------------------ reading
    def _read_encoded(self, index: torch.Tensor) -> list[torch.Tensor]:
        J, S = self._refs.shape[0], self._stack
        B = index.numel()
        ids = self._refs.index_select(1, index).reshape(-1)  # [J * B * S]
        g = self._frame_geometry
        out = empty_output(J * B * S, g, index.device)
        decode_rows(self._frames.table(), ids, out, verify=self.verify, check_bounds=False, backend=self._backend)
        out = out.view(J, B, S, *g.shape)
        return [out[j] for j in range(J)]

    def _empty_encoded(self) -> None:
        self._refs.fill_(-1)
        self._frames.empty()
        self._n_frames = 0
        self._tail = None

    # ------------------------------------------------------------------ state
    def _encoded_state(self) -> dict[str, Any]:
        return {
            "frames": store_state(self._frames),
            "age": self._age[: self._n_frames].clone(),
            "n_frames": self._n_frames,
            "refs": self._refs.clone(),
        }

    def _load_encoded_state(self, state: dict[str, Any]) -> None:
        n, refs, age = state["n_frames"], state["refs"], state["age"]
        if not is_int(n) or not 0 <= int(n) <= self._frames.rows:
            raise StateDictError(f"frame state: n_frames must be an int in [0, {self._frames.rows}], got {n!r}")
        if not isinstance(refs, torch.Tensor) or refs.shape != self._refs.shape or refs.dtype.is_floating_point:
            raise StateDictError(f"frame state: refs must be an integer tensor of shape {list(self._refs.shape)}")
        if not isinstance(age, torch.Tensor) or age.shape != (int(n),):
            raise StateDictError(f"frame state: age must be a tensor of {int(n)} entries")
        if refs.numel() and int(refs.max()) >= self._frames.rows:
            raise StateDictError(f"frame state: refs name frames past the {self._frames.rows} frame slots")
        load_store_state(self._frames, state["frames"])
        n = int(n)
        self._age = torch.zeros(self._frames.rows, dtype=torch.int32, device=self._refs.device)
        self._age[:n] = state["age"].to(self._age.device)
        self._n_frames = n
        self._refs = state["refs"].to(self._refs.device, torch.int32).clone()
        self._tail = None

    # ------------------------------------------------------------------ sizes
    def stats(self) -> dict[str, Any]:
        """Sizes of the stacked leaves over the rows currently held.

        Returns:
            ``rows``; ``frames`` (distinct frames stored); ``slots`` (frame slots of the stacked
            rows: rows x stacked leaves x S); ``raw_bytes`` (the stacked leaves uncompressed);
            ``frame_bytes`` (stored bytes of the frames); ``stored_bytes`` (frame bytes plus the
            frame table, 20 bytes per frame, plus the references, 4 bytes per slot as int32);
            ``ratio`` = raw / stored; ``codec_ratio`` = raw bytes of the distinct frames / their
            stored bytes (the codec alone); ``dedup`` = slots / frames.
        """
        if self._layout is None:
            return {"rows": 0}
        J, S = self._refs.shape[0], self._stack
        rows_written = (self._refs[0, :, 0] >= 0)
        rows = int(rows_written.sum())
        live = self._live_frames()
        frames = int(live.sum())
        frame_bytes = self._frames.live_bytes(live)
        slots = rows * J * S
        raw = slots * self._frame_bytes
        stored = frame_bytes + frames * 20 + slots * 4
        return {
            "rows": rows,
            "frames": frames,
            "slots": slots,
            "raw_bytes": raw,
            "frame_bytes": frame_bytes,
            "stored_bytes": stored,
            "arena_bytes": self._frames.arena.numel(),
            "ratio": raw / stored if stored else float("nan"),
            "codec_ratio": frames * self._frame_bytes / frame_bytes if frame_bytes else float("nan"),
            "dedup": slots / frames if frames else float("nan"),
        }

    def bytes(self) -> int:
        """Stored bytes of the stacked leaves (see :meth:`stats`)."""
        return self.stats().get("stored_bytes", 0)
