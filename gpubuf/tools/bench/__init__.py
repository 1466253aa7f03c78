"""Benchmark harness: gpubuf, TorchRL (when installed) and raw torch side by side, in one process.

Modules, one job each:

- :mod:`~gpubuf.tools.bench.workloads`: the data, the ops and the providers that run them;
- :mod:`~gpubuf.tools.bench.prioritized`: the prioritized cycle's buffers and raw-torch floor;
- :mod:`~gpubuf.tools.bench.timing`: round-robin timing of several callables;
- :mod:`~gpubuf.tools.bench.config`: the ``--quick`` and ``--full`` configurations and the bars;
- :mod:`~gpubuf.tools.bench.harness`: the sweep;
- :mod:`~gpubuf.tools.bench.report`: rows, ratios, table, JSON and PNG;
- :mod:`~gpubuf.tools.bench.environment`: device, versions and commit of a run;
- :mod:`~gpubuf.tools.bench.torchrl_compat`: TorchRL imported lazily, failures turned into reasons;
- :mod:`~gpubuf.tools.bench.scale`: the scaling sweep (``gpubuf bench --scale``): time against N;
- :mod:`~gpubuf.tools.bench.command`: the ``gpubuf bench`` subcommand.

Nothing heavy is imported here, so that ``gpubuf --help`` stays fast.
"""
