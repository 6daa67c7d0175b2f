"""Engines: where holders' processes run (local host now; Docker, Slurm later).

See :mod:`gpubroker.engines.base` for the protocol. Importing this package is
light: no SQLAlchemy, no NVML, no Docker client; an engine gets its device
backend passed in.
"""

from __future__ import annotations

from .base import (
    NODE_STATES,
    RUN_STATES,
    Engine,
    EngineError,
    Handle,
    LaunchSpec,
    LaunchUnknown,
    Node,
    NodeState,
    OutsideHold,
    RunState,
    Status,
)
from .local import DEFAULT_PATH, LocalEngine

__all__ = [
    "DEFAULT_PATH",
    "NODE_STATES",
    "RUN_STATES",
    "Engine",
    "EngineError",
    "Handle",
    "LaunchSpec",
    "LaunchUnknown",
    "LocalEngine",
    "Node",
    "NodeState",
    "OutsideHold",
    "RunState",
    "Status",
]
