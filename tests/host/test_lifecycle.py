"""TorchRL's lifecycle members on a buffer served in the caller's process: ``start``, ``client``,
``is_alive``, ``service_backend``, ``shutdown``, and ``synchronize`` waiting for background work."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.errors import BufferShutDownError

torchrl_data = pytest.importorskip("torchrl.data", reason="TorchRL is not installed: side-by-side checks skipped")
LIBS = pytest.mark.parametrize("lib", [torchrl_data, gpubuf], ids=["torchrl", "gpubuf"])


def _tracked(lib, **kwargs):
    rb = lib.TensorDictReplayBuffer(
        storage=lib.LazyTensorStorage(8), writer=lib.TensorDictRoundRobinWriter(track_generations=True),
        batch_size=2, **kwargs,
    )
    rb.extend(TensorDict({"obs": torch.zeros(6, 2)}, [6]))
    return rb


@LIBS
def test_a_direct_buffer_is_started_and_is_its_own_client(lib):
    rb = lib.ReplayBuffer(storage=lib.LazyTensorStorage(4))
    assert rb.service_backend == "direct"
    assert rb.is_alive
    assert rb.start() is rb and rb.client() is rb


@LIBS
def test_after_shutdown_samples_and_submitted_updates_are_refused_and_writes_go_on(lib):
    rb = _tracked(lib)
    index = torch.arange(2)
    generation = rb.writer.generations_of(index)
    rb.shutdown()
    rb.shutdown()  # a second call does nothing
    assert not rb.is_alive
    with pytest.raises(RuntimeError, match="shut down"):
        rb.sample()
    with pytest.raises(RuntimeError, match="shut down"):
        rb.submit_update_if_present(index=index, generation=generation, patch={"obs": torch.ones(2, 2)})
    with pytest.raises(RuntimeError, match="shut down"):
        rb.start()
    rb.extend(TensorDict({"obs": torch.ones(2, 2)}, [2]))
    assert len(rb) == 8 and torch.equal(rb[6:]["obs"], torch.ones(2, 2))
    result = rb.update_if_present(index=index, generation=generation, patch={"obs": torch.full((2, 2), 3.0)})
    assert bool(result.updated.all()) and torch.equal(rb[:2]["obs"], torch.full((2, 2), 3.0))


def test_shutdown_raises_the_typed_error_and_leaves_a_lazy_buffer_unbuilt():
    rb = _tracked(gpubuf)
    rb.shutdown()
    with pytest.raises(BufferShutDownError):
        rb.sample()
    delayed = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(4), delayed_init=True)
    assert delayed.is_alive and delayed.service_backend == "direct"
    assert not delayed.initialized


def test_synchronize_waits_for_submitted_updates_and_raises_the_first_error_once():
    rb = _tracked(gpubuf)
    gate = threading.Event()
    update_if_present = rb.update_if_present

    def held_back(**kwargs):
        gate.wait(10)
        return update_if_present(**kwargs)

    rb.update_if_present = held_back  # the background thread calls the instance's method
    index = torch.arange(2)
    generation = rb.writer.generations_of(index)
    good = rb.submit_update_if_present(index=index, generation=generation, patch={"obs": torch.ones(2, 2)})
    bad = rb.submit_update_if_present(index=index, generation=generation, patch={"nope": torch.ones(2, 2)})
    assert not good.done()
    threading.Timer(0.05, gate.set).start()
    with pytest.raises(KeyError):
        rb.synchronize()
    assert good.done() and bad.done()
    assert torch.equal(rb[:2]["obs"], torch.ones(2, 2))
    rb.synchronize()  # the error was raised once


def test_shutdown_waits_for_prefetched_batches_and_submitted_updates_then_stops_their_threads():
    rb = _tracked(gpubuf, prefetch=2)
    rb.sample()  # starts prefetching
    index = torch.arange(2)
    future = rb.submit_update_if_present(
        index=index, generation=rb.writer.generations_of(index), patch={"nope": torch.ones(2, 2)}
    )
    with pytest.raises(KeyError):
        rb.shutdown()  # the failed update's error, once both threads are stopped
    assert future.done() and not rb.is_alive
    for executor in (rb._prefetch_executor, rb._update_executor):
        with pytest.raises(RuntimeError, match="after shutdown"):
            executor.submit(lambda: None)
    with pytest.raises(BufferShutDownError):
        rb.sample()


@LIBS
@pytest.mark.parametrize("bad", [
    {"transport": "ray"}, {"transport_options": {"backend": "gloo"}}, {"service_backend_options": {"remote_config": {}}},
    {"service_backend": "grpc"},
], ids=["transport", "transport_options", "service_backend_options", "service_backend"])
def test_a_direct_buffer_refuses_remote_options(lib, bad):
    with pytest.raises(ValueError):
        lib.ReplayBuffer(storage=lib.LazyTensorStorage(4), **bad)


@LIBS
def test_a_direct_buffer_takes_the_direct_service_arguments(lib):
    rb = lib.TensorDictReplayBuffer(storage=lib.LazyTensorStorage(4), batch_size=2, service_backend="direct",
                                    transport="direct", transport_options=None)
    rb.extend(TensorDict({"obs": torch.zeros(3, 2)}, [3]))
    assert rb.service_backend == "direct" and rb.sample().batch_size == (2,)
