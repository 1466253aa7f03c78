"""Test configuration.

Triton kernels run on CPU tensors through Triton's interpreter when no GPU is present. The
variable must be set before any kernel module (hence triton.language) is imported, which is
why it is set here, at conftest import time, before test modules are collected.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    # Long tests run only when asked for by marker (`-m slow`), so the default run stays short.
    run_slow = "slow" in (config.getoption("-m") or "")
    skip_slow = pytest.mark.skip(reason="slow: run with -m slow")
    # Where CUDA is present the kernels compile for it and the interpreter is off, so a test that
    # forces the device path onto CPU tensors cannot run; the gpu tests, the kernel tests (on
    # CUDA tensors there) and `gpu_suite.sh counts` cover that path on the device itself.
    skip_interpreter = pytest.mark.skip(reason="forces the device path onto CPU tensors through Triton's "
                                               "interpreter, which is off where CUDA is present")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and HAS_CUDA:
            item.add_marker(skip_interpreter)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture
def kernel_device():
    """The device the Triton kernels run on in this session: CUDA when present, else the interpreter's CPU."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")
