"""The distributed buffers' arguments are checked before any Ray runtime starts, and importing
gpubuf (its distributed package included) never imports Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpubuf.distributed import MinSize, RayReplayBuffer, ShardedReplayBuffer


@pytest.mark.parametrize("num_shards", [0, -1, 2.0, True])
def test_sharded_buffer_refuses_a_bad_shard_count(num_shards):
    with pytest.raises(ValueError, match="num_shards"):
        ShardedReplayBuffer(num_shards=num_shards)


@pytest.mark.parametrize("prefetch", [-1, 1.5, True, "2"])
def test_sharded_buffer_refuses_a_bad_prefetch(prefetch):
    with pytest.raises(ValueError, match="prefetch"):
        ShardedReplayBuffer(num_shards=2, prefetch=prefetch)


@pytest.mark.parametrize("cls", [ShardedReplayBuffer, RayReplayBuffer])
def test_a_rate_limiter_must_be_one(cls):
    with pytest.raises(TypeError, match="RateLimiter"):
        cls(rate_limiter={"samples_per_insert": 1.0})


def test_ray_buffer_refuses_transports_it_does_not_offer():
    with pytest.raises(NotImplementedError, match="distributed"):
        RayReplayBuffer(transport="distributed")
    with pytest.raises(ValueError, match="transport"):
        RayReplayBuffer(transport="tcp")
    with pytest.raises(ValueError, match="transport_options"):
        RayReplayBuffer(transport_options={"backend": "gloo"})


def test_min_size_is_a_rate_limiter_without_a_band():
    limiter = MinSize(5)
    assert limiter.min_size_to_sample == 5 and limiter.max_diff == float("inf")


def test_importing_gpubuf_does_not_import_ray():
    code = "import sys, gpubuf, gpubuf.distributed; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
