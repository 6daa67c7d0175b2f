"""Usage: the ledger of GPU-seconds allocated and used, its reports, and
the decayed usage fair share reads.

* :mod:`~gpubroker.usage.intervals`: the ledger's rule (pure);
* :mod:`~gpubroker.usage.ledger`: the ledger of a running broker;
* :mod:`~gpubroker.usage.report`: reports per user, group, pool, model or day;
* :mod:`~gpubroker.usage.decayed`: fair share's decayed usage, charged from the
  ledger's intervals (pure).
"""
