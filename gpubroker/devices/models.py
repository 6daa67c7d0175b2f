"""Catalog of NVIDIA GPU models, for the simulated backend and for display.

Each entry carries the product name exactly as NVML reports it
(``nvmlDeviceGetName``, the "Name" column of ``nvidia-smi``) and the total
framebuffer memory in MiB as ``nvidia-smi`` / ``nvmlDeviceGetMemoryInfo().total``
shows it on recent data-center drivers (R535 and later).

Sources: NVIDIA product data sheets (H100, H200, A100, A30, L40S, L4, T4,
V100) for the memory size and MIG support, and published ``nvidia-smi``
output of those boards for the exact name and MiB figure. The MiB figure can
differ by a few hundred MiB between driver versions (older drivers report,
e.g., 32510 MiB for a V100 32GB and 81251 MiB for an A100 80GB), because the
driver reserves part of the framebuffer; the simulation only needs
realistic values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUModel:
    """One GPU product.

    Attributes:
        name: product name as NVML reports it, e.g. ``NVIDIA H100 80GB HBM3``.
        memory_total_mib: total framebuffer memory, MiB.
        mig_capable: whether the product supports Multi-Instance GPU
            (NVIDIA MIG user guide, "Supported GPUs": A30, A100, H100, H200).
        gpm_capable: whether NVML's GPU Performance Monitoring works on it
            (NVML API reference, "GPM Methods": Hopper or newer), so a MIG
            instance reports its own engine activity.
    """

    name: str
    memory_total_mib: int
    mig_capable: bool
    gpm_capable: bool = False


_CATALOG = (
    GPUModel("NVIDIA H100 80GB HBM3", 81559, mig_capable=True, gpm_capable=True),
    GPUModel("NVIDIA H100 NVL", 95830, mig_capable=True, gpm_capable=True),
    GPUModel("NVIDIA H200", 143771, mig_capable=True, gpm_capable=True),
    GPUModel("NVIDIA A100-SXM4-80GB", 81920, mig_capable=True),
    GPUModel("NVIDIA A100-SXM4-40GB", 40960, mig_capable=True),
    GPUModel("NVIDIA A100 80GB PCIe", 81920, mig_capable=True),
    GPUModel("NVIDIA A30", 24576, mig_capable=True),
    GPUModel("NVIDIA L40S", 46068, mig_capable=False),
    GPUModel("NVIDIA L4", 23034, mig_capable=False),
    GPUModel("Tesla T4", 15360, mig_capable=False),
    GPUModel("Tesla V100-SXM2-32GB", 32768, mig_capable=False),
)

#: known models by their exact NVML name
MODELS: dict[str, GPUModel] = {model.name: model for model in _CATALOG}

#: short names accepted in configuration, mapped to the NVML name
ALIASES: dict[str, str] = {
    "H100": "NVIDIA H100 80GB HBM3",
    "H100-80GB": "NVIDIA H100 80GB HBM3",
    "H100-NVL": "NVIDIA H100 NVL",
    "H200": "NVIDIA H200",
    "A100-80GB": "NVIDIA A100-SXM4-80GB",
    "A100-40GB": "NVIDIA A100-SXM4-40GB",
    "A100-PCIE-80GB": "NVIDIA A100 80GB PCIe",
    "A30": "NVIDIA A30",
    "L40S": "NVIDIA L40S",
    "L4": "NVIDIA L4",
    "T4": "Tesla T4",
    "V100": "Tesla V100-SXM2-32GB",
    "V100-32GB": "Tesla V100-SXM2-32GB",
}

_BY_FOLDED_NAME: dict[str, GPUModel] = {
    **{name.casefold(): model for name, model in MODELS.items()},
    **{alias.casefold(): MODELS[name] for alias, name in ALIASES.items()},
}


def lookup_model(name: str) -> GPUModel:
    """Return the model called ``name`` (NVML name or alias, case-insensitive).

    Raises:
        KeyError: ``name`` is neither a known NVML name nor an alias.
    """
    try:
        return _BY_FOLDED_NAME[" ".join(name.split()).casefold()]
    except KeyError:
        raise KeyError(name) from None


def known_model_names() -> list[str]:
    """Return every accepted name: the NVML names, then the aliases."""
    return [*MODELS, *ALIASES]
