"""gpubroker's JupyterHub spawners.

Select one in ``jupyterhub_config.py`` by its entry point name::

    c.JupyterHub.spawner_class = "gpubroker-local"    # LocalProcessSpawner + GPUs
    c.JupyterHub.spawner_class = "gpubroker-simple"   # the same, without user switching
    c.JupyterHub.spawner_class = "gpubroker-docker"   # DockerSpawner + GPUs ([docker] extra)
    c.JupyterHub.spawner_class = "gpubroker-slurm"    # servers as Slurm jobs + GPUs

or mix :class:`GPUSpawnerMixin` into another spawner. This package depends
only on the broker's HTTP client (:mod:`gpubroker.client`); the Slurm
spawner also on the Slurm engine's command wrapper
(:mod:`gpubroker.engines.slurm`, no store and no NVML).
"""

from typing import Any

from .local import LocalGPUSpawner, SimpleLocalGPUSpawner
from .mixin import GPUSpawnerMixin

__all__ = ["DockerGPUSpawner", "GPUSpawnerMixin", "LocalGPUSpawner", "SimpleLocalGPUSpawner"]


def __getattr__(name: str) -> Any:
    """``DockerGPUSpawner`` is imported on first use (it needs dockerspawner)."""
    if name == "DockerGPUSpawner":
        from .docker import DockerGPUSpawner

        return DockerGPUSpawner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
