"""Uniform samplers: ``RandomSampler`` (with replacement) and ``SamplerWithoutReplacement``."""

from __future__ import annotations

from typing import Any

import torch

from gpubuf.errors import BatchSizeError, EmptyBufferError, StateDictError, UnsupportedOptionError
from gpubuf.samplers.base import Sampler
from gpubuf.storages.checks import check_state_keys

_EMPTY = "Cannot sample from an empty storage. Extend the buffer first."


def _refuse_graph_capture(sampler: Any, device: torch.device | None) -> None:
    """Raises when a draw that moves an epoch kept on the host is being captured in a CUDA graph:
    every replay would hand out the captured batch's items again, silently."""
    if device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise UnsupportedOptionError(
            f"{type(sampler).__name__} keeps its epoch's order on the host, which a CUDA graph replay cannot move "
            "(every replay would return the captured batch's items): sample it outside graph capture, or capture "
            "a sampler with replacement"
        )


def _check_batch_size(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise BatchSizeError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


class RandomSampler(Sampler):
    """Draws indices uniformly at random, with replacement, from the written range.

    Indices come from ``torch.randint`` on the storage's device with the buffer's generator.

    Keyword Args:
        replacement: ``False`` builds a :class:`SamplerWithoutReplacement` instead, with the other
            keyword arguments (``drop_last``, ``shuffle``), as TorchRL does.
    """

    def __new__(cls, *args: Any, replacement: bool = True, **kwargs: Any):
        if not replacement and cls is RandomSampler:
            return SamplerWithoutReplacement(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *, replacement: bool = True) -> None:
        pass

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        """Returns ``(index, {})``: a 1-D int64 tensor of ``batch_size`` indices (a tuple of them per
        storage dim when ``storage.ndim > 1``) on the storage's device.

        Raises:
            EmptyBufferError: the storage holds nothing.
        """
        if len(storage) == 0:
            raise EmptyBufferError(_EMPTY)
        return storage._rand_given_ndim(batch_size), {}


def _unravel(index: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index = index // size
    return tuple(reversed(out))


class SamplerWithoutReplacement(Sampler):
    """Goes through the written items in a random (or the written) order, each once per epoch.

    Args:
        drop_last: when True, an epoch ends before a batch that would be incomplete; when False
            (default), the last batch of an epoch holds the items left, so it may be shorter
            (TorchRL's behaviour, as a ``DataLoader``; TorchRL's docstring speaks of completing
            it from a new permutation, which its code does not do).
        shuffle: when False, items come in storage order.

    The permutation is redrawn when the storage's length changes between calls. ``ran_out``
    turns True when the epoch's last batch has been returned, which ends ``iter(buffer)``.
    """

    def __init__(self, drop_last: bool = False, shuffle: bool = True) -> None:
        self.drop_last = drop_last
        self.shuffle = shuffle
        self._sample_list: torch.Tensor | None = None
        self.len_storage = 0
        self._ran_out = False
        self._remaining = 0

    @property
    def ran_out(self) -> bool:
        return self._ran_out

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        self._ran_out = bool(value)

    @property
    def _remaining_batches(self) -> int:
        return self._remaining

    def _new_epoch(self, len_storage: int, batch_size: int, device: Any) -> None:
        if self.shuffle:
            self._sample_list = torch.randperm(len_storage, generator=self._rng, device=device)
        else:
            self._sample_list = torch.arange(len_storage, device=device)
        self._count_remaining(batch_size)

    def _count_remaining(self, batch_size: int) -> None:
        n = self._sample_list.numel()
        self._remaining = n // batch_size if self.drop_last else -(-n // batch_size)

    def can_sample(self, storage: Any, batch_size: int) -> bool:
        return len(storage) >= batch_size if self.drop_last else len(storage) > 0

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        """Returns ``(index, {})``, the next ``batch_size`` items of the current epoch.

        Raises:
            EmptyBufferError: the storage holds nothing.
            BatchSizeError: ``drop_last=True`` and the storage holds fewer than ``batch_size`` items.
        """
        len_storage = len(storage)
        if len_storage == 0:
            raise EmptyBufferError(_EMPTY)
        if self.drop_last and len_storage < batch_size:
            raise BatchSizeError(
                f"The batch size ({batch_size}) is greater than the storage capacity ({len_storage} items stored): "
                "with drop_last=True no batch can be drawn without repeating items"
            )
        sources = storage._row_sources
        device = sources[0].device if sources else None
        _refuse_graph_capture(self, device)
        if self._sample_list is None or self.len_storage != len_storage:
            self._new_epoch(len_storage, batch_size, device)
        self.len_storage = len_storage
        index = self._sample_list[:batch_size]
        self._sample_list = self._sample_list[batch_size:]
        self._count_remaining(batch_size)
        if self._sample_list.numel() == 0 or (self.drop_last and self._sample_list.numel() < batch_size):
            self._ran_out = True
            self._new_epoch(len_storage, batch_size, device)
        else:
            self._ran_out = False
        if storage.ndim > 1:
            index = _unravel(index, storage.shape)
        return index, {}

    def _empty(self) -> None:
        self._sample_list = None
        self.len_storage = 0
        self._ran_out = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "len_storage": self.len_storage,
            "_sample_list": self._sample_list,
            "drop_last": self.drop_last,
            "_ran_out": self._ran_out,
        }

    def _check_state_dict(self, state_dict: Any) -> None:
        check_state_keys(state_dict, ("len_storage", "_sample_list", "drop_last", "_ran_out"), "sampler state")
        length = state_dict["len_storage"]
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise StateDictError(f"sampler state: len_storage must be an int >= 0, got {length!r}")
        for key in ("drop_last", "_ran_out"):
            if not isinstance(state_dict[key], bool):
                raise StateDictError(f"sampler state: {key} must be a bool, got {state_dict[key]!r}")
        left = state_dict["_sample_list"]
        if left is None:
            return
        if not isinstance(left, torch.Tensor) or left.ndim != 1 or left.dtype != torch.int64:
            raise StateDictError("sampler state: _sample_list must be None or a 1-D int64 tensor of the epoch's indices")
        if left.device.type == "cpu" and left.numel() and (int(left.min()) < 0 or int(left.max()) >= max(length, 1)):
            raise StateDictError(f"sampler state: _sample_list holds indices outside [0, {length})")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict(state_dict)
        self.len_storage = int(state_dict["len_storage"])
        sample_list = state_dict["_sample_list"]
        self._sample_list = sample_list.clone() if isinstance(sample_list, torch.Tensor) else sample_list
        self.drop_last = bool(state_dict["drop_last"])
        self._ran_out = bool(state_dict["_ran_out"])

    def __repr__(self) -> str:
        left = 0 if self._sample_list is None else self._sample_list.numel()
        return f"{type(self).__name__}(drop_last={self.drop_last}, shuffle={self.shuffle}, left_in_epoch={left})"
