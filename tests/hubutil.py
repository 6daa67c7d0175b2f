"""Run the demo JupyterHub config (hub + proxy + broker service) on free
loopback ports, for tests and benchmarks, and stop it by PID.

This starts the real thing: ``jupyterhub -f jupyterhub_config/demo_config.py``
with configurable-http-proxy from npm and the broker as a managed service.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "jupyterhub_config" / "demo_config.py"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


class RunningHub:
    """A hub started from the demo config in ``workdir``.

    Attributes:
        url: public URL of the hub (through the proxy), ``http://127.0.0.1:PORT``.
        token: the ``demo-admin`` service token (hub admin + broker admin).
        broker: base URL of the broker API through the proxy.
    """

    def __init__(self, workdir: Path, **env: str) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.token = secrets.token_hex(16)
        #: the demo's login passwords (any user name; ``admin`` with its own)
        self.password = secrets.token_urlsafe(9)
        self.admin_password = secrets.token_urlsafe(24)
        self.url = f"http://127.0.0.1:{self.port}"
        self.broker = f"{self.url}/services/gpubroker/api/v1"
        self.broker_port = free_port()
        self.env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "GPUBROKER_DEMO_DIR": str(workdir),
            "GPUBROKER_DEMO_PORT": str(self.port),
            "GPUBROKER_DEMO_HUB_PORT": str(free_port()),
            "GPUBROKER_DEMO_PROXY_API_PORT": str(free_port()),
            "GPUBROKER_DEMO_BROKER_PORT": str(self.broker_port),
            "GPUBROKER_DEMO_API_TOKEN": self.token,
            "GPUBROKER_DEMO_PASSWORD": self.password,
            "GPUBROKER_DEMO_ADMIN_PASSWORD": self.admin_password,
            "GPUBROKER_DEMO_SHARING": "0",
            "GPUBROKER_DEMO_CHECK_STATE": "raise",
            "GPUBROKER_DEMO_LEDGER_INTERVAL": "0.5",
            **env,
        }
        #: the broker's store
        default_db = f"sqlite:///{workdir / 'gpubroker.sqlite'}"
        self.db_url = env.get("GPUBROKER_DEMO_DB_URL") or default_db
        self.proc: subprocess.Popen[bytes] | None = None
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {self.token}"

    # -- life cycle --------------------------------------------------------------

    def start(self, timeout: float = 60) -> RunningHub:
        """Start the hub and wait until the hub and the broker answer."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.workdir / "hub.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG), "--debug"],
            cwd=self.workdir,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()  # the proxy and the broker it may have started
                raise RuntimeError(f"hub exited with {self.proc.returncode}:\n{tail}")
            if self._ready():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"hub not ready in {timeout} s:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            hub = requests.get(f"{self.url}/hub/api/", timeout=2)
            broker = requests.get(f"{self.broker}/health", timeout=2)
        except requests.RequestException:
            return False
        return hub.status_code == 200 and broker.status_code == 200

    def broker_pid(self) -> int | None:
        """PID of the broker service process (found by its listening port)."""
        out = subprocess.run(
            ["ss", "-Hltnp", f"sport = :{self.broker_port}"], capture_output=True, text=True
        ).stdout
        for part in out.split("pid=")[1:]:
            return int(part.split(",")[0])
        return None

    def stop(self, timeout: float = 20, keep_servers: bool = False) -> None:
        """Stop the hub (which stops servers, proxy and broker); then make
        sure every process it started is gone, by PID. With ``keep_servers``
        single-user servers are left running (for a hub restart)."""
        pids = [_read_pid(self.workdir / "proxy.pid"), self.broker_pid()]
        self.kept_servers = self.server_pids()
        if not keep_servers:
            pids += self.kept_servers
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in pids:
            if pid and _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if hasattr(self, "log"):
            self.log.close()

    def kill_kept_servers(self) -> None:
        """SIGKILL the servers a ``stop(keep_servers=True)`` left running."""
        for pid in getattr(self, "kept_servers", []):
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the hub's log (hub, proxy and broker write there)."""
        try:
            return (self.workdir / "hub.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- hub API -------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """Call the hub API as demo-admin: ``api("GET", "/users")``."""
        return self.session.request(method, f"{self.url}/hub/api{path}", timeout=30, **kwargs)

    def broker_api(self, method: str, path: str, token: str | None = None, **kw: Any) -> Any:
        """Call the broker API through the proxy (as demo-admin unless ``token``)."""
        headers = {"Authorization": f"token {token or self.token}"}
        return requests.request(method, f"{self.broker}{path}", headers=headers, timeout=60, **kw)

    def counter(self, name: str, **labels: str) -> float:
        """The broker's Prometheus counter ``name`` (without ``_total``) now,
        summed over its series with ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        r = requests.get(
            f"{self.url}/services/gpubroker/metrics",
            headers={"Authorization": f"token {self.token}"},
            timeout=30,
        )
        r.raise_for_status()
        (family,) = [f for f in text_string_to_metric_families(r.text) if f.name == name]
        return sum(
            s.value
            for s in family.samples
            if s.name.endswith("_total") and labels.items() <= s.labels.items()
        )

    def wait_for_reconciliations(self, rounds: int, timeout: float = 60) -> None:
        """Wait until the broker has completed ``rounds`` more rounds of its
        reconciliation with the hub (its metric) than now."""
        start = self.counter("gpubroker_reconciliations", outcome="ok")
        deadline = time.monotonic() + timeout
        while self.counter("gpubroker_reconciliations", outcome="ok") < start + rounds:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {rounds} reconciliations in {timeout} s")
            time.sleep(0.2)

    def wait_for_job(self, job_id: int, token: str | None = None, timeout: float = 120) -> dict:
        """The job's view once it has ended (``TimeoutError`` if it has not)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.broker_api("GET", f"/jobs/{job_id}", token=token).json()
            if job["state"] not in ("queued", "running"):
                return dict(job)
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} has not ended in {timeout} s")

    def create_user(self, name: str) -> str:
        """Create ``name`` (if new) and return a token of theirs."""
        r = self.api("POST", f"/users/{name}")
        assert r.status_code in (201, 409), r.text
        r = self.api("POST", f"/users/{name}/tokens", json={"note": "test"})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def user_model(self, name: str) -> dict[str, Any]:
        r = self.api("GET", f"/users/{name}")
        r.raise_for_status()
        return dict(r.json())

    def server(self, name: str, server_name: str = "") -> dict[str, Any] | None:
        return self.user_model(name)["servers"].get(server_name)

    def wait_for_server(self, name: str, server_name: str = "", timeout: float = 90) -> dict:
        """Wait until the server is ready; return its model (with ``state``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.server(name, server_name)
            if model and model.get("ready"):
                return model
            if model is None or model.get("pending") not in ("spawn", None):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server {name}/{server_name} not ready:\n{self.log_tail()}")

    def wait_for_no_server(self, name: str, server_name: str = "", timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server(name, server_name) is None:
                return
            time.sleep(0.5)
        raise TimeoutError(f"server {name}/{server_name} still there")

    def server_pids(self) -> list[int]:
        """PIDs of every single-user server the hub knows (from spawner state)."""
        try:
            r = self.api("GET", "/users", params={"state": "active"})
        except requests.RequestException:
            return []
        if r.status_code != 200:
            return []
        pids = []
        for user in r.json():
            for server in (user.get("servers") or {}).values():
                pid = (server.get("state") or {}).get("pid")
                if pid:
                    pids.append(int(pid))
        return pids

    def leases(self, **params: str) -> list[dict[str, Any]]:
        r = self.broker_api("GET", "/leases", params=params)
        assert r.status_code == 200, r.text
        return list(r.json()["leases"])

    def progress(self, name: str, server_name: str = "", timeout: float = 10) -> list[dict]:
        """Read the spawn progress events stream for up to ``timeout`` seconds."""
        path = (
            f"/users/{name}/servers/{server_name}/progress"
            if server_name
            else (f"/users/{name}/server/progress")
        )
        events = []
        try:
            with self.session.get(f"{self.url}/hub/api{path}", stream=True, timeout=timeout) as r:
                deadline = time.monotonic() + timeout
                for line in r.iter_lines():
                    if line.startswith(b"data:"):
                        events.append(json.loads(line[5:]))
                    if time.monotonic() > deadline:
                        break
        except requests.RequestException:
            pass
        return events
