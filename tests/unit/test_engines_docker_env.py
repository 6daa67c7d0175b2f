"""DockerEngine's environment for a share (no Docker engine needed: the
container itself is tested in tests/integration/test_docker_runner.py)."""

from __future__ import annotations

import logging

import pytest

from gpubroker.enforce.caps import STARTUP_DIR, framework_env
from gpubroker.engines.base import LaunchSpec
from gpubroker.engines.docker import STARTUP_PATH, DockerEngine


def spec(env: dict[str, str]) -> LaunchSpec:
    return LaunchSpec(argv=("true",), env=env, cwd="/tmp", user="ann", lease_id=7)


def test_a_share_keeps_its_caps_and_loses_mps_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caps = framework_env(10240, 81559, context_mib=512)
    env = {
        **caps,
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps/GPU-1/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        "X": "1",
    }
    engine = DockerEngine()
    with caplog.at_level(logging.WARNING):
        got, hook = engine._share_env(spec(env))
    assert hook == STARTUP_DIR
    assert got["PYTHONPATH"] == STARTUP_PATH
    assert got["GPUBROKER_MEMORY_LIMIT_MIB"] == caps["GPUBROKER_MEMORY_LIMIT_MIB"]
    assert not [k for k in got if k.startswith("CUDA_MPS_")] and got["X"] == "1"
    assert "lease 7: MPS is not passed into containers; dropped CUDA_MPS_PINNED" in caplog.text


def test_a_user_pythonpath_is_kept_and_no_hook_is_mounted_without_caps() -> None:
    engine = DockerEngine()
    got, hook = engine._share_env(spec({"PYTHONPATH": "/home/ann/lib"}))
    assert (got, hook) == ({"PYTHONPATH": "/home/ann/lib"}, "")
    got, hook = engine._share_env(spec({"PYTHONPATH": f"{STARTUP_DIR}:/home/ann/lib"}))
    assert got["PYTHONPATH"] == f"{STARTUP_PATH}:/home/ann/lib" and hook == STARTUP_DIR
