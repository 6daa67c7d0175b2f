"""gpubroker: a GPU broker for JupyterHub.

Kept free of heavy imports (no ORM, no NVML) so the hub process (spawner) and
users' kernels (magics) can import :mod:`gpubroker.client` cheaply.
"""

__version__ = "0.1.0.dev0"
