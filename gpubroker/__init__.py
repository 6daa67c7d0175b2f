"""gpubroker: a GPU broker for JupyterHub.

Kept free of heavy imports (no ORM, no NVML) so the hub process (spawner) and
users' kernels (magics) can import :mod:`gpubroker.client` cheaply.
"""

__version__ = "0.1.0.dev0"


def load_ipython_extension(ipython: object) -> None:
    """``%load_ext gpubroker``: register the notebook magics
    (:mod:`gpubroker.magics`; IPython is imported only then)."""
    from .magics import load_ipython_extension as load

    load(ipython)
