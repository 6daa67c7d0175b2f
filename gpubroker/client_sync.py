"""A synchronous HTTP client of the broker's REST API, for kernels (the
notebook magics run inside an event loop, so they cannot wait on the async
client) and scripts. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, urlencode

from .client import BrokerClientError, api_base, error_text

#: seconds a submission may take beyond the client's timeout: the broker
#: checks a job as its user first, for up to 20 s (``PROBE_TIMEOUT`` of
#: :mod:`gpubroker.jobs.service`), possibly after another check of theirs
SUBMIT_EXTRA_TIMEOUT = 45.0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: urllib would send the token (an ordinary header)
    on to wherever the answer points, another host included; a redirect
    here means a wrong URL (the hub's login page, a missing slash)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


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

        Args:
            timeout: seconds for this call (default: the client's).

        Raises:
            BrokerClientError: an error answer (its status and message); a
                redirect (3xx: not followed, so the token goes nowhere
                else); 502 for an answer that is not JSON; 599 when no URL
                is set, the broker cannot be reached, or does not answer
                within the timeout.
        """
        if not self.url.startswith(("http://", "https://")):
            raise BrokerClientError(
                599,
                f"no broker URL (GPUBROKER_URL is {self.url.removesuffix('/api/v1')!r}): "
                "set it to the broker's address, e.g. "
                "http://127.0.0.1:8000/services/gpubroker/",
            )
        url = self.url + path + (f"?{urlencode(params)}" if params else "")
        data = json.dumps(body).encode() if body is not None else None
        try:
            request = urllib.request.Request(url, data=data, method=method)
        except ValueError as err:  # "http://[::1/": Invalid IPv6 URL
            raise BrokerClientError(
                599, f"broker unreachable at {self.url}: {err}: is GPUBROKER_URL a URL?"
            ) from None
        request.add_header("Authorization", f"token {self.token}")
        request.add_header("Content-Type", "application/json")
        seconds = timeout or self.timeout
        try:
            with _OPENER.open(request, timeout=seconds) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            with err:  # its connection
                if 300 <= err.code < 400:
                    where = err.headers.get("Location", "elsewhere")
                    message = f"{url} redirects to {where}: is GPUBROKER_URL the broker's URL?"
                else:
                    message = error_text(err.read(), err.code, url)
            raise BrokerClientError(err.code, message) from err
        except (OSError, http.client.HTTPException) as err:
            if isinstance(getattr(err, "reason", err), TimeoutError):
                raise BrokerClientError(
                    599, f"no answer from the broker at {self.url} within {seconds:g} s"
                ) from err
            raise BrokerClientError(599, f"broker unreachable at {self.url}: {err}") from err
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise BrokerClientError(
                502, f"{url} did not answer JSON: is GPUBROKER_URL the broker's URL?"
            ) from None

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
        """``POST /jobs``, waiting :data:`SUBMIT_EXTRA_TIMEOUT` seconds more
        than other calls (the broker checks the job first)."""
        seconds = self.timeout + SUBMIT_EXTRA_TIMEOUT
        return dict(self.call("POST", "/jobs", body, timeout=seconds))

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
