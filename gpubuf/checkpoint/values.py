"""Python values as JSON plus raw arrays, without pickle.

Used for the items of a ``ListStorage``, for state dicts of components without a dedicated
codec, and for transform states. What can be written:

* ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``complex``, ``str``;
* ``list``, ``tuple``, ``dict`` (any encodable hashable keys, insertion order kept), ``set``,
  ``frozenset``;
* ``torch.Tensor`` (dense, any device; its bytes go to a raw array), ``numpy.ndarray`` of a
  numeric or bool dtype, numpy scalars, ``bytes``/``bytearray``;
* ``TensorDict`` (nested, with ``NonTensorData`` leaves of encodable values) and instances of
  ``@tensorclass`` types defined at module level;
* ``torch.dtype``, ``torch.Size``, ``torch.device``, and a storage's ``Layout``.

Anything else raises :class:`UnserializableDataError` naming where it was found: writing it would
need pickle, which a checkpoint never holds.

Encoding: plain JSON for ``None``/``bool``/``int``/``str``/finite ``float``/``list``; everything
else is a one-key object whose key starts with ``$`` (``{"$tuple": [...]}``, ``{"$tensor": "t3"}``).

Decoding never imports a module: a tensorclass is looked up in modules already imported, and
refused otherwise.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from gpubuf.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, UnserializableDataError
from gpubuf.checkpoint.format import dtype_name, parse_dtype, parse_shape, require
from gpubuf.storages._layout import class_path, imported_class

AddArray = Callable[[torch.Tensor], str]
GetArray = Callable[[str], torch.Tensor]

_MAX_DEPTH = 200


def resolve_class(path: str, check: Callable[[type], bool], what: str) -> type:
    """The class recorded as ``"module:QualName"``, looked up in modules already imported.

    Importing a module named by a checkpoint could execute its code, so it is never done.

    Raises:
        CheckpointMismatchError: the module is not imported, or the name is not such a class.
    """
    if not isinstance(path, str) or ":" not in path:
        raise CheckpointCorruptError(f"invalid class reference {path!r}")
    module_name, qualname = path.split(":", 1)
    obj = imported_class(path)
    if not isinstance(obj, type) or not check(obj):
        raise CheckpointMismatchError(
            f"the checkpoint holds {what} {qualname!r} of module {module_name!r}, which is not imported here: "
            f"import {module_name} before loading (a checkpoint never imports code)"
        )
    return obj


def check_resolvable(cls: type, what: str) -> str:
    """The class path of ``cls``, refusing classes that could not be found again by name."""
    path = class_path(cls)
    if "<locals>" in cls.__qualname__:
        raise UnserializableDataError(
            f"{what} {cls.__qualname__!r} is defined inside a function; a checkpoint refers to classes by name, "
            "so define it at module level"
        )
    return path


class Encoder:
    """Encodes values; tensors are handed to ``add_array``, which returns their array name."""

    @classmethod
    def collecting(cls, prefix: str) -> tuple[Encoder, dict[str, torch.Tensor]]:
        """An encoder that keeps the tensors it meets, named ``<prefix>0``, ``<prefix>1``, ...

        Args:
            prefix: what the array names start with, so that they stay apart from the other
                arrays of the same component.

        Returns:
            ``(encoder, arrays)``: the encoder, and the dict (name to tensor) it fills.
        """
        arrays: dict[str, torch.Tensor] = {}

        def add(tensor: torch.Tensor) -> str:
            name = f"{prefix}{len(arrays)}"
            arrays[name] = tensor
            return name

        return cls(add), arrays

    def __init__(self, add_array: AddArray) -> None:
        self.add_array = add_array

    def encode(self, value: Any, where: str = "value", depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise UnserializableDataError(f"{where}: nested more than {_MAX_DEPTH} levels deep")
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if type(value) is complex:
            return {"$complex": [self.encode(value.real), self.encode(value.imag)]}
        if type(value) is list:
            return [self.encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if type(value) is tuple:
            return {"$tuple": [self.encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]}
        if type(value) is dict:
            return {"$dict": [[self.encode(k, f"{where} key", depth + 1), self.encode(v, f"{where}[{k!r}]", depth + 1)]
                              for k, v in value.items()]}
        if type(value) in (set, frozenset):
            tag = "$set" if type(value) is set else "$frozenset"
            return {tag: [self.encode(v, f"{where} member", depth + 1) for v in value]}
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter) or _is_memmap(value):
            return self._tensor(value, where)
        if isinstance(value, torch.dtype):
            return {"$dtype": dtype_name(value)}
        if isinstance(value, torch.Size):
            return {"$size": list(value)}
        if isinstance(value, torch.device):
            return {"$device": str(value)}
        if type(value) in (bytes, bytearray):
            array = torch.frombuffer(bytearray(value), dtype=torch.uint8) if value else torch.empty(0, dtype=torch.uint8)
            return {"$bytes" if type(value) is bytes else "$bytearray": self.add_array(array)}
        if isinstance(value, np.ndarray) and type(value) is np.ndarray:
            return {"$ndarray": self._numpy(value, where)}
        if isinstance(value, np.generic) and not isinstance(value, (np.object_, np.str_, np.bytes_, np.void)):
            return {"$npscalar": self._numpy(np.asarray(value), where)}
        from tensordict import TensorDictBase, is_tensorclass

        from gpubuf.storages._layout import Layout

        if type(value) is Layout:
            # Storages keep their layout in their state dicts.
            return {"$layout": encode_layout(value)}
        if is_tensorclass(value):
            return self._tensorclass(value, where, depth)
        if isinstance(value, TensorDictBase):
            return {"$td": self._tensordict(value, where, depth)}
        raise UnserializableDataError(
            f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be written without pickle; a "
            "checkpoint holds tensors, TensorDicts, tensorclasses, numpy arrays and JSON-like values (None, bool, "
            "int, float, str, list, tuple, dict, set, bytes) only"
        )

    def _tensor(self, value: torch.Tensor, where: str) -> dict:
        out: dict[str, Any] = {"$tensor": self.add_array(value), "device": str(value.device)}
        if value.requires_grad:
            out["requires_grad"] = True
        if type(value) is torch.nn.Parameter:
            out["parameter"] = True
        return out

    def _numpy(self, value: np.ndarray, where: str) -> str:
        if value.dtype.kind not in "biufc":
            raise UnserializableDataError(
                f"{where}: a numpy array of dtype {value.dtype} cannot be written without pickle; only numeric and "
                "bool arrays can"
            )
        # Not np.ascontiguousarray: it turns 0-d arrays (numpy scalars) into 1-d ones.
        array = value if value.flags.c_contiguous else value.copy(order="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        return self.add_array(torch.from_numpy(array))

    def _tensordict(self, td: Any, where: str, depth: int) -> dict:
        from tensordict import NonTensorData, TensorDictBase, is_tensorclass
        from tensordict.base import _is_leaf_nontensor

        if type(td).__name__ not in ("TensorDict",):
            td = td.to_tensordict()
        entries = []
        for key, value in td.items(is_leaf=_is_leaf_nontensor):
            if isinstance(value, NonTensorData):
                entries.append([key, {"$nontensor": self.encode(value.data, f"{where}[{key!r}]", depth + 1)}])
            elif isinstance(value, TensorDictBase) and not is_tensorclass(value):
                entries.append([key, {"$td": self._tensordict(value, f"{where}[{key!r}]", depth + 1)}])
            else:
                entries.append([key, self.encode(value, f"{where}[{key!r}]", depth + 1)])
        return {
            "batch_size": list(td.batch_size),
            "device": None if td.device is None else str(td.device),
            "entries": entries,
        }

    def _tensorclass(self, value: Any, where: str, depth: int) -> dict:
        path = check_resolvable(type(value), "tensorclass")
        non_tensor = getattr(value, "_non_tensordict", {}) or {}
        return {
            "$tensorclass": path,
            "td": self._tensordict(value._tensordict, where, depth + 1),
            "non_tensor": [[k, self.encode(v, f"{where}.{k}", depth + 1)] for k, v in non_tensor.items()],
        }


def _is_memmap(value: Any) -> bool:
    from tensordict.memmap import MemoryMappedTensor

    return isinstance(value, MemoryMappedTensor)


def exists_here(device: torch.device) -> bool:
    """Whether this machine has ``device``: the CPU, a CUDA device of an index it has, or MPS."""
    if device.type == "cpu":
        return True
    return {
        "cuda": torch.cuda.is_available() and (device.index is None or device.index < torch.cuda.device_count()),
        "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
    }.get(device.type, False)


def device_here(name: str) -> torch.device:
    """The recorded device when it exists on this machine, else the CPU.

    A checkpoint written on a GPU machine stays loadable on one without (the data lands on the
    CPU); a warning says so.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise CheckpointCorruptError(f"invalid device {name!r}") from None
    if exists_here(device):
        return device
    import warnings

    from gpubuf.checkpoint.errors import CheckpointWarning

    warnings.warn(f"the checkpoint recorded device {name!r}, which this machine lacks: loading on the CPU", CheckpointWarning, stacklevel=3)
    return torch.device("cpu")


class Decoder:
    """Decodes what :class:`Encoder` wrote; ``get_array`` returns a verified host tensor by name."""

    def __init__(self, get_array: GetArray) -> None:
        self.get_array = get_array

    def decode(self, value: Any, where: str = "value", depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise CheckpointCorruptError(f"{where}: nested more than {_MAX_DEPTH} levels deep")
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value
        if isinstance(value, list):
            return [self.decode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if not isinstance(value, dict) or len(value) < 1:
            raise CheckpointCorruptError(f"{where}: unexpected {type(value).__name__} {value!r:.60}")
        tag = next(iter(value))
        body = value[tag]
        d = depth + 1
        if tag == "$float":
            if body not in ("nan", "inf", "-inf"):
                raise CheckpointCorruptError(f"{where}: invalid float {body!r}")
            return float(body)
        if tag == "$complex":
            re, im = self._pair(body, where)
            return complex(self._number(re, where), self._number(im, where))
        if tag == "$tuple":
            return tuple(self.decode(v, f"{where}[{i}]", d) for i, v in enumerate(self._list(body, where)))
        if tag == "$dict":
            out = {}
            for pair in self._list(body, where):
                k, v = self._pair(pair, where)
                key = self.decode(k, f"{where} key", d)
                try:
                    out[key] = self.decode(v, f"{where}[{key!r}]", d)
                except TypeError:
                    raise CheckpointCorruptError(f"{where}: unhashable dict key {key!r:.60}") from None
            return out
        if tag in ("$set", "$frozenset"):
            try:
                items = (self.decode(v, f"{where} member", d) for v in self._list(body, where))
                return set(items) if tag == "$set" else frozenset(items)
            except TypeError:
                raise CheckpointCorruptError(f"{where}: unhashable set member") from None
        if tag == "$tensor":
            return self._tensor(value, where)
        if tag == "$dtype":
            return parse_dtype(body, where)
        if tag == "$size":
            return parse_shape(body, where)
        if tag == "$device":
            if not isinstance(body, str):
                raise CheckpointCorruptError(f"{where}: invalid device")
            try:
                return torch.device(body)
            except (RuntimeError, TypeError):
                raise CheckpointCorruptError(f"{where}: invalid device {body!r}") from None
        if tag in ("$bytes", "$bytearray"):
            array = self._array(body, where, torch.uint8)
            data = array.numpy().tobytes()
            return data if tag == "$bytes" else bytearray(data)
        if tag == "$ndarray":
            return self._array(body, where).numpy().copy()
        if tag == "$npscalar":
            array = self._array(body, where).numpy()
            if array.ndim != 0:
                raise CheckpointCorruptError(f"{where}: a numpy scalar must be 0-d")
            return array[()]
        if tag == "$td":
            return self._tensordict(body, where, d)
        if tag == "$tensorclass":
            return self._tensorclass(value, where, d)
        if tag == "$layout":
            return decode_layout(body, where)
        if tag == "$nontensor":
            raise CheckpointCorruptError(f"{where}: non-tensor entry outside a TensorDict")
        raise CheckpointCorruptError(f"{where}: unknown tag {tag!r}")

    @staticmethod
    def _list(body: Any, where: str) -> list:
        if not isinstance(body, list):
            raise CheckpointCorruptError(f"{where}: expected a list")
        return body

    @staticmethod
    def _pair(body: Any, where: str) -> list:
        if not isinstance(body, list) or len(body) != 2:
            raise CheckpointCorruptError(f"{where}: expected a pair")
        return body

    @staticmethod
    def _number(value: Any, where: str) -> float:
        if isinstance(value, dict) and "$float" in value:
            return float(value["$float"])
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise CheckpointCorruptError(f"{where}: expected a number")

    def _array(self, name: Any, where: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if not isinstance(name, str):
            raise CheckpointCorruptError(f"{where}: expected an array name")
        array = self.get_array(name)
        if dtype is not None and array.dtype != dtype:
            raise CheckpointCorruptError(f"{where}: array {name!r} has dtype {array.dtype}, expected {dtype}")
        return array

    def _tensor(self, value: dict, where: str) -> torch.Tensor:
        device = value.get("device", "cpu")
        if not isinstance(device, str):
            raise CheckpointCorruptError(f"{where}: invalid device")
        tensor = self._array(value["$tensor"], where).clone().to(device_here(device))
        if value.get("parameter") is True:
            return torch.nn.Parameter(tensor, requires_grad=value.get("requires_grad") is True)
        if value.get("requires_grad") is True:
            tensor.requires_grad_(True)
        return tensor

    def _tensordict(self, body: Any, where: str, depth: int) -> Any:
        from tensordict import NonTensorData, TensorDict

        if not isinstance(body, dict):
            raise CheckpointCorruptError(f"{where}: invalid TensorDict")
        batch_size = parse_shape(body.get("batch_size"), f"{where}.batch_size")
        device = body.get("device")
        if device is not None:
            if not isinstance(device, str):
                raise CheckpointCorruptError(f"{where}: invalid device")
            device = device_here(device)
        source = {}
        for pair in self._list(body.get("entries"), where):
            key, entry = self._pair(pair, where)
            if not isinstance(key, str):
                raise CheckpointCorruptError(f"{where}: TensorDict keys are strings")
            if isinstance(entry, dict) and "$nontensor" in entry:
                source[key] = NonTensorData(self.decode(entry["$nontensor"], f"{where}[{key!r}]", depth + 1),
                                            batch_size=batch_size)
            else:
                source[key] = self.decode(entry, f"{where}[{key!r}]", depth + 1)
        try:
            return TensorDict(source, batch_size=batch_size, device=device)
        except (RuntimeError, ValueError, TypeError) as err:
            raise CheckpointCorruptError(f"{where}: the entries do not form a TensorDict: {err}") from None

    def _tensorclass(self, value: dict, where: str, depth: int) -> Any:
        from tensordict import is_tensorclass

        cls = resolve_class(value["$tensorclass"], is_tensorclass, "the tensorclass")
        td = self._tensordict(value.get("td"), where, depth)
        non_tensor = {}
        for pair in self._list(value.get("non_tensor", []), where):
            k, v = self._pair(pair, where)
            non_tensor[k] = self.decode(v, f"{where}.{k}", depth + 1)
        try:
            out = cls._from_tensordict(td, non_tensor) if non_tensor else cls._from_tensordict(td)
        except (RuntimeError, ValueError, TypeError, KeyError) as err:
            raise CheckpointMismatchError(f"{where}: cannot rebuild {cls.__qualname__}: {err}") from None
        return out


# ---------------------------------------------------------------------- storage layouts
# A storage's layout (container kind, keys, dtypes, item shapes, tensorclass, pytree structure)
# as JSON, and back.
def encode_layout(layout: Any) -> dict:
    """The JSON form of a storage :class:`~gpubuf.storages._layout.Layout`."""
    out: dict[str, Any] = {
        "kind": layout.kind,
        "item_batch": list(layout.item_batch),
        "leaves": [{"key": list(s.key), "dtype": dtype_name(s.dtype), "shape": list(s.shape)} for s in layout.leaves],
    }
    if layout.kind == "tensorclass":
        out["container"] = check_resolvable(layout.container_cls, "tensorclass")
    if layout.kind == "pytree":
        import torch.utils._pytree as pytree

        # The tree with its leaves numbered: plain tuples, lists and dicts, which JSON holds;
        # other pytree node types cannot be written without pickle and are refused here.
        skeleton = pytree.tree_unflatten(list(range(len(layout.leaves))), layout.treespec)
        out["tree"] = Encoder(_no_arrays).encode(skeleton, "pytree structure")
    return out


def _no_arrays(tensor: torch.Tensor) -> str:
    raise UnserializableDataError("a pytree structure holds no tensor")


def _no_array_named(name: str) -> torch.Tensor:
    raise CheckpointCorruptError(f"array {name!r} is referenced but not in the checkpoint")


def decode_layout(state: Any, where: str) -> Any:
    """Rebuilds a :class:`~gpubuf.storages._layout.Layout` from :func:`encode_layout`'s output."""
    from tensordict import TensorDict, is_tensorclass

    from gpubuf.storages._layout import Layout, LeafSpec

    kind = require(state, "kind", str, where)
    if kind not in ("tensor", "tensordict", "tensorclass", "pytree"):
        raise CheckpointCorruptError(f"{where}: unknown layout kind {kind!r}")
    item_batch = parse_shape(require(state, "item_batch", list, where), f"{where}.item_batch")
    specs = []
    for i, leaf in enumerate(require(state, "leaves", list, where)):
        w = f"{where}.leaves[{i}]"
        key = require(leaf, "key", list, w)
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in key):
            raise CheckpointCorruptError(f"{w}: a key is a list of strings or ints")
        specs.append(LeafSpec(tuple(key), parse_dtype(require(leaf, "dtype", str, w), w),
                              parse_shape(require(leaf, "shape", list, w), w)))
    if not specs:
        raise CheckpointCorruptError(f"{where}: a layout has at least one leaf")
    container, treespec = None, None
    if kind == "tensordict":
        container = TensorDict
    elif kind == "tensorclass":
        container = resolve_class(require(state, "container", str, where), is_tensorclass, "the tensorclass")
    elif kind == "pytree":
        import torch.utils._pytree as pytree

        skeleton = Decoder(_no_array_named).decode(state.get("tree"), f"{where}.tree")
        numbers, treespec = pytree.tree_flatten(skeleton)
        if numbers != list(range(len(specs))):
            raise CheckpointCorruptError(f"{where}: the pytree structure does not number its {len(specs)} leaves in order")
    return Layout(kind, specs, item_batch, container, treespec)
