"""``gpubuf aot``: compile every Triton kernel specialisation for CUDA targets, without a GPU.

Triton compiles ahead of time for a target it is told of, running the ``ptxas`` it ships. Every
kernel module of ``gpubuf_kernels`` lists, next to its launcher, the specialisations the launcher
produces (``SPECIALIZATIONS``: kernel name, signature, constexprs, ``num_warps``). This compiles
each for sm_80 and sm_90 and reads, per compiled kernel:

- registers, local memory and shared memory from ``cuobjdump --dump-resource-usage`` of the cubin;
- spill stores and loads from ``ptxas -v`` on the PTX;
- whether the PTX holds 16-byte global accesses (``ld/st.global.v2.b64`` or ``.v4.b32``);
- an occupancy estimate: resident warps per SM over the SM's maximum, from registers, shared
  memory and ``num_warps`` (CUDA's allocation rules for sm_80 and sm_90).

It fails (exit status 1) on a compile error, a spill over :data:`SPILL_TOLERANCE_BYTES`, a gather kernel above
:data:`GATHER_MAX_REGISTERS` registers, or a jitted kernel that no specialisation lists. The table
goes to ``aot.json`` and ``aot.md`` in the output folder (``benchmarks/results/aot/`` in the
repository, committed). Run it with Triton's interpreter off (``TRITON_INTERPRET`` unset): it
compiles the jitted functions, which the interpreter replaces.

Example:
    $ python -m gpubuf.tools.aot --out benchmarks/results/aot
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import math
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

#: The kernel modules of ``gpubuf_kernels`` that hold Triton kernels.
KERNEL_MODULES = ("gather", "write_rows", "gather_packed", "codec", "sumtree", "slice", "episodes")
#: Compute capabilities compiled for: A100 (sm_80), H100/H200 (sm_90).
ARCHS = (80, 90)
#: The row gathers must stay at or below this many registers a thread (16 warps per SM at 4
#: warps a program, enough loads in flight for a copy).
GATHER_MAX_REGISTERS = 128
#: Bytes a kernel may spill each way before the check fails. ptxas spills a few bytes in one
#: variant of the draw (float32 leaves, depth 3, i.i.d., with weights: 12 B around CUDA's pow),
#: which stays in the table; a real register shortage spills far more.
SPILL_TOLERANCE_BYTES = 16
_GATHER_MODULES = ("gather", "write_rows", "gather_packed")

# Per-SM limits of sm_80 and sm_90 (CUDA occupancy calculator): registers, warps, resident
# programs, shared memory usable by programs, shared memory the runtime reserves per program.
_SM = {
    80: {"regs": 65536, "warps": 64, "blocks": 32, "smem": 167936, "smem_reserved": 1024},
    90: {"regs": 65536, "warps": 64, "blocks": 32, "smem": 233472, "smem_reserved": 1024},
}
_REG_GRANULE = 256  # registers are allocated per warp in units of this many


@dataclass
class Compiled:
    """One kernel specialisation compiled for one target."""

    module: str
    kernel: str
    label: str
    arch: int
    num_warps: int
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    local_bytes: int | None = None
    shared_bytes: int | None = None
    occupancy: float | None = None
    vector_16b: bool | None = None
    error: str | None = None
    key: str = ""


def _cuobjdump() -> str:
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself runs for ``sm_<arch>`` (it ships two, for older and newer PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def specializations() -> list[tuple[str, dict[str, Any]]]:
    """``(module, specialisation)`` for every entry of every kernel module's ``SPECIALIZATIONS``."""
    found = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"gpubuf_kernels.{name}")
        found += [(name, spec) for spec in getattr(module, "SPECIALIZATIONS", [])]
    return found


#: Launch options of a launch, not kernel parameters.
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
#: Constexprs whose value the launchers take from where they run: under the interpreter (no
#: libdevice) they pass False, on a GPU this.
_ON_GPU = {"LIBDEVICE": True}


def launched_specialization(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The specialisation Triton's JIT compiles for one launch on a GPU: parameter types as the
    JIT derives them from the values passed (``triton.runtime.jit.mangle_type``, or the
    parameter's annotation), and the constexprs.

    Works on the interpreter's launches too (the same arguments reach the JIT on CUDA), so a run
    of the forced device path on the CPU shows what a GPU compiles.

    Args:
        kernel: the jitted (or interpreted) kernel.
        args, kwargs: what the launcher passed (kernel arguments, constexprs, launch options).

    Returns:
        ``{"kernel", "signature", "constexprs", "num_warps"}``, the shape of a ``SPECIALIZATIONS``
        entry.
    """
    import inspect

    from triton.runtime.jit import KernelParam, mangle_type

    fn = getattr(kernel, "fn", kernel)
    params = inspect.signature(fn).parameters
    options = {k: v for k, v in kwargs.items() if k in _LAUNCH_OPTIONS}
    bound = inspect.Signature(list(params.values())).bind(*args, **{k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS})
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for number, (name, param) in enumerate(params.items()):
        value = bound.arguments[name]
        described = KernelParam(number, param, False, False)
        if described.is_constexpr:
            constexprs[name] = value
        elif described.annotation_type:
            signature[name] = described.annotation_type
        elif value is None:
            constexprs[name] = None  # the JIT makes a None argument a constexpr
        else:
            signature[name] = mangle_type(value)
    constexprs.update({name: value for name, value in _ON_GPU.items() if name in constexprs})
    return {"kernel": fn.__name__, "label": "launched", "signature": signature, "constexprs": constexprs,
            "num_warps": options.get("num_warps", 4)}


def _covers(listed: str, launched: str) -> bool:
    """Whether a listed parameter type compiles what a launch passes: the same type, or for an
    integer scalar the 64-bit one a large enough value takes (the code compiled is the same)."""
    return listed == launched or (listed == "i64" and launched == "i32")


def uncovered(found: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Launches whose parameters no ``SPECIALIZATIONS`` entry of their kernel lists: a type the
    table does not compile (a Python float reaching the JIT as float32, say), or constexprs of
    other names. One line each, duplicates dropped."""
    table: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for module, spec in specializations():
        table.setdefault((module, spec["kernel"]), []).append(spec)
    lines = []
    for module, spec in found:
        entries = table.get((module, spec["kernel"]), [])
        if not any(
            entry["signature"].keys() == spec["signature"].keys()
            and all(_covers(entry["signature"][name], kind) for name, kind in spec["signature"].items())
            and entry.get("constexprs", {}).keys() == spec["constexprs"].keys()
            for entry in entries
        ):
            line = f"{module}.{spec['kernel']} launched with {spec['signature']}: no listed specialisation has these types"
            if line not in lines:
                lines.append(line)
    return lines


@contextlib.contextmanager
def launched() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Records ``(module, specialisation)`` of every launch made through the launch helper inside
    the block (the module's short name, as in :data:`KERNEL_MODULES`)."""
    from gpubuf_kernels import _launch

    found: list[tuple[str, dict[str, Any]]] = []

    def record(kernel: Any, args: tuple, kwargs: dict) -> None:
        module = getattr(kernel, "fn", kernel).__module__.rsplit(".", 1)[-1]
        found.append((module, launched_specialization(kernel, args, kwargs)))

    _launch.add_launch_listener(record)
    try:
        yield found
    finally:
        _launch.remove_launch_listener(record)


def unlisted_kernels() -> list[str]:
    """Jitted top-level ``*_kernel`` functions of the kernel modules that no specialisation names."""
    from triton.runtime.jit import JITFunction

    listed = {(m, spec["kernel"]) for m, spec in specializations()}
    missing = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"gpubuf_kernels.{name}")
        for attr, value in vars(module).items():
            if isinstance(value, JITFunction) and attr.endswith("_kernel") and (name, attr) not in listed:
                missing.append(f"{name}.{attr}")
    return missing


def occupancy(registers: int, shared: int, num_warps: int, arch: int) -> float:
    """Resident warps per SM over the SM's maximum, for a kernel of these resources."""
    sm = _SM[arch]
    per_warp = math.ceil(registers * 32 / _REG_GRANULE) * _REG_GRANULE
    by_regs = (sm["regs"] // per_warp) // num_warps if per_warp else sm["blocks"]
    by_warps = sm["warps"] // num_warps
    by_smem = sm["smem"] // (shared + sm["smem_reserved"]) if shared else sm["blocks"]
    blocks = min(by_regs, by_warps, by_smem, sm["blocks"])
    return round(blocks * num_warps / sm["warps"], 3)


def _resource_usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {key: int(value) for key, value in fields.items()}


def _spills(ptx: str, arch: int) -> tuple[int, int]:
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        run = subprocess.run(
            [_ptxas(arch), f"-arch={target.group(1) if target else f'sm_{arch}'}", "-v", str(path), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    log = run.stdout + run.stderr
    stores = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))
    loads = sum(int(n) for n in re.findall(r"(\d+) bytes spill loads", log))
    return stores, loads


def cache_key(module: str, spec: dict[str, Any], arch: int) -> str:
    """What a compile result depends on: the source of every jitted function of the kernel's
    module and the module's constexpr globals (a superset of what the kernel calls and reads),
    the specialisation, the target and Triton's version. Line numbers are left out, so editing a
    docstring or another function of the module keeps the key."""
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    found = vars(importlib.import_module(f"gpubuf_kernels.{module}"))
    sources = sorted((name, value.src) for name, value in found.items() if isinstance(value, JITFunction))
    constants = sorted((name, repr(value.value)) for name, value in found.items() if isinstance(value, tl.constexpr))
    text = json.dumps([sources, constants, spec, arch, triton.__version__], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def compile_one(module: str, spec: dict[str, Any], arch: int) -> Compiled:
    """Compiles one specialisation for ``sm_<arch>`` and reads its resources (never raises)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = Compiled(module, spec["kernel"], spec.get("label", ""), arch, spec.get("num_warps", 4))
    try:
        row.key = cache_key(module, spec, arch)
        fn = getattr(importlib.import_module(f"gpubuf_kernels.{module}"), spec["kernel"])
        source = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec.get("constexprs", {}))
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": row.num_warps})
        usage = _resource_usage(kernel.asm["cubin"])
        row.registers = usage.get("REG")
        row.local_bytes = usage.get("LOCAL", 0) + usage.get("STACK", 0)
        row.shared_bytes = max(usage.get("SHARED", 0), int(kernel.metadata.shared or 0))
        row.spill_stores, row.spill_loads = _spills(kernel.asm["ptx"], arch)
        row.occupancy = occupancy(row.registers or 0, row.shared_bytes, row.num_warps, arch)
        row.vector_16b = bool(re.search(r"(ld|st)\.global(\.\w+)*\.(v2\.b64|v4\.b32)", kernel.asm["ptx"]))
    except Exception as err:  # reported in the table and as a problem, not raised: see every failure at once
        row.error = f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
    return row


def problems(rows: Sequence[Compiled], missing: Sequence[str] = ()) -> list[str]:
    """Everything that fails the check, one line each (empty: the check passes)."""
    found = [f"no specialisation lists the kernel {name}" for name in missing]
    for r in rows:
        what = f"{r.module}.{r.kernel}[{r.label}] sm_{r.arch}"
        if r.error:
            found.append(f"{what}: {r.error}")
            continue
        if max(r.spill_stores or 0, r.spill_loads or 0, r.local_bytes or 0) > SPILL_TOLERANCE_BYTES:
            found.append(f"{what}: spills ({r.spill_stores} B stored, {r.spill_loads} B loaded, {r.local_bytes} B local)")
        if r.module in _GATHER_MODULES and (r.registers or 0) > GATHER_MAX_REGISTERS:
            found.append(f"{what}: {r.registers} registers, above {GATHER_MAX_REGISTERS}")
    return found


def compile_all(
    archs: Sequence[int] = ARCHS, reuse: Path | None = None, specs: Sequence[tuple[str, dict[str, Any]]] | None = None
) -> list[Compiled]:
    """Every specialisation for every target in ``archs``.

    Args:
        archs: compute capabilities.
        reuse: an ``aot.json`` written before: a row of it whose :func:`cache_key` matches (same
            kernel sources, specialisation, target and Triton) and that compiled cleanly is taken
            as it is instead of compiling again. The committed table makes the test of the check
            compile only the kernels that changed.
    """
    known = {}
    if reuse is not None and reuse.exists():
        known = {row["key"]: row for row in json.loads(reuse.read_text())["rows"] if row.get("key") and not row.get("error")}
    rows = []
    if specs is None:
        specs = specializations()
    else:
        unique = {json.dumps([m, spec], sort_keys=True, default=str): (m, spec) for m, spec in specs}
        specs = list(unique.values())
    for module, spec in specs:
        for arch in archs:
            old = known.get(cache_key(module, spec, arch))
            rows.append(Compiled(**old) if old is not None else compile_one(module, spec, arch))
    return rows


def write(rows: Sequence[Compiled], out: Path) -> None:
    """Writes ``aot.json`` (rows and versions) and ``aot.md`` (the table) into ``out``."""
    import triton

    out.mkdir(parents=True, exist_ok=True)
    meta = {"triton": triton.__version__, "archs": sorted({r.arch for r in rows})}
    (out / "aot.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    lines = [
        f"Ahead-of-time compile of every kernel specialisation (Triton {triton.__version__}; `python -m gpubuf.tools.aot`).",
        "",
        "| kernel | specialisation | arch | warps | registers | spills (B) | shared (B) | occupancy | 16-B accesses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            lines.append(f"| {r.module}.{r.kernel} | {r.label} | sm_{r.arch} | {r.num_warps} | error: {r.error} | | | | |")
            continue
        lines.append(
            f"| {r.module}.{r.kernel} | {r.label} | sm_{r.arch} | {r.num_warps} | {r.registers} | "
            f"{(r.spill_stores or 0) + (r.spill_loads or 0)} | {r.shared_bytes} | {r.occupancy:.2f} | {'yes' if r.vector_16b else 'no'} |"
        )
    (out / "aot.md").write_text("\n".join(lines) + "\n")


def run(
    out: Path | None, archs: Sequence[int] = ARCHS, reuse: Path | None = None, launched_from: Path | None = None
) -> int:
    """Compiles, prints the problems, writes the table; returns the exit status.

    With ``launched_from`` (a JSON list of ``[module, specialisation]`` as :func:`launched`
    records them) it compiles those instead of the table, and reports them also when the
    table lists none of their types (:func:`uncovered`).
    """
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpubuf aot compiles the jitted kernels: unset TRITON_INTERPRET")
        return 2
    if launched_from is not None:
        specs = [(module, spec) for module, spec in json.loads(launched_from.read_text())]
        rows = compile_all(archs, reuse, specs)
        found = uncovered(specs) + problems(rows)
    else:
        rows = compile_all(archs, reuse)
        found = problems(rows, unlisted_kernels())
    if out is not None:
        write(rows, out)
    for line in found:
        print(line)
    print(f"{len(rows)} compiled kernels, {len(found)} problems")
    return 1 if found else 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("aot", help="compile every kernel specialisation for sm_80 and sm_90 (no GPU needed)")
    _arguments(parser)
    parser.set_defaults(func=lambda args: run(args.out, args.arch, args.reuse, args.launched))


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="folder for aot.json and aot.md")
    parser.add_argument("--reuse", type=Path, default=None, help="an aot.json whose rows of unchanged kernels are kept")
    parser.add_argument("--launched", type=Path, default=None,
                        help="a JSON list of [module, specialisation] recorded from launches: compile those instead")
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=sorted(_SM), help="compute capabilities")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m gpubuf.tools.aot", description=__doc__.splitlines()[0])
    _arguments(parser)
    args = parser.parse_args()
    raise SystemExit(run(args.out, args.arch, args.reuse, args.launched))
