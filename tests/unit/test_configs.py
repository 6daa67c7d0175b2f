"""The shipped hub configs load, and the spawner entry points resolve."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
from traitlets.config import PyFileConfigLoader

import gpubroker_spawner

CONFIGS = Path(__file__).resolve().parents[2] / "jupyterhub_config"


def load(name: str):
    return PyFileConfigLoader(name, path=str(CONFIGS)).load_config()


def test_spawner_entry_points_resolve() -> None:
    spawners = entry_points(group="jupyterhub.spawners")
    assert spawners["gpubroker-local"].load() is gpubroker_spawner.LocalGPUSpawner
    assert spawners["gpubroker-simple"].load() is gpubroker_spawner.SimpleLocalGPUSpawner


def test_demo_config_registers_the_broker_service(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPUBROKER_DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("GPUBROKER_DEMO_API_TOKEN", "t0ken")
    c = load("demo_config.py")
    assert c.JupyterHub.ip == "127.0.0.1" and c.JupyterHub.hub_ip == "127.0.0.1"
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert "--device-backend=fake" in services["gpubroker"]["command"]
    assert services["demo-admin"]["api_token"] == "t0ken"
    assert "custom:gpubroker:admin" in c.JupyterHub.custom_scopes
    assert c.JupyterHub.spawner_class == "gpubroker-simple"


def test_production_example_loads(monkeypatch) -> None:
    monkeypatch.setenv("GPUBROKER_API_TOKEN", "x")
    monkeypatch.setenv("CONFIGPROXY_AUTH_TOKEN", "y")
    c = load("jupyterhub_config.py")
    assert c.JupyterHub.spawner_class == "gpubroker-local"
    command = c.JupyterHub.services[0]["command"]
    assert "--device-backend=nvml" in command


def test_production_example_needs_its_secrets(monkeypatch) -> None:
    monkeypatch.delenv("GPUBROKER_API_TOKEN", raising=False)
    with pytest.raises(KeyError):
        load("jupyterhub_config.py")
