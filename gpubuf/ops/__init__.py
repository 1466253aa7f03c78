"""Ops: each a pure-torch twin ``<op>_ref`` (the specification and the CPU path) plus a public op
that dispatches by tensor device to its Triton kernel in ``gpubuf_kernels``."""

from gpubuf.ops.gather_rows import gather_rows, gather_rows_ref

__all__ = ["gather_rows", "gather_rows_ref"]
