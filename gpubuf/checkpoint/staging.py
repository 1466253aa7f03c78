"""Loading into an empty memory-mapped storage: the files are verified while copied to their place.

A ``LazyMemmapStorage`` keeps each leaf in a raw file of ``[capacity, *item_shape]``, which is
byte for byte the array file a dump writes for that leaf. So a load into such a storage, still
empty, copies each of those checkpoint files next to where the storage keeps its files (its
``scratch_dir``, or the new temporary directory it would make), hashing the bytes on their way
(one read, one write, no page faults through a mapping), and once everything has been verified
the storage takes the copies as its files (a rename each, :meth:`LazyMemmapStorage._adopt_files`)
instead of creating files and copying the rows into them a second time.

The copies are made in ``<scratch_dir>/.gpubuf-load-<pid>-<hex>/`` and are the storage's only
once it adopts them; until then nothing of the storage changed, and :meth:`Staging.discard`
(which every load runs on its way out, failed or not) removes what is left. A load killed midway
leaves that folder behind; the next load into the same ``scratch_dir`` removes those of
processes that no longer run.

A storage that already has files (they may be shared with other processes, which map them) or
that is shared from its construction (``shared_init=True``) gets no staging: its rows are copied
into its files as before.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpubuf.checkpoint.atomic import remove_dead
from gpubuf.storages import _memmap_files
from gpubuf.storages.memmap import LazyMemmapStorage

STAGE_MARK = ".gpubuf-load-"


@dataclass
class Staging:
    """Where a load copies a memory-mapped storage's files, and what it copied there.

    Attributes:
        prefix: the arrays' files this applies to (a component's folder, ``"storage/"``).
        scratch_dir: the storage's directory, or None for a storage that makes a temporary
            directory at its first write (one is then made here, in the same place).
        directory: where the copies go (made by :meth:`open`).
        new_root: the temporary directory made for a storage without ``scratch_dir``.
        arrays: array name -> the copy that the array fills exactly (offset 0, whole file).
        adopted: the storage took the copies as its files.
    """

    prefix: str
    scratch_dir: str | None
    directory: Path | None = None
    new_root: Path | None = None
    made_scratch: bool = False
    arrays: dict[str, Path] = field(default_factory=dict)
    adopted: bool = False

    def open(self, nbytes: int) -> Path:
        """Makes the folder of the copies (``nbytes`` in all) and returns it."""
        if self.directory is not None:
            return self.directory
        if self.scratch_dir is None:
            base = _memmap_files.temp_base(nbytes)
            self.new_root = Path(tempfile.mkdtemp(prefix="gpubuf_memmap_", dir=base))
            root = self.new_root
        else:
            root = Path(self.scratch_dir)
            if not root.is_dir():
                root.mkdir(parents=True)
                self.made_scratch = True
            remove_dead(root, STAGE_MARK)
        self.directory = root / f"{STAGE_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        self.directory.mkdir()
        return self.directory

    def root(self) -> str | None:
        """The directory the storage keeps its files in once it adopts the copies."""
        return str(self.new_root) if self.new_root is not None else self.scratch_dir

    def discard(self) -> None:
        """Removes the copies the storage did not take (all of them, unless it adopted them)."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self.adopted:
            return
        if self.new_root is not None:
            shutil.rmtree(self.new_root, ignore_errors=True)
        elif self.made_scratch and self.scratch_dir is not None:
            try:
                os.rmdir(self.scratch_dir)
            except OSError:
                pass


def staging_for(storage: Any, codec: Any) -> Staging | None:
    """A :class:`Staging` for a load into ``storage`` through ``codec``, or None where the rows
    are to be copied into the storage's files (see the module docstring).

    Only the plain tensor-storage checkpointer writes the leaves as the storage's own files (the
    compact ones, TorchRL's TED formats, write other arrays); load hooks make new leaves.
    """
    if not isinstance(storage, LazyMemmapStorage) or codec.name != "tensor_storage":
        return None
    if storage.initialized or storage._state.shared or storage._load_hooks:
        return None
    return Staging(prefix="storage/", scratch_dir=storage.scratch_dir)
