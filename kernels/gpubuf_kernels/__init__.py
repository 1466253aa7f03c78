"""Triton kernels of gpubuf, shipped as the ``gpubuf_kernels`` package.

Nothing here runs at import: no driver query, no compilation. Each module holds private
``_<op>_kernel`` Triton functions and a public ``<op>_triton`` launcher; the torch twin of each
op, which is also its specification, lives in ``gpubuf.ops.<op>``.
"""
