"""The demo hub config: sharing pools derived from the inventory it has, the
state dir's record of the devices, and servers stopped before the broker."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import runpy
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

import gpubroker_spawner
from gpubroker.devices.fake import FakeDeviceBackend, fake_uuid
from gpubroker.devices.models import lookup_model
from gpubroker.pools import Pools

CONFIG = Path(__file__).resolve().parents[2] / "jupyterhub_config" / "demo_config.py"


@pytest.fixture
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run the demo config as JupyterHub would, in a fresh state dir; return
    its globals (``c``, the helpers) after it ran."""
    for name in list(os.environ):
        if name.startswith("GPUBROKER_DEMO_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GPUBROKER_DEMO_DIR", str(tmp_path))

    def run(**env: str) -> dict[str, Any]:
        for name, value in env.items():
            monkeypatch.setenv(f"GPUBROKER_DEMO_{name}", value)
        return runpy.run_path(str(CONFIG), init_globals={"get_config": Config})

    return run


def broker_args(c: Any) -> dict[str, str]:
    """The broker command's ``--Name=value`` options."""
    (service,) = [s for s in c.JupyterHub.services if s["name"] == "gpubroker"]
    return dict(arg[2:].split("=", 1) for arg in service["command"] if arg.startswith("--"))


def test_default_demo_keeps_its_eight_h100_layout(demo) -> None:
    args = broker_args(demo()["c"])
    assert json.loads(args["Pools.pools"]) == [
        {"name": "mig", "mode": "mig", "devices": ["*:4-5"]},
        {"name": "shared", "mode": "timeslice", "devices": ["*:6-7"], "reserve_gib": 2},
    ]
    assert args["FakeDeviceBackend.mig_enabled"] == "[4, 5]"
    c = demo()["c"]
    names = [p["display_name"] for p in c.SimpleLocalGPUSpawner.gpu_profiles]
    assert names == ["Full H100", "MIG 1g.10gb", "MIG 3g.40gb", "Shared GPU, 10 GiB", "No GPU"]
    assert c.DockerGPUSpawner.gpu_profiles == c.SimpleLocalGPUSpawner.gpu_profiles


def test_four_a100s_get_pools_that_exist(demo, tmp_path: Path) -> None:
    c = demo(INVENTORY="4 x A100-80GB")["c"]
    args = broker_args(c)
    pools = json.loads(args["Pools.pools"])
    assert [(p["name"], p["devices"]) for p in pools] == [("mig", ["*:2"]), ("shared", ["*:3"])]
    # the broker starts with them: the backend and the pools accept what the demo passes
    backend = FakeDeviceBackend(
        inventory=[args["FakeDeviceBackend.inventory"]],
        mig_enabled=json.loads(args["FakeDeviceBackend.mig_enabled"]),
        node_name="demo-node",
    )
    assert [d.mig_enabled for d in backend.devices()] == [False, False, True, False]
    Pools(pools=pools)
    profiles = c.SimpleLocalGPUSpawner.gpu_profiles
    assert [p["display_name"] for p in profiles] == [
        "Full A100",
        "MIG 1g.10gb",
        "MIG 3g.40gb",
        "Shared GPU, 10 GiB",
        "No GPU",
    ]
    assert "A100" in profiles[1]["description"] and profiles[1]["default"] is True


@pytest.mark.parametrize(
    ("inventory", "mig", "shared", "first_mig_profile"),
    [
        ("16 x H200", "*:8-11", "*:12-15", "1g.18gb"),
        ("3 x A30", "*:1", "*:2", "1g.6gb"),
        ("5 x A100-40GB", "*:3", "*:4", "1g.5gb"),
        ('["4 x H100", "4 x L40S"]', "*:2-3", "*:6-7", "1g.10gb"),
    ],
)
def test_pools_scale_with_the_inventory(demo, inventory, mig, shared, first_mig_profile) -> None:
    c = demo(INVENTORY=inventory)["c"]
    pools = {p["name"]: p["devices"] for p in json.loads(broker_args(c)["Pools.pools"])}
    assert pools == {"mig": [mig], "shared": [shared]}
    profiles = c.SimpleLocalGPUSpawner.gpu_profiles
    mig_profiles = [p["request"]["mig_profile"] for p in profiles if "mig_profile" in p["request"]]
    assert mig_profiles[0] == first_mig_profile
    gpubroker_spawner.SimpleLocalGPUSpawner().gpu_profiles = profiles  # the spawner accepts them


def test_too_few_devices_get_whole_gpus_and_say_so(demo, caplog) -> None:
    caplog.set_level(logging.INFO)
    c = demo(INVENTORY="2 x H100")["c"]
    assert "Pools.pools" not in broker_args(c)
    assert "FakeDeviceBackend.mig_enabled" not in broker_args(c)
    assert "gpu_profiles" not in c.SimpleLocalGPUSpawner
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("2 simulated GPUs are too few" in w for w in warnings), warnings


def test_gpus_without_mig_get_no_mig_pool(demo, caplog) -> None:
    caplog.set_level(logging.INFO)
    c = demo(INVENTORY="4 x L40S")["c"]
    args = broker_args(c)
    assert [p["name"] for p in json.loads(args["Pools.pools"])] == ["shared"]
    assert args["FakeDeviceBackend.mig_enabled"] == "[]"
    names = [p["display_name"] for p in c.SimpleLocalGPUSpawner.gpu_profiles]
    assert names == ["Full L40S", "Shared GPU, 10 GiB", "No GPU"]
    assert any("L40S cannot do MIG" in r.getMessage() for r in caplog.records)


def test_sharing_off_gives_whole_gpus_and_the_count_menu(demo) -> None:
    c = demo(INVENTORY="4 x A100-80GB", SHARING="0")["c"]
    assert "Pools.pools" not in broker_args(c)
    assert "gpu_profiles" not in c.SimpleLocalGPUSpawner


@pytest.mark.parametrize(
    "env",
    [{"SHARING": "maybe"}, {"INVENTORY": "4 x B300"}, {"INVENTORY": "[4, 5]"}],
)
def test_bad_settings_stop_the_hub_with_a_message(demo, caplog, env) -> None:
    with pytest.raises(SystemExit):
        demo(**env)
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "gpubroker demo: GPUBROKER_DEMO_" in error


def test_other_gpus_on_old_state_stop_the_hub_naming_the_folder(demo, caplog, tmp_path) -> None:
    demo()
    demo()  # the same set-up again: fine
    with pytest.raises(SystemExit):
        demo(INVENTORY="4 x A100-80GB")
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert f"rm -rf {tmp_path}" in error and "GPUBROKER_DEMO_DIR=" in error
    assert "GPUBROKER_DEMO_INVENTORY was '8 x NVIDIA H100 80GB HBM3'" in error
    assert "now '4 x NVIDIA A100-SXM4-80GB'" in error


def test_the_same_gpus_spelled_otherwise_are_the_same(demo) -> None:
    demo(INVENTORY="8 x H100")
    demo(INVENTORY="8x NVIDIA H100 80GB HBM3", SHARING="0")


def test_turning_sharing_back_on_turns_simulated_mig_mode_back_on(demo, tmp_path) -> None:
    """A run without sharing leaves MIG mode off in the fake GPUs' state (the
    broker turns it off outside MIG pools); the next run with sharing sets it
    to its pools again, except on a GPU that still holds instances."""
    demo(SHARING="0")
    h100 = lookup_model("H100").name
    held = {"enabled": False, "created": 1, "instances": [{"profile": "1g.10gb"}]}
    state = {
        "_mig": {
            fake_uuid("demo-node", 4, h100): {"enabled": False, "created": 1, "instances": []},
            fake_uuid("demo-node", 5, h100): held,
            fake_uuid("demo-node", 1, h100): {"enabled": True, "created": 0, "instances": []},
        },
        fake_uuid("demo-node", 0, h100): {"utilization_gpu": 5, "memory_used_mib": 1},
    }
    path = tmp_path / "fake-gpu-usage.json"
    path.write_text(json.dumps(state))
    demo(SHARING="1")
    after = json.loads(path.read_text())
    assert after["_mig"][fake_uuid("demo-node", 4, h100)]["enabled"] is True
    assert after["_mig"][fake_uuid("demo-node", 5, h100)] == held
    assert after["_mig"][fake_uuid("demo-node", 1, h100)]["enabled"] is False
    assert after[fake_uuid("demo-node", 0, h100)] == state[fake_uuid("demo-node", 0, h100)]
    path.write_text(json.dumps(state))
    demo(SHARING="1")  # no change of sharing: the state is left alone
    assert json.loads(path.read_text()) == state


class FakeSpawner:
    def __init__(self, active: bool) -> None:
        self.active = active


class FakeUser:
    def __init__(self, order: list[str], name: str, **servers: bool) -> None:
        self.order, self.name = order, name
        self.spawners = {server: FakeSpawner(active) for server, active in servers.items()}

    async def stop(self, server: str) -> None:
        await asyncio.sleep(0)
        self.order.append(f"stop {self.name}/{server}")
        if self.name == "broken":
            raise RuntimeError("cannot stop")


class FakeApp:
    def __init__(self, cleanup_servers: bool) -> None:
        self.cleanup_servers = cleanup_servers
        self.order: list[str] = []
        self.log = logging.getLogger("test-hub")
        self.users = {
            1: FakeUser(self.order, "ann", **{"": True, "gpu": True, "old": False}),
            2: FakeUser(self.order, "broken", **{"": True}),
        }

    async def cleanup(self) -> None:
        self.order.append("services, then (no longer running) servers, proxy")


def test_hub_shutdown_stops_servers_before_the_broker(demo) -> None:
    stop_servers_before_services = demo()["stop_servers_before_services"]
    app = FakeApp(cleanup_servers=True)
    stop_servers_before_services(app)
    asyncio.run(app.cleanup())
    assert sorted(app.order[:3]) == ["stop ann/", "stop ann/gpu", "stop broken/"]
    assert app.order[3:] == ["services, then (no longer running) servers, proxy"]


def test_hub_shutdown_without_cleanup_servers_leaves_servers_running(demo) -> None:
    stop_servers_before_services = demo()["stop_servers_before_services"]
    app = FakeApp(cleanup_servers=False)
    stop_servers_before_services(app)
    asyncio.run(app.cleanup())
    assert app.order == ["services, then (no longer running) servers, proxy"]
