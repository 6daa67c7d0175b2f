"""An async HTTP client of the broker's REST API.

Imported by the spawner (in the hub process) and later by notebook magics:
it depends on Tornado only, never on the store or NVML.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest


class BrokerClientError(Exception):
    """The broker answered with an error, or could not be reached.

    Attributes:
        status: the HTTP status (599 when the broker could not be reached).
        message: the broker's message (``{"message": …}`` of its error body).
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class BrokerClient:
    """Calls the broker at ``url`` with a JupyterHub ``token``.

    Args:
        url: the broker's base URL, e.g.
            ``http://127.0.0.1:10101/services/gpubroker/`` (default:
            ``$GPUBROKER_URL``).
        token: a JupyterHub token with access to the service (default:
            ``$GPUBROKER_API_TOKEN``, else ``$JUPYTERHUB_API_TOKEN``).
        timeout: seconds for a call without long-polling.
        tls: ``(keyfile, certfile, cafile)`` (PEM paths): the calls present
            that key and certificate and trust only the authorities in
            ``cafile``; the spawner passes the hub's own when the hub runs
            with ``internal_ssl``. ``None``: Tornado's default (the system's
            authorities, no client certificate). Given as files, not as an
            ``SSLContext``, so that it works with either of Tornado's HTTP
            clients (a hub with pycurl uses the curl one).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout: float = 20,
        tls: tuple[str, str, str] | None = None,
    ):
        self.url, self.token = api_base(url, token)
        self.timeout = timeout
        self.tls = tls

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        url = self.url + path + (f"?{urlencode(params)}" if params else "")
        request = HTTPRequest(
            url,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
            body=json.dumps(body) if body is not None else None,
            allow_nonstandard_methods=True,
            request_timeout=timeout or self.timeout,
            # a redirect is an error: Tornado would send the token on with it
            follow_redirects=False,
            **_tls_arguments(self.tls),
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
        except HTTPClientError as err:
            if 300 <= err.code < 400 and err.response is not None:
                where = err.response.headers.get("Location", "elsewhere")
                raise BrokerClientError(
                    err.code, f"{url} redirects to {where}: is the broker's URL right?"
                ) from err
            raise BrokerClientError(err.code, _message(err, url)) from err
        except OSError as err:
            raise BrokerClientError(599, f"broker unreachable at {self.url}: {err}") from err
        try:
            return json.loads(response.body or b"null")
        except ValueError:
            raise BrokerClientError(
                502, f"{url} did not answer JSON: is the broker's URL right?"
            ) from None

    async def health(self) -> dict[str, Any]:
        """``GET /health``."""
        return await self._call("GET", "/health")  # type: ignore[no-any-return]

    async def devices(self) -> dict[str, Any]:
        """``GET /devices``: ``{"backend", "devices", "summary"}``."""
        return await self._call("GET", "/devices")  # type: ignore[no-any-return]

    async def request_lease(
        self,
        user: str,
        server_name: str,
        gpus: int | None = None,
        dry_run: bool = False,
        **extra: Any,
    ) -> dict[str, Any]:
        """``POST /leases``; returns the lease (``granted`` or ``pending``).

        The request names exactly one kind of slot:

        - ``gpus=N``: N whole devices;
        - ``mig_profile="1g.10gb"`` (in ``extra``): one MIG instance of that profile;
        - ``memory_gib=X`` (in ``extra``), optionally ``count=N``: N time-sliced
          shares of X GiB each, on distinct devices.

        ``gpus`` is left out of the body when it is ``None``, so a MIG or share
        request goes through ``extra`` alone, e.g.
        ``request_lease("ann", "", mig_profile="1g.10gb")``. ``extra`` may also
        hold ``pool`` (a pool name), ``priority_class``, ``time_limit`` (s),
        ``group``, ``holder_kind``. With ``dry_run`` nothing is created: the
        answer says whether the request would be admitted.

        The lease view has ``id``, ``state``, ``env`` (the variables the server
        must get), ``devices``, ``queue`` (while pending) and, from brokers that
        share GPUs, ``kind`` (``"gpus"``, ``"mig"`` or ``"share"``), ``summary``
        (e.g. ``"1 x MIG 1g.10gb"``), ``guarantee`` (a sentence), ``weight``
        (device-units charged to quotas), ``mig_profile``, ``memory_gib``,
        ``count`` and ``pool``.

        Raises:
            BrokerClientError: 400 (bad input; the message names the field),
                403 (scope or quota), 409 (the server already has a lease).
        """
        body: dict[str, Any] = {"user": user, "server_name": server_name}
        if gpus is not None:
            body["gpus"] = gpus
        body.update(extra)
        params = {"dry_run": "true"} if dry_run else None
        return await self._call("POST", "/leases", body, params=params)  # type: ignore[no-any-return]

    async def pools(self, user: str | None = None) -> dict[str, Any]:
        """``GET /pools[?user=NAME]``: the device pools, what each could grant
        now, and the quota of ``user`` (default: the caller).

        Returns:
            ``{"pools": [...], "quota": {...}}``. Each pool:
            ``{"name", "mode" ("exclusive" | "mig" | "timeslice"), "purpose"
            ("interactive" | "batch"), "devices" (int), "models" ([str]),
            "free": {"gpus" (whole devices free now), "mig" ({profile: instances
            that could be created now}), "share_gib" (largest share grantable
            now on one device), "shares_total_gib"}}``. The quota, in GPU units
            (a MIG instance counts compute slices / 7, a share its memory over
            the device's): ``{"user", "limit" (None: none), "guaranteed",
            "held", "pending", "remaining" (None: no limit)}``.
        """
        params = {"user": user} if user else None
        return await self._call("GET", "/pools", params=params)  # type: ignore[no-any-return]

    async def set_server_url(
        self,
        lease_id: int,
        url: str,
        container_id: str | None = None,
        docker_engine: str | None = None,
        slurm_job: str | None = None,
    ) -> dict[str, Any]:
        """``PATCH /leases/{id}`` with ``server_url`` and, for a server in a
        Docker container, its ``container_id`` and the ``docker_engine``'s
        ID, or for a server run as a Slurm job, its ``slurm_job`` id
        (admins: the spawner)."""
        body: dict[str, Any] = {"server_url": url}
        if container_id:
            body["container_id"] = container_id
        if docker_engine:
            body["docker_engine"] = docker_engine
        if slurm_job:
            body["slurm_job"] = slurm_job
        return await self._call("PATCH", f"/leases/{lease_id}", body)  # type: ignore[no-any-return]

    async def notices(self, user: str | None = None) -> list[Any]:
        """``GET /notices``: cull warnings and culls, newest first."""
        data = await self._call("GET", "/notices", params={"user": user} if user else None)
        return data["notices"]  # type: ignore[no-any-return]

    async def queue(self) -> list[Any]:
        """``GET /queue``: pending requests in queue order."""
        data = await self._call("GET", "/queue")
        return data["queue"]  # type: ignore[no-any-return]

    async def get_lease(
        self, lease_id: int, wait: float = 0, version: int | None = None
    ) -> dict[str, Any]:
        """``GET /leases/{id}``; with ``wait`` seconds, long-poll until the
        lease's ``version`` differs from ``version`` (default: the current one)."""
        params: dict[str, Any] = {"wait": wait} if wait else {}
        if version is not None:
            params["version"] = version
        return await self._call(  # type: ignore[no-any-return]
            "GET", f"/leases/{lease_id}", params=params, timeout=self.timeout + wait
        )

    async def list_leases(self, user: str | None = None, state: str = "active") -> list[Any]:
        """``GET /leases``; returns the list of leases."""
        params = {"state": state, **({"user": user} if user else {})}
        data = await self._call("GET", "/leases", params=params)
        return data["leases"]  # type: ignore[no-any-return]

    async def lease_events(self, lease_id: int) -> list[Any]:
        """``GET /leases/{id}/events``: the lease's transition log, oldest first."""
        data = await self._call("GET", f"/leases/{lease_id}/events")
        return data["events"]  # type: ignore[no-any-return]

    async def release_lease(
        self, lease_id: int, reason: str = "", holder_stopped: bool = False
    ) -> dict[str, Any]:
        """``DELETE /leases/{id}`` (idempotent); returns the lease: released,
        or still ``granted`` while its server or job is stopped first.
        ``holder_stopped``: the caller (a broker admin: the spawner) has
        stopped the lease's server itself, so it is released at once."""
        body: dict[str, Any] = {"reason": reason} if reason else {}
        if holder_stopped:
            body["holder_stopped"] = True
        return await self._call("DELETE", f"/leases/{lease_id}", body)  # type: ignore[no-any-return]

    async def usage(
        self,
        start: str | None = None,
        end: str | None = None,
        by: str = "user",
        tz: str = "UTC",
        user: str | None = None,
    ) -> dict[str, Any]:
        """``GET /usage``: the usage report as JSON (your own rows; an admin's
        token: everyone's, or ``user``'s). ``start``/``end``: ``YYYY-MM-DD``
        or ISO 8601 (default: this month so far); ``by``: user, group, pool,
        model or day; ``tz``: an IANA time zone."""
        params = {"by": by, "tz": tz, "format": "json"}
        for name, value in (("from", start), ("to", end), ("user", user)):
            if value:
                params[name] = value
        return await self._call("GET", "/usage", params=params)  # type: ignore[no-any-return]


def api_base(url: str | None, token: str | None) -> tuple[str, str]:
    """The API's base URL (``url``, default ``$GPUBROKER_URL``, plus
    ``/api/v1``) and the token (``token``, default ``$GPUBROKER_API_TOKEN``,
    else ``$JUPYTERHUB_API_TOKEN``: in a server, its own)."""
    base = (url or os.environ.get("GPUBROKER_URL", "")).rstrip("/") + "/api/v1"
    secret = (
        token or os.environ.get("GPUBROKER_API_TOKEN") or os.environ.get("JUPYTERHUB_API_TOKEN", "")
    )
    return base, secret


def _message(err: HTTPClientError, url: str) -> str:
    body = err.response.body if err.response is not None else b""
    return error_text(body, err.code, url) if body else str(err)


def error_text(body: bytes, status: int, url: str) -> str:
    """The message of an error answer's ``body``: the broker's
    (``{"message": …}``); for an HTML page (the hub's or a proxy's, not the
    broker's) a sentence naming ``status`` and ``url``; else the text's
    first 500 characters."""
    try:
        return str(json.loads(body)["message"])
    except (ValueError, KeyError, TypeError):
        pass
    text = body.decode("utf-8", "replace").strip()
    if text.startswith("<"):
        return f"HTTP {status} from {url}: a web page, not the broker's answer"
    return text[:500] or f"HTTP {status} from {url}"


def _tls_arguments(tls: tuple[str, str, str] | None) -> dict[str, Any]:
    """``HTTPRequest`` arguments of a client certificate and a trust bundle
    (``BrokerClient.tls``); none for ``None``."""
    if tls is None:
        return {}
    keyfile, certfile, cafile = tls
    return {"client_key": keyfile, "client_cert": certfile, "ca_certs": cafile}
