"""Device backends: the real one (NVML) and a simulated one (fake).

Backends are imported lazily, so importing this package loads neither
``pynvml`` nor the fake's catalog.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from .base import DeviceBackend, DeviceBackendError, DeviceInfo, DeviceUsage, ProcessInfo

__all__ = [
    "BACKENDS",
    "DeviceBackend",
    "DeviceBackendError",
    "DeviceInfo",
    "DeviceUsage",
    "ProcessInfo",
    "backend_class",
    "load_backend",
]

#: backend kind -> "module:class", imported on first use
BACKENDS: dict[str, str] = {
    "fake": "gpubroker.devices.fake:FakeDeviceBackend",
    "nvml": "gpubroker.devices.nvml:NVMLDeviceBackend",
}

#: kinds :func:`load_backend` accepts
KINDS = ("auto", *BACKENDS)


def backend_class(kind: str) -> type[DeviceBackend]:
    """Import and return the backend class of ``kind`` ("fake" or "nvml").

    Raises:
        ValueError: unknown kind.
    """
    try:
        module_name, class_name = BACKENDS[kind].split(":")
    except KeyError:
        raise ValueError(f"unknown device backend {kind!r}; valid: {', '.join(BACKENDS)}") from None
    cls: type[DeviceBackend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def load_backend(
    kind: str, *, parent: Any = None, log: logging.Logger | None = None
) -> DeviceBackend:
    """Create the device backend ``kind``.

    Args:
        kind: "nvml" (real GPUs), "fake" (SIMULATED GPUs) or "auto" (NVML,
            and the fake when NVML cannot be initialised, with a loud warning).
        parent: traitlets parent (e.g. the app) whose config the backend reads.
        log: logger for the backend and the fallback warning (default: the
            parent's log, else the ``gpubroker`` logger).

    Raises:
        ValueError: unknown kind; the message lists the valid kinds.
        DeviceBackendError: the backend cannot be initialised ("nvml": no
            driver; "fake": bad inventory).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown device backend {kind!r}; valid: {', '.join(KINDS)}")
    if log is None:
        log = getattr(parent, "log", None) or logging.getLogger("gpubroker")
    if kind == "nvml":
        return backend_class(kind)(parent=parent, log=log)
    if kind == "auto":
        try:
            return backend_class("nvml")(parent=parent, log=log)
        except DeviceBackendError as err:
            log.warning("NO NVIDIA DRIVER FOUND (%s)", err)
    backend = backend_class("fake")(parent=parent, log=log)
    # not chosen: an engine with an inventory of its own (Slurm) is not simulated
    backend.fallback = kind == "auto"
    log.warning(
        "USING SIMULATED GPUS (FakeDeviceBackend: %s). "
        "NOTHING THIS BROKER HANDS OUT IS A REAL GPU.",
        ", ".join(getattr(backend, "inventory", ())),
    )
    return backend
