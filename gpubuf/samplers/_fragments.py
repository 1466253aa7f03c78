"""Logical trajectories whose steps sit anywhere in a storage (``SliceSampler(fragmented=True)``).

Interleaved writers (several environments sharing one buffer) leave the steps of a trajectory at
non-adjacent rows. Each live row then carries a record, its trajectory id and its step number
(``traj_key`` and ``step_key``), and a *run* is a maximal sequence of records of one trajectory
with consecutive step numbers: a missing step splits a trajectory into two runs.

:class:`FragmentIndex` keeps one record per row of a one-dimensional storage, set by writes
(work proportional to the rows written), and packs the runs on the first draw after a write:
the live rows sorted by ``(trajectory, step)``, stably, so the packing is a function of the
stored values alone (the same as TorchRL's, for the same data). Draws between writes reuse it.
"""

from __future__ import annotations

import torch

from gpubuf.errors import TrajectoryStepError

__all__ = ["FragmentIndex"]


def _records(values: torch.Tensor, rows: int, key: tuple) -> torch.Tensor:
    """One int64 value per row from an entry read for ``rows`` rows."""
    if not isinstance(values, torch.Tensor):
        raise TrajectoryStepError(f"entry {key!r} must hold a tensor, got {type(values).__name__}")
    if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
        raise TrajectoryStepError(f"entry {key!r} must hold integers, got dtype={values.dtype}")
    if values.numel() != rows:
        raise TrajectoryStepError(
            f"entry {key!r} must hold one value per step (shape [] or [1]), got {values.numel() // max(rows, 1)}"
        )
    return values.reshape(rows).to("cpu", torch.int64)


class FragmentIndex:
    """Per-row ``(trajectory, step)`` records of a one-dimensional storage and their runs.

    State (CPU, int64): ``traj[r]`` and ``step[r]`` for rows ``r < size``; ``step[r] = -1``
    marks a row without a live record. Nothing of the storage's size is read on a draw.
    """

    def __init__(self) -> None:
        self.traj = torch.zeros(0, dtype=torch.int64)
        self.step = torch.zeros(0, dtype=torch.int64)
        self._runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def set(self, rows: torch.Tensor, traj: torch.Tensor, step: torch.Tensor, keys: tuple[tuple, tuple]) -> None:
        """Records the trajectory ids and step numbers written at ``rows`` (the last write of a
        row repeated within ``rows`` wins).

        Args:
            rows: int64 ``[n]`` row numbers.
            traj, step: the entries read at ``rows`` (one integer per row).
            keys: ``(traj_key, step_key)``, for the messages.

        Raises:
            TrajectoryStepError: an entry that is not one integer per row, or a negative step;
                nothing is changed then.
        """
        rows = rows.reshape(-1).to("cpu", torch.int64)
        n = rows.shape[0]
        traj = _records(traj, n, keys[0])
        step = _records(step, n, keys[1])
        if n and bool((step < 0).any()):
            raise TrajectoryStepError(f"step numbers must be non-negative, got {int(step.min())} under {keys[1]!r}")
        if n == 0:
            return
        size = int(rows.max()) + 1
        if size > self.step.shape[0]:
            grow = size - self.step.shape[0]
            self.traj = torch.cat([self.traj, self.traj.new_zeros(grow)])
            self.step = torch.cat([self.step, self.step.new_full((grow,), -1)])
        self.traj[rows] = traj
        self.step[rows] = step
        self._runs = None

    def truncate(self, size: int) -> None:
        """Drops the records of rows ``>= size`` (rows no longer stored)."""
        if self.step.shape[0] > size:
            self.step[size:] = -1
            self._runs = None

    def runs(self, keys: tuple[tuple, tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ordered_rows, run_offsets, run_lengths)`` (CPU int64): the live rows in
        ``(trajectory, step)`` order, where each run starts in that order, and each run's length.

        Raises:
            TrajectoryStepError: two live rows hold the same trajectory and step.
        """
        if self._runs is not None:
            return self._runs
        live = (self.step >= 0).nonzero().squeeze(1)
        traj, step = self.traj[live], self.step[live]
        order = torch.argsort(step, stable=True)
        order = order[torch.argsort(traj[order], stable=True)]
        traj, step = traj[order], step[order]
        same_traj = traj[1:] == traj[:-1]
        if bool((same_traj & (step[1:] == step[:-1])).any()):
            at = int((same_traj & (step[1:] == step[:-1])).nonzero()[0, 0])
            raise TrajectoryStepError(
                f"found two stored steps of trajectory {int(traj[at])} numbered {int(step[at])} (traj_key={keys[0]!r}, "
                f"step_key={keys[1]!r}): trajectory-step pairs must be unique among the stored rows. Reused trajectory "
                "ids (a collector restarted while its earlier episodes are stored) do this: use ids that stay unique, or "
                "empty the buffer first"
            )
        new_run = torch.ones_like(step, dtype=torch.bool)
        new_run[1:] = ~same_traj | (step[1:] != step[:-1] + 1)
        offsets = new_run.nonzero().squeeze(1)
        bounds = torch.cat([offsets, offsets.new_tensor([step.shape[0]])])
        self._runs = (live[order], offsets, bounds[1:] - bounds[:-1])
        return self._runs

    def state_dict(self) -> dict:
        return {"traj": self.traj.clone(), "step": self.step.clone()}

    @classmethod
    def from_state_dict(cls, state: dict) -> "FragmentIndex":
        traj, step = torch.as_tensor(state["traj"]), torch.as_tensor(state["step"])
        if traj.ndim != 1 or traj.shape != step.shape:
            raise ValueError(f"fragment records of shapes {list(traj.shape)} and {list(step.shape)}: expected two equal 1-D")
        index = cls()
        index.traj, index.step = traj.to(torch.int64).clone(), step.to(torch.int64).clone()
        return index
