"""Ray-backed buffers on a local Ray cluster (127.0.0.1, 2 CPUs): a remote buffer, a 4-shard
buffer, a rate limiter and a shard that dies.

Every assertion is on counts, contents and distributions, none on timing; the timeouts given to
blocking calls only turn a deadlock into a failure.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch
from tensordict import TensorDict

ray = pytest.importorskip("ray")

from gpubuf import (  # noqa: E402
    LazyTensorStorage,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from gpubuf.distributed import (  # noqa: E402
    MinSize,
    RayReplayBuffer,
    RemoteTensorDictReplayBuffer,
    SampleToInsertRatio,
    ShardedReplayBuffer,
)
from gpubuf.errors import RateLimitTimeoutError, SchemaMismatchError, ShardUnavailableError  # noqa: E402
from ray_net_helpers import is_loopback, listening_addresses  # noqa: E402

# pytest imports this file as a top-level module that Ray's workers cannot import: its remote
# functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WRITERS, ROWS, BATCH, SHARDS = 4, 25_000, 1_000, 4
DEADLOCK_GUARD_S = 120  # a blocked call fails after this long instead of hanging the suite


def rows(ids: torch.Tensor) -> TensorDict:
    return TensorDict({"id": ids, "obs": ids.to(torch.float32).unsqueeze(-1).expand(-1, 3).clone()}, [len(ids)])


@ray.remote
def write_rows(buffer, writer: int) -> torch.Tensor:
    """Writes ids ``[writer * ROWS, (writer + 1) * ROWS)`` in batches; returns the indices written."""
    start = writer * ROWS
    return torch.cat([buffer.extend(rows(torch.arange(start + b, start + b + BATCH))) for b in range(0, ROWS, BATCH)])


@pytest.fixture(scope="module")
def remote(ray_cluster):
    rb = RayReplayBuffer(
        replay_buffer_cls=RemoteTensorDictReplayBuffer,
        storage=partial(LazyTensorStorage, WRITERS * ROWS),
        batch_size=64,
        remote_config={"num_cpus": 0},
    )
    yield rb
    rb.close()


@pytest.fixture(scope="module")
def sharded(ray_cluster, tmp_path_factory):
    rb = ShardedReplayBuffer(
        num_shards=SHARDS,
        replay_buffer_cls=TensorDictPrioritizedReplayBuffer,
        alpha=1.0,
        beta=0.6,
        storage=partial(LazyTensorStorage, 2 * ROWS),
        batch_size=256,
        checkpoint_dir=tmp_path_factory.mktemp("shards"),
        rate_limiter=MinSize(1),  # never blocks here; counts every insert and sample across clients
        seed=0,
    )
    yield rb
    rb.close()


# ---------------------------------------------------------------------------- one remote buffer
def test_four_writer_tasks_into_one_remote_buffer_lose_and_duplicate_nothing(remote):
    indices = ray.get([write_rows.remote(remote, w) for w in range(WRITERS)])
    assert len(remote) == remote.write_count == WRITERS * ROWS
    ids = remote[:]["id"]
    assert torch.equal(torch.sort(ids).values, torch.arange(WRITERS * ROWS))
    for writer, index in enumerate(indices):
        # Each writer was told where its rows landed.
        assert torch.equal(ids[index], torch.arange(writer * ROWS, (writer + 1) * ROWS))


def test_every_buffer_class_gives_its_ray_actor_class(ray_cluster):
    """TorchRL's ``as_remote`` on any buffer class: a Ray actor class with ``is_remote`` set."""
    actor_cls = TensorDictReplayBuffer.as_remote({"num_cpus": 0})
    assert actor_cls.is_remote
    actor = actor_cls.remote(storage=partial(LazyTensorStorage, 50), batch_size=4)
    try:
        index = ray.get(actor.extend.remote(rows(torch.arange(10))), timeout=DEADLOCK_GUARD_S)
        assert index.tolist() == list(range(10))
        batch = ray.get(actor.sample.remote(), timeout=DEADLOCK_GUARD_S)
        assert batch.batch_size == (4,) and bool((batch["id"] < 10).all())
    finally:
        ray.kill(actor)


def test_a_buffer_asked_for_as_a_ray_service_is_built_in_an_actor(ray_cluster):
    """TorchRL's dispatch: a buffer class called with service_backend="ray" returns that buffer
    built in a Ray actor, with the options' remote_config; other options are refused first."""
    with pytest.raises(TypeError, match="Unexpected Ray replay-buffer service options"):
        TensorDictReplayBuffer(storage=partial(LazyTensorStorage, 100), service_backend="ray",
                               service_backend_options={"actor_options": {}})
    rb = TensorDictReplayBuffer(
        storage=partial(LazyTensorStorage, 100), batch_size=8, service_backend="ray",
        service_backend_options={"remote_config": {"num_cpus": 0}},
    )
    try:
        assert isinstance(rb, RayReplayBuffer) and rb.service_backend == "ray"
        assert rb.replay_buffer_cls is TensorDictReplayBuffer
        rb.extend(rows(torch.arange(20)))
        assert len(rb) == 20
        batch = rb.sample()
        assert batch.batch_size == (8,) and bool((batch["obs"][:, 0] == batch["id"].float()).all())
    finally:
        rb.close()


def test_remote_buffer_forwards_the_buffer_api(remote, tmp_path):
    batch, info = remote.sample(return_info=True)
    assert batch.batch_size == (64,) and torch.equal(batch["index"], info["index"])
    assert torch.equal(batch["id"], remote[info["index"]]["id"])
    before = len(remote)
    with pytest.raises(SchemaMismatchError):  # the actor's typed error, as raised there
        remote.extend(TensorDict({"id": torch.arange(2), "obs": torch.zeros(2, 5)}, [2]))
    assert len(remote) == before
    with pytest.raises(ValueError, match="rate_limiter"):
        remote.sample(wait=True)
    remote.dumps(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "meta.json").exists()
    remote.empty()
    assert len(remote) == 0
    remote.loads(tmp_path / "ckpt")
    assert len(remote) == before


def test_remote_buffer_members_act_on_the_actor_buffer(ray_cluster):
    # Every member of TorchRL's RayReplayBuffer, used through the handle: the effects are read
    # back from the actor, never from a local copy.
    rb = RayReplayBuffer(
        replay_buffer_cls=TensorDictReplayBuffer,
        storage=partial(LazyTensorStorage, 8),
        sampler=SamplerWithoutReplacement,
        writer=partial(RoundRobinWriter, track_generations=True),
        batch_size=4,
        remote_config={"num_cpus": 0},
        delayed_init=True,
    )
    try:
        assert not rb.initialized

        def traced(ids: torch.Tensor) -> TensorDict:
            data = rows(ids)
            data["traj_ids"] = ids // 3
            return data

        ids = torch.arange(6)
        index = rb.extend(traced(ids))
        assert rb.initialized
        # Components, through the actor.
        assert len(rb.storage) == 6 and rb.storage.max_size == 8
        assert torch.equal(rb.storage[index]["id"], ids)
        assert type(rb.sampler).__name__ == "RemoteComponent" and rb.sampler.ran_out is False
        generation = rb.writer.generations_of(index)
        assert generation.shape == (6,) and bool((generation >= 0).all())
        rb.transform.append(lambda td: td.set("seen", torch.ones(td.batch_size)))
        assert bool((rb.sample()["seen"] == 1).all())  # the appended transform runs on the actor
        # In-place writes return the client for chaining, and land on the actor.
        assert rb.set_("obs", torch.zeros(6, 3)) is rb
        assert rb.set_at_("obs", torch.ones(2, 3), index[:2]).share() is rb
        assert torch.equal(rb[:]["obs"][:, 0], torch.tensor([1.0, 1, 0, 0, 0, 0]))
        assert rb.update_({"obs": torch.full((6, 3), 5.0)}) is rb and bool((rb[:]["obs"] == 5).all())
        # Conditional updates: a live handle is patched, a stale one is skipped.
        result = rb.update_if_present(index=index[:3], generation=generation[:3], patch={"id": torch.full((3,), 70)})
        assert result.updated_count == 3
        rb.extend(traced(torch.arange(100, 103)))  # rewrites slots 6, 7 and 0: slot 0's handle is stale
        patch = {"id": torch.full((2,), 80)}
        future = rb.submit_update_if_present(index=index[:2], generation=generation[:2], patch=patch)
        rb.synchronize()
        assert future.result().updated.tolist() == [False, True]
        assert rb[1]["id"] == 80 and rb[0]["id"] == 102
        # Bulk writes and reads, oldest first.
        rb.write_all(traced(torch.arange(20, 28)))
        assert torch.equal(rb.read_all_in_order()["id"], torch.arange(20, 28))
        # Iteration without replacement: every item once, then the end.
        seen = torch.cat([batch["id"] for batch in rb])
        assert torch.equal(torch.sort(seen).values, torch.arange(20, 28))
        assert rb.next() is not None  # a new pass starts after the end
        rb.empty()
        rb.extend(traced(torch.arange(1, 9)))  # trajectories 0: ids 1-2, 1: ids 3-5, 2: ids 6-8
        assert sorted(len(t) for t in rb.query(trajectory_key="traj_ids")) == [2, 3, 3]
    finally:
        rb.close()


# ---------------------------------------------------------------------------- four shards
def test_four_writer_tasks_into_four_shards_lose_and_duplicate_nothing(sharded):
    sharded.empty()
    indices = ray.get([write_rows.remote(sharded, w) for w in range(WRITERS)])
    assert len(sharded) == WRITERS * ROWS
    assert sharded.stats()["rate_limiter"] == {"inserted": WRITERS * ROWS, "reserved": 0, "sampled": 0}
    held = torch.cat([sharded.shard(s)[:]["id"] for s in range(SHARDS)])
    assert torch.equal(torch.sort(held).values, torch.arange(WRITERS * ROWS))
    everything = torch.cat(indices)
    assert torch.unique(everything).numel() == WRITERS * ROWS
    for writer, index in enumerate(indices):
        # A global index names its shard: reading it back gives the row written there.
        assert torch.equal(sharded[index]["id"], torch.arange(writer * ROWS, (writer + 1) * ROWS))


def test_rows_routed_by_key_land_on_the_shard_the_key_names(sharded):
    sharded.empty()
    sharded.shard_key = "id"
    try:
        ids = torch.randperm(400, generator=torch.Generator().manual_seed(2))
        index = sharded.extend(rows(ids))
    finally:
        sharded.shard_key = None
    shard_of, _ = sharded.split_index(index)
    assert torch.equal(shard_of, ids % SHARDS)
    assert torch.equal(sharded[index]["id"], ids)
    for s in range(SHARDS):
        assert torch.equal(torch.sort(sharded.shard(s)[:]["id"]).values, torch.arange(s, 400, SHARDS))


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for ``df`` degrees of freedom at upper tail 1e-4 (Wilson-Hilferty)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def test_prioritized_sampling_over_four_shards_is_globally_proportional(sharded):
    sharded.empty()
    per_shard = 32
    index = torch.cat([sharded.extend(rows(torch.arange(s * per_shard, (s + 1) * per_shard))) for s in range(SHARDS)])
    shard_of, _ = sharded.split_index(index)
    assert sorted(set(shard_of.tolist())) == list(range(SHARDS))
    gen = torch.Generator().manual_seed(1)
    # Shards of very different total mass: a per-shard (not global) draw would be far off.
    priority = (torch.rand(len(index), generator=gen) + 0.05) * (1.0 + 3.0 * shard_of)
    sharded.update_priority(index, priority)
    leaf = (priority.to(torch.float64) + 1e-8).to(torch.float32).to(torch.float64)  # alpha = 1
    position = torch.full((SHARDS * sharded.shard_capacity,), -1, dtype=torch.long)
    position[index] = torch.arange(len(index))
    counts = torch.zeros(len(index), dtype=torch.float64)
    draws = 0
    for _ in range(120):
        batch = sharded.sample(wait=True, timeout=DEADLOCK_GUARD_S)
        where = position[batch["index"]]
        assert bool((where >= 0).all())
        # Rows and indices agree, and the weights are against the global minimum.
        assert torch.equal(batch["id"], where)  # the row at position k holds id k
        expected_w = (leaf[where] / leaf.min()) ** -0.6
        torch.testing.assert_close(batch["priority_weight"].to(torch.float64), expected_w, rtol=1e-5, atol=0)
        counts += torch.bincount(where, minlength=len(index)).to(torch.float64)
        draws += batch.batch_size[0]
    assert sharded.stats()["rate_limiter"]["sampled"] == draws
    expected = leaf / leaf.sum() * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi2_critical(len(index) - 1), chi2
    # The mass of each shard is drawn in its share.
    shard_counts = torch.bincount(shard_of, weights=counts, minlength=SHARDS)
    shard_expected = torch.bincount(shard_of, weights=expected, minlength=SHARDS)
    assert float(((shard_counts - shard_expected) ** 2 / shard_expected).sum()) < _chi2_critical(SHARDS - 1)

    # A sample's new priorities go back to the shards that hold its rows.
    batch["td_error"] = torch.full((batch.batch_size[0],), 7.0)
    sharded.update_tensordict_priority(batch)
    touched = torch.unique(position[batch["index"]])
    leaf[touched] = 7.0
    masses = sharded.stats()["shards"]
    for s in range(SHARDS):
        assert masses[s]["mass"] == pytest.approx(float(leaf[shard_of == s].sum()), rel=1e-6)


def test_a_killed_shard_raises_a_typed_error_and_comes_back_from_its_checkpoint(sharded):
    sharded.empty()
    index = torch.cat([sharded.extend(rows(torch.arange(s * 100, (s + 1) * 100))) for s in range(SHARDS)])
    shard_of, _ = sharded.split_index(index)
    sharded.checkpoint()
    victim = int(shard_of[0])
    saved = sharded.shard(victim)[:]["id"]
    os.kill(sharded.shard_pid(victim), signal.SIGKILL)

    with pytest.raises(ShardUnavailableError, match=f"shard {victim} of {SHARDS}") as caught:
        sharded.update_priority(index[shard_of == victim], torch.full((100,), 2.0))
    assert caught.value.shard == victim and isinstance(caught.value, RuntimeError)
    assert sharded.unavailable_shards == [victim]

    # The other shards keep serving: sampling, writing, priority updates.
    batch = sharded.sample(512)
    assert not bool((sharded.split_index(batch["index"])[0] == victim).any())
    assert len(sharded) == 300
    more = sharded.extend(rows(torch.arange(1000, 1100)))
    assert not bool((sharded.split_index(more)[0] == victim).any())
    sharded.update_priority(index[shard_of != victim], torch.full((300,), 2.0))

    sharded.restart_shard(victim)
    assert sharded.unavailable_shards == []
    assert torch.equal(sharded.shard(victim)[:]["id"], saved)
    assert len(sharded) == 500
    back = sharded.sample(2048)
    assert bool((sharded.split_index(back["index"])[0] == victim).any())


def test_batches_drawn_ahead_are_stored_rows_and_follow_updates_and_empty(ray_cluster):
    prefetch = 2
    rb = ShardedReplayBuffer(
        num_shards=2,
        replay_buffer_cls=TensorDictPrioritizedReplayBuffer,
        alpha=1.0,
        beta=0.5,
        storage=partial(LazyTensorStorage, 64),
        batch_size=16,
        prefetch=prefetch,
        remote_config={"num_cpus": 0},
        seed=3,
    )
    try:
        index = torch.cat([rb.extend(rows(torch.arange(s * 32, (s + 1) * 32))) for s in range(2)])
        shard_of, _ = rb.split_index(index)
        for _ in range(3 * prefetch):
            batch = rb.sample()
            assert batch.batch_size == (16,)
            assert torch.equal(batch["id"], rb[batch["index"]]["id"])  # each row is the one its index names
        assert rb.sample(8).batch_size == (8,)  # another size: drawn now, not taken from what was drawn ahead
        # Priority updates sent while batches are drawn ahead reach the shards: once those batches
        # (at most 2 * prefetch) are handed out, shard 0's rows, now of negligible priority, are not drawn.
        low = shard_of == 0
        rb.update_priority(index, torch.where(low, 1e-6, 1.0))
        masses = rb.stats()["shards"]
        assert masses[0]["mass"] < 1e-3 and masses[1]["mass"] == pytest.approx(32.0)
        for _ in range(2 * prefetch):
            rb.sample()
        later = torch.cat([rb.sample()["index"] for _ in range(4)])
        assert not bool((rb.split_index(later)[0] == 0).any())
        # Emptying drops what was drawn ahead: only rows written after it come back.
        rb.empty()
        rb.extend(rows(torch.arange(500, 532)))
        assert bool((rb.sample()["id"] >= 500).all())
    finally:
        rb.close()


# ---------------------------------------------------------------------------- rate limiter
SPI, MIN_SIZE, ERROR_BUFFER = 2.0, 500, 300.0
INSERT_BATCHES, INSERT_ROWS, SAMPLE_BATCHES, SAMPLE_ROWS = 15, 100, 24, 100


@ray.remote
def limited_writer(buffer, writer: int) -> list[dict]:
    seen = []
    for b in range(INSERT_BATCHES):
        start = (writer * INSERT_BATCHES + b) * INSERT_ROWS
        buffer.extend(rows(torch.arange(start, start + INSERT_ROWS)), timeout=DEADLOCK_GUARD_S)
        seen.append(buffer.stats()["rate_limiter"])
    return seen


def limited_sampler(buffer) -> tuple[int, list[dict]]:
    seen, drawn = [], 0
    for _ in range(SAMPLE_BATCHES):
        drawn += buffer.sample(SAMPLE_ROWS, wait=True, timeout=DEADLOCK_GUARD_S).batch_size[0]
        seen.append(buffer.stats()["rate_limiter"])
    return drawn, seen


def test_rate_limiter_holds_the_ratio_under_concurrent_writers_and_samplers(ray_cluster):
    limiter = SampleToInsertRatio(samples_per_insert=SPI, min_size_to_sample=MIN_SIZE, error_buffer=ERROR_BUFFER)
    rb = RayReplayBuffer(
        replay_buffer_cls=RemoteTensorDictReplayBuffer,
        storage=partial(LazyTensorStorage, 2 * INSERT_BATCHES * INSERT_ROWS),
        remote_config={"num_cpus": 0},
        rate_limiter=limiter,
    )
    try:
        assert not rb.can_sample(SAMPLE_ROWS)
        with pytest.raises(RateLimitTimeoutError):
            rb.sample(SAMPLE_ROWS)  # wait=False: refused at once
        with pytest.raises(TimeoutError):
            rb.sample(SAMPLE_ROWS, wait=True, timeout=0.2)  # nothing will be inserted meanwhile

        # Writers are Ray tasks (other processes), samplers threads of this one: all at once.
        writers = [limited_writer.remote(rb, w) for w in range(2)]
        with ThreadPoolExecutor(2) as pool:
            samplers = [pool.submit(limited_sampler, rb.client()) for _ in range(2)]
            sampled = [f.result() for f in samplers]
        written = [s for seen in ray.get(writers) for s in seen]
        snapshots = written + [s for _, seen in sampled for s in seen]

        for snap in snapshots:
            inserted, reserved, n_sampled = snap["inserted"], snap["reserved"], snap["sampled"]
            if inserted + reserved > MIN_SIZE:
                assert (inserted + reserved) * SPI - n_sampled <= limiter.max_diff, snap
            if n_sampled:
                assert inserted >= MIN_SIZE and inserted * SPI - n_sampled >= limiter.min_diff, snap
        total_inserted = 2 * INSERT_BATCHES * INSERT_ROWS
        total_sampled = 2 * SAMPLE_BATCHES * SAMPLE_ROWS
        assert sum(drawn for drawn, _ in sampled) == total_sampled
        final = rb.stats()
        assert final["rate_limiter"] == {"inserted": total_inserted, "reserved": 0, "sampled": total_sampled}
        assert final["size"] == final["write_count"] == total_inserted
        assert limiter.min_diff <= total_inserted * SPI - total_sampled <= limiter.max_diff
    finally:
        rb.close()


# ---------------------------------------------------------------------------- the cluster itself
def test_the_cluster_listens_on_loopback_addresses_only(remote, sharded):
    addresses = listening_addresses(os.getpid())
    assert addresses, "no listening socket found for the cluster's processes"
    outward = [a for a in addresses if not is_loopback(a[0])]
    assert not outward, outward
