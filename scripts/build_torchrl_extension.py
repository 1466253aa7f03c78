"""Rebuilds TorchRL's C++ extension (its CPU segment trees) against the torch installed here.

TorchRL's wheels carry an extension compiled for one torch release; under another torch it fails
to load (``undefined symbol``) and TorchRL's prioritized samplers raise, so ``gpubuf bench``
reports those rows as unavailable. The wheels also ship the extension's C++ sources
(``torchrl/csrc``): this script compiles the CPU part of them with ``torch.utils.cpp_extension``
(a C++ compiler is needed; about 1.5 minutes on 2 cores) and puts the result in place of the
shipped binary, keeping that one as ``<name>.orig``. Then TorchRL's prioritized buffers run
with their own C++ trees, and the prioritized rows of ``gpubuf bench`` compare side by side::

    python scripts/build_torchrl_extension.py            # build and install
    python scripts/build_torchrl_extension.py --restore  # put the shipped binary back

Only the benchmark baseline changes; gpubuf never imports TorchRL.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path


def _extension_path(package: Path) -> Path:
    found = sorted(package.glob("_torchrl*.so")) + sorted(package.glob("_torchrl*.pyd"))
    found = [p for p in found if not p.name.endswith(".orig")]
    if not found:
        raise SystemExit(f"no _torchrl extension binary in {package}")
    return found[0]


def _loads(package: Path) -> str | None:
    """None when TorchRL's CPU trees import in a fresh process, else the error."""
    import subprocess

    code = "from torchrl._torchrl import SumSegmentTreeFp32; SumSegmentTreeFp32(8)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return None if result.returncode == 0 else (result.stderr.strip().splitlines() or ["failed"])[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restore", action="store_true", help="put back the binary the wheel shipped")
    parser.add_argument("--force", action="store_true", help="rebuild even if the extension loads")
    args = parser.parse_args(argv)

    import importlib.util

    spec = importlib.util.find_spec("torchrl")
    if spec is None or spec.origin is None:
        raise SystemExit("torchrl is not installed (pip install -e '.[compare]')")
    package = Path(spec.origin).parent
    target = _extension_path(package)
    backup = target.with_name(target.name + ".orig")

    if args.restore:
        if not backup.exists():
            raise SystemExit(f"no {backup.name} to restore")
        shutil.copy2(backup, target)
        print(f"restored {target}")
        return 0

    error = _loads(package)
    if error is None and not args.force:
        print("TorchRL's extension loads already; nothing to do (--force rebuilds)")
        return 0
    print(f"TorchRL's extension does not load here ({error}); building it against this torch...", flush=True)

    from torch.utils.cpp_extension import load

    csrc = package / "csrc"
    sources = [str(csrc / "pybind.cpp"), str(csrc / "utils.cpp")]
    with tempfile.TemporaryDirectory() as build:
        module = load(
            name="_torchrl",
            sources=sources,
            extra_cflags=["-O3"],  # as an optimised release build
            build_directory=build,
            with_cuda=False,
            verbose=False,
        )
        built = Path(module.__file__)
        if not backup.exists():
            shutil.copy2(target, backup)
        shutil.copy2(built, target)
    error = _loads(package)
    if error is not None:
        shutil.copy2(backup, target)
        raise SystemExit(f"the rebuilt extension does not load either ({error}); the shipped one is back")
    print(f"installed {target} (the shipped binary is kept as {backup.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
