"""Codecs for stacked Atari observations, compared on real frames: bytes per row, encode and decode speed.

Every codec stores the same transitions' stacked observations (``[4, 84, 84]`` uint8, ``obs``
and ``next_obs``, from ``scripts/make_atari_frames.py``) and must give them back bit for bit:

- ``zlib-3``: each stacked row compressed on its own, as TorchRL's ``CompressedListStorage``
  stores it (its default);
- ``lz4``, ``zstd-1``, ``zstd-3``: the same, with the well-kept ``lz4`` and ``zstandard``
  packages (one chunk per row, so that a sample decodes only its rows);
- ``... +dedup``: the same codec over each distinct frame once (a stacked row refers to its
  four frames, found by byte comparison as ``FrameStackStorage`` finds them); bytes per row
  count the frames' bytes plus four 4-byte references;
- ``CompressedTensorStorage``: gpubuf's storage of rows coded one by one; on the host each row
  is one zstd-3 frame (the in-house row codec is its device path);
- ``row codec +dedup``: gpubuf's ``FrameStackStorage``.

Encode is timed over every row (single thread, the way each library runs by default on the
host); decode over ``--batch`` random rows, median of ``--repeats`` (codecs interleaved so
that they share the machine's noise). Bytes per row are per stacked row (``obs`` and
``next_obs`` each count as one).

    python benchmarks/bench_codecs.py [--frames bench-out/atari_frames.npz] [--rows-per-game 750]
        [--batch 256] [--repeats 7] [--json bench-out/codecs.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench_compressed import environment, load_frames, make_transitions  # noqa: E402

STACK = (4, 84, 84)


def _byte_codecs() -> dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]]:
    import lz4.block
    import zstandard

    z1c, z3c = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    zd = zstandard.ZstdDecompressor()
    frame_bytes = int(np.prod(STACK[1:]))
    return {
        "zlib-3": (lambda b: zlib.compress(b, 3), zlib.decompress),
        "lz4": (lz4.block.compress, lz4.block.decompress),
        "zstd-1": (z1c.compress, zd.decompress),
        "zstd-3": (z3c.compress, zd.decompress),
    }, frame_bytes


class RowChunks:
    """Each stacked row compressed on its own; a sample decompresses only its rows."""

    def __init__(self, compress, decompress) -> None:
        self.compress, self.decompress = compress, decompress
        self.rows: list[bytes] = []

    def extend(self, stacks: np.ndarray) -> None:
        self.rows.extend(self.compress(row.tobytes()) for row in stacks)

    def sample(self, index: np.ndarray) -> np.ndarray:
        out = np.empty((len(index),) + STACK, dtype=np.uint8)
        flat = out.reshape(len(index), -1)
        for k, i in enumerate(index):
            flat[k] = np.frombuffer(self.decompress(self.rows[i]), dtype=np.uint8)
        return out

    def nbytes(self) -> int:
        return sum(len(r) for r in self.rows)


class FrameChunks:
    """Each distinct frame compressed once; a stacked row is four references to frames."""

    def __init__(self, compress, decompress) -> None:
        self.compress, self.decompress = compress, decompress
        self.frames: list[bytes] = []
        self.refs: list[np.ndarray] = []
        self._last: dict[bytes, int] = {}

    def extend(self, stacks: np.ndarray) -> None:
        for row in stacks:
            ids = np.empty(STACK[0], dtype=np.int32)
            for s, frame in enumerate(row):
                key = frame.tobytes()
                found = self._last.get(key)
                if found is None:
                    found = len(self.frames)
                    self.frames.append(self.compress(key))
                    self._last[key] = found
                ids[s] = found
            self.refs.append(ids)
            # Candidates are recent frames only, as a streaming writer would keep them.
            if len(self._last) > 64:
                for key in list(self._last)[: len(self._last) - 64]:
                    del self._last[key]

    def sample(self, index: np.ndarray) -> np.ndarray:
        out = np.empty((len(index),) + STACK, dtype=np.uint8)
        flat = out.reshape(len(index), STACK[0], -1)
        for k, i in enumerate(index):
            for s, f in enumerate(self.refs[i]):
                flat[k, s] = np.frombuffer(self.decompress(self.frames[f]), dtype=np.uint8)
        return out

    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames) + 4 * STACK[0] * len(self.refs)


class GpubufStorage:
    """A gpubuf storage: ``CompressedTensorStorage`` (zstd rows on the host) or ``FrameStackStorage``."""

    def __init__(self, dedup: bool, capacity: int) -> None:
        from gpubuf.storages.codec_storage import CompressedTensorStorage
        from gpubuf.storages.frame_stack import FrameStackStorage

        if dedup:
            self.storage = FrameStackStorage(capacity, stack_keys=["obs"])
        else:
            self.storage = CompressedTensorStorage(capacity, compress_keys=["obs"])
        self.written = 0

    def extend(self, stacks: np.ndarray) -> None:
        from tensordict import TensorDict

        n = len(stacks)
        self.storage.set(range(self.written, self.written + n), TensorDict({"obs": torch.from_numpy(stacks)}, [n]))
        self.written += n

    def sample(self, index: np.ndarray) -> np.ndarray:
        return self.storage.get(torch.from_numpy(index))["obs"].numpy()

    def nbytes(self) -> int:
        return self.storage.bytes()


def stacks_of(frames: dict, rows_per_game: int) -> np.ndarray:
    """``obs`` then ``next_obs`` stacks of the first ``rows_per_game`` transitions of each game, in order."""
    td, game, _ = make_transitions(frames, None)
    parts = []
    for g in np.unique(game):
        sel = torch.from_numpy(np.nonzero(game == g)[0][:rows_per_game])
        part = td[sel]
        # A writer sees obs[t] then, later, next_obs[t] = obs[t+1]: store the stream of obs
        # followed by each episode's final next_obs, here simply obs rows then next_obs rows.
        parts.append(part["obs"].numpy())
        parts.append(part["next_obs"].numpy())
    return np.concatenate(parts)


def run(stacks: np.ndarray, batch: int, repeats: int, chunk: int = 1000) -> dict:
    byte_codecs, _ = _byte_codecs()
    makers: dict[str, Callable[[], object]] = {}
    for name, (c, d) in byte_codecs.items():
        makers[name] = lambda c=c, d=d: RowChunks(c, d)
        makers[f"{name} +dedup"] = lambda c=c, d=d: FrameChunks(c, d)
    makers["CompressedTensorStorage"] = lambda: GpubufStorage(False, len(stacks))
    makers["row codec +dedup"] = lambda: GpubufStorage(True, len(stacks))
    raw_row = int(np.prod(STACK))
    results = {}
    stores = {}
    for name, make in makers.items():
        warm = make()  # compiled kernels and lazy imports are paid here, not in the timing
        warm.extend(stacks[:200])
        warm.sample(np.arange(8))
        store = make()
        t0 = time.perf_counter()
        for i in range(0, len(stacks), chunk):
            store.extend(stacks[i : i + chunk])
        encode_s = time.perf_counter() - t0
        stores[name] = store
        results[name] = {
            "bytes_per_row": store.nbytes() / len(stacks),
            "ratio": raw_row * len(stacks) / store.nbytes(),
            "encode_rows_per_s": len(stacks) / encode_s,
            "encode_MB_per_s": raw_row * len(stacks) / encode_s / 1e6,
        }
        print(f"  encoded {name}", flush=True)
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(repeats):
        index = rng.integers(0, len(stacks), batch)
        expected = stacks[index]
        for name, store in stores.items():
            t0 = time.perf_counter()
            got = store.sample(index)
            times[name].append(time.perf_counter() - t0)
            if not np.array_equal(got, expected):
                raise AssertionError(f"{name} did not give the rows back bit for bit")
    for name in makers:
        p50 = statistics.median(times[name])
        results[name]["decode_ms_p50"] = p50 * 1e3
        results[name]["decode_MB_per_s"] = raw_row * batch / p50 / 1e6
    base = results["zlib-3"]
    for name, r in results.items():
        r["encode_vs_zlib3"] = r["encode_rows_per_s"] / base["encode_rows_per_s"]
        r["decode_vs_zlib3"] = base["decode_ms_p50"] / r["decode_ms_p50"]
        r["bytes_vs_zlib3"] = r["bytes_per_row"] / base["bytes_per_row"]
    return results


def print_table(results: dict) -> None:
    print(f"{'codec':<18} {'B/row':>8} {'x zlib-3':>8} {'encode MB/s':>12} {'x':>6} {'decode MB/s':>12} {'x':>6}")
    for name, r in results.items():
        print(
            f"{name:<18} {r['bytes_per_row']:>8.0f} {r['bytes_vs_zlib3']:>8.2f} {r['encode_MB_per_s']:>12.1f} "
            f"{r['encode_vs_zlib3']:>6.1f} {r['decode_MB_per_s']:>12.1f} {r['decode_vs_zlib3']:>6.1f}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=Path, default=ROOT.parent / "bench-out" / "atari_frames.npz")
    parser.add_argument("--rows-per-game", type=int, default=750)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    frames = load_frames(args.frames)
    stacks = stacks_of(frames, args.rows_per_game)
    print(f"{len(stacks)} stacked rows of {STACK} uint8 from {args.frames.name}", flush=True)
    results = run(stacks, args.batch, args.repeats)
    print_table(results)
    out = {"env": environment(torch.device("cpu"), 1), "rows": len(stacks), "batch": args.batch, "codecs": results}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
