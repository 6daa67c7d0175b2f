"""A synchronous HTTP client of the broker's REST API, for kernels (the
notebook magics run inside an event loop, so they cannot wait on the async
client) and scripts. Standard library only.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, urlencode

from .client import BrokerClientError, api_base


class SyncBrokerClient:
    """Calls the broker at ``url`` with a JupyterHub ``token``.

    Args:
        url: the broker's base URL (default: ``$GPUBROKER_URL``, which the
            spawner sets in every server).
        token: default ``$GPUBROKER_API_TOKEN``, else ``$JUPYTERHUB_API_TOKEN``
            (the server's own token: the user's rights only).
        timeout: seconds per call (a long-poll adds its wait).
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 20):
        self.url, self.token = api_base(url, token)
        self.timeout = timeout

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One call; the decoded JSON answer.

        Raises:
            BrokerClientError: an error answer (its status and message), or
                599 when the broker cannot be reached.
        """
        url = self.url + path + (f"?{urlencode(params)}" if params else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"token {self.token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            raise BrokerClientError(err.code, _message(err.read())) from err
        except OSError as err:
            raise BrokerClientError(599, f"broker unreachable at {self.url}: {err}") from err

    def lease(self, lease_id: int) -> dict[str, Any]:
        """``GET /leases/{id}``."""
        return dict(self.call("GET", f"/leases/{int(lease_id)}"))

    def devices(self) -> list[Any]:
        """``GET /devices``: every device, what it does and its use now."""
        return list(self.call("GET", "/devices")["devices"])

    def pools(self) -> dict[str, Any]:
        """``GET /pools``: the pools with what is free, and the caller's quota room."""
        return dict(self.call("GET", "/pools"))

    def notices(self) -> list[Any]:
        """``GET /notices``: the caller's notices, newest first."""
        return list(self.call("GET", "/notices")["notices"])

    def submit_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /jobs``."""
        return dict(self.call("POST", "/jobs", body))

    def jobs(self) -> list[Any]:
        """``GET /jobs``: the caller's jobs, newest first."""
        return list(self.call("GET", "/jobs")["jobs"])

    def job(self, job_id: int) -> dict[str, Any]:
        """``GET /jobs/{id}``."""
        return dict(self.call("GET", f"/jobs/{int(job_id)}"))

    def job_logs(self, job_id: int, offset: int = 0, wait: float = 0) -> dict[str, Any]:
        """``GET /jobs/{id}/logs``: text from byte ``offset``; ``wait``
        seconds for more while the job runs."""
        params = {"offset": offset, "wait": wait}
        path = f"/jobs/{int(job_id)}/logs"
        return dict(self.call("GET", path, params=params, timeout=self.timeout + wait))

    def release_lease(self, lease_id: int, reason: str) -> dict[str, Any]:
        """``DELETE /leases/{id}`` with ``reason``: a running server's lease
        is released once the hub has stopped the server."""
        return dict(self.call("DELETE", f"/leases/{int(lease_id)}", {"reason": reason}))

    def cancel_job(self, job_id: int) -> dict[str, Any]:
        """``DELETE /jobs/{id}``."""
        return dict(self.call("DELETE", f"/jobs/{quote(str(int(job_id)))}"))


def job_body(what: dict[str, Any], **options: Any) -> dict[str, Any]:
    """A ``POST /jobs`` body: ``what`` (``notebook`` and ``params``, or
    ``command``) and the options that are set (``gpus``, ``mig_profile``,
    ``memory_gib``, ``time``, ``kernel``, ``pool``, ``priority_class``,
    ``retries``; those not given, ``None`` or ``""``, are left out: a
    ``0`` is sent, so the broker names its limit)."""
    given = {key: value for key, value in options.items() if value is not None and value != ""}
    return dict(what) | given


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]
