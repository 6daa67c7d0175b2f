"""The shipped hub configs load, and the spawner entry points resolve."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml
from traitlets.config import PyFileConfigLoader

import gpubroker_spawner

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "jupyterhub_config"
DOCKER = REPO / "docker"


def load(name: str):
    return PyFileConfigLoader(name, path=str(CONFIGS)).load_config()


def test_spawner_entry_points_resolve() -> None:
    spawners = entry_points(group="jupyterhub.spawners")
    assert spawners["gpubroker-local"].load() is gpubroker_spawner.LocalGPUSpawner
    assert spawners["gpubroker-simple"].load() is gpubroker_spawner.SimpleLocalGPUSpawner
    assert spawners["gpubroker-docker"].load() is gpubroker_spawner.DockerGPUSpawner


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


def test_the_demo_asks_for_a_password_kept_in_its_state_dir(tmp_path, monkeypatch) -> None:
    """Any login got a server running as the demo's account (root, when
    root started it), for anyone who reached 127.0.0.1. Logins now need
    the demo's passwords, made at the first start and kept (0600)."""
    monkeypatch.setenv("GPUBROKER_DEMO_DIR", str(tmp_path))
    for var in ("GPUBROKER_DEMO_PASSWORD", "GPUBROKER_DEMO_ADMIN_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    c = load("demo_config.py")
    assert c.JupyterHub.authenticator_class == "shared-password"
    auth = c.SharedPasswordAuthenticator
    user, admin = auth.user_password, auth.admin_password
    assert len(user) >= 8 and len(admin) >= 32 and user != admin
    for name, value in (("demo-password", user), ("demo-admin-password", admin)):
        kept = tmp_path / name
        assert kept.read_text() == value and kept.stat().st_mode & 0o777 == 0o600
    shown = c.JupyterHub.template_vars["announcement_login"]  # on the login page
    assert str(tmp_path / "demo-password") in shown and user not in shown and admin not in shown
    again = load("demo_config.py").SharedPasswordAuthenticator
    assert (again.user_password, again.admin_password) == (user, admin)
    monkeypatch.setenv("GPUBROKER_DEMO_PASSWORD", "given-password")
    given = load("demo_config.py")
    assert given.SharedPasswordAuthenticator.user_password == "given-password"
    # the login page no longer points at the file, which holds an old password
    shown = given.JupyterHub.template_vars["announcement_login"]
    assert "${GPUBROKER_DEMO_PASSWORD}" in shown and str(tmp_path / "demo-password") not in shown


def test_production_example_loads(monkeypatch) -> None:
    monkeypatch.setenv("GPUBROKER_API_TOKEN", "x")
    monkeypatch.setenv("CONFIGPROXY_AUTH_TOKEN", "y")
    c = load("jupyterhub_config.py")
    assert c.JupyterHub.spawner_class == "gpubroker-local"
    command = c.JupyterHub.services[0]["command"]
    assert "--device-backend=nvml" in command


@pytest.mark.parametrize("name", ["jupyterhub_config.py", "demo_config.py"])
def test_the_stores_password_is_not_on_the_brokers_command_line(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The production example passed its PostgreSQL URL as --db-url: any
    local user (every notebook user, with LocalGPUSpawner) read the password
    with ps. It goes in the service's environment now, in both configs."""
    url = "postgresql+psycopg://gpubroker:S3cret@db.example/gpubroker"
    for var in ("GPUBROKER_API_TOKEN", "CONFIGPROXY_AUTH_TOKEN", "GPUBROKER_DEMO_API_TOKEN"):
        monkeypatch.setenv(var, "x")
    monkeypatch.setenv("GPUBROKER_DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("GPUBROKER_DB_URL", url)
    monkeypatch.setenv("GPUBROKER_DEMO_DB_URL", url)
    (broker,) = [s for s in load(name).JupyterHub.services if s["name"] == "gpubroker"]
    assert not [arg for arg in broker["command"] if "S3cret" in arg or "db-url" in arg]
    assert broker["environment"]["GPUBROKER_DB_URL"] == url


def test_production_example_stops_servers_before_the_broker(monkeypatch) -> None:
    """Loaded by the hub itself, the production example wraps the hub's
    cleanup so servers stop (and release their leases) before the managed
    broker service does (the order itself: test_demo_config)."""
    from jupyterhub.app import JupyterHub

    class Hub:
        async def cleanup(self) -> None:
            pass

    hub = Hub()
    original = hub.cleanup
    monkeypatch.setattr(JupyterHub, "initialized", classmethod(lambda cls: True))
    monkeypatch.setattr(JupyterHub, "instance", classmethod(lambda cls: hub))
    monkeypatch.setenv("GPUBROKER_API_TOKEN", "x")
    monkeypatch.setenv("CONFIGPROXY_AUTH_TOKEN", "y")
    load("jupyterhub_config.py")
    assert hub.cleanup != original
    assert hub.cleanup.__qualname__.endswith("cleanup_servers_first")


def test_production_example_needs_its_secrets(monkeypatch) -> None:
    monkeypatch.delenv("GPUBROKER_API_TOKEN", raising=False)
    with pytest.raises(KeyError):
        load("jupyterhub_config.py")


def test_the_docker_deployments_hub_config_loads(monkeypatch) -> None:
    for name in ("GPUBROKER_SERVICE_TOKEN", "CONFIGPROXY_AUTH_TOKEN", "JUPYTERHUB_USER_PASSWORD"):
        monkeypatch.setenv(name, "x")
    monkeypatch.delenv("JUPYTERHUB_ADMIN_PASSWORD", raising=False)
    monkeypatch.setenv("JUPYTERHUB_DB_URL", "postgresql+psycopg://gpubroker@postgres/jupyterhub")
    monkeypatch.setenv("JUPYTERHUB_ADMIN_USERS", "ann,bob")
    c = PyFileConfigLoader("jupyterhub_config.py", path=str(DOCKER / "hub")).load_config()
    assert c.JupyterHub.spawner_class == "gpubroker-docker"
    (service,) = c.JupyterHub.services
    assert service["url"] == "http://broker:10101" and "command" not in service
    assert c.DockerGPUSpawner.broker_url == "http://broker:10101/services/gpubroker/"
    assert c.DockerGPUSpawner.network_name == "gpubroker"
    admins = next(r for r in c.JupyterHub.load_roles if r["name"] == "gpubroker-admins")
    assert admins["users"] == ["ann", "bob"]
    # a first-try login, never an open door: no admin password set, none accepted
    assert c.JupyterHub.authenticator_class == "shared-password"
    assert c.SharedPasswordAuthenticator.user_password == "x"
    assert "admin_password" not in c.SharedPasswordAuthenticator
    assert c.JupyterHub.cleanup_servers is False
    # every profile is one the spawner accepts
    spawner = gpubroker_spawner.DockerGPUSpawner()
    spawner.gpu_profiles = c.DockerGPUSpawner.gpu_profiles


def test_the_compose_file_builds_the_images_of_docker_and_names_its_secrets() -> None:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "broker", "hub", "notebook"}
    for name in ("broker", "hub", "notebook"):
        build = services[name]["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).is_file()
    text = (DOCKER / "compose.yaml").read_text()
    example = (DOCKER / "env.example").read_text()
    secrets = ("POSTGRES_PASSWORD", "JUPYTERHUB_DB_PASSWORD", "GPUBROKER_SERVICE_TOKEN")
    for secret in (*secrets, "CONFIGPROXY_AUTH_TOKEN"):
        assert f"${{{secret}:?" in text and f"{secret}=" in example
    broker = services["broker"]
    assert broker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    ]
    # the share watchdog reads and ends host processes that NVML names
    assert broker["pid"] == "host" and "SYS_PTRACE" in broker["cap_add"]
    # no password on a command line (ps shows it to every local user)
    assert not any("POSTGRES_PASSWORD" in arg for arg in broker["command"])
    assert "${POSTGRES_PASSWORD}" in broker["environment"]["GPUBROKER_DB_URL"]
    # the database is on a network of its own, which users' servers do not join
    assert compose["networks"]["database"]["internal"] is True
    assert services["postgres"]["networks"] == ["database"]
