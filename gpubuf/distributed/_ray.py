"""Ray, imported on first use, and the few things every distributed buffer needs from it.

``import gpubuf`` (and ``import gpubuf.distributed``) never imports Ray: it is an optional extra
(``pip install gpubuf[ray]``), imported by the first buffer that needs it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from tensordict import TensorDictBase

#: The ``ray.init`` arguments used when no Ray runtime is running and none are given: a local
#: cluster without its dashboard (TorchRL's ``DEFAULT_RAY_INIT_CONFIG`` starts none either).
DEFAULT_RAY_INIT_CONFIG: dict[str, Any] = {"include_dashboard": False}


def default_remote_config() -> dict[str, Any]:
    """TorchRL's ``DEFAULT_REMOTE_CLASS_CONFIG``: one CPU, 2 GiB, a fifth of a GPU when there is one."""
    return {
        "num_cpus": 1,
        "num_gpus": 0.2 if torch.cuda.is_available() else None,
        "memory": 2 * 1024**3,
    }


def require_ray() -> Any:
    """Returns the ``ray`` module.

    Raises:
        ImportError: Ray is not installed; the message says how to install it.
    """
    try:
        import ray
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "gpubuf's distributed buffers need Ray: pip install 'gpubuf[ray]' (or pip install ray)"
        ) from err
    return ray


def actor_gone_errors() -> tuple[type[BaseException], ...]:
    """The Ray exceptions that mean an actor cannot serve: it died, or is unreachable or restarting."""
    ray = require_ray()
    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get`` that re-raises a remote method's own exception (a typed gpubuf error keeps its type
    and message), not Ray's wrapper with the remote traceback folded into the message."""
    ray = require_ray()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as err:
        cause = getattr(err, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise


def to_cpu(value: Any) -> Any:
    """Tensors and TensorDicts moved to the CPU (for an actor that has no GPU); anything else as is."""
    if isinstance(value, (torch.Tensor, TensorDictBase)) and value.device is not None and value.device.type != "cpu":
        return value.to("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


class RuntimeLease:
    """Starts a Ray runtime when none runs, and shuts it down when the last owner releases it.

    A runtime that was already running (``ray.init`` called by the user) is never shut down.
    """

    _lock = threading.RLock()
    _leases = 0
    _owns_runtime = False

    def __init__(self) -> None:
        self._released = False

    @classmethod
    def acquire(cls, ray_init_config: dict[str, Any] | None) -> "RuntimeLease":
        ray = require_ray()
        with cls._lock:
            if not ray.is_initialized():
                config = dict(DEFAULT_RAY_INIT_CONFIG if ray_init_config is None else ray_init_config)
                ray.init(**config)
                cls._owns_runtime = True
            cls._leases += 1
        return cls()

    def release(self) -> None:
        ray = require_ray()
        with type(self)._lock:
            if self._released:
                return
            self._released = True
            type(self)._leases -= 1
            if type(self)._leases == 0 and type(self)._owns_runtime:
                if ray.is_initialized():
                    ray.shutdown()
                type(self)._owns_runtime = False
