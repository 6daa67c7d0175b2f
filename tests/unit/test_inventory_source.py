"""What GET /devices says about where the devices come from (a new admin's
trial of the Slurm demo: on a Slurm cluster whose head node has no NVIDIA
driver, ``auto`` fell back to the fake backend and every page said the
cluster's GPUs were simulated)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from traitlets.config import Config

from gpubroker import devices
from gpubroker.core import Broker
from gpubroker.devices.base import DeviceBackendError
from gpubroker.devices.fake import FakeDeviceBackend
from gpubroker.store.db import make_engine, make_session_factory, upgrade


def _broker(tmp_path: Path, backend: FakeDeviceBackend, engine: str) -> Broker:
    url = f"sqlite:///{tmp_path / 'b.sqlite'}"
    upgrade(url)
    config = Config({"Broker": {"engine_kind": engine}})
    sessions = make_session_factory(make_engine(url))
    return Broker(session_factory=sessions, backend=backend, config=config)


def test_the_local_engine_names_its_device_backend(tmp_path: Path) -> None:
    broker = _broker(tmp_path, FakeDeviceBackend(inventory=["2 x H100"]), "local")
    assert broker.inventory_source() == {
        "kind": "fake",
        "simulated": True,
        "message": "SIMULATED GPUs: no NVIDIA driver is in use; these devices are fake",
    }


def _no_driver(kind: str) -> type:
    """The backend classes of a host without an NVIDIA driver."""

    class NoDriver:
        def __init__(self, **_: object) -> None:
            raise DeviceBackendError("NVML Shared Library Not Found")

    return NoDriver if kind == "nvml" else FakeDeviceBackend


def test_slurm_gpus_are_not_simulated_because_the_head_node_has_no_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "backend_class", _no_driver)
    fallback = devices.load_backend("auto", log=logging.getLogger("test"))
    assert fallback.simulated and fallback.fallback
    broker = _broker(tmp_path, fallback, "slurm")
    assert broker.inventory_source() == {
        "kind": "slurm",
        "simulated": False,
        "message": "Slurm: the GPUs (GRES) of the cluster's nodes",
    }


def test_a_slurm_demo_that_chose_the_fake_backend_says_simulated(tmp_path: Path) -> None:
    chosen = devices.load_backend("fake", log=logging.getLogger("test"))
    assert not chosen.fallback
    broker = _broker(tmp_path, chosen, "slurm")
    assert broker.inventory_source()["simulated"] is True
    assert broker.inventory_source()["kind"] == "slurm"
