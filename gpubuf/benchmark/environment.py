"""What a benchmark result must record about where it ran: device, versions, commit."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

_PACKAGES = ("torch", "triton", "tensordict", "torchrl", "gpubuf")


def resolve_device(name: str) -> torch.device:
    """Turns ``"auto"``, ``"cpu"`` or ``"cuda"`` into a device.

    Raises:
        ValueError: an unknown name, or ``"cuda"`` where CUDA is not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but CUDA is not available on this machine")
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (with its logical core count)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = _cpu_model() or platform.processor() or platform.machine()
    return f"{model} ({_cpu_count()} logical cores)"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def versions() -> dict[str, str | None]:
    """Installed versions (from package metadata, so nothing is imported) of the packages involved."""
    found: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_sha() -> str | None:
    """The commit of the gpubuf checkout this code runs from (``-dirty`` when modified), or None
    (an installed wheel, or git missing)."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if sha and status else (sha or None)


def collect(device: torch.device) -> dict:
    """The environment block of a result: device, device name, versions, git sha, threads, host."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        "versions": versions(),
        "git_sha": git_sha(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


__all__ = ["collect", "device_name", "git_sha", "resolve_device", "versions"]
