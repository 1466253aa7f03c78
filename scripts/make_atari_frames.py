"""Writes real Atari frames, preprocessed as DQN agents see them, to an ``.npz`` file.

The frames feed the compressed-storage tests (a small set shipped in ``tests/data/``) and
benchmarks (a full-size set written to ``bench-out/``). They come from the Arcade Learning
Environment (``pip install ale-py``; its wheels ship the ROMs) under a uniformly random policy,
with the usual preprocessing of Atari agents (Mnih et al. 2015; gymnasium's
``AtariPreprocessing``):

- sticky actions with probability 0.25 (ALE v5 default) and up to 30 no-op steps at reset;
- each agent step repeats its action for ``frame_skip`` emulator frames and keeps the
  pixel-wise max of the last two (Atari sprites flicker between frames);
- grayscale (ALE's own luminance), resized from 210x160 to 84x84 by area averaging: each
  output pixel is the mean of the source area it covers, fractional pixels weighted by their
  covered fraction (what OpenCV's ``INTER_AREA`` does when shrinking), rounded to nearest;
- episodes end at game over or after ``max_episode_steps`` agent steps (truncation).

The output holds frames, not stacks: an episode of ``T`` agent steps gives ``T + 1`` frames (the
reset frame, then one per step). Stacks of 4 are built from them by consumers, with
:func:`gpubuf.ops.match_frames.stack_indices`, repeating an episode's first frame as frame-stacking
environment wrappers do. Arrays in the file:

- ``frames``: uint8 ``[N, 84, 84]``, episodes one after another, games one after another;
- ``episode_start``: bool ``[N]``, True on the first frame of each episode;
- ``game``: int16 ``[N]``, index into ``games`` (a str array of ROM names);
- ``action``: int16 ``[N]``, the action taken from this frame (-1 on an episode's last frame);
- ``reward``: float32 ``[N]``, the reward received on reaching this frame (0 on a first frame);
- ``terminal``: bool ``[N]``, True on a last frame reached by game over (not truncation);
- ``seed``, ``frame_skip``, ``max_episode_steps``: 0-d metadata.

The output is deterministic for a given seed and ale-py version.

Examples::

    python scripts/make_atari_frames.py --out bench-out/atari_frames.npz
    python scripts/make_atari_frames.py --steps 150 --max-episode-steps 60 --out tests/data/atari_small.npz
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

DEFAULT_GAMES = ("pong", "breakout", "space_invaders", "seaquest")
SIZE = 84


def _area_weights(src: int, dst: int) -> np.ndarray:
    """``[dst, src]`` float64 matrix: row i averages the source interval ``[i, i + 1) * src / dst``."""
    scale = src / dst
    lo = np.arange(dst)[:, None] * scale
    edges = np.arange(src)[None, :]
    covered = np.clip(np.minimum(edges + 1, lo + scale) - np.maximum(edges, lo), 0.0, None)
    return covered / scale


_WEIGHTS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _resize(screens: np.ndarray) -> np.ndarray:
    """Area-averages ``[n, H, W]`` uint8 screens down to ``[n, 84, 84]`` uint8.

    Two large matrix products per batch: many small per-frame products cost far more in call
    and threading overhead than in arithmetic.
    """
    n, h, w = screens.shape
    if (h, w) not in _WEIGHTS:
        _WEIGHTS[(h, w)] = (_area_weights(h, SIZE), _area_weights(w, SIZE))
    rows, cols = _WEIGHTS[(h, w)]
    x = screens.reshape(n * h, w).astype(np.float64) @ cols.T  # [n * H, 84]
    x = x.reshape(n, h, SIZE).transpose(1, 0, 2).reshape(h, n * SIZE)
    y = (rows @ x).reshape(SIZE, n, SIZE).transpose(1, 0, 2)  # [n, 84, 84]
    return np.clip(np.rint(y), 0, 255).astype(np.uint8)


def play(
    game: str,
    steps: int,
    *,
    seed: int,
    frame_skip: int = 4,
    max_episode_steps: int = 27_000,
    noop_max: int = 30,
    sticky: float = 0.25,
) -> dict[str, np.ndarray]:
    """Plays ``game`` with a random policy for ``steps`` agent steps (whole episodes, the last one cut short).

    Returns:
        ``frames`` uint8 ``[N, 84, 84]``, ``episode_start`` bool ``[N]``, ``action`` int16 ``[N]``,
        ``reward`` float32 ``[N]``, ``terminal`` bool ``[N]`` with ``N = steps + episodes``.
    """
    from ale_py import ALEInterface, LoggerMode, roms

    ALEInterface.setLoggerMode(LoggerMode.Error)
    ale = ALEInterface()
    ale.setInt("random_seed", seed)
    ale.setFloat("repeat_action_probability", sticky)
    ale.setInt("frame_skip", 1)  # frames are skipped here, to max-pool the last two
    ale.loadROM(roms.get_rom_path(game))
    actions = ale.getMinimalActionSet()
    rng = np.random.default_rng(seed)
    h, w = ale.getScreenDims()
    last = np.empty((2, h, w), dtype=np.uint8)

    frames, screens, starts, taken, rewards, terminals = [], [], [], [], [], []

    def observe() -> None:
        screens.append(np.maximum(last[0], last[1]))
        if len(screens) == 1024:  # bounded memory: full-size screens are 16x the frames
            frames.append(_resize(np.stack(screens)))
            screens.clear()

    def reset() -> None:
        ale.reset_game()
        for _ in range(int(rng.integers(0, noop_max + 1))):
            ale.act(actions[0])
            if ale.game_over():
                ale.reset_game()
        ale.getScreenGrayscale(last[0])
        last[1] = last[0]
        observe()
        starts.append(True)
        rewards.append(0.0)
        terminals.append(False)

    reset()
    episode_steps = 0
    for step in range(steps):
        a = int(rng.integers(len(actions)))
        reward = 0.0
        for k in range(frame_skip):
            reward += ale.act(actions[a])
            if k >= frame_skip - 2:
                ale.getScreenGrayscale(last[k - (frame_skip - 2)])
            if ale.game_over():
                break
        if frame_skip < 2:
            last[0] = last[1]
        taken.append(a)
        observe()
        starts.append(False)
        rewards.append(reward)
        episode_steps += 1
        over = ale.game_over()
        terminals.append(over)
        if (over or episode_steps >= max_episode_steps) and step < steps - 1:
            taken.append(-1)
            reset()
            episode_steps = 0
    taken.append(-1)
    if screens:
        frames.append(_resize(np.stack(screens)))
    return {
        "frames": np.concatenate(frames),
        "episode_start": np.array(starts, dtype=bool),
        "action": np.array(taken, dtype=np.int16),
        "reward": np.array(rewards, dtype=np.float32),
        "terminal": np.array(terminals, dtype=bool),
    }


def make(
    games: tuple[str, ...] = DEFAULT_GAMES,
    steps: int = 12_500,
    *,
    seed: int = 0,
    frame_skip: int = 4,
    max_episode_steps: int = 27_000,
) -> dict[str, np.ndarray]:
    """Plays every game for ``steps`` agent steps and concatenates the results (see the module docstring)."""
    parts = [
        play(g, steps, seed=seed + i, frame_skip=frame_skip, max_episode_steps=max_episode_steps)
        for i, g in enumerate(games)
    ]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    out["game"] = np.concatenate([np.full(len(p["frames"]), i, dtype=np.int16) for i, p in enumerate(parts)])
    out["games"] = np.array(games)
    out["seed"] = np.array(seed)
    out["frame_skip"] = np.array(frame_skip)
    out["max_episode_steps"] = np.array(max_episode_steps)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/atari_frames.npz"))
    parser.add_argument("--games", nargs="+", default=list(DEFAULT_GAMES))
    parser.add_argument("--steps", type=int, default=12_500, help="agent steps per game")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frame-skip", type=int, default=4)
    parser.add_argument("--max-episode-steps", type=int, default=27_000)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    data = make(
        tuple(args.games), args.steps, seed=args.seed, frame_skip=args.frame_skip,
        max_episode_steps=args.max_episode_steps,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    n = len(data["frames"])
    print(
        f"wrote {args.out}: {n} frames, {int(data['episode_start'].sum())} episodes, games {list(args.games)}, "
        f"{args.out.stat().st_size / 1e6:.2f} MB in {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
