"""Benchmark harness: gpubuf, TorchRL (when installed) and raw torch side by side, in one process.

Modules, one job each:

- :mod:`~gpubuf.benchmark.workloads`: the data, the ops and the providers that run them;
- :mod:`~gpubuf.benchmark.prioritized`: the prioritized cycle's buffers and raw-torch floor;
- :mod:`~gpubuf.benchmark.timing`: round-robin timing of several callables;
- :mod:`~gpubuf.benchmark.config`: the ``--quick`` and ``--full`` configurations and the bars;
- :mod:`~gpubuf.benchmark.harness`: the sweep;
- :mod:`~gpubuf.benchmark.report`: rows, ratios, table, JSON and PNG;
- :mod:`~gpubuf.benchmark.environment`: device, versions and commit of a run;
- :mod:`~gpubuf.benchmark.torchrl_compat`: TorchRL imported lazily, failures turned into reasons;
- :mod:`~gpubuf.benchmark.command`: the ``gpubuf bench`` subcommand.

Nothing heavy is imported here, so that ``gpubuf --help`` stays fast.
"""
