"""Dumping and loading whole buffers (and single storages): the two-phase protocol.

Dump: every component is encoded first (an unwritable item raises before any file exists), the
arrays and ``meta.json`` are written to a temporary directory, which is then put in place
atomically (:mod:`gpubuf.checkpoint.atomic`).

Load: ``meta.json`` is parsed and checked, the directory is scanned (no unlisted, pickle-like or
escaping file), every file is read and verified, every component's codec prepares its new state
against the target, and only then is anything of the target buffer changed, by thunks that
assign attributes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gpubuf._version import __version__
from gpubuf.checkpoint import atomic, torchrl_import
from gpubuf.checkpoint.arrays import ArraySet, parse_tables, read_arrays
from gpubuf.checkpoint.codecs import Codec, Context, H5Array, LiveFile, _array, codec_for, is_memmap, storage_codec
from gpubuf.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointIOError,
    CheckpointPathError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    CheckpointWarning,
    NotACheckpointError,
    UnserializableDataError,
)
from gpubuf.checkpoint.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    META_FILE,
    check_digest,
    check_header,
    check_host,
    is_inside,
    read_json,
    require,
    require_int,
    scan_directory,
    seal_meta,
)
from gpubuf.checkpoint.staging import Staging, staging_for
from gpubuf.checkpoint.values import Decoder, Encoder, exists_here
from gpubuf.storages._layout import class_path
from gpubuf.errors import GpubufError

SLOTS = ("storage", "sampler", "writer")


# ---------------------------------------------------------------------- dump
def dump_buffer(buffer: Any, path: Any) -> None:
    """Writes a checkpoint of ``buffer`` (storage, sampler, writer, generator state, batch size,
    transform states) to the directory ``path``.

    The buffer's content is not modified (batches prefetched ahead are dropped and drawn again
    later, identically). ``path`` is replaced atomically: a process killed at any point
    leaves either the previous checkpoint or the new one there, complete. When a memory-mapped
    storage's files already lie inside ``path``, they are listed in place, not copied (zero copy).

    Raises:
        UnserializableDataError: the buffer holds something that cannot be written without
            pickle; nothing is written.
        NotACheckpointError: ``path`` is a file, or a non-empty directory that is not a gpubuf
            checkpoint (it is never replaced).
    """
    # Batches drawn ahead (prefetch) moved the sampler and the generator past what the caller
    # has seen: they are dropped and their draws undone, so that the checkpoint holds the state
    # right after the last batch returned. They are drawn again, identically.
    buffer._invalidate_prefetch()
    final = _as_path(path)
    components = {
        "storage": (buffer._storage, storage_codec(buffer._storage)),
        "sampler": (buffer._sampler, codec_for(buffer._sampler)),
        "writer": (buffer._writer, codec_for(buffer._writer)),
    }
    _dump(final, components, Context(buffer=buffer), buffer)


def dump_storage(storage: Any, path: Any, *, checkpointer: Codec | None = None) -> None:
    """Writes a checkpoint holding ``storage`` alone to the directory ``path`` (see :func:`dump_buffer`)."""
    codec = checkpointer if checkpointer is not None else storage_codec(storage)
    _dump(_as_path(path), {"storage": (storage, codec)}, Context(), None)


def _as_path(path: Any) -> Path:
    """``path`` as an absolute ``Path``, or :class:`CheckpointPathError` when it is not a path."""
    try:
        return Path(path).absolute()
    except TypeError:
        raise CheckpointPathError(
            f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__}"
        ) from None


def _check_target(final: Path) -> None:
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise NotACheckpointError(f"{final} exists and is not a directory: refusing to replace it with a checkpoint")
    if final.is_dir() and any(final.iterdir()):
        meta = final / META_FILE
        try:
            meta = check_header(read_json(meta, "target"), final)
        except CheckpointError as err:
            # Only a gpubuf checkpoint is ever replaced: a dump must not wipe a foreign directory.
            raise NotACheckpointError(
                f"{final} is a non-empty directory that is not a gpubuf checkpoint ({err}): refusing to replace it; "
                "choose an empty or new path"
            ) from None
        if meta.get("in_place"):
            # Replacing the directory would delete a memory-mapped storage's files with it.
            raise NotACheckpointError(
                f"{final} holds a memory-mapped storage's files (an in-place checkpoint): refusing to replace it with "
                "a checkpoint of another storage; dump elsewhere"
            )


def _dump(final: Path, components: dict, context: Context, buffer: Any) -> None:
    try:
        _dump_checked(final, components, context, buffer)
    except OSError as err:
        if isinstance(err, GpubufError):
            raise
        raise CheckpointIOError(
            err.errno, f"cannot write a checkpoint at {final}: {err.strerror or err} (expected a path whose parent is a "
            "writable directory)", err.filename
        ) from err


def _dump_checked(final: Path, components: dict, context: Context, buffer: Any) -> None:
    check_host()
    atomic.recover(final)
    if final.is_dir():
        atomic.recover_in_place(final, _referenced(final))
    scratch = atomic.tmp_dir_for(final)
    try:
        context.target, context.scratch = final, scratch
        encoded = []
        meta_components = {}
        for slot, (component, codec) in components.items():
            state, local = codec.to_checkpoint(component, context)
            meta_components[slot] = {
                "codec": codec.name,
                "codec_version": codec.version,
                "class": class_path(type(component)),
                "state": state,
            }
            encoded.extend((f"{slot}/{name}", value) for name, value in local.items())
        extra = ArraySet()
        buffer_meta = _buffer_meta(buffer, extra) if buffer is not None else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "byteorder": "little",
        "created_by": f"gpubuf {__version__}",
        "kind": "buffer" if buffer is not None else "storage",
        "buffer": buffer_meta,
        "components": meta_components,
    }
    live = _live_inside(final, encoded)
    if live:
        _dump_in_place(final, encoded, extra, meta, live)
    else:
        _dump_atomic(final, encoded, extra, meta)


def _live_inside(final: Path, encoded: list) -> dict[int, str]:
    """Positions of the live files (memory-mapped storage files) lying inside ``final``, with
    their paths relative to it: those are listed in place instead of copied."""
    out = {}
    if not final.is_dir():
        return out
    root = Path(os.path.realpath(final))
    for i, (_, value) in enumerate(encoded):
        if isinstance(value, LiveFile):
            path = Path(os.path.realpath(value.path))
            if is_inside(path, root) and path != root:
                out[i] = path.relative_to(root).as_posix()
    return out


def _arrays(encoded: list, extra: ArraySet, live: dict[int, str]) -> ArraySet:
    arrays = extra
    for i, (name, value) in enumerate(encoded):
        if i in live:
            arrays.add_live(name if value.tensor is not None else None, live[i], value.tensor, value.offset)
            continue
        if isinstance(value, LiveFile):
            if value.tensor is None:
                continue  # a storage's bookkeeping file elsewhere: not part of the checkpoint
            # A memory-mapped file elsewhere than the checkpoint: its bytes are copied.
            value = value.tensor
        if isinstance(value, H5Array):
            slot = name.split("/", 1)[0]
            arrays.add(name, value.tensor, h5_file=f"{slot}/{value.file}", h5_kwargs=value.kwargs)
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"codec output {name!r} is a {type(value).__name__}, expected a tensor")
        arrays.add(name, value)
    return arrays


def _dump_atomic(final: Path, encoded: list, extra: ArraySet, meta: dict) -> None:
    _check_target(final)
    arrays = _arrays(encoded, extra, {})
    tmp = atomic.tmp_dir_for(final)
    try:
        files, table = arrays.write(tmp)
        _write_meta(tmp / META_FILE, {**meta, "files": files, "arrays": table})
        atomic.fsync_directories(tmp)
        atomic.commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _dump_in_place(final: Path, encoded: list, extra: ArraySet, meta: dict, live: dict[int, str]) -> None:
    """Zero copy: a memory-mapped storage living in ``final`` is listed, not copied; see
    :mod:`gpubuf.checkpoint.atomic` for how the rest is made crash-safe."""
    arrays = _arrays(encoded, extra, live)
    previous = _previous_files(final)
    allowed = set(arrays.live_files) | previous | {META_FILE}
    foreign = [
        rel for rel in _all_files(final)
        if rel not in allowed and not rel.split("/", 1)[0].startswith((atomic.GEN_MARK, atomic.META_TMP_MARK))
    ]
    if foreign:
        raise NotACheckpointError(
            f"{final} holds files that are neither the storage's nor a checkpoint's (e.g. {foreign[0]!r}): refusing "
            "to make it a checkpoint; dump elsewhere, or remove them"
        )
    gen = atomic.gen_dir_for(final)
    lock = atomic.hold(gen)
    try:
        files, table = arrays.write(gen, prefix=gen.name + "/", live_root=final)
        atomic.fsync_directories(gen)
        meta = {**meta, "files": files, "arrays": table, "in_place": True}
        atomic.commit_meta_in_place(final, _meta_text(meta), keep={gen.name})
    except BaseException:
        if gen.name not in _referenced(final):
            shutil.rmtree(gen, ignore_errors=True)
        raise
    finally:
        atomic.release(lock)
    for rel in previous - set(files):
        # Arrays of a previous copying dump to this directory, now unreferenced.
        if not rel.startswith(atomic.GEN_MARK):
            try:
                os.unlink(final / rel)
            except OSError:
                pass


def _referenced(final: Path) -> set[str]:
    """First path components of the files the current ``meta.json`` of ``final`` references."""
    return {rel.split("/", 1)[0] for rel in _previous_files(final)}


def _previous_files(final: Path) -> set[str]:
    try:
        meta = check_header(read_json(final / META_FILE, "meta.json"), final)
    except CheckpointError:
        return set()
    return {rel for rel in meta.get("files", {}) if isinstance(rel, str)}


def _all_files(root: Path) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            out.append((Path(dirpath) / name).relative_to(root).as_posix())
    return out


def _buffer_meta(buffer: Any, arrays: ArraySet) -> dict:
    def add(tensor: torch.Tensor) -> str:
        name = f"buffer/x{len([n for n in arrays.arrays if n.startswith('buffer/')])}"
        arrays.add(name, tensor)
        return name

    transforms = buffer._transform.state_dict()
    rng = None
    if buffer._rng is not None:
        arrays.add("rng/state", buffer._rng.get_state())
        rng = {"device": str(buffer._rng.device), "state": "rng/state"}
    return {
        "class": class_path(type(buffer)),
        "batch_size": buffer._batch_size,
        "transforms": Encoder(add).encode(transforms, "transform states") if transforms else None,
        "rng": rng,
    }


def _meta_text(meta: dict) -> str:
    try:
        return json.dumps(seal_meta(meta), allow_nan=False, separators=(",", ":"))
    except ValueError as err:
        raise UnserializableDataError(f"a codec produced a state that is not strict JSON: {err}") from err


def _write_meta(path: Path, meta: dict) -> None:
    text = _meta_text(meta)
    with open(path, "x", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


# ---------------------------------------------------------------------- load
def load_buffer(buffer: Any, path: Any) -> None:
    """Restores ``buffer`` from a checkpoint directory written by :func:`dump_buffer` (or by
    TorchRL's ``ReplayBuffer.dumps``; see :mod:`gpubuf.checkpoint.torchrl_import`).

    Mutates the buffer's storage, sampler, writer, generator (when one was saved), batch size
    and transform states. Everything is validated first: on any error the buffer is unchanged.

    Raises:
        NotACheckpointError: ``path`` is missing, a foreign directory, or a partial one.
        CheckpointVersionError: an unknown format version.
        CheckpointCorruptError: a truncated file, a size / dtype / shape / checksum mismatch.
        UnsafeCheckpointError: a symlink leading outside, a pickle file, any unlisted file.
        CheckpointMismatchError: the checkpoint's components or capacity differ from the buffer's.
    """
    final = _as_path(path)
    storage_target = (buffer._storage, storage_codec(buffer._storage))
    stage = staging_for(*storage_target)
    try:
        meta, arrays, context = _read_typed(final, buffer, copies_storage=is_memmap(buffer._storage), stage=stage)
        if meta.get("kind") != "buffer":
            raise CheckpointMismatchError(f"{final} holds a {meta.get('kind')!r} checkpoint, not a buffer's")
        components = require(meta, "components", dict, "meta.json")
        _check_item_kind(buffer, components)
        targets = {
            "storage": storage_target,
            "sampler": (buffer._sampler, codec_for(buffer._sampler)),
            "writer": (buffer._writer, codec_for(buffer._writer)),
        }
        # The storage is prepared last, after every other check: the generic codec prepares a
        # shallow copy of its component, which shares (and may write into) the objects it holds.
        load_transforms, finish = _prepare_buffer(buffer, meta.get("buffer"), arrays)
        applies = {
            slot: _prepare(slot, components, arrays, targets[slot], context) for slot in SLOTS if slot != "storage"
        }
        # Transforms load their state themselves and may still refuse it: before the storage, and
        # put back if the storage refuses its part. Then the components (attribute swaps), then the
        # generator, which set_rng hands to the components just swapped in.
        previous_transforms = buffer._transform.state_dict()
        load_transforms()
        try:
            applies["storage"] = _prepare("storage", components, arrays, targets["storage"], context)
        except BaseException:
            buffer._transform.load_state_dict(previous_transforms)
            raise
        for slot in SLOTS:
            applies[slot]()
        finish()
    finally:
        if stage is not None:
            stage.discard()


def _check_item_kind(buffer: Any, components: dict) -> None:
    """Refuses the checkpoint of a buffer of plain items for a buffer of TensorDicts (whose
    sampling would then fail): the stored layout's kind must be a TensorDict's."""
    if not buffer._tensordict_items:
        return
    storage = components.get("storage")
    state = storage.get("state") if isinstance(storage, dict) else None
    layout = state.get("layout") if isinstance(state, dict) else None
    kind = layout.get("kind") if isinstance(layout, dict) else None
    if kind is not None and kind != "tensordict":
        raise CheckpointMismatchError(
            f"the checkpoint's storage holds {kind} items, and a {type(buffer).__name__} holds TensorDicts: load it "
            "into a buffer of the kind that wrote it"
        )


def load_storage(storage: Any, path: Any, *, checkpointer: Codec | None = None) -> None:
    """Restores ``storage`` from a storage (or buffer) checkpoint; see :func:`load_buffer`."""
    final = _as_path(path)
    codec = checkpointer if checkpointer is not None else storage_codec(storage)
    stage = staging_for(storage, codec)
    try:
        meta, arrays, context = _read_typed(final, None, copies_storage=is_memmap(storage), stage=stage)
        apply = _prepare("storage", require(meta, "components", dict, "meta.json"), arrays, (storage, codec), context)
        apply()
    finally:
        if stage is not None:
            stage.discard()


def _read_typed(
    final: Path, buffer: Any, *, copies_storage: bool = False, stage: Staging | None = None
) -> tuple[dict, dict, Context]:
    """:func:`_read`, with the file system's own errors as :class:`CheckpointIOError`."""
    try:
        return _read(final, buffer, copies_storage=copies_storage, stage=stage)
    except OSError as err:
        if isinstance(err, GpubufError):
            raise
        raise CheckpointIOError(err.errno, f"cannot read the checkpoint at {final}: {err.strerror or err}", err.filename) from err


def _read(
    final: Path, buffer: Any, *, copies_storage: bool = False, stage: Staging | None = None
) -> tuple[dict, dict, Context]:
    """Parses and checks ``meta.json`` and reads and verifies every file.

    ``copies_storage``: the target storage copies the storage arrays into its own files (a
    memory-mapped storage), so they are verified through mappings instead of read into memory.
    ``stage``: an empty memory-mapped target, which takes verified copies of its files instead
    (see :mod:`~gpubuf.checkpoint.staging`); it is handed to the codecs in the context.
    """
    check_host()
    atomic.recover(final)
    if final.is_dir():
        atomic.recover_in_place(final, _referenced(final))
    if not final.is_dir():
        raise NotACheckpointError(f"{final} is not a directory" if final.exists() else f"{final} does not exist")
    context = Context(buffer=buffer, target=final, staging=stage)
    if not (final / META_FILE).exists() and not (final / META_FILE).is_symlink():

        if torchrl_import.is_torchrl_checkpoint(final):
            meta, arrays = torchrl_import.read_torchrl_checkpoint(final, buffer)
            context.batch_size = (meta.get("buffer") or {}).get("batch_size")
            return meta, arrays, context
        raise NotACheckpointError(
            f"{final} is not a checkpoint: it has no {META_FILE} (a foreign directory, or one whose dump did not complete)"
        )
    meta = check_header(read_json(final / META_FILE, "meta.json"), final)
    check_digest(meta, final)
    files, specs = parse_tables(meta)
    scan_directory(final, files)
    arrays = read_arrays(final, files, specs, mapped="storage/" if copies_storage else None, stage=stage)
    return meta, arrays, context


def _prepare(slot: str, components: dict, arrays: dict, target: tuple, context: Context) -> Any:
    component, codec = target
    if slot not in components:
        raise CheckpointMismatchError(f"the checkpoint holds no {slot}")
    entry = require(components, slot, dict, "meta.json components")
    where = f"meta.json components.{slot}"
    name = require(entry, "codec", str, where)
    version = require_int(entry, "codec_version", where, minimum=1)
    if not codec.can_load(name):
        recorded = entry.get("class", "?")
        raise CheckpointMismatchError(
            f"the checkpoint's {slot} is a {recorded} (codec {name!r}); the buffer's {slot} is a "
            f"{type(component).__qualname__} (codec {codec.name!r}): build the buffer with the same components"
        )
    if version > codec.version:

        raise CheckpointVersionError(f"{where}: codec {name!r} version {version} is newer than this gpubuf's ({codec.version})")
    prefix = slot + "/"
    local = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
    return codec.from_checkpoint(component, require(entry, "state", dict, where), local, context)


def _prepare_buffer(buffer: Any, entry: Any, arrays: dict) -> tuple[Any, Any]:
    """Validates the buffer-level part; returns the thunks installing the transform states, and
    the batch size and generator."""
    if entry is None:
        return (lambda: None), (lambda: None)
    where = "meta.json buffer"
    batch_size = require_int(entry, "batch_size", where, minimum=1, nullable=True)
    transforms = None
    if entry.get("transforms") is not None:
        transforms = Decoder(lambda name: _array(arrays, name)).decode(entry["transforms"], "transform states")
        if not isinstance(transforms, dict):
            raise CheckpointCorruptError(f"{where}.transforms: expected a dict")
    generator = None
    rng = entry.get("rng")
    if rng is not None:
        device = require(rng, "device", str, f"{where}.rng")
        state = _array(arrays, require(rng, "state", str, f"{where}.rng"))
        generator = _generator(device, state)

    def load_transforms() -> None:
        if transforms:
            try:
                buffer._transform.load_state_dict(transforms)
            except Exception as err:
                raise CheckpointMismatchError(f"the buffer's transforms refused their saved state: {err}") from err

    def finish() -> None:
        buffer._batch_size = batch_size
        if generator is not None:
            buffer.set_rng(generator)

    return load_transforms, finish


def _generator(device: str, state: torch.Tensor) -> torch.Generator | None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise CheckpointCorruptError(f"invalid generator device {device!r}") from None
    if not exists_here(dev):
        import warnings

        warnings.warn(
            f"the checkpoint holds the state of a generator on {device}, which this machine lacks: the buffer keeps its "
            "own generator, so samples after loading will differ from the saved buffer's",
            CheckpointWarning,
            stacklevel=4,
        )
        return None
    if state.dtype != torch.uint8 or state.ndim != 1:
        raise CheckpointCorruptError("the generator state must be a 1-D uint8 array")
    generator = torch.Generator(device=dev)
    try:
        generator.set_state(state.clone())
    except (RuntimeError, ValueError) as err:
        raise CheckpointCorruptError(f"the generator state is invalid: {err}") from None
    return generator


# ---------------------------------------------------------------------- one sampler or writer
def dump_component(component: Any, slot: str, path: Any) -> None:
    """Writes a checkpoint holding one sampler or writer (``slot``: ``"sampler"`` or ``"writer"``)
    to the directory ``path``; the format and guarantees of :func:`dump_buffer`."""
    _dump(Path(path).absolute(), {slot: (component, codec_for(component))}, Context(), None)


def load_component(component: Any, slot: str, path: Any) -> None:
    """Restores one sampler or writer from a checkpoint of :func:`dump_component` or
    :func:`dump_buffer` (its ``slot`` component); validated first, unchanged on error."""
    final = Path(path).absolute()
    meta, arrays, context = _read(final, None)
    components = require(meta, "components", dict, "meta.json")
    _prepare(slot, components, arrays, (component, codec_for(component)), context)()
