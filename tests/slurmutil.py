"""The two-node Slurm cluster of the tests: :mod:`gpubroker.engines.slurm_testbed`
(in the package, since ``make demo-slurm`` starts the same one)."""

from gpubroker.engines.slurm_testbed import (
    GPU_TYPE,
    GPUS_PER_NODE,
    NODES,
    SlurmCluster,
    start,
    why_not,
)

__all__ = ["GPUS_PER_NODE", "GPU_TYPE", "NODES", "SlurmCluster", "start", "why_not"]
