"""Every public name of ``torchrl.data.replay_buffers`` exists in gpubuf with a compatible signature.

The names are enumerated from TorchRL itself (the package's ``__all__``, its subpackages' ``__all__``
and the public classes of its ``scheduler`` module), so a name TorchRL adds shows up here as a
failure. "Compatible" means: every parameter of TorchRL's callable is accepted by gpubuf's under
the same name (directly, or through ``**kwargs`` that reach a base class that names it), a
positional parameter sits at the same position, and a default, where TorchRL has one, is equal.
For classes this holds for the constructor and every public method and property.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest
import torch
from tensordict import TensorClass, is_tensorclass

import gpubuf

torchrl_rb = pytest.importorskip("torchrl.data.replay_buffers")

# Names that are not gpubuf's to provide (yet), each with the reason. Remove an entry when its
# work lands; the test then checks the name like any other.
EXCLUDED_NAMES = {
    # TorchRL's compiled C++ segment trees are an implementation detail of its PrioritizedSampler;
    # gpubuf's sum tree is gpubuf.ops.sumtree.SumTree, with another interface.
    "SumSegmentTreeFp32": "TorchRL's compiled segment tree, not replay-buffer API",
    "SumSegmentTreeFp64": "TorchRL's compiled segment tree, not replay-buffer API",
    "MinSegmentTreeFp32": "TorchRL's compiled segment tree, not replay-buffer API",
    "MinSegmentTreeFp64": "TorchRL's compiled segment tree, not replay-buffer API",
    "CudaSumSegmentTreeFp32": "TorchRL's compiled segment tree, not replay-buffer API",
    "CudaSumSegmentTreeFp64": "TorchRL's compiled segment tree, not replay-buffer API",
    "CudaMinSegmentTreeFp32": "TorchRL's compiled segment tree, not replay-buffer API",
    "CudaMinSegmentTreeFp64": "TorchRL's compiled segment tree, not replay-buffer API",
}

# Members and parameters not provided yet, each with the reason (checked like any other once
# removed from here).
RAY_SERVICE_MEMBERS: set[str] = set()
RAY_SERVICE_PARAMS: set[str] = set()

# Names not provided yet, with the reason; each is an expected failure (strict: the entry must go
# once the name and all its members work).
PENDING: dict[str, str] = {
}

SUBMODULES = ("samplers", "storages", "writers", "replay_buffers")
EXTRA_MODULES = ("scheduler",)


def _public_names() -> list[str]:
    names = set(torchrl_rb.__all__)
    for sub in SUBMODULES:
        names |= set(getattr(importlib.import_module(f"torchrl.data.replay_buffers.{sub}"), "__all__", ()))
    for sub in EXTRA_MODULES:
        module = importlib.import_module(f"torchrl.data.replay_buffers.{sub}")
        for name, obj in vars(module).items():
            if not name.startswith("_") and inspect.isclass(obj) and obj.__module__ == module.__name__:
                names.add(name)
    names.add("pin_memory_output")  # torchrl.data.replay_buffers.utils' public decorator
    return sorted(names - set(EXCLUDED_NAMES))


def _torchrl(name: str):
    for module in (torchrl_rb, *(f"torchrl.data.replay_buffers.{m}" for m in (*SUBMODULES, *EXTRA_MODULES, "utils"))):
        module = importlib.import_module(module) if isinstance(module, str) else module
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(name)


def _members(cls: type) -> list[str]:
    return sorted(
        m
        for m in dir(cls)
        if not m.startswith("_") and m not in RAY_SERVICE_MEMBERS and not _is_enum_member(cls, m)
        and _defined_by_torchrl(cls, m)
    )


class _PlainTensorClass(TensorClass):
    x: torch.Tensor


def _defined_by_torchrl(cls: type, member: str) -> bool:
    """Whether ``member`` is TorchRL's own, not inherited from tensordict's tensorclass or ``str``."""
    if is_tensorclass(cls) and hasattr(_PlainTensorClass, member):
        return False
    for owner in cls.__mro__:
        if member in vars(owner):
            return owner.__module__.startswith("torchrl")
    return False


def _is_enum_member(cls: type, name: str) -> bool:
    return isinstance(getattr(cls, name, None), cls)


def _cases() -> list:
    return [
        pytest.param(name, marks=pytest.mark.xfail(reason=PENDING[name], strict=True)) if name in PENDING else name
        for name in _public_names()
    ]


def _signature(obj) -> inspect.Signature | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def _accepts(cls_or_fn, member: str | None, param: str) -> inspect.Parameter | None:
    """gpubuf's parameter ``param`` of ``cls_or_fn[.member]``, following ``**kwargs`` up the MRO."""
    owners = cls_or_fn.__mro__ if inspect.isclass(cls_or_fn) else (cls_or_fn,)
    for owner in owners:
        fn = owner if member is None else vars(owner).get(member)
        if fn is None:
            continue
        sig = _signature(fn)
        if sig is None:
            return None
        if param in sig.parameters:
            return sig.parameters[param]
        if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            return None
    return None


def _same_default(a, b) -> bool:
    if a is b or (isinstance(a, property) and isinstance(b, property)):
        # (a tensorclass field's default is the class's property in both)
        return True
    if inspect.isclass(a) and a.__module__.startswith("torchrl.") and getattr(gpubuf, a.__name__, None) is b:
        # A TorchRL class as the default (RayReplayBuffer's replay_buffer_cls): gpubuf's namesake.
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - tensors and the like: compare by identity only
        return False


def _check_callable(label: str, theirs, ours, owner=None, member: str | None = None) -> None:
    their_sig, our_sig = _signature(theirs), _signature(ours)
    if their_sig is None:
        return
    assert our_sig is not None, f"{label}: gpubuf's has no inspectable signature"
    # "self" is left out: TorchRL's static methods are gpubuf's methods in some places, called
    # the same way on an instance.
    their_positional = [p.name for p in their_sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD][:]
    our_positional = [p.name for p in our_sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    their_positional = [n for n in their_positional if n != "self"]
    our_positional = [n for n in our_positional if n != "self"]
    problems = []
    for p in their_sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in RAY_SERVICE_PARAMS or p.name == "self":
            continue
        ours_p = our_sig.parameters.get(p.name)
        if ours_p is None and owner is not None:
            ours_p = _accepts(owner, member, p.name)
        if ours_p is None:
            problems.append(f"parameter {p.name!r} missing")
            continue
        if p.kind is p.POSITIONAL_OR_KEYWORD and p.name in our_positional:
            if their_positional.index(p.name) != our_positional.index(p.name):
                problems.append(f"parameter {p.name!r} at position {our_positional.index(p.name)}, TorchRL's at "
                                f"{their_positional.index(p.name)}")
        elif p.kind is p.POSITIONAL_OR_KEYWORD and ours_p.kind is ours_p.KEYWORD_ONLY:
            problems.append(f"parameter {p.name!r} is keyword-only, TorchRL's is positional")
        if p.default is not p.empty and not _same_default(p.default, ours_p.default):
            problems.append(f"parameter {p.name!r} defaults to {ours_p.default!r}, TorchRL's to {p.default!r}")
    assert not problems, f"{label}: " + "; ".join(problems)


@pytest.mark.parametrize("name", _cases())
def test_torchrl_public_name_has_a_compatible_gpubuf_counterpart(name):
    """The name exists; a class's constructor and every public member of TorchRL's are compatible."""
    theirs = _torchrl(name)
    assert hasattr(gpubuf, name), f"gpubuf has no {name}"
    ours = getattr(gpubuf, name)
    if not inspect.isclass(theirs):
        if callable(theirs):
            assert callable(ours), f"{name}: not callable in gpubuf"
            _check_callable(name, theirs, ours)
        elif isinstance(theirs, (str, int, float, bool, tuple, list, dict, frozenset, set)):
            assert ours == theirs, f"{name}: {ours!r} != TorchRL's {theirs!r}"
        else:
            # An object (such as ``traj``, the root of query expressions): the same kind of object.
            assert type(ours).__name__ == type(theirs).__name__, f"{name}: a {type(ours).__name__}"
        return
    assert inspect.isclass(ours), f"{name}: TorchRL's is a class, gpubuf's a {type(ours).__name__}"
    problems = []
    for label, check in [(f"{name}.__init__", lambda: _check_callable(
            f"{name}.__init__", theirs.__init__, ours.__init__, owner=ours, member="__init__"))] + [
        (f"{name}.{member}", lambda member=member: _check_member(name, theirs, ours, member)) for member in _members(theirs)
    ]:
        try:
            check()
        except AssertionError as err:
            problems.append(f"{label}: {err}".split("\nassert")[0])
    assert not problems, "\n".join(problems)


def _check_member(name: str, theirs: type, ours: type, member: str) -> None:
    their_attr = inspect.getattr_static(theirs, member)
    assert hasattr(ours, member), f"gpubuf's {name} has no {member}"
    our_attr = inspect.getattr_static(ours, member) if member in dir(ours) else getattr(ours, member)
    if isinstance(their_attr, property):
        assert isinstance(our_attr, property) or not callable(our_attr), f"{name}.{member}: TorchRL's is a property"
        return
    if isinstance(their_attr, (staticmethod, classmethod)) or inspect.isfunction(their_attr):
        our_fn = getattr(ours, member)
        assert callable(our_fn), f"{name}.{member}: not callable in gpubuf"
        _check_callable(f"{name}.{member}", getattr(theirs, member), our_fn, owner=ours, member=member)


def test_the_enumeration_sees_torchrl_names():
    # The enumeration itself must not come back empty or miss the core names.
    names = set(_public_names())
    assert {"ReplayBuffer", "PrioritizedSampler", "LazyTensorStorage", "RoundRobinWriter", "LinearScheduler"} <= names
    assert not names & set(EXCLUDED_NAMES)
