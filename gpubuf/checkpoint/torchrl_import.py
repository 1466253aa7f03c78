"""Reading checkpoints written by TorchRL's ``ReplayBuffer.dumps`` (migration), without pickle.

TorchRL's layout::

    buffer_metadata.json              {"batch_size": ..., ...}
    storage/storage_metadata.json     {"metadata": {...}, "is_pytree": bool, "len": int}
    storage/meta.json, <key>.memmap   a memory-mapped TensorDict (non-pytree storages), nested
                                      TensorDicts in sub-directories, a tensorclass's fields
                                      under _tensordict/
    storage/<path>.memmap             one file per leaf (pytree storages; no meta.json)
    sampler/                          SamplerWithoutReplacement: a memory-mapped TensorDict of its
                                      state dict; PrioritizedSampler: sampler_metadata.json and
                                      sumtree.memmap / mintree.memmap; RandomSampler: nothing
    writer/metadata.json              {"cursor": ..., "write_count": ...}
    rng_state/                        a memory-mapped TensorDict holding the generator state
    prefetch.pkl, transform.t         pickles

Only JSON and raw ``.memmap`` files are read; each raw file's size is checked against the dtype
and shape its JSON records before it is read (TorchRL records no checksum). Pickles are never
unpickled: ``prefetch.pkl`` (prefetched batches, redrawn after loading) and ``transform.t``
(transform states, kept as they are in the target buffer) are skipped with a
:class:`~gpubuf.checkpoint.CheckpointWarning`; any other pickle, or a file this module does not
know, is refused with :class:`~gpubuf.checkpoint.UnsafeCheckpointError`, since the state it holds
would be lost.

The result is the same ``(meta, arrays)`` pair a native checkpoint yields, so the same codecs
load it, with the same validation and the same all-or-nothing installation.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from gpubuf.checkpoint.arrays import ArraySpec, read_file, view_array
from gpubuf.checkpoint.values import Encoder, encode_layout
from gpubuf.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointWarning,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from gpubuf.checkpoint.format import (
    check_relpath,
    parse_dtype,
    parse_shape,
    read_json,
    require,
    require_int,
    resolve_inside,
    scan_directory,
)
from gpubuf.checkpoint.progress import progress_bar

SKIPPED_PICKLES = {
    "prefetch.pkl": "prefetched batches are not restored; they are drawn anew",
    "transform.t": "transform states are not restored; the buffer's transforms keep theirs",
}
SINGLE_TENSOR = "_-single-tensor-_"
_TD_TYPE = re.compile(r"^<class '([A-Za-z_][\w.]*)'>$")
_TD_META_KEYS = ("shape", "device", "_type")


def is_torchrl_checkpoint(path: Path) -> bool:
    """True when ``path`` looks like the output of TorchRL's ``ReplayBuffer.dumps``."""
    return (path / "buffer_metadata.json").is_file() and (path / "storage").is_dir()


class _Reader:
    """Collects the files read (to refuse any other) and the arrays, while parsing."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.consumed: set[str] = set()
        self.pending: dict[str, tuple[str, torch.dtype, torch.Size]] = {}

    def json(self, rel: str) -> Any:
        check_relpath(rel, "TorchRL checkpoint")
        self.consumed.add(rel)
        return read_json(resolve_inside(self.root, rel, "TorchRL checkpoint"), rel)

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def array(self, name: str, rel: str, dtype: torch.dtype, shape: torch.Size) -> str:
        check_relpath(rel, "TorchRL checkpoint")
        if not rel.endswith(".memmap"):
            raise UnsafeCheckpointError(f"{rel!r}: only .memmap files hold arrays")
        self.consumed.add(rel)
        self.pending[name] = (rel, dtype, shape)
        return name

    def read_all(self) -> dict[str, torch.Tensor]:
        total = sum(s.numel() * d.itemsize for _, d, s in self.pending.values())
        bar = progress_bar(total, "gpubuf load (TorchRL)")
        out = {}
        try:
            for name, (rel, dtype, shape) in self.pending.items():
                nbytes = shape.numel() * dtype.itemsize
                raw = read_file(self.root, rel, {"nbytes": nbytes, "checksum": None}, bar)
                out[name] = view_array(raw, ArraySpec(name, rel, 0, nbytes, dtype, shape))
        finally:
            bar.close()
        return out


def _key_file(key: str) -> list[str]:
    """File names TensorDict may have used for ``key``: its robust encoding, then the raw key."""
    if key in ("", ".", ".."):
        encoded = "%" if not key else "%2E" * len(key)
    else:
        unsafe = set('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}
        encoded = "".join(f"%{ord(c):02X}" if c in unsafe else c for c in key)
    return [encoded] if encoded == key or "/" in key or "\\" in key else [encoded, key]


def _td_dir(reader: _Reader, rel_dir: str, prefix: tuple, leaves: list, compact: dict | None = None) -> dict:
    """Parses a memory-mapped TensorDict directory; appends ``(key, dtype, shape, file)`` leaves.

    With ``compact`` (the root of a storage written by TorchRL's Flat/Nested checkpointers), its
    non-tensor entries (``shift``, ``is_full``, ``_storage_shape``) and nested tensors are
    collected there instead of refused.
    """
    meta = reader.json(f"{rel_dir}/meta.json")
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{rel_dir}/meta.json: expected an object")
    for key, entry in meta.items():
        if key in _TD_META_KEYS:
            continue
        where = f"{rel_dir}/meta.json[{key!r}]"
        if not isinstance(entry, dict):
            raise CheckpointMismatchError(f"{where}: a non-tensor entry ({entry!r:.40}); only tensors are imported")
        if compact is not None and entry.get("type") == "NonTensorData" and not prefix:
            sub = _existing(reader, rel_dir, _key_file(key), where)
            value = reader.json(f"{sub}/meta.json")
            if not isinstance(value, dict) or not value.get("_is_non_tensor") or "data" not in value:
                raise CheckpointCorruptError(f"{sub}/meta.json: expected a NonTensorData entry")
            compact[key] = value["data"]
            continue
        if "dtype" in entry and "shape" in entry:
            if entry.get("is_nested"):
                if compact is None:
                    raise CheckpointMismatchError(f"{where}: nested (jagged) tensors are not imported")
                _nested_leaf(reader, rel_dir, (*prefix, key), entry, where, compact)
                continue
            dtype = parse_dtype(entry["dtype"], where)
            shape = parse_shape(entry["shape"], where)
            rel = _existing(reader, rel_dir, [f"{name}.memmap" for name in _key_file(key)], where)
            leaves.append(((*prefix, key), dtype, shape, rel))
        elif entry.get("type") == "TensorDict" or "_type" in entry or entry.get("type"):
            if entry.get("type") not in (None, "TensorDict"):
                raise CheckpointMismatchError(f"{where}: a {entry.get('type')} entry is not imported")
            sub = _existing(reader, rel_dir, _key_file(key), where)
            _td_dir(reader, sub, (*prefix, key), leaves)
        else:
            raise CheckpointMismatchError(f"{where}: unknown entry {entry!r:.60}")
    return meta


def _nested_leaf(reader: _Reader, rel_dir: str, key: tuple, entry: dict, where: str, compact: dict) -> None:
    """A nested tensor of TorchRL's nested layout: its row shapes are read now (to size its values)."""
    dtype = parse_dtype(entry["dtype"], where)
    rows = parse_shape(entry["shape"], where)
    names = _key_file(key[-1])
    values_rel = _existing(reader, rel_dir, [f"{name}.memmap" for name in names], where)
    shapes_rel = _existing(reader, rel_dir, [f"{name}.shape.memmap" for name in names], where)
    if len(rows) != 2:
        raise CheckpointCorruptError(f"{where}: a nested tensor of {len(rows)} dims, expected [rows, dims]")
    reader.consumed.add(shapes_rel)
    raw = read_file(reader.root, shapes_rel, {"nbytes": rows.numel() * 8, "checksum": None}, progress_bar(0, ""))
    shapes = raw.view(torch.int64).view(rows)
    if shapes.numel() and (int(shapes.min()) < 0 or bool((shapes[:, 1:] != shapes[:1, 1:]).any())):
        raise CheckpointCorruptError(f"{shapes_rel}: rows of negative or differing trailing shapes")
    feature = torch.Size(shapes[0, 1:].tolist()) if shapes.numel() else torch.Size()
    total = int(shapes[:, 0].sum()) if shapes.numel() else 0
    name = f"compact/{len(compact.setdefault('__nested__', []))}"
    compact["__nested__"].append((key, reader.array(name, values_rel, dtype, torch.Size([total, *feature]))))


def _existing(reader: _Reader, rel_dir: str, names: list[str], where: str) -> str:
    for name in names:
        rel = f"{rel_dir}/{name}"
        check_relpath(rel, where)
        if reader.exists(rel):
            return rel
    raise CheckpointCorruptError(f"{where}: {rel_dir}/{names[0]} is missing")


def _class_of(td_type: Any, where: str) -> tuple[str, str]:
    match = _TD_TYPE.match(td_type) if isinstance(td_type, str) else None
    if match is None:
        raise CheckpointCorruptError(f"{where}: unknown _type {td_type!r}")
    module, _, name = match.group(1).rpartition(".")
    return module, name


# ---------------------------------------------------------------------- storage
def _storage(reader: _Reader, buffer: Any) -> tuple[dict, dict]:
    from tensordict import TensorDict

    from gpubuf.storages._layout import Layout, LeafSpec

    if not reader.exists("storage/storage_metadata.json") and reader.exists(H5_FILE):
        return _h5_storage(reader, buffer), {}
    if not reader.exists("storage/storage_metadata.json") and reader.exists(CLIST_INDICES):
        return _compressed_list(reader), {}
    smeta = reader.json("storage/storage_metadata.json")
    where = "storage/storage_metadata.json"
    is_pytree = require(smeta, "is_pytree", bool, where)
    length = require_int(smeta, "len", where)
    storage = buffer._storage if buffer is not None else None
    ndim = storage.ndim if storage is not None else 1
    arrays: dict[str, str] = {}
    if not is_pytree:
        root = reader.json("storage/meta.json")
        module, name = _class_of(root.get("_type"), "storage/meta.json")
        leaves: list = []
        if module == "tensordict._td" and name == "TensorDict" and _is_compact(root):
            # Written by TorchRL's FlatStorageCheckpointer / NestedStorageCheckpointer: rebuilt
            # into TED rows once the arrays are read (read_torchrl_checkpoint).
            compact: dict = {}
            reader.consumed.discard("storage/meta.json")
            _td_dir(reader, "storage", (), leaves, compact)
            for i, (key, dtype, shape, rel) in enumerate(leaves):
                compact.setdefault("__flat__", []).append((key, reader.array(f"compact/flat_{i}", rel, dtype, shape)))
            return {"compact": compact, "length": length, "ndim": ndim}, arrays
        if module == "tensordict._td" and name == "TensorDict":
            kind, container, td_meta = "tensordict", TensorDict, root
            reader.consumed.discard("storage/meta.json")
            _td_dir(reader, "storage", (), leaves)
        else:
            from tensordict import is_tensorclass

            from gpubuf.checkpoint.values import resolve_class

            extra = [k for k in root if k != "_type"]
            if extra:
                raise CheckpointMismatchError(f"storage/meta.json: tensorclass non-tensor fields {extra} are not imported")
            container = resolve_class(f"{module}:{name}", is_tensorclass, "the tensorclass")
            kind = "tensorclass"
            td_meta = _td_dir(reader, "storage/_tensordict", (), leaves)
        if not leaves:
            raise CheckpointMismatchError("the TorchRL storage holds no tensor")
        batch = parse_shape(td_meta.get("shape"), "storage/meta.json shape")
        if len(batch) < ndim:
            raise CheckpointMismatchError(f"the TorchRL storage has shape {list(batch)}, fewer dims than ndim={ndim}")
        specs = []
        for i, (key, dtype, shape, rel) in enumerate(leaves):
            if shape[: len(batch)] != batch:
                raise CheckpointCorruptError(f"{rel}: shape {list(shape)} does not start with the storage's {list(batch)}")
            specs.append(LeafSpec(key, dtype, shape[1:]))
            arrays[f"storage/leaf_{i}"] = reader.array(f"storage/leaf_{i}", rel, dtype, shape)
        layout = Layout(kind, specs, batch[1:], container, None)
        device = td_meta.get("device") if isinstance(td_meta.get("device"), str) else None
    else:
        layout, device = _pytree_layout(reader, smeta, storage, arrays)
    state = {
        "max_size": int(layout.leaves[0].shape[: ndim - 1].numel() * _cap0(reader, arrays)),
        "ndim": ndim,
        "len": length,
        "initialized": True,
        "auto_device": False,
        "device": device if device not in (None, "None") else None,
        "layout": encode_layout(layout),
    }
    return {"codec": "tensor_storage", "codec_version": 1, "class": "torchrl", "state": state}, arrays


H5_FILE = "storage/checkpoint.h5"


def _h5_storage(reader: _Reader, buffer: Any) -> dict:
    """A storage written by TorchRL's ``H5StorageCheckpointer``: one HDF5 group per trajectory
    (``traj_<i>``, see ``H5Split``) and the scalars ``_len``, ``shift``, ``is_full``,
    ``_storage_shape``. Read with ``h5py`` (datasets only, no link to another file)."""
    try:
        import h5py
    except ImportError as err:
        raise CheckpointMismatchError("a TorchRL H5 checkpoint needs h5py (pip install h5py)") from err
    check_relpath(H5_FILE, "TorchRL checkpoint")
    reader.consumed.add(H5_FILE)
    path = resolve_inside(reader.root, H5_FILE, "TorchRL checkpoint")
    compact: dict = {"__nested__": []}
    with h5py.File(path, "r") as file:

        def dataset(group: Any, name: str, where: str) -> torch.Tensor:
            link = group.get(name, getlink=True)
            if not isinstance(link, h5py.HardLink):
                raise UnsafeCheckpointError(f"{where}: a link ({type(link).__name__}) is refused")
            node = group[name]
            if not isinstance(node, h5py.Dataset) or node.is_virtual or node.external:
                raise UnsafeCheckpointError(f"{where}: only plain datasets are read")
            return torch.from_numpy(node[()].copy()) if node.shape else torch.tensor(node[()])

        trajectories: dict[int, dict] = {}
        for name in file:
            match = re.fullmatch(r"traj_(\d+)", name)
            if match is None:
                if name not in ("_len", "shift", "is_full", "_storage_shape"):
                    raise CheckpointMismatchError(f"{H5_FILE}: unknown entry {name!r}")
                compact[name] = dataset(file, name, f"{H5_FILE}:{name}").tolist()
                continue
            group = file[name]
            fields: dict = {}

            def collect(prefix: tuple, node: Any, where: str) -> None:
                for key in node:
                    link = node.get(key, getlink=True)
                    if not isinstance(link, h5py.HardLink):
                        raise UnsafeCheckpointError(f"{where}/{key}: a link ({type(link).__name__}) is refused")
                    if isinstance(node[key], h5py.Group):
                        collect((*prefix, key), node[key], f"{where}/{key}")
                    else:
                        fields[(*prefix, key)] = dataset(node, key, f"{where}/{key}")

            collect((), group, f"{H5_FILE}:{name}")
            trajectories[int(match.group(1))] = fields
    if not trajectories or any(k not in compact for k in ("_len", "shift", "is_full")):
        raise CheckpointCorruptError(f"{H5_FILE}: not a TorchRL H5 storage (no trajectories or scalars)")
    order = [trajectories[i] for i in sorted(trajectories)]
    keys = set(order[0])
    if any(set(t) != keys for t in order):
        raise CheckpointCorruptError(f"{H5_FILE}: trajectories with different keys")
    for key in sorted(keys):
        compact["__nested__"].append((key, torch.cat([t[key] for t in order])))
    if isinstance(compact.get("_storage_shape"), int):
        compact["_storage_shape"] = [compact["_storage_shape"]]
    return {"compact": compact, "length": int(compact["_len"]), "ndim": buffer._storage.ndim if buffer is not None else 1}


CLIST_INDICES = "storage/data_indices.json"
_CLIST_DATA = "storage/compressed_data"


def _compressed_list(reader: _Reader) -> dict:
    """A storage written by TorchRL's ``CompressedListStorageCheckpointer``.

    Its files: ``storage/metadata.json`` (each item's metadata, with ``torch.Size``, dtypes and
    devices as ``{"__type__": ..., "value": ...}``), ``storage/data_indices.json`` (each item's
    position in the stack below, null for an unset slot) and ``storage/compressed_data/`` (a
    memory-mapped lazy stack of TensorDicts: ``{"data": bytes}`` for a tensor item, one byte
    tensor per field for a TensorDict item). The compressed bytes are registered as arrays;
    :func:`_compressed_list_entry` assembles the storage's state dict once they are read.
    """
    where = "storage/metadata.json"
    metadata = reader.json(where)
    indices = reader.json(CLIST_INDICES)
    if not isinstance(metadata, list) or not isinstance(indices, list) or len(metadata) != len(indices):
        raise CheckpointCorruptError(f"{where} and {CLIST_INDICES}: expected two lists of one length")
    if reader.exists(_CLIST_DATA):
        stack = reader.json(f"{_CLIST_DATA}/meta.json")
        if _class_of(stack.get("_type") if isinstance(stack, dict) else None, f"{_CLIST_DATA}/meta.json")[1] not in (
            "LazyStackedTensorDict",
        ) or stack.get("stack_dim", 0) != 0:
            raise CheckpointCorruptError(f"{_CLIST_DATA}/meta.json: expected a lazy stack of TensorDicts along dim 0")
    items: list = []
    for i, (index, meta) in enumerate(zip(indices, metadata)):
        at = f"{where}[{i}]"
        if index is None:
            if meta is not None:
                raise CheckpointCorruptError(f"{at}: metadata for an item that was not saved")
            items.append(None)
            continue
        if isinstance(index, bool) or not isinstance(index, int) or index < 0 or not isinstance(meta, dict):
            raise CheckpointCorruptError(f"{CLIST_INDICES}[{i}]: expected a position and a metadata object")
        kind = meta.get("type")
        if kind == "tensor":
            expected = {"data"}
        elif kind == "tensordict" and isinstance(meta.get("fields"), dict):
            fields = meta["fields"]
            odd = [k for k, f in fields.items() if not isinstance(f, dict) or f.get("type") != "tensor"]
            if odd:
                raise CheckpointMismatchError(f"{at}: non-tensor fields {odd} are not imported")
            expected = set(fields)
        else:
            raise CheckpointMismatchError(f"{at}: items of type {kind!r} are not imported (tensors and TensorDicts are)")
        leaves: list = []
        _td_dir(reader, _existing(reader, _CLIST_DATA, [str(index)], at), (), leaves)
        found = {key[0] for key, *_ in leaves if len(key) == 1}
        if found != expected or len(leaves) != len(expected):
            raise CheckpointCorruptError(f"{at}: the saved bytes hold {sorted(found)}, the metadata names {sorted(expected)}")
        arrays = {}
        for key, dtype, shape, rel in leaves:
            if dtype != torch.uint8 or len(shape) != 1:
                raise CheckpointCorruptError(f"{rel}: compressed bytes must be 1-D uint8, got {dtype}{list(shape)}")
            arrays[key[0]] = reader.array(f"storage/clist/{i}/{key[0]}", rel, dtype, shape)
        items.append((_torch_values(meta, at), arrays))
    return {"compressed_list": items}


def _torch_values(value: Any, where: str) -> Any:
    """TorchRL's JSON metadata with its ``{"__type__": ...}`` leaves as torch objects (never ``eval``)."""
    if isinstance(value, list):
        return [_torch_values(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    if "__type__" not in value:
        return {k: _torch_values(v, f"{where}[{k!r}]") for k, v in value.items()}
    kind, raw = value.get("__type__"), value.get("value")
    if kind == "torch.Size" and isinstance(raw, list) and all(isinstance(d, int) and d >= 0 for d in raw):
        return torch.Size(raw)
    if kind == "torch.dtype":
        return parse_dtype(raw, where)
    if kind == "torch.device" and isinstance(raw, str):
        try:
            return torch.device(raw)
        except RuntimeError:
            pass
    raise CheckpointCorruptError(f"{where}: cannot read {value!r:.80}")


def _compressed_list_entry(entry: dict, arrays: dict) -> dict:
    """The native entry of a TorchRL compressed list storage: its ``state_dict()``, for
    ``CompressedListStorage.load_state_dict`` (the items stay compressed as they were)."""
    storage, metadata = [], []
    for item in entry["compressed_list"]:
        if item is None:
            storage.append(None)
            metadata.append(None)
            continue
        meta, names = item
        parts = {key: arrays.pop(name) for key, name in names.items()}
        storage.append(parts["data"] if meta["type"] == "tensor" else parts)
        metadata.append(meta)
    encoder, encoded = Encoder.collecting("s")
    state = encoder.encode({"_storage": storage, "_metadata": metadata}, "the TorchRL compressed list")
    arrays.update({f"storage/{name}": tensor for name, tensor in encoded.items()})
    return {
        "codec": "compressed_list_storage",
        "codec_version": 1,
        "class": "torchrl",
        "state": {"class": "gpubuf.storages.compressed.CompressedListStorage", "state": state},
    }


def _is_compact(root: dict) -> bool:
    return all(isinstance(root.get(k), dict) and root[k].get("type") == "NonTensorData" for k in ("shift", "is_full"))


def _compact_storage(entry: dict, arrays: dict) -> dict:
    """The TED rows of a TorchRL Flat/Nested checkpoint (through ``Flat2TED`` / ``Nested2TED``'s
    rebuild), as a native storage entry; their leaves are put in ``arrays``."""
    from tensordict import TensorDict

    from gpubuf.checkpoint.ted_hooks import Flat2TED
    from gpubuf.storages._layout import Layout

    compact = entry["compact"]
    flat = TensorDict()
    for key, name in compact.get("__flat__", []) + compact.get("__nested__", []):
        flat.set(key, arrays.pop(name) if isinstance(name, str) else name)
    storage_shape = compact.get("_storage_shape")
    for key in ("shift", "is_full", "_storage_shape"):
        if key in compact:
            flat.set_non_tensor(key, compact[key])
    if "done" not in flat.keys():
        raise CheckpointMismatchError("the TorchRL compact checkpoint holds no 'done' entry to rebuild trajectories from")
    if compact.get("__nested__") and storage_shape is None:
        raise CheckpointCorruptError("the TorchRL nested checkpoint records no _storage_shape")
    try:
        ted = Flat2TED()(flat)
    except (RuntimeError, IndexError, ValueError, KeyError) as err:
        raise CheckpointCorruptError(f"the TorchRL compact checkpoint does not rebuild into TED rows: {err}") from err
    ted = ted.filter_non_tensor_data() if hasattr(ted, "filter_non_tensor_data") else ted
    layout = Layout.from_batch(ted, leading=1)
    leaves = layout.split(ted, leading=None, device=None)
    for i, leaf in enumerate(leaves):
        arrays[f"storage/leaf_{i}"] = leaf.contiguous()
    state = {
        "max_size": int(ted.shape[0]),
        "ndim": entry["ndim"],
        "len": entry["length"],
        "initialized": True,
        "auto_device": False,
        "device": None,
        "layout": encode_layout(layout),
    }
    return {"codec": "tensor_storage", "codec_version": 1, "class": "torchrl", "state": state}


def _cap0(reader: _Reader, arrays: dict) -> int:
    rel, dtype, shape = reader.pending[next(iter(arrays))]
    return shape[0] if len(shape) else 0


def _pytree_layout(reader: _Reader, smeta: dict, storage: Any, arrays: dict) -> tuple[Any, None]:
    from gpubuf.storages._layout import Layout, LeafSpec

    entries = require(smeta, "metadata", dict, "storage/storage_metadata.json")
    if set(entries) == {SINGLE_TENSOR}:
        md = entries[SINGLE_TENSOR]
        dtype = parse_dtype(require(md, "dtype", str, SINGLE_TENSOR), SINGLE_TENSOR)
        shape = parse_shape(require(md, "shape", list, SINGLE_TENSOR), SINGLE_TENSOR)
        if not len(shape):
            raise CheckpointCorruptError("the TorchRL storage's tensor has no leading dim")
        arrays["storage/leaf_0"] = reader.array("storage/leaf_0", f"storage/{SINGLE_TENSOR}.memmap", dtype, shape)
        return Layout("tensor", [LeafSpec((), dtype, shape[1:])], (), None, None), None
    # TorchRL records the leaves' paths but not the tree's node types: as TorchRL itself requires,
    # the target storage must already hold data of the same structure.
    target = storage.layout if storage is not None else None
    if target is None or target.kind != "pytree":
        raise CheckpointMismatchError(
            "this TorchRL checkpoint holds a pytree storage, whose structure TorchRL does not record: extend the "
            "buffer once with data of the same structure before loading it (TorchRL requires the same)"
        )
    import torch.utils._pytree as pytree

    paths = [
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(len(target.keys))), target.treespec))[0]
    ]
    if sorted(p.replace("/", ".") for p in paths) != sorted(entries):
        raise CheckpointMismatchError(
            f"the TorchRL pytree storage has leaves {sorted(entries)}, the buffer's storage {sorted(paths)}"
        )
    specs = []
    for i, (path, spec) in enumerate(zip(paths, target.leaves)):
        md = entries[path.replace("/", ".")]
        dtype = parse_dtype(require(md, "dtype", str, path), path)
        shape = parse_shape(require(md, "shape", list, path), path)
        if not len(shape):
            raise CheckpointCorruptError(f"{path}: no leading dim")
        specs.append(LeafSpec(spec.key, dtype, shape[1:]))
        arrays[f"storage/leaf_{i}"] = reader.array(f"storage/leaf_{i}", f"storage/{path}.memmap", dtype, shape)
    return Layout("pytree", specs, (), None, target.treespec), None


# ---------------------------------------------------------------------- sampler, writer, rng
def _sampler(reader: _Reader, batch_size: int | None) -> tuple[dict, dict]:
    if not reader.exists("sampler"):
        return {"codec": "random_sampler", "codec_version": 1, "class": "torchrl", "state": {}}, {}
    if reader.exists("sampler/sampler_metadata.json"):
        from gpubuf.checkpoint.prioritized import torchrl_prioritized_state

        return torchrl_prioritized_state(reader)
    if not reader.exists("sampler/meta.json"):
        names = sorted(os.listdir(reader.root / "sampler"))
        raise UnsafeCheckpointError(
            f"sampler/ holds {names}: a sampler state gpubuf cannot read without unpickling; refused"
        )
    leaves: list = []
    _td_dir(reader, "sampler", (), leaves)
    found = {key: (dtype, shape, rel) for key, dtype, shape, rel in leaves}
    expected = {("len_storage",), ("_sample_list",), ("drop_last",), ("_ran_out",)}
    if not set(found) <= expected or ("len_storage",) not in found:
        raise CheckpointMismatchError(f"sampler/: unknown sampler state {sorted(found)}")
    arrays = {name: reader.array(f"sampler/{name}", rel, dtype, shape)
              for (name,), (dtype, shape, rel) in found.items()}
    return {"codec": "sampler_without_replacement", "codec_version": 1, "class": "torchrl",
            "state": {"_torchrl": True, "batch_size": batch_size}}, {f"sampler/{k}": v for k, v in arrays.items()}


def _writer(reader: _Reader) -> dict:
    meta = reader.json("writer/metadata.json")
    where = "writer/metadata.json"
    unknown = set(meta) - {"cursor", "write_count"}
    if unknown:
        raise CheckpointMismatchError(f"{where}: a writer with state {sorted(unknown)} (not a round-robin writer) is not imported")
    return {"codec": "round_robin_writer", "codec_version": 1, "class": "torchrl",
            "state": {"cursor": require_int(meta, "cursor", where), "write_count": require_int(meta, "write_count", where, nullable=True)}}


def _rng(reader: _Reader) -> dict | None:
    if not reader.exists("rng_state"):
        return None
    leaves: list = []
    meta = _td_dir(reader, "rng_state", (), leaves)
    if len(leaves) != 1 or leaves[0][0] != ("rng_state",) or leaves[0][1] != torch.uint8:
        raise CheckpointCorruptError("rng_state/: expected one uint8 tensor 'rng_state'")
    _, dtype, shape, rel = leaves[0]
    reader.array("rng/state", rel, dtype, shape)
    device = meta.get("device")
    return {"device": device if isinstance(device, str) and device != "None" else "cpu", "state": "rng/state"}


def read_torchrl_checkpoint(path: Path, buffer: Any) -> tuple[dict, dict]:
    """Parses a TorchRL checkpoint directory into ``(meta, arrays)`` of the native form.

    Raises:
        NotACheckpointError: not a TorchRL checkpoint.
        UnsafeCheckpointError: a symlink leading outside, an unknown file, a pickle that holds
            state that would be lost.
        CheckpointCorruptError: a raw file of another size than its recorded dtype and shape.
        CheckpointMismatchError: TorchRL components gpubuf does not import (see the messages).
    """
    if not is_torchrl_checkpoint(path):
        raise NotACheckpointError(f"{path} is not a TorchRL checkpoint")
    reader = _Reader(path)
    bmeta = reader.json("buffer_metadata.json")
    batch_size = require_int(bmeta, "batch_size", "buffer_metadata.json", minimum=1, nullable=True)
    storage_entry, _ = _storage(reader, buffer)
    sampler_entry, _ = _sampler(reader, batch_size)
    writer_entry = _writer(reader) if reader.exists("writer/metadata.json") else None
    rng = _rng(reader)
    skipped = [name for name in SKIPPED_PICKLES if (path / name).is_file() and not (path / name).is_symlink()]
    scan_directory(path, reader.consumed, allowed_extra=skipped)
    arrays = reader.read_all()
    if "compact" in storage_entry:
        storage_entry = _compact_storage(storage_entry, arrays)
    elif "compressed_list" in storage_entry:
        storage_entry = _compressed_list_entry(storage_entry, arrays)
    for name in skipped:
        warnings.warn(
            f"{name} of the TorchRL checkpoint {path} is a pickle and was not read: {SKIPPED_PICKLES[name]}",
            CheckpointWarning,
            stacklevel=4,
        )
    components = {"storage": storage_entry, "sampler": sampler_entry}
    components["writer"] = writer_entry or {"codec": "round_robin_writer", "codec_version": 1, "class": "torchrl",
                                            "state": {"cursor": 0, "write_count": None}}
    if sampler_entry["codec"] == "sampler_without_replacement":
        sampler_entry["state"] = _swr_state(arrays, batch_size)
    meta = {
        "kind": "buffer",
        "buffer": {"batch_size": batch_size, "transforms": None, "rng": rng},
        "components": components,
    }
    return meta, arrays


def _swr_state(arrays: dict, batch_size: int | None) -> dict:
    """TorchRL's SamplerWithoutReplacement state dict, in the native codec's form."""

    def scalar(name: str, kind: type) -> Any:
        value = arrays.get(f"sampler/{name}")
        if value is None:
            return None
        if value.numel() != 1:
            raise CheckpointCorruptError(f"sampler/{name}: expected a scalar")
        return kind(value.reshape(()).item())

    sample_list = arrays.get("sampler/_sample_list")
    if sample_list is not None:
        if sample_list.dtype != torch.int64:
            raise CheckpointCorruptError("sampler/_sample_list: expected int64")
        sample_list = sample_list.reshape(-1)
        arrays["sampler/sample_list"] = sample_list
    drop_last = bool(scalar("drop_last", bool))
    left = 0 if sample_list is None else sample_list.numel()
    remaining = 0
    if batch_size:
        remaining = left // batch_size if drop_last else -(-left // batch_size)
    return {
        "drop_last": drop_last,
        "shuffle": None,
        "len_storage": scalar("len_storage", int) or 0,
        "ran_out": bool(scalar("_ran_out", bool)),
        "remaining": remaining,
        "sample_list": None if sample_list is None else "sample_list",
        "device": "cpu",
    }
