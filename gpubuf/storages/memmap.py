"""``LazyMemmapStorage``: a tensor storage whose leaves are memory-mapped files.

It is a :class:`~gpubuf.storages.LazyTensorStorage` whose leaves are allocated as shared file
mappings on the first write (one file per leaf, see :mod:`gpubuf.storages._memmap_files`), and
whose length and write cursor live in a small state file next to them
(:mod:`gpubuf.storages._shared`). Both are reached by path, which is what makes the storage
sharable: a forked or spawned worker, or an unrelated process constructing the same storage
with ``shared_init=True``, maps the same files and moves the same cursor.

Round-robin writers reserve rows through :meth:`LazyMemmapStorage._append_rows`: the cursor moves
and the rows are copied under the storage's lock, so concurrent writers in several processes get
disjoint rows, every row below ``len(storage)`` holds data for a reader in another process, and
once the storage wraps, rows are overwritten in the order they were reserved (a writer delayed by
a whole lap never copies over a newer reservation's rows).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Any, Collection, Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree
from tensordict import TensorDictBase, is_tensorclass

from gpubuf.errors import (
    CapacityError,
    DiskFullError,
    GpubufError,
    MemmapStorageError,
    SchemaMismatchError,
    ScratchDirError,
    StorageExistsError,
    StorageMismatchError,
    StorageNotSharableError,
)
from gpubuf.storages import _cleanup
from gpubuf.storages import _memmap_files as files
from gpubuf.storages._layout import Layout, expand_as_batch
from gpubuf.storages.base import Appended
from gpubuf.storages._shared import (
    STATUS_EMPTY,
    STATUS_INITIALIZING,
    STATUS_READY,
    FileState,
    LocalState,
    state_dir,
)
from gpubuf.storages.items import is_int, leading_size, stack_items
from gpubuf.storages.tensor import LazyTensorStorage, _check_state, _unaliased

__all__ = [
    "SharedInitTensorStorage",
    "LazyMemmapStorage",
    "MemmapStorageError",
    "ScratchDirError",
    "StorageExistsError",
    "DiskFullError",
    "StorageMismatchError",
    "StorageNotSharableError",
]

_CPU = torch.device("cpu")
_MAX_FILE_BYTES = 2**63 - 1


class _LeafFile:
    """An open data file: its path, a descriptor (for block allocation) and its bytes per dim-0 row."""

    __slots__ = ("path", "fd", "row_bytes", "pid")

    def __init__(self, path: str, fd: int, row_bytes: int) -> None:
        self.path = path
        self.fd = fd
        self.row_bytes = row_bytes
        self.pid = os.getpid()

    def close(self) -> None:
        if self.fd >= 0 and self.pid == os.getpid():
            os.close(self.fd)
        self.fd = -1


class LazyMemmapStorage(LazyTensorStorage):
    """A memory-mapped storage of tensors, TensorDicts, tensorclasses or pytrees of tensors.

    Same constructor and behaviour as ``torchrl.data.LazyMemmapStorage``. The files are created
    on the first write, one per leaf, raw and C-contiguous (``[capacity_dim0, *item_shape]``),
    sparse until rows are written; nested keys become folders. The storage can be extended and
    read from several processes at once (see :mod:`gpubuf.storages.memmap`).

    Args:
        max_size: the capacity in items (elements over the first ``ndim`` dims).

    Keyword Args:
        scratch_dir: where the files go. ``None`` (default): a new temporary directory, in
            ``/dev/shm`` when the whole capacity fits in at most half the free memory (as
            TorchRL), else in the system temporary directory. The path is kept absolute in
            :attr:`scratch_dir` (no trailing separator).
        device: where read and sampled batches are returned. The rows themselves always live in
            the files (host memory). ``"cpu"`` (default), ``"cuda"``, or ``None``/``"auto"`` for the
            device of the first batch written; later batches must then come on that device.
            (TorchRL only accepts ``"cpu"`` here; gpubuf moves the gathered rows.)
        ndim: how many leading dims count towards the length (default 1).
        existsok: what happens when the files already exist at the first write. ``False``
            (default): :class:`StorageExistsError`. ``True``: the files are reused in place
            (resized to this storage's capacity) and the storage starts empty. (TorchRL's
            docstring says both; this is the one chosen, and tested.)
        compilable: accepted for TorchRL compatibility; a compilable storage cannot be shared
            (``shared_init=True`` then raises ``ValueError``).
        shared_init: several processes may construct this storage on the same ``scratch_dir``
            (or receive one constructed, still empty, by their parent): the first one to write
            creates the files under a file lock, the others wait on that lock and map the files.
            None of them can see a half-created storage. With ``scratch_dir=None`` the
            temporary directory is created at construction, so that it can be passed to workers.
            A storage already complete in ``scratch_dir`` is joined as it is (its rows, length
            and cursor are kept: this is how a reader process attaches to a live buffer); call
            :meth:`cleanup` on it to start afresh.
        auto_cleanup: remove the files when the process that created them exits (normal exit,
            Ctrl+C, SIGTERM) or when the storage is garbage-collected there. Defaults to
            ``True`` for a temporary directory and ``False`` for a ``scratch_dir`` you gave.

    Raises:
        CapacityError: ``max_size`` is not a positive int.
        ScratchDirError: ``scratch_dir`` is not, and cannot be made, a writable directory.
        StorageMismatchError: with ``shared_init=True``, the storage found in ``scratch_dir`` was
            made with another ``max_size`` or ``ndim``.

    Examples:
        >>> data = TensorDict({
        ...     "some data": torch.randn(10, 11),
        ...     ("some", "nested", "data"): torch.randn(10, 11, 12),
        ... }, batch_size=[10, 11])
        >>> storage = LazyMemmapStorage(100)
        >>> storage.set(range(10), data)
        >>> len(storage)  # only the first dimension is considered as indexable
        10
        >>> storage.get(0).batch_size
        torch.Size([11])
    """

    #: Rows live in sparse files, not in memory: a capacity past the RAM is fine.
    _rows_in_memory = False
    #: The rows of the first write while it creates the files (their blocks are reserved by the
    #: creation), or None.
    _pending_rows = None

    def __init__(
        self,
        max_size: int,
        *,
        scratch_dir: str | os.PathLike | None = None,
        device: torch.device | str | None = "cpu",
        ndim: int = 1,
        existsok: bool = False,
        compilable: bool = False,
        shared_init: bool = False,
        auto_cleanup: bool | None = None,
    ) -> None:
        self._files: list[_LeafFile] | None = None
        self._pending_device: torch.device | None = None
        self._cleaner = _cleanup.Cleaner(auto=False)
        super().__init__(max_size, device=device, ndim=ndim, compilable=compilable)
        if shared_init and compilable:
            raise ValueError("a compilable storage cannot be shared between processes (shared_init=True)")
        self.existsok = bool(existsok)
        self.shared_init = bool(shared_init)
        self._scratch_dir_is_temp = scratch_dir is None
        self.scratch_dir: str | None = None
        if scratch_dir is not None:
            self.scratch_dir = os.path.abspath(os.fspath(scratch_dir))
            files.check_scratch_dir(self.scratch_dir)
        self._auto_cleanup = self._scratch_dir_is_temp if auto_cleanup is None else bool(auto_cleanup)
        self._cleaner.auto = self._auto_cleanup
        self._cleaner.root = self.scratch_dir
        self._created_files = False
        if self._auto_cleanup:
            _cleanup.track(self, self._cleaner)
        if self.shared_init:
            self._open_shared_state()

    # ------------------------------------------------------------------ shared state
    def _open_shared_state(self) -> None:
        """Creates or joins the state file at construction (``shared_init=True``)."""
        if self.scratch_dir is None:
            try:
                self.scratch_dir = tempfile.mkdtemp(prefix="gpubuf_memmap_")
            except OSError as err:
                raise files.typed_os_error(err, "cannot create a temporary directory") from err
            self._own_directory(self.scratch_dir)
        try:
            self._state = FileState.open(self.scratch_dir, max_size=self.max_size, ndim=self.ndim, reset=False)
        except ValueError as err:
            raise StorageMismatchError(str(err)) from err
        except OSError as err:
            raise files.typed_os_error(err, f"cannot open the storage state in {self.scratch_dir}") from err

    @property
    def initialized(self) -> bool:
        """Whether the files exist and are mapped here; maps them if another process created them."""
        if self._leaves is None and self._state.shared and self._state.status == STATUS_READY:
            self._attach(None)
        return self._leaves is not None

    @property
    def layout(self) -> Layout | None:
        self.initialized
        return self._layout

    @property
    def files(self) -> dict[tuple, str]:
        """The absolute path of each leaf's file, by leaf key (empty before the first write)."""
        if not self.initialized:
            return {}
        return {spec.key: f.path for spec, f in zip(self._layout.leaves, self._files)}

    def _own_directory(self, path: str) -> None:
        """This process made ``path`` for the storage: it goes whole at cleanup."""
        cleaner = self._cleaner
        cleaner.root = path
        cleaner.whole_dir = True
        cleaner.owner_pid = os.getpid()

    def _check_usable(self) -> None:
        if self._cleaner.done:
            raise MemmapStorageError(
                f"this storage's files in {self.scratch_dir} were removed by cleanup(); create a new storage"
            )

    # ------------------------------------------------------------------ file creation / attachment
    def _target_device(self, leaves: Sequence[torch.Tensor]) -> torch.device:
        # Rows always go to the files (host memory); the batch's device only matters for "auto",
        # where it becomes the device that reads are returned on.
        if self._auto_device and not self.initialized:
            self._pending_device = leaves[0].device
        return _CPU

    def _prepare(self, data: Any, leading: Sequence[int] | None, *args: Any, **kwargs: Any):
        if self._leaves is None and self._state.shared and self._state.status == STATUS_READY:
            # Another process created the files: map them with this batch's layout (which also
            # carries its tensorclass), checked against the one on disk.
            self._attach(self._layout_of(data, leading))
        return super()._prepare(data, leading, *args, **kwargs)

    @staticmethod
    def _layout_of(data: Any, leading: Sequence[int] | None) -> Layout | None:
        try:
            if isinstance(data, list) and leading:
                data = stack_items(data)
            return Layout.from_batch(data, leading=0 if leading is None else len(leading))
        except GpubufError:
            # Bad data: the base class's validation reports it after a plain attach.
            return None

    def _capacity_plan(self, layout: Layout) -> tuple[int, list[int]]:
        """``(capacity along dim 0, storage dims 1..ndim-1)`` for items of ``layout``."""
        if self.ndim == 1:
            cap0, rest = self.max_size, []
        else:
            rest = list(layout.leaves[0].shape[: self.ndim - 1])
            if len(rest) != self.ndim - 1:
                raise SchemaMismatchError(
                    f"ndim={self.ndim} needs items with at least {self.ndim - 1} batch dims; got item shape "
                    f"{list(layout.leaves[0].shape)}"
                )
            cap0 = -(-self.max_size // max(int(np.prod(rest)), 1))
        widest = max((spec.row_bytes for spec in layout.leaves), default=0)
        if cap0 * widest > _MAX_FILE_BYTES:
            # Checked before any file exists: the files are sparse, but their size is an off_t.
            raise CapacityError(
                f"a file of {cap0:,} rows of {widest:,} bytes exceeds the largest file size (2**63 - 1 bytes): "
                "expected a smaller capacity"
            )
        return cap0, rest

    def _init_from(self, layout: Layout, leaves: list[torch.Tensor]) -> None:
        self._check_usable()
        if self._auto_device:
            self.device = self._pending_device or _CPU
        if self._state.shared:
            with self._state.lock:
                status = self._state.status
                if status == STATUS_READY:
                    self._attach(layout)
                    return
                # A process that died while creating the files left them half made: redo them.
                self._create_files(layout, overwrite=self.existsok or status == STATUS_INITIALIZING)
            return
        self._init_private(layout)

    def _adopt_files(
        self, layout: Layout, sources: Sequence[str | torch.Tensor], *, scratch_dir: str | None
    ) -> None:
        """Initialises the empty storage from complete files, one per leaf: each is moved to its
        leaf's path (a rename) and mapped; no row is copied.

        For a checkpoint load, whose verified copies of the leaves are already the files this
        storage would hold. The length stays 0 (the caller sets it).

        Args:
            layout: the items' layout.
            sources: per leaf, in layout order, the path of a raw ``[capacity_dim0, *item_shape]``
                file on the file system of the storage's directory, or a host tensor of that shape
                (a small leaf), written into a new file.
            scratch_dir: the directory for a storage that has none yet (made for it, and then
                its own, removed at cleanup); ignored when it has one.

        Raises:
            StorageExistsError: the leaf files exist and ``existsok`` is False.
            MemmapStorageError: a file has another size or cannot be moved or mapped; the storage
                stays empty.
        """
        self._check_usable()
        if self._leaves is not None or self._state.shared:
            raise MemmapStorageError(
                errno.EEXIST, f"the storage in {self.scratch_dir} already has files: its rows are copied into them"
            )
        given = self.scratch_dir is None
        if given:
            self.scratch_dir = scratch_dir
            self._own_directory(scratch_dir)
        if self._auto_device:
            self.device = self._pending_device or _CPU
        try:
            self._init_private(layout, sources=list(sources))
        except BaseException:
            if given:
                self._forget_directory()
            raise

    def _init_private(self, layout: Layout, *, sources: list[str | torch.Tensor] | None = None) -> None:
        """First write of a storage nobody else has opened: make the directory, state and files
        (or adopt ``sources`` as the files, see :meth:`_adopt_files`)."""
        cap0, rest = self._capacity_plan(layout)
        made_dir = None
        if self.scratch_dir is None:
            nbytes = cap0 * sum(spec.row_bytes for spec in layout.leaves)
            base = files.temp_base(nbytes)
            try:
                made_dir = tempfile.mkdtemp(prefix="gpubuf_memmap_", dir=base)
            except OSError as err:
                raise files.typed_os_error(err, f"cannot create a temporary directory in {base}") from err
            self.scratch_dir = made_dir
            self._own_directory(made_dir)
        elif not self.existsok:
            taken = [
                p
                for p in [os.path.join(state_dir(self.scratch_dir), "state")]
                + [os.path.join(self.scratch_dir, files.leaf_relpath(layout.kind, s.key)) for s in layout.leaves]
                if os.path.lexists(p)
            ]
            if taken:
                raise StorageExistsError(
                    errno.EEXIST,
                    f"a storage already exists in {self.scratch_dir} ({len(taken)} file(s), e.g. {taken[0]!r}); pass "
                    "existsok=True to reuse the files, shared_init=True to join it, or choose another scratch_dir",
                    taken[0],
                )
        meta_existed = os.path.isdir(state_dir(self.scratch_dir))
        local = self._state
        try:
            state = FileState.open(self.scratch_dir, max_size=self.max_size, ndim=self.ndim, reset=True)
        except (OSError, ValueError) as err:
            self._undo_dirs(made_dir, None if meta_existed else state_dir(self.scratch_dir))
            if made_dir is not None:
                self._forget_directory()
            if isinstance(err, ValueError):
                raise StorageMismatchError(str(err)) from err
            raise files.typed_os_error(err, f"cannot create the storage state in {self.scratch_dir}") from err
        self._state = state
        try:
            with state.lock:
                self._create_files(layout, overwrite=self.existsok, sources=sources)
                # Counters set before the first write (e.g. a writer's loaded cursor) carry over.
                state.cursor = local.cursor
                state.write_count = local.write_count
        except BaseException:
            self._state = local
            state.close()
            self._undo_dirs(made_dir, None if meta_existed else state_dir(self.scratch_dir))
            if made_dir is not None:
                self._forget_directory()
            raise

    def _forget_directory(self) -> None:
        self.scratch_dir = self._cleaner.root = None
        self._cleaner.whole_dir = False
        self._cleaner.owner_pid = None

    def _undo_dirs(self, made_dir: str | None, meta_dir: str | None) -> None:
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
        elif meta_dir is not None:
            shutil.rmtree(meta_dir, ignore_errors=True)

    def _create_files(
        self, layout: Layout, *, overwrite: bool, sources: list[str | torch.Tensor] | None = None
    ) -> None:
        """Creates the data files (or moves ``sources`` there) and ``layout.json``; the caller
        holds the state lock.

        On any error the files created here are removed, the state says EMPTY again and the
        storage stays uninitialised; the error is raised as a typed :class:`MemmapStorageError`.
        """
        state = self._state
        root = self.scratch_dir
        cap0, rest = self._capacity_plan(layout)
        plan = []
        for spec in layout.leaves:
            path = os.path.join(root, files.leaf_relpath(layout.kind, spec.key))
            row_bytes = spec.row_bytes
            plan.append((spec, path, row_bytes))
        if not overwrite:
            taken = [path for _, path, _ in plan if os.path.lexists(path)]
            if taken:
                raise StorageExistsError(
                    errno.EEXIST,
                    f"{len(taken)} data file(s) already exist in {root}, e.g. {taken[0]!r}; pass existsok=True to "
                    "reuse them or choose another scratch_dir",
                    taken[0],
                )
        state.status = STATUS_INITIALIZING
        created: list[str] = []
        made_dirs: list[str] = []
        opened: list[_LeafFile] = []
        try:
            for i, (spec, path, row_bytes) in enumerate(plan):
                parent = os.path.dirname(path)
                if not os.path.isdir(parent):
                    missing = parent
                    while not os.path.isdir(os.path.dirname(missing)):
                        missing = os.path.dirname(missing)
                    os.makedirs(parent, exist_ok=True)
                    made_dirs.append(missing)
                existed = os.path.lexists(path)
                source = None if sources is None else sources[i]
                if isinstance(source, str):
                    fd = files.adopt_file(source, path, cap0 * row_bytes)
                else:
                    fd = files.create_file(path, cap0 * row_bytes, exclusive=not overwrite)
                if isinstance(source, torch.Tensor):
                    try:
                        files.allocate_blocks(fd, 0, cap0 * row_bytes)
                        files.write_rows(fd, 0, source.contiguous())
                    except BaseException:
                        os.close(fd)
                        if not existed:
                            _remove(path)
                        raise
                if not existed:
                    created.append(path)
                opened.append(_LeafFile(path, fd, row_bytes))
            tensors = [
                files.map_file(path, (cap0, *spec.shape), spec.dtype) for (spec, path, _) in plan
            ]
            files.write_description(
                root,
                files.describe(layout, max_size=self.max_size, ndim=self.ndim, capacity_dim0=cap0, rest_shape=rest),
            )
            # Adopted or written files were written whole: every row has its blocks.
            state.alloc_rows = 0 if sources is None else cap0
            pending = self._pending_rows
            if pending is not None:
                # The set() that triggered the creation writes these rows next: a full disk
                # must fail here, while the creation can still be undone.
                self._files = opened
                self._ensure_allocated(self._runs(pending))
        except (OSError, RuntimeError) as err:
            # RuntimeError: torch.from_file could not map a file (e.g. out of address space).
            self._files = None
            for leaf_file in opened:
                leaf_file.close()
            for path in created:
                _remove(path)
            for path in reversed(made_dirs):
                shutil.rmtree(path, ignore_errors=True)
            state.status = STATUS_EMPTY
            if isinstance(err, OSError):
                raise files.typed_os_error(err, f"cannot create the storage's files in {root}") from err
            raise MemmapStorageError(errno.EIO, f"cannot map the storage's files in {root}: {err}", root) from err
        state.length = 0
        state.status = STATUS_READY
        self._files = opened
        self._created_files = True
        cleaner = self._cleaner
        cleaner.paths = [f.path for f in opened]
        if not cleaner.whole_dir and cleaner.owner_pid is None:
            # In a scratch_dir of the user's, the process that created the files owns them.
            cleaner.owner_pid = os.getpid()
        self._install(layout, tensors)

    def _attach(self, layout: Layout | None) -> None:
        """Maps files created by another process (or before a pickle round trip)."""
        self._check_usable()
        root = self.scratch_dir
        try:
            description = files.read_description(root)
        except OSError as err:
            raise files.typed_os_error(err, f"cannot read the storage layout in {root}") from err
        if layout is None:
            layout = files.layout_from_description(description)
        else:
            files.check_same_layout(layout, description, root)
        if description["max_size"] != self.max_size and self.ndim == 1:
            raise StorageMismatchError(
                f"the storage in {root} holds max_size={description['max_size']}, this one asks for {self.max_size}"
            )
        cap0 = description["capacity_dim0"]
        opened: list[_LeafFile] = []
        try:
            tensors = []
            for spec, leaf in zip(layout.leaves, description["leaves"]):
                path = os.path.join(root, leaf["file"])
                opened.append(_LeafFile(path, files.open_file(path), spec.row_bytes))
                tensors.append(files.map_file(path, (cap0, *spec.shape), spec.dtype))
        except (OSError, RuntimeError) as err:
            for leaf_file in opened:
                leaf_file.close()
            if isinstance(err, OSError):
                raise files.typed_os_error(err, f"cannot open the storage's files in {root}") from err
            raise MemmapStorageError(errno.EIO, f"cannot map the storage's files in {root}: {err}", root) from err
        if not self._state.shared:
            # Files found in place (e.g. a checkpoint loaded where this storage keeps its files):
            # join their shared state, keeping the counters this handle was given.
            local = self._state
            try:
                state = FileState.open(root, max_size=self.max_size, ndim=self.ndim, reset=False)
            except (OSError, ValueError) as err:
                for leaf_file in opened:
                    leaf_file.close()
                if isinstance(err, ValueError):
                    raise StorageMismatchError(str(err)) from err
                raise files.typed_os_error(err, f"cannot open the storage state in {root}") from err
            with state.lock:
                state.cursor = local.cursor
                state.write_count = local.write_count
                state.length = local.length
            self._state = state
        if self._auto_device and self.device == "auto":
            self.device = self._pending_device or _CPU
        self._files = opened
        self._cleaner.paths = [f.path for f in opened]
        self._install(layout, tensors)
        pending = self._pending_rows
        if pending is not None:
            with self._state.lock:
                self._ensure_allocated(self._runs(pending))

    def _description(self) -> dict:
        """The JSON description of this storage's files (what ``.gpubuf/layout.json`` holds)."""
        cap0 = self._capacity_along_dim0
        return files.describe(
            self._layout, max_size=self.max_size, ndim=self.ndim, capacity_dim0=cap0, rest_shape=list(self._rest_shape)
        )

    # ------------------------------------------------------------------ disk blocks
    def _ensure_allocated(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Reserves disk blocks for the dim-0 row ranges ``[lo, hi)`` before they are written.

        The caller holds the state lock. Rows ``[0, alloc_rows)`` are known to have blocks; the
        watermark moves when a range starts at or below it (round-robin writes always do).

        Raises:
            DiskFullError: no space for these rows; nothing was written.
        """
        state = self._state
        alloc = state.alloc_rows
        moved = alloc
        for lo, hi in ranges:
            if hi <= max(lo, moved):
                continue
            first = max(lo, moved)
            for leaf_file in self._files:
                if leaf_file.row_bytes == 0:
                    continue
                try:
                    files.allocate_blocks(leaf_file.fd, first * leaf_file.row_bytes, (hi - first) * leaf_file.row_bytes)
                except OSError as err:
                    if err.errno in files._DISK_FULL:
                        raise files.typed_os_error(
                            err, f"cannot store rows {first}..{hi - 1} in {leaf_file.path}"
                        ) from err
                    if err.errno in (95, 22, 38):  # EOPNOTSUPP, EINVAL, ENOSYS: no allocation on this fs
                        continue
                    raise files.typed_os_error(err, f"cannot reserve blocks in {leaf_file.path}") from err
            if lo <= moved:
                moved = hi
        if moved != alloc:
            state.alloc_rows = moved

    def _row_ranges(self, first: int, count: int) -> list[tuple[int, int]]:
        cap0 = self._capacity_along_dim0
        head = min(count, cap0 - first)
        ranges = [(first, first + head)]
        if head < count:
            ranges.append((0, count - head))
        return ranges

    # ------------------------------------------------------------------ writing
    def _append_rows(
        self, cursor: Any, data: Any, *, single: bool = False, index_key: tuple | None = None
    ) -> Appended:
        """Writes a batch at ``cursor``, the shared write cursor (:attr:`_write_state`): the writers' path.

        Validates the batch (nothing changes if it is rejected), creates or maps the files on
        the first write, then, under the storage's lock, reserves the rows by moving the
        cursor, copies them and adds them to the length: writers in several processes take
        turns, and no row ever holds fields of two writes. See :meth:`Storage._append_rows` for the
        arguments; ``index_key``'s leaf is filled with each row's own dim-0 index under the lock,
        and a batch's ``data`` gets those rows as its entry after the write.

        Raises:
            SchemaMismatchError, DTypeMismatchError, DeviceMismatchError, UnsupportedDataError:
                the batch does not fit; nothing changed.
            DiskFullError: no disk space for the rows; nothing changed.
        """
        self._check_usable()
        # The first write replaces the process-local state by the one in the files: a writer
        # holding the storage's cursor then moves that one.
        own = cursor is self._state
        if single:
            n, leading = 1, []
        else:
            if isinstance(data, list):
                data = stack_items(data)
            n = leading_size(data)
            leading = [n]
        layout, leaves, needs_init = self._prepare(data, leading)
        if single:
            leaves = [leaf.unsqueeze(0) for leaf in leaves]
        if needs_init:
            self._init_from(layout, leaves)
        if own:
            cursor = self._state
        cap0 = self._capacity_along_dim0
        skip = max(n - cap0, 0)
        count = n - skip
        state = self._state
        lock = state.lock
        lock.acquire()
        try:
            start = cursor.cursor
            first = (start + skip) % cap0
            self._ensure_allocated(self._row_ranges(first, count))
            cursor.cursor = (start + n) % cap0
            cursor.write_count = cursor.write_count + n
            # The copy stays under the lock. While the storage fills, rows then become visible in
            # order (every row below len(storage) holds data for a concurrent reader); once it
            # is full, a writer delayed by a whole lap of the others would otherwise copy over
            # rows that a later reservation is copying at the same time, leaving rows whose
            # fields come from two writes.
            rows = None if index_key is None else self._fill_index(leaves, index_key, start, n, cap0)
            self._copy_rows(first, skip, count, leaves)
            state.length = min(state.length + n * self._rest_numel, self.max_size)
        finally:
            lock.release()
        if single or rows is None:
            return Appended(start, None)
        # As every storage's: the data then holds the rows as its index entry.
        data.set(index_key, expand_as_batch(rows, data.batch_size))
        return Appended(start, rows)

    def _copy_rows(self, first: int, skip: int, count: int, leaves: list[torch.Tensor]) -> None:
        """Copies ``count`` batch rows from ``skip`` on into dim-0 rows ``first, ...`` (wrapping
        once).

        Rows written for the first time, rows whose pages are still dirty from the last write
        (:func:`~gpubuf.storages._memmap_files.mostly_dirty`, asked once per range of the first
        field: every field's rows were written together) and rows on a memory-only file system
        (``/dev/shm``: never written back) go through the mapping, a plain copy.
        Other written rows are overwritten with ``pwrite`` where a leaf's rows are contiguous host
        memory (:func:`~gpubuf.storages._memmap_files.write_rows`): a copy through the mapping
        would fault on every page the kernel has written back. Measured on ext4: into fresh
        preallocated blocks a ``pwrite`` is 2x to 3x slower than the mapping's first faults; over
        written-back rows it is 1.3x to 5x faster (1M rows of 277 B: 35 ms against 72 to 86 ms);
        over rows still dirty it is 1.4x slower (33 ms against 22 to 25 ms).
        """
        handles = self._files
        if handles is None or len(handles) != len(self._leaves):
            return super()._copy_rows(first, skip, count, leaves)
        # A batch read from the storage itself is a view of its mapping: copied first, as the
        # tensor storage does (a copy through the mapping refuses overlapping memory).
        leaves = _unaliased(leaves, self._store_spans())
        head = min(count, self._capacity_along_dim0 - first)
        filled = self._len_along_dim0
        # On a memory-only file system nothing is ever written back: the mapping is always a plain copy.
        in_memory = files.in_memory_fs(os.path.dirname(handles[0].path))
        parts = []
        for row, at, n in ((first, skip, head), (0, skip + head, count - head)):
            if n > 0:
                overwrite = row + n <= filled and handles[0].fd >= 0 and not in_memory
                lead = handles[0].row_bytes
                if overwrite and files.mostly_dirty(handles[0].fd, row * lead, n * lead):
                    overwrite = False
                parts.append((row, at, n, overwrite))
        for store, leaf, handle in zip(self._leaves, leaves, handles):
            for row, at, n, overwrite in parts:
                rows = leaf[at : at + n]
                written = False
                if overwrite and rows.dtype == store.dtype and rows.shape[1:] == store.shape[1:] and handle.fd >= 0:
                    try:
                        written = files.write_rows(handle.fd, row * handle.row_bytes, rows)
                    except OSError as err:
                        raise files.typed_os_error(err, f"cannot write rows to {handle.path}") from err
                if not written:
                    store[row : row + n].copy_(rows)

    def _fill_index(
        self, leaves: list[torch.Tensor], index_key: tuple, start: int, n: int, cap0: int
    ) -> torch.Tensor | None:
        """Replaces the ``index_key`` leaf by each row's dim-0 index (broadcast over its item
        shape); returns those rows as ``int64 [n]``, or None when the layout has no such leaf."""
        pos = self._layout.index_of(index_key)
        if pos is None:
            return None
        spec = self._layout.leaves[pos]
        rows = torch.arange(start, start + n, dtype=torch.int64)
        if start + n > cap0:
            rows = rows % cap0
        leaves[pos] = rows.to(spec.dtype).view(n, *([1] * len(spec.shape))).expand(n, *spec.shape)
        return rows

    def _write_rows(self, start: int, data: Any) -> int:
        """Writes a batch at dim-0 rows ``start, start+1, ...`` (wrapping); the length grows.

        The shared cursor is not moved: this is the path of writers that keep their own.
        """
        self._check_usable()
        n, leaves, first, skip, count = self._batch_rows(start, data)
        state = self._state
        with state.lock:
            self._ensure_allocated(self._row_ranges(first, count))
            self._copy_rows(first, skip, count, leaves)
            state.length = min(state.length + n * self._rest_numel, self.max_size)
        return n

    def _cursor_rows(self, cursor: Any, data: Any) -> torch.Tensor | None:
        """The dim-0 rows a ``set`` cursor touches (normalised, sorted, unique), or None when unknown."""
        try:
            cap0 = self._max_size_along_dim0(batched_data=data) if not is_int(cursor) else self._max_size_along_dim0(
                single_data=data
            )
            if is_int(cursor):
                rows = torch.tensor([int(cursor)])
            elif isinstance(cursor, slice):
                rows = torch.arange(cap0)[cursor]
            elif isinstance(cursor, tuple):
                rows = torch.as_tensor(cursor[0]).reshape(-1).long()
            else:
                rows = torch.as_tensor(np.asarray(cursor) if not isinstance(cursor, torch.Tensor) else cursor)
                if rows.dtype == torch.bool:
                    rows = rows.reshape(-1).nonzero().squeeze(-1)
                rows = rows.reshape(-1).long().cpu()
            if rows.numel() == 0 or int(rows.min()) < -cap0 or int(rows.max()) >= cap0:
                return None
            return torch.unique(torch.where(rows < 0, rows + cap0, rows))
        except Exception:
            # Whatever the cursor is, the base class validates it and raises the typed error.
            return None

    @staticmethod
    def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
        """Sorted unique rows as ``[lo, hi)`` runs of consecutive rows."""
        if rows.numel() == 0:
            return []
        breaks = (rows[1:] - rows[:-1] != 1).nonzero().squeeze(-1) + 1
        starts = torch.cat([rows[:1], rows[breaks]]).tolist()
        ends = torch.cat([rows[breaks - 1], rows[-1:]]).add(1).tolist()
        return list(zip(starts, ends))

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes ``data`` at ``cursor``; see :meth:`TensorStorage.set`.

        The write holds the storage's lock, so that the length update is atomic between
        processes; disk blocks for the rows are reserved before any byte is copied.

        Raises:
            DiskFullError: no disk space for these rows; nothing was written.
            Every error of :meth:`TensorStorage.set`, with nothing written.
        """
        self._check_usable()
        if isinstance(data, list):
            data = stack_items(data)
        # For a storage nobody else has opened yet, this is the private lock; the files and the
        # shared state are created inside the base class's set, before any other process can
        # know them.
        with self._state.lock:
            rows = self._cursor_rows(cursor, data)
            if self.initialized:
                if rows is not None:
                    self._ensure_allocated(self._runs(rows))
            else:
                # Blocks for these rows are reserved by the creation itself (see _create_files).
                self._pending_rows = rows
            try:
                super().set(cursor, data, set_cursor=set_cursor)
            finally:
                self._pending_rows = None

    def _empty(self) -> None:
        with self._state.lock:
            self._state.length = 0

    # ------------------------------------------------------------------ reading
    @property
    def _out_device(self) -> torch.device:
        return self.device if isinstance(self.device, torch.device) else _CPU

    @property
    def _row_sources(self) -> list[torch.Tensor] | None:
        self.initialized  # maps the files another process created
        return self._flat_leaves

    def _gather(self, index: torch.Tensor, skip: Collection[int] = ()) -> list:
        self.initialized
        if index.device.type != "cpu":
            index = index.cpu()
        return super()._gather(index, skip)

    def _build(
        self, leaves: list, lead: Sequence[int], *, device: torch.device | None = None, consumed: int | None = None
    ) -> Any:
        if device is None:
            # Rows gathered from the files are on the host; batches go to the storage's device.
            device = self._out_device
            if device.type != "cpu":
                leaves = [leaf if leaf is None or leaf.device == device else leaf.to(device) for leaf in leaves]
        return super()._build(leaves, lead, device=device, consumed=consumed)

    def get(self, index: Any) -> Any:
        """Reads items; see :meth:`TensorStorage.get`. Results are on :attr:`device`."""
        out = super().get(index)
        device = self._out_device
        if device.type == "cpu":
            return out
        return _relocate(out, self._layout, device)

    @property
    def _storage(self) -> Any:
        """The whole storage as one container of views on the mapped files (host memory)."""
        if not self.initialized:
            return None
        return self._build(list(self._leaves), [self._capacity_along_dim0], device=_CPU, consumed=0)

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copies a state dict's data into the files (created if needed) and sets the length.

        Raises:
            StorageMismatchError: the files exist with another layout.
            DiskFullError: no space for the rows.
        """
        self._check_usable()
        data, length = _check_state(state_dict, self.ndim)
        if data is None:
            self._empty()
            return
        n = leading_size(data)
        if not self.initialized and self.ndim == 1 and n != self.max_size:
            raise StorageMismatchError(f"the state dict holds {n} rows, this storage's capacity is {self.max_size}")
        if self.initialized:
            files.check_same_layout(Layout.from_batch(data, leading=1), self._description(), self.scratch_dir)
            if n != self._capacity_along_dim0:
                raise StorageMismatchError(
                    f"the state dict holds {n} rows along dim 0, this storage {self._capacity_along_dim0}"
                )
        self._write_rows(0, data)
        with self._state.lock:
            self._state.length = length

    # ------------------------------------------------------------------ cleanup
    def cleanup(self) -> bool:
        """Removes the storage's files from disk.

        A temporary directory is removed whole; in a ``scratch_dir`` you gave, only the files
        this storage uses (data files, ``.gpubuf/``) and the folders left empty go. Mappings
        already open in a process stay readable there (the kernel keeps unlinked mapped files),
        but the storage takes no more writes and no other process can open it.

        Returns:
            True if something was removed, False if it was already cleaned up or had no files.
        """
        cleaner = self._cleaner
        if not cleaner.done and not cleaner.paths and cleaner.root is not None:
            try:
                cleaner.paths = [
                    os.path.join(cleaner.root, leaf["file"]) for leaf in files.read_description(cleaner.root)["leaves"]
                ]
            except (OSError, ValueError, KeyError):
                pass
        return cleaner.run()

    # ------------------------------------------------------------------ pickling (spawn)
    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.context import get_spawning_popen

        if self._leaves is None and not self._state.shared and get_spawning_popen() is not None:
            # Like TorchRL: the child would make files of its own that the parent never sees.
            raise StorageNotSharableError(
                f"Cowardly refusing to share a storage of type {type(self).__name__} between processes if it has not "
                "been initialized yet: its files do not exist. "
                "Write some data first, or create it with shared_init=True so that the processes initialise it "
                "together"
            )
        state = dict(self.__dict__)
        state["_was_initialized"] = self._leaves is not None
        for name in ("_leaves", "_flat_leaves", "_files"):
            state[name] = None
        state["_attached_entities"] = []
        state.pop("_pending_rows", None)
        state.pop("_spans", None)  # the mapped leaves' ranges: the child maps them anew
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        was_initialized = state.pop("_was_initialized", False)
        self.__dict__.update(state)
        if was_initialized:
            self._attach(self._layout)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, len={len(self)}, device={self.device}, ndim={self.ndim}, "
            f"scratch_dir={self.scratch_dir!r}, shared={self._state.shared}, layout={self._layout})"
        )


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _relocate(out: Any, layout: Layout, device: torch.device) -> Any:
    """Moves a read result (tensor, TensorDict, tensorclass, pytree) to ``device``."""
    if isinstance(out, torch.Tensor):
        return out.to(device)
    if is_tensorclass(out) or isinstance(out, TensorDictBase):
        td = out._tensordict if is_tensorclass(out) else out
        leaves = [td.get(key).to(device) for key in layout.keys]
        return layout.build(leaves, td.batch_size, device)
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)


class SharedInitTensorStorage(LazyMemmapStorage):
    """What ``LazyTensorStorage(max_size, shared_init=True)`` builds: TorchRL keeps such rows in a
    memory-mapped TensorDict in a temporary directory that the first process to write creates and
    the others load; here they are a :class:`LazyMemmapStorage` with ``shared_init=True`` in a
    new temporary directory (``/dev/shm`` when the capacity fits in half the free memory), which
    workers receive with the storage (pickled, forked or spawned).

    Args:
        max_size, device, ndim, compilable, consolidated: as :class:`LazyTensorStorage`.
        shared_init: always True here.
        cleanup_memmap: remove the files when the process that created them exits (the
            ``auto_cleanup`` of :class:`LazyMemmapStorage`).
    """

    def __init__(
        self, max_size: int, *, consolidated: bool = False, shared_init: bool = True, cleanup_memmap: bool = True,
        **kwargs: Any,
    ) -> None:
        # (device, ndim and compilable go on as they are.)
        super().__init__(max_size, shared_init=True, auto_cleanup=cleanup_memmap, **kwargs)
        self.consolidated = consolidated
        self.cleanup_memmap = cleanup_memmap
