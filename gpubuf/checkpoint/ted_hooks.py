"""TorchRL's TED checkpoint hooks: ``TED2Flat``, ``Flat2TED``, ``TED2Nested``, ``Nested2TED``,
``H5Split``, ``H5Combine``.

They turn a storage's TED content (each step with its successor under ``"next"``) into the compact
layouts TorchRL writes (flat: each observation once; nested: one row per trajectory) and back. They
follow TorchRL's hooks (MIT licence) so that data laid out by either library reads in the other:
the import of TorchRL-written compact checkpoints (:mod:`gpubuf.checkpoint.torchrl_import`) uses
``Flat2TED`` and ``Nested2TED``, and a gpubuf storage takes them as save / load hooks.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase, lazy_stack
from tensordict.utils import unravel_key
from torch.nn import functional as F

from gpubuf.utils import DEFAULT_DONE_KEYS, find_start_stop_traj

__all__ = ["TED2Flat", "Flat2TED", "TED2Nested", "Nested2TED", "H5Split", "H5Combine"]


class TED2Flat:
    """A storage save hook writing TED data in the compact "flat" layout (TorchRL's format).

    Each observation is written once: the root value of every step, and the ``"next"`` value only
    after a step that ends a trajectory. ``shift`` (the write cursor) and ``is_full`` are set by
    the checkpointer before the call.

    Args:
        done_key: the done flag (default ``("next", "done")``).
        shift_key: where the shift is written (default ``"shift"``).
        is_full_key: where ``is_full`` is written (default ``"is_full"``).
        done_keys: the done entries (default :data:`~gpubuf.DEFAULT_DONE_KEYS`).
        reward_keys: the reward entries (default ``("reward",)``).

    Examples:
        >>> rb = ReplayBuffer(storage=LazyMemmapStorage(200))
        >>> rb.register_save_hook(TED2Flat())
    """

    shift: int | None = None
    is_full: bool | None = None

    def __init__(
        self,
        done_key=("next", "done"),
        shift_key="shift",
        is_full_key="is_full",
        done_keys=DEFAULT_DONE_KEYS,
        reward_keys=("reward",),
    ):
        self.done_key = done_key
        self.shift_key = shift_key
        self.is_full_key = is_full_key
        self.done_keys = {unravel_key(key) for key in done_keys}
        self.reward_keys = {unravel_key(key) for key in reward_keys}

    def __call__(self, data: TensorDictBase, path: Path = None):
        shift = self.shift
        is_full = self.is_full
        output = TensorDict()
        output.set_non_tensor(self.is_full_key, is_full)
        output.set_non_tensor(self.shift_key, shift)
        output.set_non_tensor("_storage_shape", tuple(data.shape))
        output.memmap_(path)

        done = data.get(self.done_key).squeeze(-1).clone()
        if not is_full:
            done[shift - 1] = True  # shift is the cursor place
        else:
            done = done.roll(-shift, dims=0)
            done[-1] = True
        # Done and reward entries are taken from "next"; the other "next" entries take a row
        # more per trajectory (its last observation).
        from_next = self.done_keys | self.reward_keys
        next_keys = set(data.get("next").keys(True, True))
        keys_to_expand = next_keys - from_next
        total_keys = set(data.exclude("next").keys(True, True)) | next_keys
        len_with_offset = data.numel() + done.sum()
        for key in total_keys:
            entry = data.get(("next", key) if key in from_next else key)
            rows = len_with_offset if key in keys_to_expand else data.numel()
            output.make_memmap(key, shape=torch.Size([rows, *entry.shape[data.ndim :]]), dtype=entry.dtype)

        def write(data, output, done):
            self._call(data=data, output=output, is_full=is_full, shift=shift, done=done, total_keys=total_keys,
                       keys_to_expand=keys_to_expand, from_next=from_next)

        if data.ndim == 1:
            write(data, output, done)
            return output
        with data.flatten(1, -1) if data.ndim > 2 else contextlib.nullcontext(data) as data_flat:
            if data.ndim > 2:
                done = done.flatten(1, -1)
            slices = _column_slices(data_flat.shape[0], done.sum(0))
            for data_slice, done_slice, (rows, rows_expanded) in zip(data_flat.unbind(1), done.unbind(1), slices):
                out_slice = output.named_apply(
                    lambda key, val, rows=rows, rows_expanded=rows_expanded: val[
                        rows_expanded if key in keys_to_expand else rows
                    ],
                    nested_keys=True,
                )
                write(data_slice, out_slice, done_slice)
        return output

    def _call(self, *, data, output, is_full, shift, done, total_keys, keys_to_expand, from_next):
        # Where each step's observation goes, and where the last observation of each trajectory.
        idx = torch.arange(data.shape[0])
        idx_done = (idx + done.cumsum(0))[done]
        idx += torch.nn.functional.pad(done, [1, 0])[:-1].cumsum(0)
        for key in total_keys:
            entry = data.get(("next", key) if key in from_next else key)
            mmap = output.get(key)
            if key in keys_to_expand:
                shifted_next = data.get(("next", key))
                if is_full:
                    _roll_inplace(entry, shift=-shift, out=mmap, index_dest=idx)
                    _roll_inplace(shifted_next, shift=-shift, out=mmap, index_dest=idx_done, index_source=done)
                else:
                    mmap[idx] = entry
                    mmap[idx_done] = shifted_next[done]
            elif is_full:
                _roll_inplace(entry, shift=-shift, out=mmap)
            else:
                mmap.copy_(entry)
        return output


class Flat2TED:
    """A storage load hook rebuilding TED data from the flat layout of :class:`TED2Flat`.

    Args:
        done_key: the done flag in the flat data (default ``"done"``).
        shift_key, is_full_key, done_keys, reward_keys: as :class:`TED2Flat`.

    Examples:
        >>> rb_load = ReplayBuffer(storage=LazyMemmapStorage(200))
        >>> rb_load.register_load_hook(Flat2TED())
    """

    def __init__(
        self, done_key="done", shift_key="shift", is_full_key="is_full", done_keys=DEFAULT_DONE_KEYS, reward_keys=("reward",)
    ):
        TED2Flat.__init__(self, done_key, shift_key, is_full_key, done_keys, reward_keys)

    def __call__(self, data: TensorDictBase, out: TensorDictBase = None):
        storage_shape = data.get_non_tensor("_storage_shape", default=None)
        if isinstance(storage_shape, int):
            storage_shape = torch.Size([storage_shape])
        shift = data.get_non_tensor(self.shift_key, default=None)
        is_full = data.get_non_tensor(self.is_full_key, default=None)
        done = (
            data.get("done").reshape((*storage_shape[1:], -1)).contiguous()
            .permute(-1, *range(0, len(storage_shape) - 1)).clone()
        )
        done[-1 if is_full else shift - 1] = True  # shift is the cursor place
        if storage_shape is None or len(storage_shape) <= 1:
            return self._call(data=data, out=out, is_full=is_full, shift=shift)
        if out is None:
            if len(storage_shape) > 2:
                # Flattening the lazy stack would make the data unavailable.
                raise RuntimeError(
                    "Checkpointing an uninitialized buffer with more than 2 dimensions is currently not supported. "
                    "Please file an issue on GitHub to ask for this feature!"
                )
            out = TensorDict(batch_size=storage_shape)
            out = lazy_stack([out._get_sub_tensordict((slice(None), j)) for j in range(out.shape[1])], 1)
        nsteps = done.shape[0]
        plain_rows = nsteps * done.shape[1:].numel()
        with out.flatten(1, -1) if out.ndim > 2 else contextlib.nullcontext(out) as out_flat:
            for out_column, (rows, rows_expanded) in zip(out_flat.unbind(-1), _column_slices(nsteps, done.sum(0))):
                data_slice = data.named_apply(
                    lambda key, val, rows=rows, rows_expanded=rows_expanded: val[
                        rows if val.shape[0] == plain_rows else rows_expanded
                    ],
                    nested_keys=True,
                    batch_size=[],
                )
                self._call(data=data_slice, out=out_column, is_full=is_full, shift=shift)
        return out

    def _call(self, *, data, out, shift, is_full):
        done = data.get(self.done_key)
        nsteps = done.shape[0]
        # Where each step's observation lies in the flat rows; its next observation follows it.
        root_idx = torch.arange(nsteps) + F.pad(done.squeeze(-1), [1, 0])[:-1].cumsum(0)
        next_idx = root_idx + 1
        if out is None:
            out = TensorDict(batch_size=[nsteps])

        def maybe_roll(entry, out=None):
            if is_full and shift is not None:
                if out is None:
                    return entry.roll(shift, dims=0)
                _roll_inplace(entry, shift=shift, out=out)
            elif out is None:
                return entry
            else:
                out.copy_(entry)

        root_idx = maybe_roll(root_idx)
        next_idx = maybe_roll(next_idx)
        if not is_full:
            next_idx = next_idx[:-1]
        from_next = self.done_keys | self.reward_keys
        for key, entry in data.items(True, True):
            if entry.shape[0] == nsteps:
                if key in from_next:
                    if key != "reward" and key not in out.keys(True, True):
                        # A done state at the root, all False.
                        out.set(key, torch.zeros_like(entry), inplace=True)
                    key = ("next", key)
                entry = maybe_roll(entry, out=out.get(key, None))
                if entry is not None:  # out has no such entry yet
                    out.set(key, entry, inplace=True)
                continue
            dest_next = out.get(("next", key), None)
            if dest_next is not None:
                (dest_next if is_full else dest_next[:-1]).copy_(entry[next_idx])
            elif is_full:
                out.set(("next", key), entry[next_idx], inplace=True)
            else:
                val = entry[next_idx]
                out.set(("next", key), torch.cat([val, torch.zeros_like(val[:1])]), inplace=True)
            dest = out.get(key, None)
            if dest is not None:
                dest.copy_(entry[root_idx])
            else:
                out.set(key, entry[root_idx], inplace=True)
        return out


class TED2Nested(TED2Flat):
    """A storage save hook writing TED data as nested (jagged) tensors, one row per trajectory."""

    def __init__(self, *args, **kwargs):
        if not hasattr(torch, "_nested_compute_contiguous_strides_offsets"):
            raise ValueError(
                f"Unsupported torch version {torch.__version__}. "
                f"torch>=2.4 is required for {type(self).__name__} to be used."
            )
        return super().__init__(*args, **kwargs)

    def __call__(self, data: TensorDictBase, path: Path = None):
        data = super().__call__(data, path=path)

        storage_shape = data.get_non_tensor("_storage_shape", (-1,))
        storage_shape = (*storage_shape[1:], storage_shape[0])  # time last
        done = data.get("done").squeeze(-1).clone()
        if not self.is_full:
            done.view(storage_shape)[..., self.shift - 1] = True
        done.view(storage_shape)[..., -1] = True
        # The ring has been linearized by TED2Flat and the final boundary of every row was forced
        # above, so the flat end flags fully delimit the trajectories.
        _, _, traj_lengths = find_start_stop_traj(end=done, at_capacity=False)
        ntraj = traj_lengths.numel()
        out = TensorDict(batch_size=[ntraj])
        out.update(dict(data.non_tensor_items()))
        out.memmap_(path)
        traj_lengths = traj_lengths.unsqueeze(-1)
        # Keys stored with their extra "next" rows take a row more per trajectory (but for the
        # last trajectory of a row that is not full, which has none).
        if self.is_full:
            traj_lengths_expand = traj_lengths + 1
        else:
            traj_lengths_expand = traj_lengths + (traj_lengths.cumsum(0) % storage_shape[-1] != 0)
        for key, val in data.items(True, True):
            lengths = traj_lengths_expand if val.shape[0] != done.shape[0] else traj_lengths
            shape = torch.cat([lengths, torch.tensor(val.shape[1:], dtype=torch.long).repeat(ntraj, 1)], -1)
            # The same storage with a new (nested) shape: nothing is copied.
            out.make_memmap_from_storage(key, val.untyped_storage(), dtype=val.dtype, shape=shape)
        return out


class Nested2TED(Flat2TED):
    """A storage load hook rebuilding TED data from the nested layout of :class:`TED2Nested`."""

    def __call__(self, data, out: TensorDictBase = None):
        def flatten_het_dim(tensor):  # the nested rows, back to back
            shape = [tensor.size(i) for i in range(2, tensor.ndim)]
            return torch.tensor(tensor.untyped_storage(), dtype=tensor.dtype).view(-1, *shape)

        data = data.apply(flatten_het_dim, batch_size=[])
        data.auto_batch_size_()
        return super().__call__(data, out=out)


class H5Split(TED2Flat):
    """Splits data prepared with :class:`TED2Nested` into one entry per trajectory (``traj_<i>``)."""

    def __call__(self, data):
        nzeros = int(math.ceil(math.log10(data.shape[0])))
        trajectories = data.filter_non_tensor_data().unbind(0)
        result = TensorDict({f"traj_{str(i).zfill(nzeros)}": traj for i, traj in enumerate(trajectories)})
        return result.update(dict(data.non_tensor_items()))


class H5Combine:
    """Combines the ``traj_<i>`` entries of :class:`H5Split` into one memory-mapped TensorDict."""

    def __call__(self, data, out=None):
        # The whole file is read into memory, and ``out`` is not used (as in TorchRL).
        values = [val for key, val in data.items() if key.startswith("traj")]
        metadata_keys = [key for key in data.keys() if not key.startswith("traj")]
        result = TensorDict({key: NonTensorData(data[key]) for key in metadata_keys})
        result.memmap_()  # a memory-mapped TensorDict without files

        def initialize(key, *x):
            result.make_memmap(key, shape=torch.stack([torch.tensor(_x.shape) for _x in x]), dtype=x[0].dtype)

        def populate(key, *x):
            dest = result.get(key)
            for i, _x in enumerate(x):
                dest[i].copy_(_x)

        for fn in (initialize, populate):
            values[0].named_apply(fn, *values[1:], nested_keys=True, batch_size=[], filter_empty=True)
        return result


def _column_slices(nsteps, traj_per_dim):
    """Per column of a 2-d storage: its rows in the plain layout and in the one with a row more per trajectory."""
    start = start_with_offset = 0
    for traj_for_dim in traj_per_dim:
        stop, stop_with_offset = start + nsteps, start_with_offset + nsteps + traj_for_dim
        yield slice(start, stop), slice(start_with_offset, stop_with_offset)
        start, start_with_offset = stop, stop_with_offset


def _roll_inplace(tensor, shift, out, index_dest=None, index_source=None):
    # slice 0
    source0 = tensor[:-shift]
    if index_source is not None:
        source0 = source0[index_source[shift:]]

    slice0_shift = source0.shape[0]
    if index_dest is not None:
        out[index_dest[-slice0_shift:]] = source0
    else:
        slice0 = out[-slice0_shift:]
        slice0.copy_(source0)

    # slice 1
    source1 = tensor[-shift:]
    if index_source is not None:
        source1 = source1[index_source[:shift]]
    if index_dest is not None:
        out[index_dest[:-slice0_shift]] = source1
    else:
        slice1 = out[:-slice0_shift]
        slice1.copy_(source1)
    return out
