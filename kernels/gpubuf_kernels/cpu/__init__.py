"""CPU kernels: compiled loops (Numba) for the ops whose torch twins cost more in dispatch than in work.

A CPU sum-tree update or descent of a few hundred entries is dozens of small torch calls, each
a few microseconds of dispatch around well under a microsecond of work; TorchRL runs these in
C++. The kernels here are the same loops compiled with Numba (a dependency of gpubuf). They return what the twins return, bit for bit, and the twins stay the
specification, the fallback where Numba is missing, and the test oracle.

The row gather (:mod:`.rows`) is here because a sample's rows are scattered over the storage:
``index_select`` waits for each row's cache misses in turn, where one loop over every field can
prefetch the rows it copies next.

The row decode and encode of the codec (:mod:`.codec`, :mod:`.encoder`) are here for another
reason: their torch versions treat a batch as whole-tensor steps (line tables, a pool of expanded
lines, gathers), several passes over intermediates larger than the rows, where a loop reads or
writes each line once.

Numba compiles each kernel on first use and caches the machine code on disk (``cache=True``),
so later processes load it in milliseconds. Nothing is imported or compiled when ``gpubuf`` is.
"""
