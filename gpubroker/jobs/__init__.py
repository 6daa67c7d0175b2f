"""Batch jobs: a notebook or a command run to completion on a lease of its
own (:mod:`gpubroker.jobs.service`; the states in :mod:`gpubroker.model.jobs`)."""
