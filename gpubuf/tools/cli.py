"""The ``gpubuf`` command: a dispatcher to subcommands.

Each subcommand lives in its own module, which exposes ``register(subparsers)``: it adds its
parser and sets ``func`` (``args -> exit status``) as a default. Adding a subcommand
(``profile``, ``inspect``) is one more entry in :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Sequence

#: Modules providing ``register(subparsers)``, in the order they appear in ``gpubuf --help``.
SUBCOMMANDS: tuple[str, ...] = ("gpubuf.tools.bench.command", "gpubuf.tools.profile", "gpubuf.tools.aot")


def build_parser() -> argparse.ArgumentParser:
    """The ``gpubuf`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="gpubuf", description="gpubuf: a GPU-first replay buffer for PyTorch.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpubuf`` console script.

    Args:
        argv: the arguments (without the program name); defaults to ``sys.argv[1:]``.

    Returns:
        The exit status of the subcommand.
    """
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
