"""A memory-mapped storage's layout file names its items' tensorclass: reopening the files looks
the class up in modules already imported and takes only a tensorclass type."""

from __future__ import annotations

import sys

import pytest

from gpubuf.data import RewardData
from gpubuf.errors import StorageMismatchError
from gpubuf.storages import _memmap_files as files
from gpubuf.storages._layout import class_path


def _description(container: str) -> dict:
    return {
        "kind": "tensorclass",
        "container": container,
        "leaves": [{"key": ["end_scores"], "dtype": "float32", "item_shape": []}],
        "item_batch": [],
    }


def test_an_imported_tensorclass_is_found_by_its_path():
    layout = files.layout_from_description(_description(class_path(RewardData)))
    assert layout.container_cls is RewardData and layout.kind == "tensorclass"


@pytest.mark.parametrize("container", ["module_never_imported_here:Items", "os:system", "torch:Tensor", "gpubuf.data:NoSuchClass"])
def test_anything_else_is_refused_without_importing(container):
    with pytest.raises(StorageMismatchError, match="import"):
        files.layout_from_description(_description(container))
    assert "module_never_imported_here" not in sys.modules
