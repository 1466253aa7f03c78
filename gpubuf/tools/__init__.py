"""Tools on top of the library: the ``gpubuf`` command, the side-by-side benchmark harness and profiling.

Nothing in the library imports this package; it imports the library like any user would.
"""
