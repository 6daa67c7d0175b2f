"""Trace-driven simulation: replay a job trace through the real scheduling core.

The scheduler is pure (``schedule(state, now) -> Decisions``), so the
simulator feeds it the same :class:`~gpubroker.scheduler.SchedulerState` the
live broker builds, on a virtual clock, and applies its decisions with
:func:`gpubroker.scheduler.apply`, whose rules the live broker follows.

Modules, one idea each:

- :mod:`~gpubroker.simulate.readers`: trace formats (Philly, Helios, Alibaba
  ``openb``, native CSV/JSON) into :class:`~gpubroker.simulate.readers.TraceJob`.
- :mod:`~gpubroker.simulate.cluster`: cluster specs (``16x8xA100-80GB``) into slots.
- :mod:`~gpubroker.simulate.workload`: enrichment (groups, priority classes,
  time limits) and admission against the cluster.
- :mod:`~gpubroker.simulate.engine`: the discrete-event loop.
- :mod:`~gpubroker.simulate.baselines`: the Slurm-like baseline policy.
- :mod:`~gpubroker.simulate.metrics`: queueing delay, JCT, allocation, fairness.
- :mod:`~gpubroker.simulate.compare`: one workload through several policies.
- :mod:`~gpubroker.simulate.plots`: PNG figures (matplotlib, imported lazily).
- :mod:`~gpubroker.simulate.cli`: the ``gpubroker simulate`` command.
"""
