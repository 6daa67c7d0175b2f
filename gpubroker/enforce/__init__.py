"""Enforcement of memory caps for time-sliced shares of a device.

A share lease gets ``memory_mib`` of one device (``CUDA_VISIBLE_DEVICES`` =
that device's UUID) next to other users' shares. Nothing in CUDA stops a
process from allocating the whole device, so the broker enforces the cap in
three layers, each switchable on its own:

1. **MPS** (:mod:`gpubroker.enforce.mps`): an NVIDIA Multi-Process Service
   control daemon per device; each client process gets a *hard* cap on the
   device memory it may allocate (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and a
   share of the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). Guarantees: an
   allocation over the cap fails with out-of-memory in that process only.
   Only where MPS runs: Volta or newer, Linux, and clients either of the
   same user as the running MPS server or a multi-user MPS setup (legacy MPS
   runs one server per user id at a time; clients of another user wait until
   the current server's clients have all exited). The cap is per client
   process, not per lease.
2. **Framework caps** (:mod:`gpubroker.enforce.caps`): environment variables
   and a ``sitecustomize`` start-up hook in the user's kernels that make
   JAX, TensorFlow and PyTorch limit their own allocators. *Soft*: only for
   frameworks that honour them, only in Python processes that run the hook,
   and only while the user's code does not override them.
3. **Watchdog** (:mod:`gpubroker.enforce.watchdog`): compares what NVML
   reports per process with each lease's cap and, after a warning and a
   grace period, ends the offending processes. *After the fact*: an
   over-allocation happens and is visible to others until the watchdog acts;
   it sees only what NVML reports (processes in other PID namespaces, e.g.
   containers, may be invisible or mis-numbered).

This module stays free of heavy imports so the broker can import it cheaply.
"""

from __future__ import annotations


class EnforcementError(RuntimeError):
    """An enforcement layer could not do its job, e.g. the MPS control
    command is missing or failed; the message names the command and carries
    its standard error."""


__all__ = ["EnforcementError"]
