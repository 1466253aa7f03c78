"""What a benchmark result must record about where it ran: device, versions, commit."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

_PACKAGES = ("torch", "triton", "tensordict", "torchrl", "numba", "gpubuf")


def resolve_device(name: str) -> torch.device:
    """Turns ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a device.

    Raises:
        ValueError: an unknown name, or ``"cuda"`` where CUDA is not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name) if name.startswith(("cpu", "cuda")) else None
    if device is None:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but CUDA is not available on this machine")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else device


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


#: Names the commit of a copy of the checkout that has no ``.git`` (a working tree sent to a
#: GPU machine, say), for :func:`git_sha`.
GIT_SHA_VARIABLE = "GPUBUF_GIT_SHA"


def git_sha() -> str | None:
    """The commit of the gpubuf checkout this code runs from (``-dirty`` when modified).

    ``GPUBUF_GIT_SHA``, when set, wins: a copy sent to another machine may carry no ``.git``, or
    one older than its files. Otherwise git's answer, or None where git cannot tell (git
    missing, an installed wheel).
    """
    import os

    told = os.environ.get(GIT_SHA_VARIABLE) or None
    if told is not None:
        return told
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
        return told
    return f"{sha}-dirty" if sha and status else (sha or told)


def load_average() -> float | None:
    """The 1-minute load average of the host (None where the OS has none)."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cpu_kernels() -> str:
    """Which path CPU sum trees take: ``"numba"`` (compiled kernels) or ``"torch"``."""
    from gpubuf.ops._dispatch import numba_enabled

    return "numba" if numba_enabled() else "torch"


def torchrl_extension(package: Path | None = None) -> str | None:
    """``"rebuilt"`` when ``scripts/build_torchrl_extension.py`` replaced TorchRL's shipped
    extension (its prioritized rows then run TorchRL's own C++ compiled for this torch),
    ``"shipped"`` otherwise, None without TorchRL. Read from files; nothing is imported.

    Args:
        package: TorchRL's package directory (default: the installed one's).
    """
    if package is None:
        from importlib.util import find_spec

        try:
            spec = find_spec("torchrl")
        except (ImportError, ValueError):
            return None
        if spec is None or spec.origin is None:
            return None
        package = Path(spec.origin).parent
    return "rebuilt" if any(package.glob("_torchrl*.orig")) else "shipped"


def collect(device: torch.device) -> dict:
    """The environment block of a result: device, device name, versions, git sha, threads, host load,
    the CPU sum-tree path and which TorchRL extension ran."""
    return {
        "device": device.type,
        "device_name": device_name(device),
        "versions": versions(),
        "cpu_kernels": cpu_kernels(),
        "torchrl_extension": torchrl_extension(),
        "git_sha": git_sha(),
        "torch_threads": torch.get_num_threads(),
        "cpu_cores": _cpu_count(),
        "load_average": load_average(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def contention_note(env: dict) -> str | None:
    """A warning when other processes already keep the CPU's cores busy, or None.

    On such a host a multi-threaded torch op waits for its slowest thread, which another
    process may have descheduled: medians then measure the scheduler, not the code.
    """
    load, cores = env.get("load_average"), env.get("cpu_cores")
    if env.get("device") != "cpu" or load is None or not cores or load < cores:
        return None
    return (
        f"NOTE: load average {load} on {cores} cores before the run: other processes compete for the CPU; "
        "timings are noisy (try --threads 1)"
    )


__all__ = ["collect", "contention_note", "device_name", "git_sha", "load_average", "resolve_device", "versions"]
