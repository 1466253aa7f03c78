"""Packaging guards: no top-level ``kernels`` module, and ``import gpubuf`` needs neither GPU nor Triton."""

import glob
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernels_folder_is_not_a_package():
    # A top-level "kernels" package would shadow Hugging Face's `kernels`, which transformers imports.
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert (ROOT / "kernels" / "gpubuf_kernels" / "__init__.py").exists()


def test_kernel_package_imports_as_gpubuf_kernels():
    import gpubuf_kernels

    assert pathlib.Path(gpubuf_kernels.__file__).resolve().parent == ROOT / "kernels" / "gpubuf_kernels"


def test_wheel_ships_gpubuf_and_gpubuf_kernels_only(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = glob.glob(str(tmp_path / "gpubuf-*.whl"))
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    top = {name for name in top if not name.endswith(".dist-info")}
    assert top == {"gpubuf", "gpubuf_kernels"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "gpubuf_kernels/gather.py" in names
    assert "gpubuf_kernels/cpu/sumtree.py" in names
    # every source folder of the package ships (a forgotten subpackage breaks installed copies only)
    shipped = {name.rsplit("/", 1)[0] for name in names if name.endswith(".py")}
    for init in (ROOT / "gpubuf").rglob("*.py"):
        folder = init.parent.relative_to(ROOT).as_posix()
        if "__pycache__" not in folder:
            assert folder in shipped, f"{folder} is missing from the wheel"


BLOCK_TRITON = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is blocked in this test")
sys.meta_path.insert(0, Block())
import torch
import gpubuf
assert "gpubuf_kernels" not in sys.modules, "import gpubuf imported the kernels"
assert "triton" not in sys.modules
rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(16), batch_size=4)
rb.extend(torch.arange(10.0))
batch = rb.sample()
assert batch.shape == (4,)
print("ok")
"""


def test_import_gpubuf_without_triton_or_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", BLOCK_TRITON], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


BLOCK_NUMBA = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "numba" or name.startswith("numba."):
            raise ImportError("numba is blocked in this test")
sys.meta_path.insert(0, Block())
import torch
import gpubuf
from gpubuf.ops._dispatch import resolve_backend
from gpubuf.errors import BackendUnavailableError
assert resolve_backend(torch.zeros(1), "auto", has_cpu_kernel=True) == "torch"
try:
    resolve_backend(torch.zeros(1), "numba", has_cpu_kernel=True)
    raise SystemExit("backend='numba' without numba did not raise")
except BackendUnavailableError:
    pass
rb = gpubuf.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=gpubuf.LazyTensorStorage(64), batch_size=8)
rb.extend(torch.arange(40.0))
batch, info = rb.sample(return_info=True)
rb.update_priority(info["index"], torch.rand(8))
assert "numba" not in sys.modules
print("ok")
"""


def test_prioritized_buffer_without_numba_uses_the_torch_path():
    result = subprocess.run([sys.executable, "-c", BLOCK_NUMBA], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_import_gpubuf_does_not_import_numba():
    code = "import sys, gpubuf; assert 'numba' not in sys.modules; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["ReplayBuffer", "TensorDictReplayBuffer", "LazyTensorStorage", "TensorStorage",
                                  "ListStorage", "RandomSampler", "SamplerWithoutReplacement", "RoundRobinWriter",
                                  "TensorDictRoundRobinWriter"])
def test_public_names(name):
    import gpubuf

    assert hasattr(gpubuf, name)
