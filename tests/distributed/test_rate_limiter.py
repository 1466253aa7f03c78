"""Rate limiters' admission rules (Reverb's ``SampleToInsertRatio`` and ``MinSize``), without Ray."""

from __future__ import annotations

import math

import pytest

from gpubuf.distributed import MinSize, RateLimiterState, SampleToInsertRatio


def test_error_buffer_sets_the_band_around_the_min_size_offset():
    limiter = SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=100, error_buffer=50.0)
    assert (limiter.min_diff, limiter.max_diff) == (350.0, 450.0)
    explicit = SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=100, error_buffer=(10, 30))
    assert (explicit.min_diff, explicit.max_diff) == (10.0, 30.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"samples_per_insert": 0.0, "min_size_to_sample": 1, "error_buffer": 10}, "samples_per_insert"),
        ({"samples_per_insert": math.inf, "min_size_to_sample": 1, "error_buffer": 10}, "samples_per_insert"),
        ({"samples_per_insert": 1.0, "min_size_to_sample": 0, "error_buffer": 10}, "min_size_to_sample"),
        ({"samples_per_insert": 4.0, "min_size_to_sample": 1, "error_buffer": 3.9}, "at least"),
        ({"samples_per_insert": 1.0, "min_size_to_sample": 1, "error_buffer": -1}, "error_buffer"),
        ({"samples_per_insert": 1.0, "min_size_to_sample": 1, "error_buffer": "wide"}, "error_buffer"),
        ({"samples_per_insert": 1.0, "min_size_to_sample": 1, "error_buffer": (5, 1)}, "must not exceed"),
    ],
)
def test_invalid_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SampleToInsertRatio(**kwargs)


def test_inserts_and_samples_wait_for_each_other_inside_the_band():
    # Offset 3, band [1, 5]: once 3 items are in, inserted - sampled stays within [1, 5].
    state = RateLimiterState(SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=3, error_buffer=2))
    for _ in range(5):
        assert state.try_reserve_insert(1) is not None
        state.commit_insert(1)
    assert state.try_reserve_insert(1) is None  # 6 - 0 > 5
    assert state.try_sample(5) is None  # 5 - 5 < 1
    assert state.try_sample(4) == {"inserted": 5, "reserved": 0, "sampled": 4}
    assert state.try_sample(1) is None
    assert state.try_reserve_insert(1) == {"inserted": 5, "reserved": 1, "sampled": 4}


def test_samples_wait_for_the_min_size_and_for_committed_inserts():
    state = RateLimiterState(SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=3, error_buffer=10))
    # Below the minimum size an insert is always admitted, however large the difference.
    assert state.try_reserve_insert(3) is not None
    assert not state.can_sample(1)  # reserved, not written yet
    state.commit_insert(3)
    assert state.can_sample(1)


def test_a_cancelled_insert_frees_its_reservation():
    state = RateLimiterState(SampleToInsertRatio(samples_per_insert=1.0, min_size_to_sample=1, error_buffer=2))
    assert state.try_reserve_insert(3) is not None
    assert state.try_reserve_insert(1) is None
    state.cancel_insert(3)
    assert state.snapshot() == {"inserted": 0, "reserved": 0, "sampled": 0}
    assert state.try_reserve_insert(3) is not None


def test_a_full_buffer_stops_counting_size():
    # Capacity 2 never reaches a minimum size of 3: sampling stays closed, as the buffer never holds 3.
    state = RateLimiterState(MinSize(3), capacity=2)
    for _ in range(10):
        assert state.try_reserve_insert(1) is not None
        state.commit_insert(1)
    assert not state.can_sample(1)


def test_min_size_never_blocks_inserts():
    state = RateLimiterState(MinSize(2))
    assert not state.can_sample(1)
    assert state.try_reserve_insert(10**9) is not None
    state.commit_insert(10**9)
    assert state.try_sample(10**12) is not None
    assert state.can_insert(1)
