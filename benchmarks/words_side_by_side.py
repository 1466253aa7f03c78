"""The word intrinsics of ``gpubuf_kernels/cpu/_words.py`` against plain Numba byte loops, side by side.

Copies the compiled CPU kernels into a temporary package whose ``_words`` holds the same
functions written as loops over bytes, then times the row encoder and decoder of both on
Atari-like frame stacks (flat backgrounds, moving blocks, a noisy line) in one process, and
checks that they decode the same bytes.

    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/words_side_by_side.py
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import gpubuf.ops.encode_rows as E
import gpubuf.ops.decode_rows as D
import gpubuf_kernels.cpu
from gpubuf.codec.checksum import as_int32
from gpubuf.ops.encode_rows import encode_planes
from gpubuf.codec.format import RowGeometry
from gpubuf.ops.decode_rows import RowTable

PLAIN_WORDS = """\
# Plain-Numba versions of the word intrinsics, for a side-by-side measurement.
import numpy as np
from numba import njit


@njit(inline="always")
def load_word(arr, pos):
    v = np.uint64(0)
    for t in range(8):
        v |= np.uint64(arr[pos + t]) << np.uint64(8 * t)
    return v


@njit(inline="always")
def store_word(arr, pos, value):
    v = np.uint64(value)
    for t in range(8):
        arr[pos + t] = np.uint8((v >> np.uint64(8 * t)) & np.uint64(255))


@njit(inline="always")
def store_wide(arr, pos, value):
    for q in range(4):
        store_word(arr, pos + 8 * q, value)


@njit(inline="always")
def copy_wide(dst, d, src, s):
    for t in range(32):
        dst[d + t] = src[s + t]


@njit(inline="always")
def add_wide(dst, d, src, s, value):
    for t in range(32):
        dst[d + t] = np.uint8((np.int64(src[s + t]) + np.int64(value)) & 255)


@njit(inline="always")
def equal_wide(a, i, b, j):
    for t in range(32):
        if a[i + t] != b[j + t]:
            return False
    return True


@njit(inline="always")
def change_bits(a, i):
    m = np.uint32(0)
    for t in range(32):
        if a[i + t] != a[i + t - 1]:
            m |= np.uint32(1) << np.uint32(t)
    return m


@njit(inline="always")
def residual_change_bits(a, i, r, j):
    m = np.uint32(0)
    for t in range(32):
        x = (np.int64(a[i + t]) - np.int64(r[j + t])) & 255
        y = (np.int64(a[i + t - 1]) - np.int64(r[j + t - 1])) & 255
        if x != y:
            m |= np.uint32(1) << np.uint32(t)
    return m


@njit(inline="always")
def popcount(v):
    c = 0
    x = np.uint32(v)
    while x:
        x &= x - np.uint32(1)
        c += 1
    return np.int64(c)


@njit(inline="always")
def lowest_bit(v):
    x = np.uint32(v)
    c = 0
    while (x & np.uint32(1)) == 0:
        x >>= np.uint32(1)
        c += 1
    return np.int64(c)
"""


def _plain_package() -> str:
    root = Path(tempfile.mkdtemp(prefix="gpubuf_words_"))
    shutil.copytree(Path(gpubuf_kernels.cpu.__file__).parent, root / "plain_cpu", ignore=shutil.ignore_patterns("__pycache__"))
    encoder = root / "plain_cpu" / "encoder.py"
    encoder.write_text(encoder.read_text().replace("from gpubuf_kernels.cpu._words import", "from ._words import"))
    (root / "plain_cpu" / "_words.py").write_text(PLAIN_WORDS)
    sys.path.insert(0, str(root))
    return "plain_cpu"


def _frames(n: int, gen: torch.Generator) -> torch.Tensor:
    base = torch.zeros(n, 4, 84, 84, dtype=torch.uint8)
    base[:, :, 60:84] = 40
    for k in range(n):
        x, y = (int(v) for v in torch.randint(0, 70, (2,), generator=gen))
        base[k, :, y : y + 12, x : x + 8] = 200
        base[k, :, 10, :] = torch.randint(0, 255, (84,), generator=gen, dtype=torch.uint8)
    return base


def _table(rows: torch.Tensor) -> RowTable:
    g = RowGeometry.of(rows.dtype, rows.shape[1:])
    enc = encode_planes(g.to_planes(rows), g)
    return RowTable(enc.data, enc.starts, enc.lengths.to(torch.int32), as_int32(enc.checksums), None, g)


def _median(fn, reps: int = 9) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = _frames(2048, gen)
    index = torch.randint(0, rows.shape[0], (512,), generator=gen)
    plain = _plain_package()
    variants = {
        "intrinsics": (importlib.import_module("gpubuf_kernels.cpu.codec"), importlib.import_module("gpubuf_kernels.cpu.encoder")),
        "plain loops": (importlib.import_module(f"{plain}.codec"), importlib.import_module(f"{plain}.encoder")),
    }
    results = {}
    for name, (codec, encoder) in variants.items():
        D.kernel_module = lambda module, c=codec: c
        E.kernel_module = lambda module, e=encoder: e
        table = _table(rows)
        out = D.decode_rows(table, index, backend="numba")
        results[name] = (_median(lambda: _table(rows)), _median(lambda: D.decode_rows(table, index, backend="numba")), out)
    assert torch.equal(results["intrinsics"][2], results["plain loops"][2])
    for name, (encode_s, decode_s, _) in results.items():
        print(f"{name:>12}: encode 2,048 stacks {encode_s * 1e3:8.1f} ms, decode 512 stacks {decode_s * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
