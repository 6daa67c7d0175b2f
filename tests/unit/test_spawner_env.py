"""The spawner's environment: the broker's variables always win."""

from __future__ import annotations

from types import SimpleNamespace

from jupyterhub.objects import Hub

from gpubroker_spawner import SimpleLocalGPUSpawner
from gpubroker_spawner.mixin import NO_GPU_ENV


def make_spawner(**kwargs) -> SimpleLocalGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann")
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    return SimpleLocalGPUSpawner(
        user=user, hub=hub, broker_url="http://127.0.0.1:10101/services/gpubroker/", **kwargs
    )


def test_broker_variables_override_configured_and_user_environment() -> None:
    spawner = make_spawner(
        environment={"CUDA_VISIBLE_DEVICES": "0,1,2", "NVIDIA_VISIBLE_DEVICES": "all", "X": "1"}
    )
    spawner._gpu_env = {"CUDA_VISIBLE_DEVICES": "GPU-a", "NVIDIA_VISIBLE_DEVICES": "GPU-a"}
    env = spawner.get_env()
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == "GPU-a"
    assert env["X"] == "1"
    assert env["GPUBROKER_URL"] == "http://127.0.0.1:10101/services/gpubroker/"


def test_without_a_lease_no_gpu_is_visible() -> None:
    spawner = make_spawner(environment={"CUDA_VISIBLE_DEVICES": "0"})
    env = spawner.get_env()
    for key, value in NO_GPU_ENV.items():
        assert env[key] == value


def test_lease_id_survives_in_the_spawner_state() -> None:
    spawner = make_spawner()
    spawner.gpu_lease_id = 7
    state = spawner.get_state()
    restored = make_spawner()
    restored.load_state(state)
    assert restored.gpu_lease_id == 7
    restored.clear_state()
    assert restored.gpu_lease_id is None


def test_start_timeout_leaves_room_for_the_queue() -> None:
    spawner = make_spawner(queue_timeout=600)
    assert spawner.start_timeout == 720


async def test_form_tells_why_the_last_lease_ended(monkeypatch) -> None:
    spawner = make_spawner()
    spawner.gpu_last_end = "culled: idle 62 min <GPU 0%>"

    class Inventory:  # the broker's answer to GET /devices, as the form reads it
        async def devices(self):
            return {"summary": {"request_limit": 2, "free": 2, "total": 2}, "devices": []}

        async def pools(self, user):
            return {"pools": [], "quota": {"user": user, "limit": None, "remaining": None}}

    monkeypatch.setattr(type(spawner), "broker", property(lambda self: Inventory()))
    page = await spawner._gpu_options_form()
    assert "Your previous server lost its GPUs: culled: idle 62 min &lt;GPU 0%&gt;" in page
    state = spawner.get_state()
    assert state["gpu_last_end"] == "culled: idle 62 min <GPU 0%>"


def test_a_shares_pythonpath_goes_first_and_the_servers_is_kept() -> None:
    spawner = make_spawner(environment={"PYTHONPATH": "/opt/lab:/srv/shared"})
    spawner._gpu_env = {"CUDA_VISIBLE_DEVICES": "GPU-a", "PYTHONPATH": "/broker/startup"}
    assert spawner.get_env()["PYTHONPATH"] == "/broker/startup:/opt/lab:/srv/shared"
