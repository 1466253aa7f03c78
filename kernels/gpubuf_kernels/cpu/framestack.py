"""Frame matching of stacked rows as a compiled CPU loop.

:func:`gpubuf.ops.match_frames.match_frames` is the specification: for every frame slot
``(row i, leaf j, position k)`` of a batch (and of an optional tail row, row ``-1``), the first of
its candidates, in the documented order, that holds the same bytes, and from that the root of
every slot. There the candidates are whole-batch compares over a copy of tail and batch; here
each slot tries its candidates in turn, reading the frames where they lie, and takes its root
from the matched candidate's (resolved already, as every candidate is an earlier slot).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")  # a call costs more than a short compare
def _equal(a, i, b, j, n):  # pragma: no cover - compiled
    """``a[i : i + n] == b[j : j + n]``.

    An OR of XORs over the whole frame, with no early exit: that loop vectorizes, and most frames
    compared are equal (a stack against the previous row's), so a full pass is the common case
    anyway. Measured on Atari rows as uint64 units, it beats both an exit on the first differing
    unit and an exit after each block of 1 or 4 KiB.
    """
    # Unsigned offsets: with signed ones every index gets a wraparound test for negative values,
    # which keeps the loop from vectorizing.
    if n == 0:  # empty frames: all equal, and no first unit to read
        return True
    i = np.uint64(i)
    j = np.uint64(j)
    acc = a[i] ^ b[j]
    for y in range(np.uint64(1), np.uint64(n)):
        acc |= a[i + y] ^ b[j + y]
    return acc == 0


@njit(cache=True, nogil=True)
def match_roots(stacks, tail, has_tail, n, S, F, cands, n_cands):  # pragma: no cover - compiled
    """The root slot of every frame slot of tail and batch.

    Args:
        stacks: one flat array per leaf, ``[n * S * F]`` units (uint8, or a wider integer type
            when the frame size allows): frame ``(i, k)`` at ``(i * S + k) * F``.
        tail: one flat array per leaf, ``[S * F]`` units, the previous row (any content when
            ``has_tail`` is False: it is never read then).
        has_tail: whether the tail is a real row that batch row 0 may match.
        n, S, F: rows, positions per stack, units per frame.
        cands: int64 ``[J, C, 3]``: leaf ``j``'s candidates in order, ``(previous row?, leaf,
            position shift)``, only those whose shift is below ``S``.
        n_cands: int64 ``[J]``, how many of ``cands[j]`` are used.

    Returns:
        int64 ``[(n + 1) * J * S]``: the root of slot ``((i + 1) * J + j) * S + k``.
    """
    J = n_cands.shape[0]
    roots = np.arange((n + 1) * J * S)
    for i in range(n):
        has_prev = i > 0 or has_tail
        # Positions from the last down, every leaf at each: a slot's same-row candidates sit one
        # position higher, the others in the row before, so all are resolved already, whatever
        # the pairing (the roots do not depend on the walk, only on each slot's first match).
        for k in range(S - 1, -1, -1):
            for j in range(J):
                a = stacks[j]
                at = (i * S + k) * F
                slot = ((i + 1) * J + j) * S + k
                for c in range(n_cands[j]):
                    prev = cands[j, c, 0] != 0
                    jj = cands[j, c, 1]
                    kk = k + cands[j, c, 2]
                    if kk >= S or (prev and not has_prev):
                        continue
                    row = i - 1 if prev else i
                    if row < 0:  # the tail, held apart from the batch
                        same = _equal(a, at, tail[jj], kk * F, F)
                    else:
                        same = _equal(a, at, stacks[jj], (row * S + kk) * F, F)
                    if same:
                        roots[slot] = roots[((row + 1) * J + jj) * S + kk]
                        break
    return roots


@njit(cache=True, nogil=True)
def plan_frames(roots, tail_ids, has_tail, J, S, FB, first_id, stored_age, stored_key, interval):  # pragma: no cover
    """Frame numbers of every slot, and where each new frame lies and which key frame it is coded against.

    The steps of ``FrameStackStorage._write_encoded`` after the matching, and of its
    ``_assign_keys``, in one pass over the slots and one over the new frames.

    Args:
        roots: int64 ``[(n + 1) * J * S]``, :func:`match_roots`' result.
        tail_ids: int ``[J * S]``, the tail row's frame numbers (read when ``has_tail``).
        has_tail: whether row ``-1`` is a real row.
        J, S, FB: leaves, positions per stack, bytes per frame.
        first_id: the number the first new frame gets.
        stored_age, stored_key: int32, by frame number, each stored frame's age and key frame.
        interval: the key interval.

    Returns:
        ``(fid, src, off, keys, ages, key_src, key_off, stored)``: ``fid`` int64 ``[slots]``, each
        slot's frame number (-1 for the tail slots without a tail); for the ``m`` new frames, in
        slot order, int64 ``src`` (leaf) and ``off`` (byte offset in that leaf's flat batch),
        int64 ``keys`` (key frame, -1 for none) and int32 ``ages``; ``key_src``/``key_off``,
        where each key frame lies: a new frame's place, or ``(J, k * FB)`` for ``stored[k]``, the
        distinct key frames from earlier batches (to be decoded, in that order).
    """
    slots = roots.shape[0]
    JS = J * S
    fid = np.empty(slots, np.int64)
    m = 0
    # Roots first, numbered in slot order; then every other slot takes its root's number (a root
    # may come later in slot order: within a stack, positions are matched from the last down).
    for s in range(slots):
        if roots[s] != s:
            continue
        if s < JS:
            fid[s] = tail_ids[s] if has_tail else -1
        else:
            fid[s] = first_id + m
            m += 1
    for s in range(slots):
        r = roots[s]
        if r != s:
            fid[s] = fid[r]
    src = np.empty(m, np.int64)
    off = np.empty(m, np.int64)
    keys = np.empty(m, np.int64)
    ages = np.empty(m, np.int32)
    key_src = np.zeros(m, np.int64)
    key_off = np.zeros(m, np.int64)
    stored = np.empty(m, np.int64)
    n_stored = 0
    i = 0
    for s in range(JS, slots):
        if roots[s] != s:
            continue
        own = first_id + i
        k = s % S
        src[i] = (s // S) % J
        off[i] = ((s // JS - 1) * S + k) * FB
        # The predecessor: the frame before this one in its stack, when that is another frame.
        p = fid[s - 1] if k > 0 else -1
        if p == own:
            p = -1
        key = -1
        age = 0
        if 0 <= p < own:
            if p >= first_id:
                age, key = ages[p - first_id], keys[p - first_id]
            else:
                age, key = stored_age[p], stored_key[p]
            age += 1
            if age >= interval:
                key = -1
                age = 0
            elif key < 0:
                key = p
        keys[i] = key
        ages[i] = age
        if key >= first_id:
            key_src[i] = src[key - first_id]
            key_off[i] = off[key - first_id]
        elif key >= 0:
            at = 0
            while at < n_stored and stored[at] != key:
                at += 1
            if at == n_stored:
                stored[at] = key
                n_stored += 1
            key_src[i] = J
            key_off[i] = at * FB
        i += 1
    return fid, src, off, keys, ages, key_src, key_off, stored[:n_stored]
