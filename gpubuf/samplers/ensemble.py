"""``SamplerEnsemble``: draws from several storages in given proportions (TorchRL's ``SamplerEnsemble``)."""

from __future__ import annotations

import textwrap
from typing import Any, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from gpubuf._ensemble import member_positions, rng_to_members
from gpubuf.errors import (
    ArgumentConflictError,
    ComponentTypeError,
    EmptyBufferError,
    EnsembleBatchSizeError,
    InvalidArgumentError,
    UnsupportedDataError,
)
from gpubuf.samplers.base import Sampler
from gpubuf.storages.ensemble import StorageEnsemble

__all__ = ["SamplerEnsemble", "EnsembleBatchSizeError"]


class SamplerEnsemble(Sampler):
    """An ensemble of samplers, one per storage of a :class:`~gpubuf.storages.StorageEnsemble`.

    A batch of ``B`` items is ``num_buffer_sampled`` chunks of ``B // num_buffer_sampled``
    items; each chunk comes from one member, drawn with probabilities ``p`` (with replacement),
    uniformly when ``p`` is None, or one chunk per member in order with ``sample_from_all``.

    Args:
        *samplers: one sampler per member storage.

    Keyword Args:
        p: relative weights of the members (normalised here), or None; or ``"sampleable"``:
            weights recomputed at each draw from what each member can serve now (members that
            cannot are never drawn).
        sample_from_all: one chunk from every member (excludes ``p``).
        num_buffer_sampled: chunks per batch; defaults to the number of members.

    Raises:
        ArgumentConflictError: ``p`` together with ``sample_from_all=True`` (a ``RuntimeError`` as
            in TorchRL).
        InvalidArgumentError: ``p`` of the wrong length, negative, not finite or summing to zero;
            ``num_buffer_sampled`` not a positive int (a ``ValueError``).
        ComponentTypeError: a member that is not a sampler.
    """

    def __init__(
        self,
        *samplers: Sampler,
        p: Sequence[float] | torch.Tensor | None = None,
        sample_from_all: bool = False,
        num_buffer_sampled: int | None = None,
    ) -> None:
        for i, sampler in enumerate(samplers):
            if not isinstance(sampler, Sampler):
                raise ComponentTypeError(f"SamplerEnsemble member #{i} is a {type(sampler).__name__}: expected a Sampler")
        self._samplers = tuple(samplers)
        self._rng_private = None
        if sample_from_all and p is not None:
            raise ArgumentConflictError("Cannot pass both `p` argument and `sample_from_all=True`.")
        self.sample_from_all = sample_from_all
        self.p = p
        self.num_buffer_sampled = num_buffer_sampled

    _rng = rng_to_members("_samplers")

    @property
    def p(self) -> torch.Tensor | None:
        return self._p

    @p.setter
    def p(self, value: Any) -> None:
        if value is None:
            self._p = None
            return
        if isinstance(value, str):
            if value != "sampleable":
                raise InvalidArgumentError("The only dynamic SamplerEnsemble probability is 'sampleable'.")
            self._p = value
            return
        try:
            value = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidArgumentError(f"p must be {len(self._samplers)} weights (numbers), got {value!r}") from None
        if (
            value.numel() != len(self._samplers)
            or not bool(value.isfinite().all())
            or bool((value < 0).any())
            or float(value.sum()) <= 0
        ):
            raise InvalidArgumentError(
                f"p must hold {len(self._samplers)} non-negative weights with a positive sum, got {value.tolist()}"
            )
        self._p = value / value.sum()

    @property
    def num_buffer_sampled(self) -> int:
        if self.sample_from_all or self._num_buffer_sampled is None:
            return len(self._samplers)
        return self._num_buffer_sampled

    @num_buffer_sampled.setter
    def num_buffer_sampled(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise InvalidArgumentError(f"num_buffer_sampled must be None or a positive int, got {value!r}")
        self._num_buffer_sampled = None if value is None else int(value)

    def _draw_members(self, storage: Any = None, chunk: int = 1) -> torch.Tensor:
        count = self.num_buffer_sampled
        if self.sample_from_all:
            return torch.arange(count)
        if isinstance(self._p, str):
            counts = torch.tensor(
                [float(s._sampleable_count(m, chunk)) for m, s in zip(storage._storages, self._samplers)],
                dtype=torch.float64,
            )
            if not counts.any():
                raise EmptyBufferError("None of the replay-buffer ensemble members can be sampled.")
            return torch.multinomial(counts / counts.sum(), count, replacement=True, generator=_cpu(self._rng))
        if self._p is None:
            return torch.randint(len(self._samplers), (count,), generator=_cpu(self._rng))
        return torch.multinomial(self._p, count, replacement=True, generator=_cpu(self._rng))

    def sample(self, storage: Any, batch_size: int) -> tuple[TensorDict, dict]:
        """Draws ``batch_size`` items.

        Returns:
            ``(index, info)``: ``index`` is a TensorDict of batch size ``[num_buffer_sampled]``
            with ``"buffer_ids"`` (int64) and ``"index"`` (``[num_buffer_sampled, chunk]``, or
            ``[..., chunk, ndim]`` coordinates for multi-dim members); ``info`` holds the
            members' info entries stacked the same way (e.g. ``"priority_weight"``).

        Raises:
            EnsembleBatchSizeError: ``batch_size`` is not a multiple of ``num_buffer_sampled``.
            UnsupportedDataError: ``storage`` is not a StorageEnsemble of as many members.
            EmptyBufferError: a drawn member is empty.
        """
        count = self.num_buffer_sampled
        if batch_size % count:
            raise EnsembleBatchSizeError(
                f"The batch size must be divisible by num_buffer_sampled: {batch_size} % {count} != 0"
            )
        members = storage._storages if isinstance(storage, StorageEnsemble) else None
        if members is None or len(members) != len(self._samplers):
            raise UnsupportedDataError(
                f"SamplerEnsemble of {len(self._samplers)} samplers needs a StorageEnsemble of as many"
            )
        chunk = batch_size // count
        buffer_ids = self._draw_members(storage, chunk)
        indices: list = [None] * count
        infos: list = [None] * count
        # One draw per member for all its chunks, then split (fewer calls than one per chunk).
        for member in buffer_ids.unique().tolist():
            positions = (buffer_ids == member).nonzero().squeeze(-1).tolist()
            if len(members[member]) == 0:
                raise EmptyBufferError(f"member {member} of the ensemble is empty: extend it before sampling")
            index, info = self._samplers[member].sample(members[member], chunk * len(positions))
            if isinstance(index, tuple):
                # Per-dim indices (ndim > 1) as coordinates; a slice sampler's 1-tuple as rows.
                index = index[0] if len(index) == 1 else torch.stack(index, -1)
            for j, pos in enumerate(positions):
                indices[pos] = index[j * chunk : (j + 1) * chunk].cpu()
                infos[pos] = {
                    k: v[j * chunk : (j + 1) * chunk] for k, v in info.items() if isinstance(v, torch.Tensor) and v.ndim
                }
        if all(i.shape == indices[0].shape for i in indices):
            stacked = torch.stack(indices)
        else:
            stacked = torch.nested.nested_tensor(indices)
        index = TensorDict({"index": stacked, "buffer_ids": buffer_ids}, batch_size=[count])
        keys = set(infos[0]) if infos else set()
        info = {k: torch.stack([i[k] for i in infos]) for k in keys if all(k in i for i in infos)}
        return index, info

    def can_sample(self, storage: Any, batch_size: int) -> bool:
        if batch_size % self.num_buffer_sampled:
            return False
        chunk = batch_size // self.num_buffer_sampled
        ready = [s.can_sample(m, chunk) for s, m in zip(self._samplers, storage._storages)]
        return all(ready) if self.sample_from_all else any(ready)

    def _empty(self) -> None:
        for sampler in self._samplers:
            sampler._empty()

    def state_dict(self) -> dict[str, Any]:
        return {str(i): sampler.state_dict() for i, sampler in enumerate(self._samplers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, sampler in enumerate(self._samplers):
            sampler.load_state_dict(state_dict[str(i)])

    def __getitem__(self, index: Any) -> Any:
        picked = member_positions(index, len(self._samplers), type(self).__name__)
        if picked is None:
            return self
        if isinstance(picked, int):
            return self._samplers[picked]
        return SamplerEnsemble(
            *[self._samplers[i] for i in picked],
            p=self._p if self._p is None or isinstance(self._p, str) else self._p[picked],
            sample_from_all=self.sample_from_all,
            num_buffer_sampled=None if self._num_buffer_sampled is None else self._num_buffer_sampled,
        )

    def __len__(self) -> int:
        return len(self._samplers)

    def __repr__(self) -> str:
        samplers = textwrap.indent(f"samplers={list(self._samplers)}", " " * 4)
        options = f"p={self._p}, sample_from_all={self.sample_from_all}, num_buffer_sampled={self.num_buffer_sampled}"
        return f"{type(self).__name__}(\n{samplers},\n    {options})"


def _cpu(generator: torch.Generator | None) -> torch.Generator | None:
    """Member draws are tiny and made on the CPU; a CUDA generator cannot serve them."""
    if generator is not None and generator.device.type != "cpu":
        return None
    return generator
