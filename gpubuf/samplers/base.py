"""The sampler interface (TorchRL's ``Sampler``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from gpubuf.storages.checks import check_state_keys


class Sampler:
    """Chooses which items a sample reads.

    A sampler is told about writes (:meth:`add`, :meth:`extend`) and priority updates, and
    returns ``(index, info)`` from :meth:`sample`. ``self._rng`` is the ``torch.Generator`` the
    buffer hands to every component (``None``: torch's default generator).
    """

    _rng: torch.Generator | None = None
    #: The ops' backend (``gpubuf.ops._dispatch``): ``"auto"``, or what the buffer was built with.
    _backend = "auto"
    #: How a buffer of TensorDicts reduces per-item priorities with trailing dims to one per
    #: item (``"max"``, ``"min"``, ``"mean"`` or ``"median"``); prioritized samplers take it as
    #: an argument.
    reduction = "max"
    #: Whether an epoch ends before a batch that would be incomplete (samplers without
    #: replacement take it as an argument): such a sampler needs the buffer's batch size.
    drop_last = False

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        raise NotImplementedError

    def add(self, index: int) -> None:
        return None

    def extend(self, index: torch.Tensor) -> None:
        return None

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> dict | None:
        return None

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        return None

    def _check_priority(self, priority: torch.Tensor) -> None:
        """Raises what :meth:`update_priority` would raise for ``priority``, without changing
        anything (the buffer checks priorities given with new rows before writing them)."""
        return None

    def _check_new_items(self, storage: Any = None, data: Any = None, *, batched: bool = True) -> None:
        """Raises, before the buffer writes ``data`` (a batch, or one item with ``batched=False``)
        into ``storage``, what :meth:`add`/:meth:`extend` would raise after them (the bookkeeping
        of new rows). Samplers that can refuse new rows override it."""
        return None

    @property
    def default_priority(self) -> float:
        return 1.0

    @property
    def ran_out(self) -> bool:
        return False

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        pass

    @property
    def _remaining_batches(self) -> int:
        return 1

    def can_sample(self, storage: Any, batch_size: int) -> bool:
        return len(storage) > 0

    def _empty(self) -> None:
        return None

    def _bind(self, storage: Any) -> None:
        """Told the buffer's storage whenever the buffer is built or its storage, sampler or
        backend changes, since ``extend(index)`` carries no storage (a prioritized sampler bounds
        updates to the written range, follows the storage's device and fits its tree to where it
        is read); nothing to do for the others."""
        return None

    def _prefetch_state(self) -> Any:
        """What a draw changes, for a prefetching buffer to undo (:mod:`gpubuf.buffers._prefetch`).

        The default is a shallow copy of the attributes, right for samplers that reassign them;
        a sampler that mutates tensors in place during ``sample`` overrides both methods.
        """
        return dict(vars(self))

    def _prefetch_restore(self, state: Any) -> None:
        """Puts back what :meth:`_prefetch_state` returned."""
        vars(self).clear()
        vars(self).update(state)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict(state_dict)

    def _check_state_dict(self, state_dict: Any) -> None:
        """Raises :class:`~gpubuf.errors.StateDictError` for a state :meth:`load_state_dict`
        would refuse, or that would leave the sampler broken; changes nothing."""
        check_state_keys(state_dict, (), "sampler state")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ TorchRL's remaining API
    def _visible_len(self, storage: Any) -> int:
        """The buffer's length as its user sees it: every stored item (consuming samplers: the live ones)."""
        return len(storage)

    def _sampleable_count(self, storage: Any, batch_size: int) -> int:
        """How many items a draw can come from now (``SamplerEnsemble(p="sampleable")`` weighs by it)."""
        return len(storage)

    #: ``(dump(component, kind, path), load(component, kind, path))``: installed by the package from
    #: :mod:`gpubuf.checkpoint`, which reads the component's state (components never import it).
    _checkpoint_io: tuple[Callable[[Any, str, Any], None], Callable[[Any, str, Any], None]] | None = None

    def dumps(self, path: Any) -> None:
        """Writes this sampler's state as a pickle-free checkpoint directory (see :mod:`gpubuf.checkpoint`)."""
        self._checkpoint_io[0](self, "sampler", path)

    def loads(self, path: Any) -> None:
        """Restores this sampler's state from :meth:`dumps`' directory (or a buffer checkpoint's sampler)."""
        self._checkpoint_io[1](self, "sampler", path)
