"""The identity memo under the compiled CPU kernels' views: kept for the same objects only."""

from __future__ import annotations

import torch

from gpubuf.ops._memo import LastByIdentity, LastByWeakIdentity


def test_kept_while_the_same_objects_come_back_and_remade_for_others():
    memo, made = LastByIdentity(), []

    def make(value):
        def run():
            made.append(value)
            return value
        return run

    a, b = torch.zeros(3), torch.zeros(3)
    assert memo.get((a, b), make(1)) == 1
    assert memo.get((a, b), make(2)) == 1  # the same objects: kept
    assert memo.get((a, b.clone()), make(3)) == 3  # equal values, another object: remade
    assert memo.get((a,), make(4)) == 4  # fewer objects, the first the same: remade
    assert memo.get((a, b), make(5)) == 5  # one entry only: the first pair was replaced
    assert made == [1, 3, 4, 5]


def test_the_kept_objects_stay_alive():
    memo = LastByIdentity()
    memo.get((torch.zeros(2),), lambda: "views")
    (kept,) = memo._entry[0]
    assert kept.shape == (2,)  # held by the entry, so its id cannot be reused while kept


def test_the_weak_memo_keeps_nothing_alive_and_misses_once_an_object_died():
    import gc
    import weakref

    memo = LastByWeakIdentity()
    a, b = torch.zeros(3), torch.ones(3)
    made = []
    assert memo.get((a, b), lambda: made.append(1) or "first") == "first"
    assert memo.get((a, b), lambda: made.append(1) or "again") == "first" and made == [1]
    assert memo.get((b, a), lambda: made.append(1) or "swapped") == "swapped" and made == [1, 1]
    alive = weakref.ref(a)
    del a
    gc.collect()
    assert alive() is None
    c = torch.zeros(3)
    assert memo.get((c, b), lambda: "new") == "new"
