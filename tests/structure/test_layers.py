"""The import graph of ``gpubuf`` and ``gpubuf_kernels`` keeps its layers.

Read from the source (nothing is imported): every ``import`` and ``from ... import`` of a gpubuf
module, at any depth of the file (an import inside a function is an import all the same). The
rules, from the README's Layout section:

- ``gpubuf_kernels`` imports nothing of ``gpubuf``: a kernel reports a status, the host raises.
- Every package sits on a layer; an import goes to a lower layer, or stays inside its package.
  Components (storages, samplers, writers) never import ``gpubuf.checkpoint``, which reads their
  state from above.
- No circle anywhere, between modules or between packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Lowest first. A module's layer is that of its longest listed prefix.
LAYERS: list[tuple[str, ...]] = [
    ("gpubuf_kernels",),
    ("gpubuf._version", "gpubuf.errors", "gpubuf.host_memory", "gpubuf.file_lock"),
    ("gpubuf.codec", "gpubuf.data", "gpubuf.utils"),
    ("gpubuf.ops",),
    ("gpubuf.staging", "gpubuf._ensemble"),
    ("gpubuf.storages",),
    ("gpubuf.samplers", "gpubuf.writers"),
    ("gpubuf.checkpoint",),
    ("gpubuf.buffers",),
    ("gpubuf.distributed",),
    ("gpubuf",),
    ("gpubuf.tools",),
]


def _modules() -> dict[str, Path]:
    found = {}
    for package, base in (("gpubuf", ROOT), ("gpubuf_kernels", ROOT / "kernels")):
        for path in sorted((base / package).rglob("*.py")):
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module (or package) that ``name`` names, or its closest listed parent."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` the package.
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target) if target.split(".")[0] in ("gpubuf", "gpubuf_kernels") else None
            if resolved and resolved != module:
                found.add(resolved)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), i
    if layer is None:
        raise AssertionError(f"{module} is on no layer: add its package to LAYERS")
    return layer


def _package(module: str) -> str:
    """The listed prefix that places ``module`` (its package on the layer map)."""
    return max((p for ps in LAYERS for p in ps if module == p or module.startswith(p + ".")), key=len)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_graph_is_read():
    # The rules below would pass on an empty graph: make sure the reader finds real imports.
    assert "gpubuf.buffers.base" in MODULES and "gpubuf_kernels.sumtree" in MODULES
    assert "gpubuf.storages.base" in GRAPH["gpubuf.buffers.base"] or any(
        t.startswith("gpubuf.storages") for t in GRAPH["gpubuf.buffers.base"]
    )


def test_kernels_import_nothing_of_gpubuf():
    bad = {m: sorted(t for t in ts if t.split(".")[0] == "gpubuf") for m, ts in GRAPH.items() if m.startswith("gpubuf_kernels")}
    assert not {m: ts for m, ts in bad.items() if ts}


def test_every_module_is_on_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_only_go_down():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            if _package(module) == _package(target):
                continue  # inside one package: only the circle rule applies
            if _layer(target) >= _layer(module):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not go to a lower layer:\n" + "\n".join(sorted(upward))


def test_no_circle_between_modules():
    assert _cycles(GRAPH) == []


def test_no_circle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(_package(module), set()).update(_package(t) for t in targets if _package(t) != _package(module))
    assert _cycles(packages) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_circle_finder(graph, expected):
    assert _cycles(graph) == expected
