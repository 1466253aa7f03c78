"""Components reach each other through declared attributes, never by probing for them.

``../shared/DESIGN.md``: storages declare what the buffer and writers use, with defaults, "never
probed with ``hasattr``, ``getattr`` or method identity". Read from the source: a ``hasattr`` or
``getattr`` with a constant attribute name on an expression that names a component (a storage,
sampler, writer, codec or checkpointer, as a variable or an attribute such as ``self._storage``)
is a probe. Each such attribute belongs on the component's base class, with a default.

Dynamic names (a scheduler's parameter, named by the user) and user data are not components and
stay duck-typed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = re.compile(r"(^|_)(storage|sampler|writer|codec|checkpointer)s?$")
#: The tools (bench harness, profiling) read whatever a buffer holds; they are not the library's house.
SKIPPED = ("gpubuf/tools/",)


def _named(node: ast.AST) -> str | None:
    """The identifier an expression ends with (``storage``, ``self._sampler``), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def probes(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each component probe in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("hasattr", "getattr") or len(node.args) < 2:
            continue
        target, name = node.args[0], node.args[1]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue
        ident = _named(target)
        if ident is not None and COMPONENT.search(ident):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _library_files() -> list[Path]:
    files = sorted((ROOT / "gpubuf").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    return [f for f in files if not any(part in f.relative_to(ROOT).as_posix() for part in SKIPPED)]


@pytest.mark.parametrize(
    "source, expected",
    [
        ('getattr(storage, "_flat_leaves", None)', 1),
        ('hasattr(self._storage, "_len")', 1),
        ('getattr(self._sampler, "reduction", "max")', 1),
        ('getattr(codec, "name", None)', 1),
        ("getattr(self.sampler, param_name)", 0),  # a name the user gave
        ('getattr(data, "device", None)', 0),  # user data
        ("storage.max_size", 0),
    ],
)
def test_the_rule_sees_probes(source: str, expected: int) -> None:
    assert len(probes(source)) == expected


def test_no_component_is_probed() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text}"
        for path in _library_files()
        for line, text in probes(path.read_text(encoding="utf-8"))
    ]
    assert not found, "components probed instead of read through their declared interface:\n" + "\n".join(found)
