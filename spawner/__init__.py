"""gpubroker's JupyterHub spawners.

Select one in ``jupyterhub_config.py`` by its entry point name::

    c.JupyterHub.spawner_class = "gpubroker-local"    # LocalProcessSpawner + GPUs
    c.JupyterHub.spawner_class = "gpubroker-simple"   # the same, without user switching

or mix :class:`GPUSpawnerMixin` into another spawner. This package depends
only on the broker's HTTP client (:mod:`gpubroker.client`).
"""

from .local import LocalGPUSpawner, SimpleLocalGPUSpawner
from .mixin import GPUSpawnerMixin

__all__ = ["GPUSpawnerMixin", "LocalGPUSpawner", "SimpleLocalGPUSpawner"]
