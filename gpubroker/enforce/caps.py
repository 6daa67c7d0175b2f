"""Framework memory caps for a share's kernels: environment variables plus
a ``sitecustomize`` start-up hook.

:func:`framework_env` gives the variables to put in the environment of a
share's single-user server (its kernels inherit them):

- JAX: ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and the memory fraction as
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` and its newer name
  ``XLA_CLIENT_MEM_FRACTION`` (JAX documentation, "GPU memory allocation":
  the fraction is of the device's *total* memory; with the BFC allocator it
  also bounds the pool when preallocation is off; when no fraction is set,
  recent JAX may grow to 100 % of the device).
- TensorFlow: ``TF_FORCE_GPU_ALLOW_GROWTH=true`` (TensorFlow GPU guide,
  "Limiting GPU memory growth": allocate as needed instead of mapping
  nearly all device memory up front).
- ``GPUBROKER_MEMORY_LIMIT_MIB`` and ``GPUBROKER_MEMORY_FRACTION``, read by
  the start-up hook, and ``PYTHONPATH`` with :data:`STARTUP_DIR` first so
  Python runs its ``sitecustomize.py`` at start-up.

The hook (``startup/sitecustomize.py``, stdlib only) first runs any other
``sitecustomize`` later on ``sys.path`` (Python imports only the first one
found), then, when ``GPUBROKER_MEMORY_LIMIT_MIB`` is set, caps PyTorch
(``torch.cuda.set_per_process_memory_fraction``, PyTorch docs) and
TensorFlow (``tf.config.set_logical_device_configuration`` with
``memory_limit`` in MiB, TensorFlow GPU guide) when the user imports them.

Soft caps: they bind only frameworks that honour them, only in Python
processes started with this environment (not ``python -E``, ``-I`` or
``-S``), and only until the user's code sets other values.
"""

from __future__ import annotations

import os
from pathlib import Path

#: directory holding the start-up ``sitecustomize.py``; goes first on PYTHONPATH
STARTUP_DIR = str(Path(__file__).resolve().parent / "startup")


def memory_fraction(memory_mib: int, device_memory_mib: int) -> str:
    """``memory_mib / device_memory_mib`` with six decimals, rounded down
    so the fraction of the device never exceeds the share. (Three
    decimals, as before, cut a 1 GiB share's 512 MiB allocator to 431 MiB
    on a 141 GiB H200, and refused shares under 0.1 % of a device.)

    Args:
        memory_mib: the share's memory, MiB (>= 1).
        device_memory_mib: the device's total memory, MiB (>= ``memory_mib``).

    Returns:
        e.g. ``"0.125553"`` for 10240 of 81559 MiB; ``"1.000000"`` for the
        whole device.

    Raises:
        ValueError: a size is not an integer >= 1, ``memory_mib`` exceeds
            ``device_memory_mib``, or the share is under a millionth of the
            device (the fraction would round down to 0; a device over
            976 GiB).
    """
    for name, value in (("memory_mib", memory_mib), ("device_memory_mib", device_memory_mib)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer (MiB), got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1 MiB, got {value}")
    if memory_mib > device_memory_mib:
        raise ValueError(
            f"memory_mib ({memory_mib}) must be at most device_memory_mib ({device_memory_mib})"
        )
    millionths = memory_mib * _MILLION // device_memory_mib  # integer maths: never rounds up
    if millionths == 0:
        raise ValueError(
            f"memory_mib ({memory_mib}) must be at least a millionth of device_memory_mib "
            f"({device_memory_mib}), i.e. {-(-device_memory_mib // _MILLION)} MiB"
        )
    return f"{millionths // _MILLION}.{millionths % _MILLION:06d}"


_MILLION = 1_000_000


def allocator_mib(memory_mib: int, context_mib: int) -> int:
    """The MiB a framework's allocator may take of a share of ``memory_mib``
    when its CUDA context takes ``context_mib`` beside it (NVML counts both
    in the process's memory, as the share watchdog reads it): the share
    less the context, but at least half the share (a share too small for a
    context is the user's choice, not a cap of nothing)."""
    return max(memory_mib - max(context_mib, 0), memory_mib // 2, 1)


def framework_env(
    memory_mib: int,
    device_memory_mib: int,
    existing_pythonpath: str | None = None,
    context_mib: int = 0,
) -> dict[str, str]:
    """The environment that caps JAX, TensorFlow and PyTorch in a share's kernels.

    Args:
        memory_mib: the share's memory, MiB.
        device_memory_mib: the device's total memory, MiB.
        existing_pythonpath: the ``PYTHONPATH`` the server would otherwise
            get (``None`` or empty: none); its entries are kept after the
            start-up directory.
        context_mib: MiB of the share left to the CUDA context, outside the
            allocators (:func:`allocator_mib`; ``Broker.framework_context_mib``).

    Returns:
        ``XLA_PYTHON_CLIENT_MEM_FRACTION`` and ``XLA_CLIENT_MEM_FRACTION``
        (the allocator's fraction of the device, 6 decimals, rounded down;
        JAX docs), ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (JAX docs),
        ``TF_FORCE_GPU_ALLOW_GROWTH=true`` (TensorFlow GPU guide),
        ``GPUBROKER_MEMORY_LIMIT_MIB`` (the allocator's MiB),
        ``GPUBROKER_MEMORY_FRACTION`` (same fraction) and ``PYTHONPATH``
        (:data:`STARTUP_DIR` first).

    Raises:
        ValueError: as :func:`memory_fraction`.
    """
    memory_fraction(memory_mib, device_memory_mib)  # the share itself must fit
    memory_mib = allocator_mib(memory_mib, context_mib)
    fraction = memory_fraction(memory_mib, device_memory_mib)
    rest = [p for p in (existing_pythonpath or "").split(os.pathsep) if p and p != STARTUP_DIR]
    return {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": fraction,
        "XLA_CLIENT_MEM_FRACTION": fraction,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "GPUBROKER_MEMORY_LIMIT_MIB": str(memory_mib),
        "GPUBROKER_MEMORY_FRACTION": fraction,
        "PYTHONPATH": os.pathsep.join([STARTUP_DIR, *rest]),
    }
