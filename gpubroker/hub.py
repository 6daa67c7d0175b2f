"""A small client of the JupyterHub REST API, for what the broker reads.

The broker calls the hub with its own service token (``JUPYTERHUB_API_TOKEN``)
and needs the scopes ``list:users`` and ``read:servers`` (reconciliation),
``read:users`` (groups of a user), ``delete:servers`` (stopping the server
of an evicted lease) and ``tokens`` (a short-lived token of a user, limited to
one of their servers, for the culler's read of that server's kernels).

The broker's own token never leaves the broker: it is sent to the hub API
only. Whatever reaches a user's server is a token owned by that user with at
most ``access:servers!server=USER/NAME`` (see :meth:`HubClient.server_token`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Float, Unicode, default
from traitlets.config import LoggingConfigurable

PAGINATION = "application/jupyterhub-pagination+json"


class HubClient(LoggingConfigurable):
    """Reads users and servers from the hub API (paginated, JupyterHub 2+)."""

    api_url = Unicode(
        help="URL of the hub API, e.g. http://127.0.0.1:8081/hub/api "
        "(default: $JUPYTERHUB_API_URL, set by the hub for managed services)."
    ).tag(config=True)
    api_token = Unicode(
        help="Token for the hub API (default: $JUPYTERHUB_API_TOKEN).",
    ).tag(config=True)
    request_timeout = Float(10, help="Seconds before a hub API call fails.").tag(config=True)

    @default("api_url")
    def _default_api_url(self) -> str:
        return os.environ.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api")

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    async def _fetch(
        self,
        method: str,
        path: str,
        params: dict[str, Any] | None = None,
        body: dict[str, Any] | None = None,
    ) -> Any:
        url = f"{self.api_url.rstrip('/')}{path}"
        if params:
            url += f"?{urlencode(params)}"
        request = HTTPRequest(
            url,
            method=method,
            body=None if body is None else json.dumps(body),
            headers={"Authorization": f"token {self.api_token}", "Accept": PAGINATION},
            request_timeout=self.request_timeout,
            allow_nonstandard_methods=True,
        )
        response = await AsyncHTTPClient().fetch(request)
        return json.loads(response.body) if response.body else None

    async def _get(self, path: str, params: dict[str, Any]) -> dict[str, Any]:
        data: dict[str, Any] = await self._fetch("GET", path, params)
        return data

    async def ping(self) -> None:
        """Check that the hub API answers (``GET /``, no token needed).

        Raises:
            tornado.httpclient.HTTPClientError: the hub answered with an error.
            OSError: the hub cannot be reached.
        """
        request = HTTPRequest(self.api_url.rstrip("/") + "/", request_timeout=self.request_timeout)
        await AsyncHTTPClient().fetch(request)

    async def user_groups(self, user: str) -> list[str]:
        """The JupyterHub groups of ``user`` (``GET /users/{name}``).

        Raises:
            tornado.httpclient.HTTPClientError: e.g. 404 for an unknown user.
        """
        model = await self._fetch("GET", f"/users/{quote(user, safe='')}")
        return sorted(model.get("groups") or [])

    async def has_user(self, user: str) -> bool | None:
        """Whether the hub has a user named ``user`` (``GET /users/{name}``);
        ``None`` when it cannot tell now (unreachable, an error other than 404)."""
        try:
            await self._fetch("GET", f"/users/{quote(user, safe='')}")
        except HTTPClientError as err:
            return False if err.code == 404 else None
        except Exception:
            return None
        return True

    async def server_running(self, user: str, server_name: str) -> bool:
        """Whether the hub lists ``user``'s server ``server_name`` (ready or
        pending); ``True`` when the hub cannot tell (unreachable, an error):
        callers stop a server they are unsure of rather than leave it
        holding devices."""
        try:
            model = await self._fetch("GET", f"/users/{quote(user, safe='')}")
        except HTTPClientError as err:
            return err.code != 404
        except Exception:
            return True
        return server_name in (model.get("servers") or {})

    async def stop_server(
        self, user: str, server_name: str, started_by: dt.datetime | None = None
    ) -> bool:
        """Ask the hub to stop ``user``'s server ``server_name`` (needs
        ``delete:servers``).

        Args:
            started_by: aware UTC; when given, the server is stopped only if
                the hub lists it as started no later than this (``started``,
                which JupyterHub sets before its spawner runs): a server of
                that name started later is another one (the user started it
                again), and is left alone.

        Returns:
            whether the stop was asked for (``False``: not listed, or a newer
            server).

        Raises:
            tornado.httpclient.HTTPClientError: the hub answered with an error.
        """
        user_path = quote(user, safe="")
        if started_by is not None:
            model = await self._fetch("GET", f"/users/{user_path}")
            server = (model.get("servers") or {}).get(server_name)
            if not isinstance(server, dict):
                return False
            started = parse_time(server.get("started"))
            if started is not None and started > started_by:
                return False
        path = (
            f"/users/{user_path}/servers/{quote(server_name, safe='')}"
            if server_name
            else (f"/users/{user_path}/server")
        )
        await self._fetch("DELETE", path)
        return True

    @contextlib.asynccontextmanager
    async def server_token(
        self, user: str, server_name: str, purpose: str, expires_in: int = 60
    ) -> AsyncIterator[str]:
        """A token owned by ``user`` that can only reach their server
        ``server_name``, revoked when the block ends.

        The hub creates it (``POST /users/{user}/tokens`` with the single scope
        ``access:servers!server=USER/NAME``; the broker's role needs
        ``tokens``) and it expires after ``expires_in`` seconds even if the
        revocation fails. A user who records what reaches her server gets
        nothing she could not already do: this is the trust rule of
        DESIGN.md (principle 6), and why the broker's own token is never sent.

        Args:
            user: the server's owner.
            server_name: the server's name (``""``: the default server).
            purpose: a few words for the token's note in the hub (audit).
            expires_in: seconds the token lives at most.

        Yields:
            the token.

        Raises:
            tornado.httpclient.HTTPClientError: the hub refused (e.g. 403
                without the ``tokens`` scope, 404 for an unknown user).
            OSError: the hub cannot be reached.
        """
        user_path = quote(user, safe="")
        body = {
            "scopes": [f"access:servers!server={user}/{server_name}"],
            "expires_in": max(1, int(expires_in)),
            "note": f"gpubroker: {purpose}",
        }
        try:
            model = await self._fetch("POST", f"/users/{user_path}/tokens", body=body)
        except HTTPClientError as err:
            # the hub's token_expires_in_max_seconds is lower: ask for that much
            most = _max_lifetime(err)
            if most is None:
                raise
            body["expires_in"] = most
            model = await self._fetch("POST", f"/users/{user_path}/tokens", body=body)
        try:
            yield str(model["token"])
        finally:
            try:
                await self._fetch("DELETE", f"/users/{user_path}/tokens/{quote(model['id'])}")
            except Exception as err:
                self.log.warning(
                    "Could not revoke token %s of %s (it expires in %s s): %s",
                    model["id"],
                    user,
                    body["expires_in"],
                    err,
                )

    async def active_server_models(
        self, page_size: int = 200
    ) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[str, list[str]]]:
        """Every ready or pending server's model by (user, server name), and
        every such user's groups.

        Raises:
            tornado.httpclient.HTTPClientError: the hub answered with an error.
            OSError: the hub cannot be reached.
        """
        servers: dict[tuple[str, str], dict[str, Any]] = {}
        groups: dict[str, list[str]] = {}
        offset = 0
        while True:
            page = await self._get(
                "/users", {"state": "active", "offset": offset, "limit": page_size}
            )
            for user in page["items"]:
                groups[user["name"]] = sorted(user.get("groups") or [])
                for name, model in (user.get("servers") or {}).items():
                    servers[(user["name"], name)] = model
            following = (page.get("_pagination") or {}).get("next")
            if not following:
                return servers, groups
            offset = following["offset"]

    async def active_servers(self, page_size: int = 200) -> set[tuple[str, str]]:
        """(user, server name) of every server that is ready or pending
        (the default server's name is ``""``)."""
        servers, _ = await self.active_server_models(page_size)
        return set(servers)


def parse_time(value: Any) -> dt.datetime | None:
    """An ISO 8601 time as aware UTC; naive means UTC; ``None``, a value
    that is not a string (servers are read as untrusted), a bad string or
    one whose UTC time is out of range (``0001-01-01T00:00:00+01:00``) →
    ``None``."""
    if not value or not isinstance(value, str) or len(value) > 64:
        return None
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if when.tzinfo is None:
            return when.replace(tzinfo=dt.timezone.utc)
        return when.astimezone(dt.timezone.utc)
    except (ValueError, OverflowError):
        return None


def _max_lifetime(err: HTTPClientError) -> int | None:
    """The hub's longest token lifetime, from its 400 "expires_in: N must not
    exceed M" (``JupyterHub.token_expires_in_max_seconds``), else ``None``."""
    if err.code != 400 or err.response is None or not err.response.body:
        return None
    match = re.search(rb"must not exceed (\d{1,9})", err.response.body)
    return int(match.group(1)) if match and int(match.group(1)) > 0 else None
