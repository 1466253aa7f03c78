"""Profiling session: the prioritized cycle: sample B rows, then update their priorities.

Runs the ``prioritized`` workload of :mod:`gpubuf.tools.profile` under torch.profiler, writes a chrome
trace to ``profiling/out/`` and prints the top kernels and the host overhead per call. On a
machine without a GPU it profiles the torch twins on the CPU. Options as ``gpubuf profile``::

    python profiling/profile_prioritized.py [--device cpu|cuda] [-B 4096] [--rows 100000] [--steps 20]

The cycle is one learner step's worth of replay work on a
``TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5)``: ``sample(B)``, then
``update_tensordict_priority`` with fresh TD errors.
"""

import sys
from pathlib import Path

from gpubuf.tools.profile import main

if __name__ == "__main__":
    # Traces go next to this script (profiling/out/) wherever it is run from.
    raise SystemExit(main(["prioritized", *sys.argv[1:]], defaults={"out_dir": Path(__file__).parent / "out"}))
