"""Usages from TorchRL's documentation run unchanged against gpubuf and TorchRL, side by side.

Each test runs the same code with ``lib`` bound to ``torchrl.data`` and to ``gpubuf`` and compares
structure and, where the result is deterministic (or drawn from the same seeded generator), values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import gpubuf

torchrl_data = pytest.importorskip("torchrl.data")
from torchrl.data.replay_buffers import scheduler as torchrl_scheduler  # noqa: E402

LIBS = pytest.mark.parametrize("lib", [torchrl_data, gpubuf], ids=["torchrl", "gpubuf"])


def both(fn):
    """Runs ``fn(lib)`` for TorchRL and gpubuf and returns both results (see :func:`on_torchrl`)."""
    return on_torchrl(fn), fn(gpubuf)


def on_torchrl(fn):
    """``fn(torchrl.data)``. TorchRL's prioritized samplers need its compiled segment trees, which
    load only when built for the installed torch (the test command builds them:
    ``scripts/build_torchrl_extension.py``); where they are missing there is nothing to compare
    against, and the test says so."""
    try:
        return fn(torchrl_data)
    except RuntimeError as err:
        if "SegmentTree" not in str(err):
            raise
        pytest.skip(f"TorchRL's compiled segment trees do not load here: {str(err)[:100]}")


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b, (a, b)


# ---------------------------------------------------------------------- schedulers
def scheduler_lib(lib):
    return torchrl_scheduler if lib is torchrl_data else gpubuf


@pytest.mark.parametrize(
    "make",
    [
        lambda S, s: S.LinearScheduler(s, param_name="beta", final_value=1.0, num_steps=4),
        lambda S, s: S.StepScheduler(s, param_name="beta", gamma=0.1, mode="additive", max_value=1.0, n_steps=2),
        lambda S, s: S.StepScheduler(s, param_name="alpha", gamma=0.5, min_value=0.2),
        lambda S, s: S.LambdaScheduler(s, param_name="beta", lambda_fn=lambda step: 1 + step / 10),
    ],
    ids=["linear", "step-additive", "step-multiplicative", "lambda"],
)
def test_schedulers_move_the_sampler_parameter_as_torchrl(make):
    def run(lib):
        rb = lib.PrioritizedReplayBuffer(alpha=0.7, beta=0.6, storage=lib.LazyTensorStorage(10))
        schedulers = scheduler_lib(lib).SchedulerList([make(scheduler_lib(lib), rb)])
        values = []
        for _ in range(6):
            schedulers.step()
            values.append((round(float(rb.sampler.alpha), 12), round(float(rb.sampler.beta), 12)))
        return values

    ours, theirs = run(gpubuf), run(torchrl_data)
    assert ours == theirs


def test_scheduler_state_dict_round_trip_and_refusals():
    rb = gpubuf.PrioritizedReplayBuffer(alpha=0.7, beta=0.6, storage=gpubuf.LazyTensorStorage(10))
    sched = gpubuf.LinearScheduler(rb, "beta", final_value=1.0, num_steps=4)
    sched.step()
    state = sched.state_dict()
    assert "sampler" not in state and state["_step_cnt"] == 1
    other = gpubuf.LinearScheduler(rb.sampler, "beta", final_value=1.0, num_steps=4)
    other.load_state_dict(state)
    other.step()
    assert float(rb.sampler.beta) == pytest.approx(0.8)
    with pytest.raises(TypeError, match="only supports Sampler"):
        gpubuf.LinearScheduler(object(), "beta", 1.0, 4)
    with pytest.raises(ValueError, match="does not have an attribute"):
        gpubuf.LinearScheduler(rb, "gamma", 1.0, 4)
    with pytest.raises(ValueError, match="Invalid mode"):
        gpubuf.StepScheduler(rb, "beta", mode="exponential")


# ---------------------------------------------------------------------- ConsumingSampler
def test_consuming_sampler_docstring_usage():
    def run(lib):
        torch.manual_seed(0)
        rb = lib.ReplayBuffer(storage=lib.ListStorage(10), sampler=lib.ConsumingSampler(), batch_size=3)
        first = rb.extend([torch.tensor(i) for i in range(4)])
        sample = rb.sample()
        after = len(rb)
        again = rb.extend([torch.tensor(i) for i in range(10, 14)])
        return first, sorted(int(x) for x in sample), after, again, len(rb)

    theirs, ours = both(run)
    assert_same(theirs, ours)


@pytest.mark.parametrize("count", [1, 2])
def test_consume_after_n_samples_matches_torchrl(count):
    def run(lib):
        generator = torch.Generator().manual_seed(3)
        rb = lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(8), batch_size=3, consume_after_n_samples=count, generator=generator
        )
        rb.extend(torch.arange(6))
        seen = []
        while rb.can_sample():
            seen.append(rb.sample().tolist())
        with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
            rb.sample()
        state = rb.sampler.state_dict()
        return seen, len(rb), type(rb.sampler).__name__, state["_sample_count"].tolist(), rb.extend(torch.arange(3))

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_consume_after_n_samples_refusals():
    for lib in (torchrl_data, gpubuf):
        with pytest.raises(ValueError):
            lib.ReplayBuffer(storage=lib.LazyTensorStorage(4), consume_after_n_samples=0)
        with pytest.raises(TypeError):
            lib.ReplayBuffer(storage=lib.LazyTensorStorage(4), consume_after_n_samples=1.5)
        with pytest.raises(ValueError):
            lib.ReplayBuffer(storage=lib.LazyTensorStorage(4), consume_after_n_samples=1, prefetch=2, batch_size=2)
        with pytest.raises(ValueError):
            lib.ReplayBuffer(
                storage=lib.LazyTensorStorage(4), sampler=lib.SamplerWithoutReplacement(), consume_after_n_samples=1
            )


def test_consuming_sampler_dumps_and_loads(tmp_path):
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(8), sampler=gpubuf.ConsumingSampler(2), batch_size=3)
    rb.extend(torch.arange(6))
    rb.sample()
    rb.sampler.dumps(tmp_path / "sampler")
    fresh = gpubuf.ConsumingSampler(2)
    fresh.loads(tmp_path / "sampler")
    for key, value in rb.sampler.state_dict().items():
        assert_same(value, fresh.state_dict()[key])


# ---------------------------------------------------------------------- buffer members
def test_buffer_members_match_torchrl():
    def run(lib):
        rb = lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(10), batch_size=4)
        stats_before = rb.stats()
        rb.extend(TensorDict({"obs": torch.arange(6.0), "r": torch.zeros(6)}, [6]))
        out = {"stats_before": stats_before, "stats": rb.stats(), "can": rb.can_sample(), "can7": rb.can_sample(7)}
        rb.set_("r", torch.ones(6))
        rb.set_at_("obs", torch.tensor([-1.0, -2.0]), torch.tensor([0, 5]))
        rb.update_(TensorDict({"r": torch.full((6,), 3.0)}, [6]))
        stored = rb.read_all_in_order()
        out["obs"], out["r"] = stored["obs"], stored["r"]
        out["head"] = rb.read_all_in_order(2)["obs"]
        rb.write_all(TensorDict({"obs": torch.full((2,), 9.0), "r": torch.zeros(2)}, [2]))
        out["after_write_all"] = rb[:]["obs"]
        out["initialized"] = rb.initialized
        out["share"] = rb.share() is rb
        rb.synchronize()
        return out

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_can_sample_without_batch_size_raises_runtime_error():
    for lib in (torchrl_data, gpubuf):
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(4))
        with pytest.raises(RuntimeError, match="batch_size not specified"):
            rb.can_sample()


def test_next_iterates_then_returns_none_as_torchrl():
    def run(lib):
        rb = lib.TensorDictReplayBuffer(
            storage=lib.LazyTensorStorage(10), sampler=lib.SamplerWithoutReplacement(shuffle=False), batch_size=4
        )
        rb.extend(TensorDict({"obs": torch.arange(8.0)}, [8]))
        batches = []
        while (batch := rb.next()) is not None:
            batches.append(batch["obs"])
        return batches, rb.next()["obs"]

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_delayed_init_and_transform_factory():
    made = []

    def factory():
        made.append(1)
        return lambda data: data * 2

    for lib in (torchrl_data, gpubuf):
        made.clear()
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(10), batch_size=2, transform_factory=factory)
        assert not rb.initialized and not made
        assert rb.stats() == {
            "size": 0, "write_count": 0, "prefetch_queue_size": 0, "initialized": False, "capacity": 10, "utilization": 0.0
        }
        rb.extend(torch.arange(4))
        assert rb.initialized and made == [1]
        assert rb[:].tolist() == [0, 2, 4, 6]
        eager = lib.ReplayBuffer(storage=lib.LazyTensorStorage(10), delayed_init=False, transform_factory=factory)
        assert eager.initialized
        with pytest.raises(TypeError, match="mutually exclusive"):
            lib.ReplayBuffer(transform=factory(), transform_factory=factory)


def test_sample_unit_transition_is_the_identity():
    def run(lib):
        generator = torch.Generator().manual_seed(1)
        rb = lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(10), batch_size=4, sample_unit=lib.Transition(), generator=generator
        )
        rb.extend(torch.arange(10))
        return rb.sample(return_info=True)

    (t_data, t_info), (g_data, g_info) = both(run)
    assert_same(t_data, g_data)
    assert_same(t_info["index"], g_info["index"])
    with pytest.raises(TypeError, match="SampleUnit"):
        gpubuf.ReplayBuffer(sample_unit=object())


def test_random_sampler_without_replacement_dispatches():
    for lib in (torchrl_data, gpubuf):
        assert isinstance(lib.RandomSampler(), lib.RandomSampler)
        sampler = lib.RandomSampler(replacement=False, drop_last=True)
        assert isinstance(sampler, lib.SamplerWithoutReplacement) and sampler.drop_last


# ---------------------------------------------------------------------- writers
def test_writer_generations_and_write_at_match_torchrl():
    def run(lib):
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(4), writer=lib.RoundRobinWriter(track_generations=True))
        index = rb.extend(torch.arange(6))
        generations = rb.writer.generations_of(index)
        written = rb.writer.write_at(torch.tensor([1, 3]), torch.tensor([10, 30]))
        return (
            index,
            generations,
            written,
            rb.writer.generations_of(torch.arange(4)),
            rb[:],
            rb.write_count,
            rb.writer.tracks_generations,
            lib.RoundRobinWriter().generations_of(torch.arange(2)),
        )

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_writer_dumps_and_loads(tmp_path):
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4), writer=gpubuf.RoundRobinWriter(track_generations=True))
    rb.extend(torch.arange(6))
    rb.writer.dumps(tmp_path / "writer")
    fresh = gpubuf.RoundRobinWriter(track_generations=True)
    fresh.loads(tmp_path / "writer")
    assert fresh._cursor == 2 and fresh._write_count == 6
    assert fresh.generations_of(torch.arange(4)).tolist() == [1, 1, 0, 0]


# ---------------------------------------------------------------------- ensemble routing
@pytest.mark.parametrize("routing", [{"routing_key": "member"}, {"routing_dim": 0}])
def test_routed_ensemble_writes_match_torchrl(routing):
    def run(lib):
        members = [lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(6)) for _ in range(2)]
        rb = lib.ReplayBufferEnsemble(*members, **routing)
        if "routing_key" in routing:
            data = TensorDict({"obs": torch.arange(5.0), "member": torch.tensor([0, 1, 1, 0, 1])}, [5])
        else:
            data = TensorDict({"obs": torch.arange(6.0).reshape(2, 3), "member": torch.zeros(2, 3, dtype=torch.long)}, [2, 3])
        meta = rb.extend(data)
        return meta["buffer_ids"], meta["index"], members[0][:]["obs"], members[1][:]["obs"]

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_unrouted_ensemble_still_refuses_writes():
    rb = gpubuf.ReplayBufferEnsemble(gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4)))
    with pytest.raises(RuntimeError):
        rb.extend(TensorDict({"obs": torch.zeros(2)}, [2]))
    with pytest.raises(ValueError, match="mutually exclusive"):
        gpubuf.ReplayBufferEnsemble(gpubuf.ReplayBuffer(), routing_key="a", routing_dim=0)


# ---------------------------------------------------------------------- helpers
@pytest.mark.parametrize(
    "kwargs",
    [
        {"at_capacity": True, "cursor": 4},
        {"at_capacity": False},
        {"at_capacity": True, "cursor": torch.tensor([1, 4])},
        {"at_capacity": True, "cursor": range(3, 6)},
    ],
)
def test_find_start_stop_traj_matches_torchrl(kwargs):
    end = torch.zeros(10, dtype=torch.bool)
    end[2] = end[7] = True
    trajectory = torch.tensor([5, 5, 5, 0, 0, 1, 1, 1, 5, 5])
    end2d = torch.zeros(6, 3, dtype=torch.bool)
    end2d[1, 0] = end2d[4, 2] = True
    for signal in ({"end": end}, {"trajectory": trajectory}, {"end": end2d}):
        if "cursor" in kwargs and isinstance(kwargs["cursor"], int) and kwargs["cursor"] >= len(next(iter(signal.values()))):
            continue
        theirs = torchrl_data.find_start_stop_traj(**signal, **kwargs)
        ours = gpubuf.find_start_stop_traj(**signal, **kwargs)
        assert_same(theirs, ours)


def test_find_start_stop_traj_docstring_example():
    end = torch.zeros(10, dtype=torch.bool)
    end[2] = end[7] = True
    start, stop, lengths = gpubuf.find_start_stop_traj(end=end, at_capacity=True, cursor=4)
    assert start.squeeze(-1).tolist() == [8, 3, 5]
    assert stop.squeeze(-1).tolist() == [2, 4, 7]
    assert lengths.tolist() == [5, 2, 3]
    with pytest.raises(TypeError):
        gpubuf.find_start_stop_traj(at_capacity=False)


def test_small_helpers_match_torchrl():
    from torchrl.data.replay_buffers.replay_buffers import InPlaceSampler, stack_tensors
    from torchrl.data.replay_buffers.utils import pin_memory_output

    assert gpubuf.DEFAULT_DONE_KEYS == torchrl_data.DEFAULT_DONE_KEYS
    items = [[torch.ones(3) * i, torch.zeros(1, 2) + i] for i in range(4)]
    assert_same(stack_tensors(items), gpubuf.stack_tensors(items))
    with pytest.raises(RuntimeError, match="removed without replacement"):
        InPlaceSampler()
    with pytest.raises(RuntimeError, match="removed without replacement"):
        gpubuf.InPlaceSampler()

    class Holder:
        _pin_memory = False

        def out(self):
            return torch.ones(2), 3

    for decorator in (pin_memory_output, gpubuf.pin_memory_output):
        assert_same(decorator(Holder.out)(Holder()), (torch.ones(2), 3))


def test_conditional_update_result_counts():
    result = gpubuf.ConditionalUpdateResult(
        updated=torch.tensor([True, False, True, False]),
        version_rejected=torch.tensor([False, True, False, False]),
        batch_size=[4],
    )
    assert (result.updated_count, result.version_rejected_count, result.stale_count) == (2, 1, 1)
    plain = gpubuf.ConditionalUpdateResult(updated=torch.tensor([True, False]), batch_size=[2])
    assert (plain.updated_count, plain.version_rejected_count, plain.stale_count) == (1, 0, 1)


def test_storage_flags_and_checkpointer_argument():
    for name in ("ListStorage", "LazyTensorStorage", "LazyMemmapStorage", "StorageEnsemble", "Storage", "TensorStorage"):
        assert getattr(gpubuf, name).supports_conditional_update == getattr(torchrl_data, name).supports_conditional_update
    checkpointer = gpubuf.TensorStorageCheckpointer()
    assert gpubuf.Storage(4, checkpointer).checkpointer is checkpointer
    storage = gpubuf.LazyTensorStorage(4)
    storage.set(range(3), torch.arange(3) * 10)
    assert storage.get(indices=torch.tensor([2, 0])).tolist() == [20, 0]
    shared = gpubuf.LazyTensorStorage(4, shared_init=True, cleanup_memmap=True)
    assert isinstance(shared, gpubuf.LazyTensorStorage) and isinstance(shared, gpubuf.LazyMemmapStorage)
    assert shared.shared_init and shared.cleanup_memmap and not gpubuf.LazyTensorStorage(4).shared_init
    shared.cleanup()


def test_sampler_ensemble_sampleable_weights():
    rb0 = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4))
    rb1 = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4))
    rb1.extend(torch.arange(4))
    rb = gpubuf.ReplayBufferEnsemble(rb0, rb1, p="sampleable", num_buffer_sampled=2, batch_size=4)
    _, info = rb.sample(return_info=True)
    # Only the member holding items can be drawn.
    assert info["index", "buffer_ids"].tolist() == [1, 1]
    assert np.isclose(float(rb.sampler._sampleable_count(rb1.storage, 2)), 4)


# ---------------------------------------------------------------------- conditional updates
def test_update_if_present_matches_torchrl():
    def run(lib):
        rb = lib.TensorDictReplayBuffer(
            storage=lib.LazyTensorStorage(6), writer=lib.TensorDictRoundRobinWriter(track_generations=True)
        )
        index = rb.extend(TensorDict({"obs": torch.zeros(4, 2), "v": torch.full((4,), 5, dtype=torch.int64)}, [4]))
        handles = rb.writer.generations_of(index)
        rb.extend(TensorDict({"obs": torch.zeros(3, 2), "v": torch.zeros(3, dtype=torch.int64)}, [3]))  # rewrites slot 0
        plain = rb.update_if_present(index=index, generation=handles, patch={"obs": torch.ones(4, 2)})
        versioned = rb.update_if_present(
            index=torch.tensor([1, 2, 2, 3]),
            generation=rb.writer.generations_of(torch.tensor([1, 2, 2, 3])),
            patch={"obs": torch.full((4, 2), 7.0)},
            version_key="v",
            version=torch.tensor([4, 6, 8, 5]),
            require_newer=True,
        )
        future = rb.submit_update_if_present(index=index, generation=handles, patch={"obs": torch.ones(4, 2)})
        return (
            plain.updated, plain.updated_count, plain.stale_count,
            versioned.updated, versioned.version_rejected, versioned.version_rejected_count,
            rb[:]["obs"], rb[:]["v"], future.result().updated_count,
        )

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_update_if_present_refusals():
    plain = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(4))
    plain.extend(TensorDict({"obs": torch.zeros(2)}, [2]))
    with pytest.raises(RuntimeError, match="track slot generations"):
        plain.update_if_present(index=torch.tensor([0]), generation=torch.tensor([0]), patch={"obs": torch.ones(1)})
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(4), writer=gpubuf.TensorDictRoundRobinWriter(track_generations=True)
    )
    rb.extend(TensorDict({"obs": torch.zeros(2)}, [2]))
    before = rb[:]["obs"].clone()
    with pytest.raises(KeyError):
        rb.update_if_present(index=torch.tensor([0]), generation=torch.tensor([0]), patch={"nope": torch.ones(1)})
    with pytest.raises(ValueError):
        rb.update_if_present(index=torch.tensor([0]), generation=torch.tensor([0]), patch={"obs": torch.ones(1, 3)})
    with pytest.raises(ValueError, match="together"):
        rb.update_if_present(index=torch.tensor([0]), generation=torch.tensor([0]), patch={}, version=1)
    assert torch.equal(rb[:]["obs"], before)


# ---------------------------------------------------------------------- exception classes
def test_extend_mismatch_is_a_runtime_error_as_in_torchrl():
    for lib in (torchrl_data, gpubuf):
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(8))
        rb.extend(torch.zeros(2, 3))
        with pytest.raises(RuntimeError):
            rb.extend(torch.zeros(2, 4))
    # gpubuf is stricter: the failed extend leaves the buffer as it was (TorchRL's length moved to 4).
    assert len(rb) == 2
    # TorchRL casts another dtype silently; gpubuf refuses it (README: stricter), as a RuntimeError too.
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(8))
    rb.extend(torch.zeros(2, 3))
    with pytest.raises(RuntimeError):
        rb.extend(torch.zeros(2, 3, dtype=torch.int64))
    assert len(rb) == 2


def test_priority_length_mismatch_is_a_runtime_error_as_in_torchrl():
    for lib in (torchrl_data, gpubuf):
        rb = lib.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=lib.LazyTensorStorage(8))
        rb.extend(torch.arange(4))
        with pytest.raises(RuntimeError):
            rb.update_priority(torch.tensor([0, 1, 2]), torch.ones(2))


# ---------------------------------------------------------------------- staleness and prompt groups
def test_staleness_aware_sampler_matches_torchrl():
    def run(lib):
        from torchrl.data.replay_buffers.samplers import StalenessAwareSampler as TorchRLStaleness

        cls = TorchRLStaleness if lib is torchrl_data else gpubuf.StalenessAwareSampler
        sampler = cls(max_staleness=3)
        rb = lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(20), sampler=sampler, batch_size=6)
        rb.extend(TensorDict({"obs": torch.arange(10.0), "policy_version": torch.arange(10) % 5}, [10]))
        sampler.consumer_version = 5
        torch.manual_seed(0)
        sample = rb.sample()
        sampler.increment_consumer_version()
        torch.manual_seed(1)
        _, info = rb.sample(return_info=True)
        sampler.max_staleness = 0
        with pytest.raises(RuntimeError, match="exceed max_staleness"):
            rb.sample()
        return sample["obs"], sample["staleness"], info["staleness"], sampler.state_dict()

    theirs, ours = both(run)
    assert_same(theirs[:3], ours[:3])
    assert dict(theirs[3]) == ours[3]


def test_staleness_aware_sampler_needs_the_version_key():
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(4), sampler=gpubuf.StalenessAwareSampler(), batch_size=2
    )
    rb.extend(TensorDict({"obs": torch.zeros(3)}, [3]))
    with pytest.raises(KeyError, match="policy_version"):
        rb.sample()


@pytest.mark.parametrize("strategy", ["random", "recency", "reward", "variance"])
@pytest.mark.parametrize("storage", ["LazyStackStorage", "LazyTensorStorage"])
def test_prompt_group_sampler_matches_torchrl(strategy, storage):
    def run(lib):
        from torchrl.data.replay_buffers.samplers import PromptGroupSampler as TorchRLPromptGroup

        cls = TorchRLPromptGroup if lib is torchrl_data else gpubuf.PromptGroupSampler
        sampler = cls(num_groups=2, group_key="prompt", strategy=strategy, reward_key="reward")
        rb = lib.ReplayBuffer(
            storage=getattr(lib, storage)(100), sampler=sampler, batch_size=6, generator=torch.Generator().manual_seed(4)
        )
        rb.extend(TensorDict({"prompt": torch.tensor([0] * 4 + [1] * 4 + [2] * 4), "reward": torch.arange(12.0) % 5}, [12]))
        rb.extend(TensorDict({"prompt": torch.tensor([1, 2]), "reward": torch.tensor([9.0, -1.0])}, [2]))
        out = [rb.sample(return_info=True)[1]["index"] for _ in range(3)]
        return out, sampler.state_dict()

    theirs, ours = both(run)
    assert_same(theirs[0], ours[0])
    assert theirs[1].keys() == ours[1].keys()


def test_prompt_group_sampler_refusals():
    for lib_cls in (gpubuf.PromptGroupSampler,):
        with pytest.raises(TypeError, match="Exactly one"):
            lib_cls()
        with pytest.raises(ValueError):
            lib_cls(num_groups=0)
        with pytest.raises(ValueError, match="Unknown strategy"):
            lib_cls(num_groups=1, strategy="best")
    rb = gpubuf.ReplayBuffer(
        storage=gpubuf.LazyTensorStorage(10), sampler=gpubuf.PromptGroupSampler(samples_per_group=4), batch_size=6
    )
    rb.extend(TensorDict({"query": torch.zeros(4)}, [4]))
    with pytest.raises(ValueError, match="not divisible"):
        rb.sample()


# ---------------------------------------------------------------------- offline to online
def test_offline_to_online_docstring_usage_matches_torchrl():
    def run(lib):
        torch.manual_seed(0)
        offline = lib.ReplayBuffer(storage=lib.LazyTensorStorage(100))
        offline.extend(TensorDict({"observation": torch.arange(100.0)}, [100]))
        rb = lib.OfflineToOnlineReplayBuffer(offline_dataset=offline, online_capacity=50, offline_fraction=0.25, batch_size=8)
        only_offline = rb.sample()["observation"]
        rb.extend(TensorDict({"observation": -torch.arange(1.0, 11.0)}, [10]))
        mixed = rb.sample(8)["observation"]
        rb.anneal(3, 4)
        fraction = rb.offline_fraction
        rb.anneal(4, 4)
        online_only = rb.sample()["observation"]
        return only_offline, mixed, fraction, online_only, len(rb), len(rb.online_buffer)

    theirs, ours = both(run)
    assert_same(theirs, ours)
    assert (ours[1] < 0).sum() == 6 and (ours[3] < 0).all()


def test_prefill_replay_buffer_matches_torchrl():
    def run(lib):
        torch.manual_seed(0)
        dataset = lib.ReplayBuffer(storage=lib.LazyTensorStorage(50))
        dataset.extend(TensorDict({"obs": torch.arange(50.0)}, [50]))
        online = lib.ReplayBuffer(storage=lib.LazyTensorStorage(100))
        assert lib.prefill_replay_buffer(online, dataset, n_samples=25, chunk_size=10) is online
        return online[:]["obs"], len(online)

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_offline_to_online_refusals():
    offline = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4))
    with pytest.raises(ValueError, match="not both"):
        gpubuf.OfflineToOnlineReplayBuffer(offline, online_capacity=4, online_storage=gpubuf.LazyTensorStorage(4))
    with pytest.raises(ValueError, match="one of"):
        gpubuf.OfflineToOnlineReplayBuffer(offline)
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        gpubuf.OfflineToOnlineReplayBuffer(offline, online_capacity=4, offline_fraction=1.0)
    with pytest.raises(ValueError, match="batch_size must be provided"):
        gpubuf.OfflineToOnlineReplayBuffer(offline, online_capacity=4).sample()


# ---------------------------------------------------------------------- hindsight experience replay
def _her_reward(td):
    dist = (td["achieved_goal"] - td["desired_goal"]).norm(dim=-1, keepdim=True)
    return (dist < 0.05).float()


def _episode_steps(n, done_at):
    return TensorDict(
        {
            "observation": torch.arange(n * 4.0).reshape(n, 4),
            "desired_goal": torch.zeros(n, 3),
            "achieved_goal": torch.arange(n * 3.0).reshape(n, 3) / 10,
            "action": torch.zeros(n, 2),
            "next": {
                "observation": torch.arange(n * 4.0).reshape(n, 4) + 1,
                "desired_goal": torch.zeros(n, 3),
                "achieved_goal": torch.arange(n * 3.0).reshape(n, 3) / 10 + 0.1,
                "reward": torch.zeros(n, 1),
                "done": torch.tensor([[i in done_at] for i in range(n)]),
            },
        },
        batch_size=[n],
    )


@pytest.mark.parametrize("strategy", ["future", "final", "episode", "random"])
def test_her_relabels_as_torchrl(strategy):
    def run(lib):
        rb = lib.HERReplayBuffer(
            reward_fn=_her_reward,
            strategy=strategy,
            her_ratio=0.5,
            storage=lib.LazyTensorStorage(8),
            batch_size=6,
            generator=torch.Generator().manual_seed(2),
        )
        rb.extend(_episode_steps(6, {2}))
        rb.extend(_episode_steps(4, {1, 3}))  # wraps: the cursor ends the newest episode
        torch.manual_seed(5)
        batch = rb.sample()
        return batch["index"], batch["desired_goal"], batch[("next", "desired_goal")], batch[("next", "reward")]

    theirs, ours = both(run)
    assert_same(theirs, ours)


@pytest.mark.filterwarnings("ignore:Got conflicting batch_sizes")
def test_her_docstring_usage_and_refusals():
    for lib in (torchrl_data, gpubuf):
        rb = lib.HERReplayBuffer(reward_fn=_her_reward, storage=lib.LazyTensorStorage(100), batch_size=256)
        for i in range(4):
            rb.add(_episode_steps(4, {3})[i])
        batch = rb.sample(4)
        assert batch["desired_goal"].shape == torch.Size([4, 3])
        assert batch[("next", "reward")].shape == torch.Size([4, 1])
        assert lib.HindsightStrategy("final") == "final"
    with pytest.raises(ValueError, match="her_ratio"):
        gpubuf.HERReplayBuffer(reward_fn=_her_reward, her_ratio=1.5)
    rb = gpubuf.HERReplayBuffer(reward_fn=_her_reward, storage=gpubuf.LazyTensorStorage(8))
    rb.extend(TensorDict({"desired_goal": torch.zeros(2, 3)}, [2]))
    with pytest.raises(KeyError, match="achieved_goal"):
        rb.sample(2)


# ---------------------------------------------------------------------- the Sequence sample unit
def _sequence_data(n, ends):
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[list(ends)] = True
    return TensorDict({"obs": torch.arange(float(n)), ("next", "done"): done}, [n])


@pytest.mark.parametrize("boundary", ["pad", "stop", "include_reset"])
@pytest.mark.parametrize(
    "window", [{"length": 3}, {"length": 2, "burn_in": 1, "bootstrap": 1}, {"length": 3, "dilation": 2}]
)
@pytest.mark.parametrize("fill", ["partial", "full", "wrapped"])
def test_sequence_unit_matches_torchrl(boundary, window, fill):
    def run(lib):
        rb = lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(10),
            batch_size=4,
            sample_unit=lib.Sequence(episode_boundary=boundary, **window),
            generator=torch.Generator().manual_seed(7),
        )
        if fill == "partial":
            rb.extend(_sequence_data(7, {2}))
        elif fill == "full":
            rb.extend(_sequence_data(10, {4, 9}))
        else:
            rb.extend(_sequence_data(10, {4, 9}))
            rb.extend(_sequence_data(3, {0}))
        sample, info = rb.sample(return_info=True)
        return sample["obs"], {k: info[k] for k in sorted(info) if k != "index"}, info["index"]

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_sequence_unit_docstring_expand():
    for lib in (torchrl_data, gpubuf):
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(10), batch_size=2, sample_unit=lib.Sequence(length=3))
        rb.extend(_sequence_data(10, {4, 9}))
        unit = lib.Sequence(length=2, burn_in=1, bootstrap=1)
        index, info = unit.expand(torch.tensor([5]), {}, rb.storage)
        assert index.tolist() == [5, 5, 6, 7]
        assert info["learning_mask"].tolist() == [False, True, True, False]
        assert info["validity_mask"].tolist() == [False, True, True, True]
        index, _ = lib.Sequence(length=3, dilation=2).expand(torch.tensor([0]), {}, rb.storage)
        assert index.tolist() == [0, 2, 4]
    with pytest.raises(ValueError):
        gpubuf.Sequence(length=0)
    with pytest.raises(TypeError, match="TensorDict-backed"):
        gpubuf.Sequence(length=2).expand(torch.tensor([0]), {}, gpubuf.ListStorage(4))


@pytest.mark.parametrize("boundary", ["pad", "stop", "include_reset"])
def test_sequence_unit_on_a_two_dim_storage_matches_torchrl(boundary):
    def run(lib):
        rb = lib.ReplayBuffer(
            storage=lib.LazyTensorStorage(12, ndim=2),
            batch_size=3,
            sample_unit=lib.Sequence(length=3, episode_boundary=boundary),
            generator=torch.Generator().manual_seed(3),
        )
        done = torch.zeros(4, 3, 1, dtype=torch.bool)
        done[1, 0] = done[2, 2] = True
        rb.extend(TensorDict({"obs": torch.arange(12.0).reshape(4, 3), ("next", "done"): done}, [4, 3]))
        sample, info = rb.sample(return_info=True)
        return sample["obs"], info["validity_mask"], info["anchor_index"]

    theirs, ours = both(run)
    assert_same(theirs, ours)


# ---------------------------------------------------------------------- trajectory queries
def _episodes(n_steps, ends, start=0):
    done = torch.zeros(n_steps, 1, dtype=torch.bool)
    done[list(ends)] = True
    return TensorDict(
        {
            "obs": torch.arange(start, start + n_steps, dtype=torch.float32),
            "reward": (torch.arange(start, start + n_steps) % 7).float().unsqueeze(-1),
            "step_count": torch.arange(n_steps).unsqueeze(-1),
            ("next", "done"): done,
        },
        [n_steps],
    )


def _queries(lib):
    traj = lib.traj
    return [
        None,
        (traj.reward.sum() > 8) & (traj.length >= 3),
        (traj.reward > 5).any() | (traj.step_count.last() > 10),
        lambda t: t.length == 2,
    ]


@pytest.mark.parametrize("fill", ["partial", "wrapped"])
@pytest.mark.filterwarnings("ignore:No trajectory id entry")
def test_query_matches_torchrl(fill):
    def run(lib):
        rb = lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(16))
        rb.extend(_episodes(12, {2, 4, 9}))
        if fill == "wrapped":
            rb.extend(_episodes(7, {1, 5}, start=100))
        return [[t.get("obs") for t in rb.query(q)] for q in _queries(lib)]

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_filter_and_iter_trajectories_match_torchrl():
    data = _episodes(12, {2, 4, 9})
    data["traj_ids"] = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3])
    for query_t, query_g in zip(_queries(torchrl_data), _queries(gpubuf)):
        theirs = torchrl_data.filter_trajectories(data, query_t)
        ours = gpubuf.filter_trajectories(data, query_g)
        assert_same([t.get("obs") for t in theirs], [t.get("obs") for t in ours])
        assert all(isinstance(t, gpubuf.Trajectory) for t in ours)
    assert [t.length for t in gpubuf.iter_trajectories(data)] == [t.length for t in torchrl_data.iter_trajectories(data)]
    predicate = (gpubuf.traj.reward.sum() > 8) & (gpubuf.traj.length >= 3)
    assert isinstance(predicate, gpubuf.TrajectoryPredicate)
    with pytest.raises(TypeError, match="ambiguous"):
        gpubuf.filter_trajectories(data, gpubuf.traj.reward > 5)


def test_query_refuses_non_tensordict_storage():
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4))
    rb.extend(torch.arange(3))
    with pytest.raises(TypeError, match="tensordict-backed"):
        rb.query()


# ---------------------------------------------------------------------- a priority key that comes and goes
def _weights_by_index(rb, draws=4096):
    """index -> importance weight, from enough draws to see every item (deterministic per index).

    TorchRL's tree draws from a generator ``torch.manual_seed`` does not seed, so every item must
    be seen whatever the draws: the lightest here has 1/28 of the mass, and 4,096 draws all miss it
    with probability below 1e-60 (64 draws did so about one run in ten).
    """
    torch.manual_seed(0)
    _, info = rb.sample(draws, return_info=True)
    return {int(i): round(float(w), 5) for i, w in zip(info["index"], info["priority_weight"])}


@pytest.mark.parametrize("order", ["appears", "disappears"])
def test_priority_key_appearing_or_disappearing_sets_priorities_as_torchrl(order):
    def run(lib):
        rb = lib.TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=lib.LazyTensorStorage(8))
        with_key = TensorDict({"obs": torch.ones(2), "td_error": torch.tensor([5.0, 7.0])}, [2])
        without = TensorDict({"obs": torch.zeros(2)}, [2])
        batches = [without, with_key, without] if order == "appears" else [with_key, without, with_key.clone()]
        for batch in batches:
            rb.extend(batch)
        return _weights_by_index(rb), rb[:]["obs"]

    theirs, ours = both(run)
    assert theirs[0] == ours[0]
    assert_same(theirs[1], ours[1])


def test_error_messages_begin_with_torchrl_wording():
    # Code written for TorchRL matches on these messages.
    for lib in (torchrl_data, gpubuf):
        for sampler in (lib.RandomSampler(), lib.SamplerWithoutReplacement()):
            rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(4), sampler=sampler)
            with pytest.raises(RuntimeError, match="^Cannot sample from an empty storage"):
                rb.sample(2)
        rb = lib.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=lib.LazyTensorStorage(4))
        with pytest.raises(RuntimeError, match="^Cannot sample from an empty storage"):
            rb.sample(2)
        with pytest.raises(RuntimeError, match="^Cannot iterate over the replay buffer. Batch_size was not specified"):
            next(iter(lib.ReplayBuffer(storage=lib.LazyTensorStorage(4))))


# ---------------------------------------------------------------------- ensemble info
@pytest.mark.parametrize("members", ["tensordict", "tensor", "prioritized"])
def test_ensemble_sample_info_has_torchrl_structure(members):
    def run(lib):
        rbs = []
        for m in range(2):
            if members == "tensordict":
                rb = lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(4))
                rb.extend(TensorDict({"obs": torch.full((4,), float(m))}, [4]))
            elif members == "tensor":
                rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(4))
                rb.extend(torch.full((4, 2), float(m)))
            else:
                rb = lib.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=lib.LazyTensorStorage(4))
                rb.extend(torch.full((4, 2), float(m)))
            rbs.append(rb)
        ensemble = lib.ReplayBufferEnsemble(*rbs, batch_size=4, sample_from_all=True)
        _, info = ensemble.sample(return_info=True)
        return info

    theirs, ours = both(run)
    assert isinstance(ours, TensorDict)
    assert ours.batch_size == theirs.batch_size
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    for key in theirs.keys(True, True):
        assert ours.get(key).shape == theirs.get(key).shape, key
    assert_same(theirs["index", "buffer_ids"], ours["index", "buffer_ids"])


@pytest.mark.parametrize("data", [torch.tensor([1.0, 5.0]), {"r": torch.tensor([1.0, 5.0])}], ids=["tensor", "dict"])
def test_max_value_writer_refuses_plain_data_as_torchrl(data):
    # TorchRL 0.14.1 refuses plain tensors and dicts here too, with a RuntimeError.
    for lib in (torchrl_data, gpubuf):
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(3), writer=lib.TensorDictMaxValueWriter(rank_key="r"))
        with pytest.raises(RuntimeError, match="expects data to be a tensor collection"):
            rb.extend(data)
        with pytest.raises(RuntimeError, match="expects data to be a tensor collection"):
            rb.add(data)
        assert len(rb) == 0


# ---------------------------------------------------------------------- found by TorchRL's own replay-buffer tests
def test_a_tensordict_buffer_with_a_plain_writer_adds_with_priorities_as_torchrl():
    """A TensorDictReplayBuffer given a plain RoundRobinWriter and a PrioritizedSampler: ``add``
    sets the item's priority though the writer gives it no "index" entry (the caller's TensorDict
    is left without one, as TorchRL leaves it)."""

    def run(lib):
        rb = lib.TensorDictReplayBuffer(storage=lib.ListStorage(3), sampler=lib.PrioritizedSampler(3, alpha=0.8, beta=0.9),
                                        writer=lib.RoundRobinWriter(), batch_size=3)
        item = TensorDict({"a": torch.tensor([7]), "td_error": torch.tensor(2.0)}, [])
        index = rb.add(item)
        rb.add(TensorDict({"a": torch.tensor([8])}, []))
        return index, len(rb), sorted(item.keys())

    assert_same(*both(run))
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.ListStorage(3), sampler=gpubuf.PrioritizedSampler(3, alpha=1.0, beta=0.9),
                                       writer=gpubuf.RoundRobinWriter(), batch_size=3)
    rb.add(TensorDict({"a": torch.tensor([7]), "td_error": torch.tensor(2.0)}, []))
    assert rb.sampler.tree.values()[0].item() == pytest.approx(2.0 + rb.sampler._eps)


def test_one_element_tensors_are_taken_as_exponents_as_torchrl():
    def run(lib):
        sampler = lib.PrioritizedSampler(10, alpha=torch.tensor(0.6), beta=torch.tensor(0.25, dtype=torch.float64))
        sampler.alpha = torch.tensor(1)
        return float(sampler.alpha), float(sampler.beta)

    assert both(run)[0] == both(run)[1] == (1.0, 0.25)
    sampler = gpubuf.PrioritizedSampler(10, alpha=0.5, beta=0.5)
    for bad in (torch.tensor([0.5, 0.6]), torch.tensor(-1.0), torch.tensor(float("nan")), torch.tensor(True),
                torch.tensor(1j)):
        with pytest.raises(ValueError):
            gpubuf.PrioritizedSampler(10, alpha=bad, beta=0.5)
        with pytest.raises(ValueError):
            sampler.alpha = bad
        assert sampler.alpha == 0.5


@LIBS
def test_a_sampler_dropping_the_last_batch_needs_the_buffer_s_batch_size(lib):
    with pytest.raises(ValueError, match="drop_last=True must work with a predictable batch-size"):
        lib.ReplayBuffer(storage=lib.ListStorage(10), sampler=lib.SamplerWithoutReplacement(drop_last=True))
    rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(10), sampler=lib.SamplerWithoutReplacement(drop_last=True),
                          batch_size=4)
    rb.extend(torch.arange(10))
    assert len(rb.sample()) == 4


@LIBS
def test_a_batch_larger_than_the_storage_without_replacement_is_a_value_error(lib):
    storage = lib.ListStorage(10)
    storage.set(range(10), list(range(10)))
    with pytest.raises(ValueError, match=r"The batch size \(11\) is greater than the storage capacity"):
        lib.SamplerWithoutReplacement(drop_last=True).sample(storage, 11)


@LIBS
def test_a_transform_is_inserted_only_within_the_list(lib):
    from torchrl.envs.transforms import RewardScaling

    rb = lib.ReplayBuffer(batch_size=1)
    with pytest.raises(ValueError, match="Index expected to be between"):
        rb.insert_transform(10, RewardScaling(0.0, 2.0))
    with pytest.raises(ValueError, match="Index expected to be between"):
        rb.insert_transform(-1, RewardScaling(0.0, 2.0))
    assert len(rb.transform) == 0


def test_transforms_inserted_at_either_end_run_in_list_order():
    rb = gpubuf.ReplayBuffer(batch_size=1)
    rb.insert_transform(0, lambda data: data * 2)
    rb.insert_transform(-1, lambda data: data + 1)  # before the last: runs first
    rb.extend(torch.tensor([3]))
    assert rb.sample().tolist() == [8]


@LIBS
def test_memmap_files_in_place_are_refused_with_a_runtime_error(lib, tmp_path):
    first = lib.LazyMemmapStorage(4, scratch_dir=tmp_path)
    first.set(torch.arange(2), TensorDict({"a": torch.zeros(2)}, [2]))
    second = lib.LazyMemmapStorage(4, scratch_dir=tmp_path)
    with pytest.raises(RuntimeError, match="already exists"):
        second.set(torch.arange(2), TensorDict({"a": torch.ones(2)}, [2]))


def test_update_if_present_docstring_usage_with_index_generation():
    # TorchRL's documented round trip: handles taken from a sample's "index" and "index_generation".
    def run(lib):
        rb = lib.TensorDictReplayBuffer(
            storage=lib.LazyTensorStorage(10),
            writer=lib.TensorDictRoundRobinWriter(track_generations=True),
            batch_size=4,
            generator=torch.Generator().manual_seed(0),
        )
        rb.extend(TensorDict({"obs": torch.zeros(10, 3)}, batch_size=[10]))
        sample = rb.sample()
        result = rb.update_if_present(
            index=sample["index"], generation=sample["index_generation"], patch={"obs": torch.ones(4, 3)}
        )
        rb.extend(TensorDict({"obs": torch.full((3, 3), 2.0)}, batch_size=[3]))  # rewrites slots 0..2
        stale = rb.update_if_present(
            index=sample["index"], generation=sample["index_generation"], patch={"obs": torch.full((4, 3), 5.0)}
        )
        rb.add(TensorDict({"obs": torch.full((3,), 4.0)}, batch_size=[]))
        return (
            sample["index_generation"], result.updated_count, result.stale_count, stale.updated,
            rb[:]["obs"], rb.writer.generations_of(torch.arange(10)),
        )

    theirs, ours = both(run)
    assert_same(theirs, ours)


def test_generations_are_tracked_on_a_memmap_storage(tmp_path):
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyMemmapStorage(4, scratch_dir=tmp_path), writer=gpubuf.TensorDictRoundRobinWriter(track_generations=True)
    )
    index = rb.extend(TensorDict({"obs": torch.zeros(6)}, [6]))
    assert rb.writer.generations_of(index).tolist() == [1, 1, 0, 0, 1, 1]
    result = rb.update_if_present(index=torch.tensor([0, 2]), generation=torch.tensor([0, 0]), patch={"obs": torch.ones(2)})
    assert result.updated.tolist() == [False, True]


# ---------------------------------------------------------------------- state dicts across the libraries
def _stateful(lib, kind: str):
    storage = lib.LazyTensorStorage(12)
    if kind == "tensordict":
        rb = lib.TensorDictReplayBuffer(storage=storage, batch_size=4)
    elif kind == "without_replacement":
        rb = lib.ReplayBuffer(storage=storage, sampler=lib.SamplerWithoutReplacement(), batch_size=4)
    else:
        rb = lib.ReplayBuffer(storage=storage, batch_size=4)
    rb.extend(TensorDict({"obs": torch.arange(15.0).reshape(5, 3), ("next", "done"): torch.ones(5, 1, dtype=torch.bool)},
                         [5]))
    return rb


@pytest.mark.parametrize("kind", ["plain", "tensordict", "without_replacement"])
@pytest.mark.parametrize("direction", ["torchrl_to_gpubuf", "gpubuf_to_torchrl"])
def test_a_tensor_storage_buffer_s_state_dict_loads_in_the_other_library(kind, direction):
    """A tensor storage's state dict is TorchRL's (its TensorDict rows as ``state_dict()``), so
    ``load_state_dict`` takes a state of either library and gives the same rows, as TensorDicts."""
    source_lib, target_lib = (torchrl_data, gpubuf) if direction == "torchrl_to_gpubuf" else (gpubuf, torchrl_data)
    source = _stateful(source_lib, kind)
    target = _stateful(target_lib, kind)
    target.empty()
    target.load_state_dict(source.state_dict())
    assert (len(target), target.write_count) == (len(source), source.write_count) == (5, 5)
    rows, want = target[:], source[:]
    assert isinstance(rows, TensorDict) and rows.batch_size == want.batch_size
    for key in want.keys(True, True):
        assert torch.equal(rows[key], want[key]), key
    assert target.sample().batch_size == (4,)


def test_state_dicts_of_other_containers_keep_their_container():
    """Rows TorchRL cannot hold in a state dict keep their container through gpubuf's own round trip."""
    data = {"obs": torch.arange(6.0).reshape(3, 2), "nested": {"reward": torch.ones(3)}}
    for rows in (data, {"obs": torch.arange(6.0).reshape(3, 2)}):  # a flat dict too: marked, not read as a TensorDict
        rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4))
        rb.extend(rows)
        state = rb.state_dict()
        assert state["_storage"]["_pytree"] is True
        other = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4))
        other.load_state_dict(state)
        assert type(other[:]) is dict and torch.equal(other[:]["obs"], rb[:]["obs"])
    empty = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4)).state_dict()["_storage"]
    assert empty["_storage"] == {} and empty["_len"] == 0


def test_a_torchrl_prioritized_buffer_state_loads_with_its_priorities():
    """TorchRL's prioritized sampler state holds its compiled segment trees: gpubuf reads the leaves
    out of them (the same ``(p + eps) ** alpha``) and the running maximum, and draws by them."""
    def filled(lib):
        rb = lib.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=lib.LazyTensorStorage(8), batch_size=64)
        rb.extend(torch.arange(5.0))
        rb.update_priority(torch.arange(5), torch.tensor([1.0, 2.0, 0.5, 4.0, 3.0]))
        return rb

    theirs = on_torchrl(filled)
    ours = gpubuf.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=gpubuf.LazyTensorStorage(8), batch_size=64)
    ours.load_state_dict(theirs.state_dict())
    want = theirs.sampler._sum_tree[torch.arange(8)]
    assert torch.equal(ours.sampler.tree.values(), want)
    assert torch.equal(ours.sampler.tree.values(), filled(gpubuf).sampler.tree.values())
    assert float(ours.sampler._max_priority[0]) == 4.0 and int(ours.sampler._max_priority[1]) == 3
    batch, info = ours.sample(return_info=True)
    expected = (want[info["index"]].double() / want[:5].min()) ** -0.5
    torch.testing.assert_close(info["priority_weight"].double(), expected, rtol=1e-5, atol=0)
    ours.extend(torch.arange(2.0))  # new items take the loaded maximum
    assert torch.equal(ours.sampler.tree.values()[5:7], torch.full((2,), (4.0 + 1e-8) ** 0.7).float())


def test_a_malformed_torchrl_prioritized_state_changes_nothing():
    rb = gpubuf.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=gpubuf.LazyTensorStorage(8))
    rb.extend(torch.arange(5.0))
    state = rb.state_dict()
    before = rb.sampler.tree.values().clone()
    sampler_state = {k: v for k, v in state["_sampler"].items() if k != "_tree"}
    for bad in ({**sampler_state, "_sum_tree": "a tree"}, {**sampler_state, "_sum_tree": [1.0] * 8}):
        with pytest.raises(gpubuf.errors.StateDictError):
            rb.load_state_dict({**state, "_sampler": bad})
        assert torch.equal(rb.sampler.tree.values(), before)


@pytest.mark.parametrize("bad", ["not a tensor", torch.ones(3)], ids=["non_tensor", "wrong_rows"])
def test_a_malformed_tensordict_storage_state_is_refused_and_changes_nothing(bad):
    """TorchRL's form of TensorDict rows is made a TensorDict again: a value that is not a tensor,
    or a tensor whose rows do not match the others', raises StateDictError before the buffer changes."""
    rb = _stateful(gpubuf, "tensordict")
    state = rb.state_dict()
    before = rb[:].clone()
    rows = dict(state["_storage"]["_storage"])
    rows["obs"] = bad
    with pytest.raises(gpubuf.errors.StateDictError):
        rb.load_state_dict({**state, "_storage": {**state["_storage"], "_storage": rows}})
    assert (len(rb), rb.write_count) == (5, 5)
    assert (rb[:] == before).all()


def test_elements_of_a_two_dim_buffer_are_written_and_read_in_its_view_as_torchrl():
    """A buffer extended along time (``dim_extend=1``) shows ``[envs, steps]``; a tuple index picks
    elements of that view, reading and writing (a TensorDict broadcast over the picked ones)."""

    def run(lib):
        rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(102, ndim=2))
        rb.extend(TensorDict({"a": torch.arange(100).reshape(2, 50), ("b", "c"): -torch.arange(100).reshape(2, 50)},
                             [2, 50]))

        def zeros(n):
            return TensorDict({"a": torch.zeros(n, dtype=torch.long), ("b", "c"): torch.zeros(n, dtype=torch.long)}, [n])

        rb[0, 3:4] = zeros(1)
        rb[1, 5:6] = zeros(1)
        rb[:, 7:8] = zeros(1).expand(2, 1)
        rb[:, 10:20] = zeros(10)  # one row broadcast over both environments
        rb[1, [30, 31]] = zeros(2)
        return (rb[0, 3:4]["a"], rb[1, 2:7]["a"], rb[:, 9:11]["a"], rb[:]["a"], rb[:]["b", "c"], len(rb))

    assert_same(*both(run))


def test_a_bad_element_index_changes_nothing():
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(20, ndim=2))
    rb.extend(TensorDict({"a": torch.arange(20).reshape(2, 10)}, [2, 10]))
    before = rb[:]["a"].clone()
    for index in ((0, 10), (2, 0), (0, slice(0, 3), 1)):
        with pytest.raises(gpubuf.errors.InvalidIndexError):
            rb[index] = TensorDict({"a": torch.zeros(1, dtype=torch.long)}, [1])
        with pytest.raises(gpubuf.errors.InvalidIndexError):
            rb[index]
    with pytest.raises(gpubuf.errors.SchemaMismatchError):
        rb[0, 0:3] = TensorDict({"a": torch.zeros(2, dtype=torch.long)}, [2])  # 2 values for 3 elements
    assert torch.equal(rb[:]["a"], before)


def test_a_compiled_extend_and_sample_runs_call_after_call():
    """``torch.compile`` of a step that extends and samples (TorchRL's ``compilable=True`` usage):
    the CPU ops take their torch twins while tracing (Dynamo cannot trace a Numba kernel), so
    every call runs and reads what was written."""
    torch._dynamo.reset()
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(6, compilable=True), sampler=gpubuf.RandomSampler(),
                             writer=gpubuf.RoundRobinWriter(compilable=True), batch_size=3, compilable=True)

    @torch.compile
    def step(x):
        rb.extend(x)
        return rb.sample()

    for call in range(4):
        batch = step(torch.arange(3 * call, 3 * call + 3).unsqueeze(-1))
        assert batch.shape == (3, 1)
        stored = rb[:].reshape(-1).tolist()
        assert set(batch.reshape(-1).tolist()) <= set(stored)
    assert len(rb) == 6 and sorted(rb[:].reshape(-1).tolist()) == list(range(6, 12))


def test_a_compiled_extend_and_sample_stops_recompiling_after_warm_up():
    """The draw runs eagerly under ``torch.compile`` (as TorchRL's): traced, it was guarded on the
    stored length and recompiled after every write."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(100, compilable=True), sampler=gpubuf.RandomSampler(),
                             writer=gpubuf.RoundRobinWriter(compilable=True), batch_size=3, compilable=True)
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def step(x):
        rb.extend(x)
        return rb.sample()

    for _ in range(4):  # the writes' ints become dynamic after a recompile or two
        step(torch.randint(100, (3, 1)))
    warmed = counter.frame_count
    for _ in range(6):
        step(torch.randint(100, (3, 1)))
    assert counter.frame_count == warmed
    assert len(rb) == 30


@LIBS
def test_refusals_say_what_torchrl_says(lib):
    with pytest.raises(ValueError, match="Expected storage to be non-null"):
        lib.TensorStorage(None)
    with pytest.raises(ValueError, match="The max-size and the storage shape mismatch"):
        lib.TensorStorage(torch.randn(3), max_size=4)
    rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(100))
    with pytest.raises(RuntimeError, match="Stacking the elements of the list resulted in an error"):
        rb.extend([torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.01])])
    assert len(rb) == 0
    storage = lib.LazyTensorStorage(10)
    storage.set(torch.arange(10), TensorDict({"obs": torch.randn(10), ("next", "done"): torch.zeros(10, 2, dtype=torch.bool)},
                                             [10]))
    with pytest.raises(RuntimeError, match="Expected the end-of-trajectory signal to be 1-dimensional"):
        lib.SliceSampler(num_slices=2).sample(storage, 4)


def test_a_tensor_storage_given_an_empty_tensordict_takes_its_entries_from_the_first_write():
    """``TensorStorage(TensorDict(batch_size=[n]))``: n rows, every one counted as held once the
    first write has given the entries, those not written reading as zeros."""

    def run(lib):
        rb = lib.ReplayBuffer(storage=lib.TensorStorage(TensorDict(batch_size=[100])), batch_size=4)
        rb.extend(TensorDict({"root": torch.arange(1, 91), ("next", "x"): torch.ones(90, 2)}, [90]))
        return len(rb), rb[:]["root"], rb[:]["next", "x"].sum(), rb.sample().batch_size

    assert_same(*both(run))
    rb = gpubuf.ReplayBuffer(storage=gpubuf.TensorStorage(TensorDict(batch_size=[10])), batch_size=4)
    with pytest.raises(gpubuf.errors.EmptyBufferError):
        rb.sample()  # nothing written yet: no entries to read
    assert len(rb) == 0


def test_a_storage_writes_the_grid_of_ints_and_slices_of_a_tuple_cursor_as_torchrl():
    """``storage.set((0, slice(0, 2)), td)`` on an ``ndim=2`` storage writes the elements of that
    grid, in the storage's own dims; a cursor of fewer entries takes the trailing dims whole."""

    def run(lib):
        storage = lib.LazyTensorStorage(20, ndim=2)
        storage.set(torch.arange(10), TensorDict({"a": torch.zeros(10, 2)}, [10, 2]))
        storage.set((0, slice(0, 2)), TensorDict({"a": torch.tensor([1.0, 2.0])}, [2]), set_cursor=False)
        storage.set((slice(1, 3), 1), TensorDict({"a": torch.tensor([3.0, 4.0])}, [2]), set_cursor=False)
        storage.set((slice(4, 6), slice(0, 2)), TensorDict({"a": torch.tensor([[5.0, 6.0], [7.0, 8.0]])}, [2, 2]),
                    set_cursor=False)
        storage.set((slice(7, 9),), TensorDict({"a": torch.full((2, 2), 9.0)}, [2, 2]), set_cursor=False)
        return storage.get(slice(None))["a"]

    assert_same(*both(run))
    storage = gpubuf.LazyTensorStorage(20, ndim=2)
    storage.set(torch.arange(10), TensorDict({"a": torch.zeros(10, 2)}, [10, 2]))
    with pytest.raises(gpubuf.errors.InvalidIndexError):
        storage.set((slice(0, 2), [0, 1]), TensorDict({"a": torch.ones(2)}, [2]), set_cursor=False)
    with pytest.raises(gpubuf.errors.InvalidIndexError):
        storage.set((0, 1, 0), TensorDict({"a": torch.ones(1)}, [1]), set_cursor=False)
    for cursor in ((0, 5), (0, [1, 2]), (30, slice(0, 1))):  # past dim 1's 2 elements, or dim 0's 10 rows
        with pytest.raises(gpubuf.errors.IndexOutOfRangeError):
            storage.set(cursor, TensorDict({"a": torch.ones(1)}, [1]), set_cursor=False)
    assert storage.get(slice(None))["a"].abs().sum() == 0


@pytest.mark.parametrize("kind", ["prioritized", "prioritized_slice"])
def test_a_priority_tree_smaller_than_the_storage_s_rounded_capacity_is_refused_before_writing(kind):
    """``LazyTensorStorage(9, ndim=2)`` holds whole rows of 5: 10 elements. A tree of 9 would
    refuse the tenth after the rows were written; the extend is refused first, the buffer as it
    was, and a tree of 10 takes them."""

    def buffer(capacity):
        if kind == "prioritized":
            sampler = gpubuf.PrioritizedSampler(max_capacity=capacity, alpha=0.7, beta=0.9)
        else:
            sampler = gpubuf.PrioritizedSliceSampler(max_capacity=capacity, alpha=0.7, beta=0.9, num_slices=2,
                                                     traj_key="traj")
        return gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(9, ndim=2), sampler=sampler, batch_size=4)

    data = TensorDict({"traj": torch.arange(2).unsqueeze(1).expand(2, 5), "obs": torch.randn(2, 5)}, [2, 5])
    rb = buffer(9)
    with pytest.raises(gpubuf.errors.CapacityError, match="max_capacity=10"):
        rb.extend(data)
    assert (len(rb), rb.write_count, rb.storage.initialized) == (0, 0, False)
    rb = buffer(10)
    index = rb.extend(data)
    rb.update_priority(index, torch.full((index.shape[0],), 2.0))
    assert len(rb) == 10 and rb.sample().batch_size == (4,)


# ---------------------------------------------------------------------- buffers sharing one storage
def _two_buffers_over_one_storage(lib, make_sampler):
    """Two buffers over one storage and one writer; the first writes, the second samples."""
    storage, writer = lib.LazyTensorStorage(16), lib.RoundRobinWriter()
    first = lib.ReplayBuffer(storage=storage, writer=writer, sampler=make_sampler(lib), batch_size=4)
    second = lib.ReplayBuffer(storage=storage, writer=writer, sampler=make_sampler(lib), batch_size=4)
    first.extend(torch.arange(6) * 10)
    first.add(torch.tensor(60))
    return second


@pytest.mark.parametrize(
    "make_sampler",
    [
        lambda lib: lib.RandomSampler(),
        lambda lib: lib.SamplerWithoutReplacement(),
        lambda lib: lib.PrioritizedSampler(16, alpha=0.7, beta=0.5),
    ],
    ids=["random", "without_replacement", "prioritized"],
)
def test_a_second_buffer_over_a_shared_storage_samples_the_first_buffer_s_rows_as_torchrl(make_sampler):
    theirs, ours = both(lambda lib: _two_buffers_over_one_storage(lib, make_sampler))
    assert len(ours) == len(theirs) == 7
    expected = set(range(0, 70, 10))
    for rb in (theirs, ours):
        drawn = set()
        for _ in range(64):
            drawn.update(rb.sample().tolist())
        assert drawn == expected  # every row the first buffer wrote, and only those
    if isinstance(ours.sampler, gpubuf.PrioritizedSampler):
        # The rows got the default priority through the second buffer's sampler: equal weights.
        _, info = ours.sample(return_info=True)
        assert torch.allclose(info["priority_weight"], torch.ones(4, dtype=info["priority_weight"].dtype))


def test_a_buffer_given_another_storage_hears_only_of_the_new_one_s_writes():
    old, new = gpubuf.LazyTensorStorage(8), gpubuf.LazyTensorStorage(8)
    rb = gpubuf.ReplayBuffer(storage=old, sampler=gpubuf.PrioritizedSampler(8, 0.7, 0.5), batch_size=2)
    rb.set_storage(new)
    assert rb not in old._attached_entities and rb in new._attached_entities
    other = gpubuf.ReplayBuffer(storage=old, batch_size=2)
    other.extend(torch.arange(8))  # rows of the old storage: rb's sampler is not told of them
    sharer = gpubuf.ReplayBuffer(storage=new, batch_size=2)
    sharer.extend(torch.arange(3))
    assert len(rb) == 3
    assert set(rb.sample(64).tolist()) <= {0, 1, 2}
