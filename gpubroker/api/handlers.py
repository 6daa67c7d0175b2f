"""Tornado handlers of REST API v1. The OpenAPI document
(``gpubroker/api/openapi.yaml``, served at ``api/v1/openapi.json``) is the
reference for every shape; each handler's docstring names its route.

Each handler method declares who may call it (:func:`auth.needs`,
:func:`auth.public`); :meth:`APIHandler.prepare` authenticates the caller
without blocking the event loop and checks the declaration before the method
runs. A method without a declaration is refused (500).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import re
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import yaml
from jupyterhub.services.auth import HubAuthenticated, UserNotAllowed
from tornado import web

from .. import __version__
from ..core import Broker, utcnow
from ..engines.base import EngineError
from ..errors import BrokerError, Forbidden, NotFound, Unavailable
from ..store.models import HolderKind
from ..views import device_listing, queued_request
from . import auth, validation
from .longpoll import LongPollRegistry
from .redact import request_summary

#: longest long-poll a client may ask for, seconds
MAX_WAIT = 300.0
#: a Docker container id as the spawner reports it (full or short form)
CONTAINER_ID = re.compile(r"[0-9a-f]{12,64}")
#: a Docker engine's ID (``docker info``: a UUID, or the older key-derived form)
ENGINE_ID = re.compile(r"[A-Za-z0-9:-]{1,128}")
#: a Slurm job id (``SlurmGPUSpawner``)
SLURM_JOB = re.compile(r"[0-9]{1,20}")
#: what a spawner may record of its server
SERVER_RECORD = frozenset({"server_url", "container_id", "docker_engine", "slurm_job"})
#: longest ``server_url`` a lease may record, characters
MAX_URL = 2048
#: the query arguments ``GET /usage`` takes; ``token``: the hub's auth may
#: read a token there (``HubAuth.allow_token_in_url``)
USAGE_ARGUMENTS = frozenset({"from", "to", "by", "tz", "format", "user", "token"})
#: the query arguments ``GET /audit`` takes (``token``: the hub's auth may read it)
AUDIT_ARGUMENTS = frozenset({"user", "kind", "since", "until", "limit", "token"})
#: the handler methods of HTTP verbs that carry a declaration
HTTP_METHODS = ("get", "post", "put", "patch", "delete")


class APIHandler(HubAuthenticated, web.RequestHandler):  # type: ignore[misc]
    """Base: JSON in and out, errors as ``{"status": int, "message": str}``;
    :meth:`prepare` checks what the method declares it needs."""

    def decode_argument(self, value: bytes, name: str | None = None) -> str:
        """A path or query value as UTF-8; bytes that are not UTF-8 are kept
        as lone surrogates (``surrogateescape``), which every name and
        value check refuses with a 400 naming its field, after the token
        and scope checks (Tornado's own decoding answered 400 before them,
        naming no field)."""
        return value.decode("utf-8", "surrogateescape")

    #: the user the request acts for, as the method's declaration found it
    #: (:func:`auth.check`); ``None``: not an owner-or-admin method, or an
    #: admin acting for everyone
    owner: str | None = None
    _lease: dict[str, Any] | None = None

    @property
    def hub_auth(self) -> Any:
        """The HubAuth instance from the application settings."""
        return self.settings["hub_auth"]

    @hub_auth.setter
    def hub_auth(self, value: Any) -> None:
        raise AttributeError("hub_auth comes from the application settings")

    @property
    def broker(self) -> Broker:
        broker: Broker = self.settings["broker"]
        return broker

    def get_argument(self, name: str, default: Any = None, strip: bool = False) -> Any:  # type: ignore[override]
        """The query argument ``name`` as sent (``default`` when absent);
        bodies are JSON, so only the query is read. Unlike Tornado's, the
        value keeps its control characters and spaces (``strip``: strip
        spaces at both ends), so the checks see and show what was sent
        (:func:`validation.query_argument`).

        Raises:
            BadRequest: the argument is given more than once (which one
                would count is not for the server to guess:
                ``?dry_run=true&dry_run=false``), or is not UTF-8.
        """
        value = validation.query_argument(self.request.query_arguments, name)
        if value is None:
            return default
        return value.strip() if strip else value

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")

    def check_xsrf_cookie(self) -> None:
        """Token-authenticated JSON API: no XSRF cookie check."""

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = self._reason
        if isinstance(exc, web.HTTPError) and exc.log_message:
            message = exc.log_message % exc.args if exc.args else exc.log_message
        elif isinstance(exc, BrokerError):
            message = exc.message
        self.finish(json.dumps({"status": status_code, "message": message}))

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, BrokerError):
            self.log.info("%s -> %s: %s", self._request_summary(), e.status, e)
            self.send_error(e.status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def _request_summary(self) -> str:
        """``METHOD URI (IP)`` for Tornado's own log lines, secrets redacted."""
        return request_summary(self.request)

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        """Log an error of a request to the broker's log, the URI redacted
        (Tornado's own would log the whole request, ``?token=`` included)."""
        if isinstance(value, web.HTTPError):
            if value.log_message:
                message = value.log_message % value.args if value.args else value.log_message
                self.log.warning("%d %s: %s", value.status_code, self._request_summary(), message)
        else:
            self.log.error(
                "Uncaught exception %s", self._request_summary(), exc_info=(typ, value, tb)
            )

    @property
    def log(self) -> Any:
        return self.settings["log"]

    async def prepare(self) -> None:
        """The one check of who may call what: read the declaration of the
        method the request is for (:func:`auth.need_of`), authenticate the
        caller when it needs a token, and refuse what the declaration does
        not allow (:func:`auth.check`; its finders may answer 400/404 first).

        Raises:
            HTTPError: 401 without a token, 403 when the token lacks the
                service's access scope, 500 for a method without declaration.
            Forbidden: 403 naming the scope the caller lacks.
        """
        name = (self.request.method or "").lower()
        method = getattr(type(self), name, None)
        if method is None or method is getattr(web.RequestHandler, name, None):
            return  # not served here: Tornado answers 405
        need = auth.need_of(method)
        if need is None:
            raise web.HTTPError(500, f"{type(self).__name__}.{name} declares no scope")
        if not need.token:
            return
        model = await self._authenticate()
        self.owner = auth.check(need, model, self, *self.path_args)

    async def _authenticate(self) -> dict[str, Any]:
        """Identify the caller with the hub without blocking the event loop
        (``HubAuth.get_user(sync=False)``; its cache of
        ``GPUBrokerApp.token_cache_max_age`` seconds applies), then check the
        service's access scope as :class:`HubAuthenticated` does.

        Raises:
            HTTPError: 401 without a token, 403 when the token lacks the
                service's access scope.
        """
        token = self.hub_auth.get_token(self, in_cookie=False)
        if token:
            model = await self._token_owner(token)
            self._cached_hub_user = model  # what HubAuth.get_user would cache
            if model:
                self._token_authenticated = True
        else:
            model = await self.hub_auth.get_user(self, sync=False)
        if model:
            try:
                model = self.check_hub_user(model)
            except UserNotAllowed:
                model = None
        self._hub_auth_user_cache = model
        if model:
            self.current_user = model
            return dict(model)
        if self.hub_auth.get_token(self):
            raise web.HTTPError(
                403, "token lacks scope {}".format(", ".join(sorted(self.hub_auth.access_scopes)))
            )
        raise web.HTTPError(401, "authentication required: send 'Authorization: token …'")

    async def _token_owner(self, token: str) -> dict[str, Any] | None:
        """``HubAuth.user_for_token`` (async, cached), asked once for many:
        requests with the same token while the hub is being asked wait for
        that one answer instead of asking again (no burst of hub requests
        when a cached check expires under load)."""
        session_id = self.hub_auth.get_session_id(self)
        checks: dict[tuple[str, str], asyncio.Future[Any]] = self.application.settings.setdefault(
            "token_checks", {}
        )
        key = (token, session_id)
        check = checks.get(key)
        if check is None:
            check = asyncio.ensure_future(
                self.hub_auth.user_for_token(token, session_id=session_id, sync=False)
            )
            checks[key] = check
            check.add_done_callback(lambda _done: checks.pop(key, None))
        model: dict[str, Any] | None = await asyncio.shield(check)
        return model

    def get_current_user(self) -> dict[str, Any] | None:
        """The caller :meth:`prepare` authenticated, or ``None``; never asks
        the hub itself (HubAuthenticated's would, blocking the event loop)."""
        model: dict[str, Any] | None = getattr(self, "_hub_auth_user_cache", None)
        return model

    def caller(self) -> dict[str, Any]:
        """The authenticated caller's model (a copy).

        Raises:
            HTTPError: 401: the method's declaration needs no token, so
                :meth:`prepare` authenticated no one.
        """
        model = self.get_current_user()
        if not model:
            raise web.HTTPError(401, "authentication required: send 'Authorization: token …'")
        return dict(model)

    @property
    def me(self) -> str:
        """The caller's name (user or service)."""
        return auth.caller_name(self.caller())

    @property
    def actor(self) -> str:
        """Who the caller's changes are recorded as (:func:`auth.caller_actor`)."""
        return auth.caller_actor(self.caller())

    @property
    def own_user(self) -> str:
        """The user the caller is (:func:`auth.own_user`); ``""``, which no
        user is named, for a service."""
        return auth.own_user(self.caller()) or ""

    @property
    def admin(self) -> bool:
        """Whether the caller holds ``custom:gpubroker:admin`` (what admins
        see and how their releases go; who may call what is declared)."""
        return auth.is_admin(self.caller())

    def lease(self, raw_id: str) -> dict[str, Any]:
        """The lease of the path's ``{id}``, read once per request.

        Raises:
            NotFound: no such lease.
        """
        if self._lease is None:
            self._lease = self.broker.get_lease(self.lease_id(raw_id))
        return self._lease

    def lease_owner(self, raw_id: str) -> str:
        """The user of the path's lease (an ``unless_owner`` finder)."""
        return str(self.lease(raw_id)["user"])

    def lease_unseen(self, raw_id: str) -> str:
        """The 404 of another user's lease (an ``unseen`` message)."""
        return f"lease {self.lease_id(raw_id)}: no such lease"

    def named_user(self, *args: Any) -> str | None:
        """The ``?user=`` argument (an ``unless_owner`` finder)."""
        return self.name_arg("user")

    def lease_id(self, raw: str) -> int:
        """The ``{id}`` of the path as an int (:func:`validation.lease_id`).

        Raises:
            NotFound: not an id any lease can have (beyond 64 bits).
        """
        return validation.lease_id(raw)

    def name_arg(self, name: str) -> str | None:
        """A name query argument (``?user=``), checked, or ``None`` when absent.

        Raises:
            BadRequest: malformed (see :func:`validation.check_name`).
        """
        return validation.optional_name_arg(self.get_argument(name, None), name)


class NotFoundHandler(APIHandler):
    """Any path that is no route: a JSON 404 like every other error."""

    async def prepare(self) -> None:
        raise NotFound(f"path {validation.echo(self.request.path)}: no such endpoint")


class HealthHandler(APIHandler):
    """``GET /api/v1/health``: liveness, version and device backend (no auth)."""

    @auth.public
    def get(self) -> None:
        backend = self.broker.backend
        self.write_json(
            {
                "status": "ok",
                "version": __version__,
                "backend": backend.kind,
                "simulated": backend.simulated,
            }
        )


class DevicesHandler(APIHandler):
    """``GET /api/v1/devices``: the inventory, what each device is doing, a summary."""

    @auth.needs(auth.ACCESS_SCOPE)
    def get(self) -> None:
        self.write_json(device_listing(self.broker, self.admin, self.own_user, self.log))


class InventoryHandler(APIHandler):
    """``POST /api/v1/inventory``: admins: read the engine's inventory now
    (Slurm: ``sinfo``/``squeue``, off the event loop) rather than at the
    next ``Broker.inventory_interval``; answers the device listing."""

    @auth.needs(auth.ADMIN_SCOPE, action="reading the inventory again")
    async def post(self) -> None:
        read = self.settings.get("read_inventory")
        try:
            nodes = await (read() if read else asyncio.to_thread(self.broker.engine.nodes))
        except EngineError as err:
            message = f"inventory: the engine cannot say now (nothing changed): {err}"
            raise Unavailable(message) from err
        self.broker.sync_inventory(nodes)
        self.write_json(device_listing(self.broker, self.admin, self.own_user, self.log))


class LeasesHandler(APIHandler):
    """``GET /api/v1/leases[?user=&state=active|all]`` and ``POST /api/v1/leases``."""

    _request: tuple[dict[str, Any], bool] | None = None

    def _listed_user(self) -> str | None:
        """The ``?user=`` of a listing (``?state=`` checked too, first, as
        before); the calling user's own name counts as none named (a
        service owns no leases: it needs the admin scope)."""
        user = self.name_arg("user")
        state = self.get_argument("state", "active")
        if state not in ("active", "all"):
            raise validation.BadRequest(
                f"state: must be 'active' or 'all', got {validation.echo(state)}"
            )
        return None if user is not None and user == self.own_user else user

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=_listed_user)
    async def get(self) -> None:
        await self.broker.settled()  # every request answered so far has its verdict
        named = self.name_arg("user")
        active = self.get_argument("state", "active") == "active"
        leases = self.broker.list_leases(user=self.owner if named is None else named, active=active)
        self.write_json({"leases": leases})

    def _lease_request(self) -> tuple[dict[str, Any], bool]:
        """The request's body and ``?dry_run=``, checked once."""
        if self._request is None:
            body = validation.lease_request(validation.parse_json_object(self.request.body))
            dry_run = validation.flag(self.get_argument("dry_run", None), "dry_run")
            self._request = body, dry_run
        return self._request

    def _requested_user(self) -> str:
        return str(self._lease_request()[0]["user"])

    def _not_for_a_server(self) -> str | None:
        """A lease held by something else than a hub server needs the admin scope."""
        kind = self._lease_request()[0]["holder_kind"]
        return f"holder_kind: {kind!r}" if kind != HolderKind.server.value else None

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=_requested_user, admin_for=_not_for_a_server)
    async def post(self) -> None:
        body, dry_run = self._lease_request()
        groups = await self.settings["groups_of"](body["user"])
        lease = self.broker.request_lease(
            **body,
            groups=groups,
            dry_run=dry_run,
            admin=self.admin,
            actor=self.actor,
        )
        if dry_run:
            self.write_json(lease)
            return
        lease = await self.broker.after_pass(lease)
        self.set_header("Location", f"{self.request.path}/{lease['id']}")
        self.write_json(lease, status=201)


class LeaseHandler(APIHandler):
    """``GET /api/v1/leases/{id}[?wait=SECONDS&version=N]``, ``PATCH`` (admins:
    priority class of a pending request) and ``DELETE /api/v1/leases/{id}``."""

    _gone: asyncio.Event | None = None

    @auth.needs(
        auth.ADMIN_SCOPE, unless_owner=APIHandler.lease_owner, unseen=APIHandler.lease_unseen
    )
    async def get(self, raw_id: str) -> None:
        """The lease; with ``wait``, a long-poll, one of at most
        ``GPUBrokerApp.max_long_polls_per_user`` of this caller (one more
        answers the caller's oldest at once with the lease as it stands)."""
        model = self.caller()
        self.lease(raw_id)  # 404 before any wait
        await self.broker.settled()
        lease = self.broker.get_lease(self.lease_id(raw_id))
        wait = validation.wait_seconds(self.get_argument("wait", None), MAX_WAIT)
        version = validation.optional_int(self.get_argument("version", None), "version")
        if wait:
            registry: LongPollRegistry = self.settings["long_polls"]
            caller = f"{model.get('kind', 'user')}:{self.me}"
            if self.admin and lease["user"] != self.me:
                # the spawner (an admin) polls for every user: bound it per user
                caller += f" for {lease['user']}"
            self._gone = asyncio.Event()
            changed = await registry.wait(
                caller, self.broker.wait_for_change(lease["id"], wait, version), self._gone
            )
            if self._gone.is_set():
                return  # the client went away: nobody to answer
            lease = changed if changed is not None else self.broker.get_lease(lease["id"])
        self.write_json(lease)

    def on_connection_close(self) -> None:
        """The client went away: end its long-poll (frees its place in the limit)."""
        if self._gone is not None:
            self._gone.set()

    @auth.needs(auth.ADMIN_SCOPE, action="changing a lease")
    def patch(self, raw_id: str) -> None:
        """Admins: ``{"priority_class": NAME}`` moves a pending request;
        ``{"server_url": URL[, "container_id": ID]}`` records where its
        server listens and, in Docker, its container, or on Slurm its
        ``slurm_job`` (the spawner)."""
        body = validation.parse_json_object(self.request.body)
        lease_id = self.lease_id(raw_id)
        form = lease_patch_form(body)
        if form == SERVER_RECORD:
            url = body["server_url"]
            if not _server_url(url):
                raise validation.BadRequest(
                    f"server_url: must be an http(s) URL with a host, no spaces or control"
                    f" characters, of at most {MAX_URL} characters, got {validation.echo(url)}"
                )
            container = body.get("container_id")
            if container is not None and not (
                isinstance(container, str) and CONTAINER_ID.fullmatch(container)
            ):
                raise validation.BadRequest(
                    "container_id: must be a Docker container id (12 to 64 lower-case hex"
                    f" digits), got {validation.echo(container)}"
                )
            engine = body.get("docker_engine")
            if engine is not None and not (
                container is not None and isinstance(engine, str) and ENGINE_ID.fullmatch(engine)
            ):
                raise validation.BadRequest(
                    "docker_engine: must come with container_id and be a Docker engine ID"
                    f" (at most 128 letters, digits, ':' and '-'), got {validation.echo(engine)}"
                )
            job = body.get("slurm_job")
            if job is not None and not (
                isinstance(job, str) and SLURM_JOB.fullmatch(job) and container is None
            ):
                raise validation.BadRequest(
                    "slurm_job: must be a Slurm job id (1 to 20 digits), not with container_id,"
                    f" got {validation.echo(job)}"
                )
            self.write_json(
                self.broker.set_server_url(lease_id, url, container, engine, job, actor=self.actor)
            )
            return
        name = body.get("priority_class")
        if not isinstance(name, str):
            raise validation.BadRequest(
                "priority_class: must be a string (a class name), got " + validation.echo(name)
            )
        name = validation.check_name(name, "priority_class")
        self.write_json(self.broker.set_priority_class(lease_id, name, actor=self.actor))

    @auth.needs(
        auth.ADMIN_SCOPE, unless_owner=APIHandler.lease_owner, unseen=APIHandler.lease_unseen
    )
    async def delete(self, raw_id: str) -> None:
        lease = self.lease(raw_id)
        given, stopped = validation.release_body(validation.parse_json_object(self.request.body))
        reason = given or f"released by {self.me}"
        if stopped and not self.admin:
            raise Forbidden(
                f"holder_stopped: only a broker admin (the spawner, {auth.ADMIN_SCOPE}) "
                "may say the server is stopped"
            )
        # a (human) admin's release of another user's lease tells its holder,
        # as the panel's; a service's (the spawner's, a tool's) tells no one
        me = self.own_user
        tell = self.admin and not stopped and bool(me) and lease["user"] != me
        done = await self.broker.release_asked(
            lease["id"],
            reason,
            self.actor,
            server_running=self.settings["server_running"],
            holder_stopped=stopped,
            tell=tell,
        )
        self.write_json(done.lease)


def _server_url(url: object) -> bool:
    """Whether ``url`` is a server URL a lease may record: ``http(s)://``
    with a host (and a valid port, if any), no whitespace or control
    character, at most :data:`MAX_URL` characters."""
    if not isinstance(url, str) or len(url) > MAX_URL:
        return False
    if any(c <= " " or "\x7f" <= c <= "\x9f" for c in url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def lease_patch_form(body: dict[str, Any]) -> frozenset[str]:
    """Which of the two bodies of ``PATCH /leases/{id}`` ``body`` is: the
    fields of the ``server_url`` form (:data:`SERVER_RECORD`) when it has
    ``server_url``, else ``{"priority_class"}`` when it has that.

    Returns:
        the form's allowed fields.

    Raises:
        BadRequest: neither field (``body: must be ...``), or a field the
            form does not take: ``x: unknown field (allowed: priority_class)``.
    """
    if "server_url" in body:
        form = SERVER_RECORD
    elif "priority_class" in body:
        form = frozenset({"priority_class"})
    else:
        got = ", ".join(map(validation.echo, sorted(body))) or "no field"
        raise validation.BadRequest(
            'body: must be {"priority_class": NAME} or {"server_url": URL, ...}, got ' + got
        )
    validation.unknown_field(body, form)
    return form


class LeaseEventsHandler(APIHandler):
    """``GET /api/v1/leases/{id}/events``: the lease's transition log (its
    owner or an admin)."""

    @auth.needs(
        auth.ADMIN_SCOPE, unless_owner=APIHandler.lease_owner, unseen=APIHandler.lease_unseen
    )
    def get(self, raw_id: str) -> None:
        lease_id = self.lease(raw_id)["id"]
        self.write_json({"events": self.broker.lease_events(lease_id)})


class QueueHandler(APIHandler):
    """``GET /api/v1/queue``: pending requests in queue order, with position,
    reason, message and estimated start, open to every caller (like
    ``squeue``). With ``private_queue`` (the ``GPUBrokerApp`` option, on by
    default) a caller who is not a broker admin sees other users' requests
    without who asked (:func:`~gpubroker.views.queued_request`)."""

    @auth.needs(auth.ACCESS_SCOPE)
    async def get(self) -> None:
        await self.broker.settled()
        queue = self.broker.queue()
        if self.settings.get("private_queue", True) and not self.admin:
            me = self.own_user
            queue = [v if v["user"] == me else queued_request(v) for v in queue]
        self.write_json({"queue": queue})


class NoticesHandler(APIHandler):
    """``GET /api/v1/notices[?user=]``: cull warnings and culls, newest first
    (users see their own; admins all, or one user's)."""

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=APIHandler.named_user)
    def get(self) -> None:
        self.write_json({"notices": self.broker.notices(self.owner)})


class QuotasHandler(APIHandler):
    """``GET /api/v1/quotas``: quotas in force (admins)."""

    @auth.needs(auth.ADMIN_SCOPE)
    def get(self) -> None:
        self.write_json(self.broker.quotas())


class QuotaHandler(APIHandler):
    """``PUT``/``DELETE /api/v1/quotas/{kind}/{name}``: set or remove a stored
    quota of a ``user`` or ``group`` (admins); applies from the next pass."""

    @auth.needs(auth.ADMIN_SCOPE)
    async def put(self, kind: str, name: str) -> None:
        kind, name = validation.quota_path(kind, name)
        guaranteed, limit = validation.quota_body(validation.parse_json_object(self.request.body))
        self.broker.set_quota(kind, name, guaranteed, limit, actor=self.actor)
        answer = self.broker.quotas()
        if kind == "user" and await self.settings["has_user"](name) is False:
            # kept: users are often given quotas before their first login
            unknown = f"user {name}: the hub has no such user (yet); the quota applies once it has"
            answer["warnings"] = [unknown, *answer["warnings"]]
        self.write_json(answer)

    @auth.needs(auth.ADMIN_SCOPE)
    def delete(self, kind: str, name: str) -> None:
        kind, name = validation.quota_path(kind, name)
        self.broker.delete_quota(kind, name, actor=self.actor)
        self.write_json(self.broker.quotas())


class DeviceHandler(APIHandler):
    """``PATCH /api/v1/devices/{uuid}`` with ``{"drained": bool}``: drain a
    device (no new grants; running leases continue) or undrain it; or with
    ``{"mig_mode": bool}``: switch MIG mode once the device is empty (a drain
    operation: no new grants meanwhile). Admins only."""

    @auth.needs(auth.ADMIN_SCOPE)
    async def patch(self, uuid: str) -> None:
        uuid = validation.check_name(uuid, "uuid")
        body = validation.parse_json_object(self.request.body)
        if set(body) == {"mig_mode"} and isinstance(body["mig_mode"], bool):
            view = self.broker.request_mig_mode(uuid, body["mig_mode"], actor=self.actor)
            self.write_json(await self.broker.after_mig_mode(view))
            return
        if set(body) != {"drained"} or not isinstance(body["drained"], bool):
            raise validation.BadRequest(
                'drained/mig_mode: body must be {"drained": true|false} or {"mig_mode": true|false}'
            )
        self.write_json(self.broker.set_drained(uuid, body["drained"], actor=self.actor))


class PoolsHandler(APIHandler):
    """``GET /api/v1/pools[?user=NAME]``: every pool with what is free now, and
    the user's quota room (the caller's own unless an admin names another)."""

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=APIHandler.named_user)
    def get(self) -> None:
        self.write_json(self.broker.availability(self.owner or self.own_user))


class UsageHandler(APIHandler):
    """``GET /api/v1/usage?from=&to=&by=&tz=&format=[&user=]``: the usage
    report (:mod:`gpubroker.usage.report`); users get their own rows,
    admins everyone's (or one user's with ``?user=``). ``format``: ``json``
    (default), ``csv``, ``table`` or ``html``. Any other query argument
    (but ``token``, which the hub's auth may read) is a 400 naming it."""

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=APIHandler.named_user)
    async def get(self) -> None:
        from ..usage import query, render
        from ..usage.report import ReportError, parse_request
        from ..usage.workers import flush_before_report

        validation.known_arguments(self.request.query_arguments, USAGE_ARGUMENTS)
        arg = self.get_argument
        now = utcnow()
        try:
            request = parse_request(
                arg("from", None),
                arg("to", None),
                arg("by", None),
                arg("tz", None),
                arg("format", None) or "json",
                now,
            )
        except ReportError as err:
            raise validation.BadRequest(str(err)) from None
        problem = render.html_problem(request.format)
        if problem:
            raise validation.BadRequest(problem)
        ledger = self.settings.get("ledger")
        prices = ledger.price_per_gpu_hour if ledger is not None else {}
        factory = self.broker.session_factory

        def build() -> str:
            rows = query.build_report(factory, request, now, prices, user=self.owner)
            plots = (
                query.series(factory, request, now, self.owner)
                if request.format == "html"
                else None
            )
            return render.render(request, rows, plots)

        first = functools.partial(flush_before_report, ledger, self.log)
        text = await self.settings["reports"].run(self.me, build, first)
        if request.format == "json":
            self.set_header("Content-Type", "application/json; charset=utf-8")
        else:
            kinds = {"csv": "text/csv", "table": "text/plain", "html": "text/html"}
            self.set_header("Content-Type", f"{kinds[request.format]}; charset=utf-8")
        self.finish(text)


class AuditHandler(APIHandler):
    """``GET /api/v1/audit?user=&kind=&since=&until=&limit=``: the audit log,
    newest first (admins; :mod:`gpubroker.observe.audit`). Any other query
    argument (but ``token``) is a 400 naming it: a misspelt ``?usr=bob``
    must not answer with everyone's entries."""

    @auth.needs(auth.ADMIN_SCOPE, action="the audit log")
    async def get(self) -> None:
        from ..observe import audit
        from ..usage.report import ReportError, parse_time

        validation.known_arguments(self.request.query_arguments, AUDIT_ARGUMENTS)
        bounds = {}
        for name in ("since", "until"):
            raw = self.get_argument(name, None)
            try:
                bounds[name] = parse_time(name, raw, dt.timezone.utc) if raw else None
            except ReportError as err:
                raise validation.BadRequest(str(err)) from None
        try:
            audit.check_period(bounds["since"], bounds["until"])
        except ValueError as err:
            raise validation.BadRequest(str(err)) from None
        limit = validation.optional_int(
            self.get_argument("limit", None), "limit", 1, audit.MAX_LIMIT
        )
        kind = self.get_argument("kind", None)
        if kind is not None:
            kind = validation.check_name(kind, "kind")
        found = await audit.read(
            self.broker.session_factory,
            bounds["since"],
            bounds["until"],
            self.name_arg("user"),
            kind,
            limit or 500,
            on_behalf=(self.settings.get("service_name") or "gpubroker",),
        )
        self.write_json({"entries": found})


class MetricsHandler(APIHandler):
    """``GET {base_url}metrics``: Prometheus metrics in text format
    (:mod:`gpubroker.observe.metrics`), for callers holding the scope
    ``GPUBrokerApp.metrics_scope`` (or the broker admin scope)."""

    @auth.needs(auth.setting_scope("metrics_scope"), action="reading metrics")
    def get(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST

        metrics = self.settings.get("metrics")
        if metrics is None:
            raise NotFound("metrics: not enabled in this broker")
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(metrics.exposition())


class _JobHandler(APIHandler):
    """Base of the job handlers: the broker's job service."""

    @property
    def jobs(self) -> Any:
        service = self.settings.get("jobs")
        if service is None:
            raise NotFound("jobs: this broker runs no batch jobs")
        return service

    def job_id(self, raw: str) -> int:
        """The job id of the URL path (404 naming the job when it cannot be one)."""
        return validation.lease_id(raw, "job")

    def job_owner(self, raw_id: str) -> str:
        """The user of the path's job (an ``unless_owner`` finder)."""
        return str(self.jobs.owner(self.job_id(raw_id)))

    def job_unseen(self, raw_id: str) -> str:
        """The 404 of another user's job (an ``unseen`` message)."""
        return f"job {self.job_id(raw_id)}: no such job"


class JobsHandler(_JobHandler):
    """``POST /api/v1/jobs`` (submit a batch job: a notebook or a command on a
    lease of its own) and ``GET /api/v1/jobs[?user=]`` (newest first; users
    see their own, admins all)."""

    _body: dict[str, Any] | None = None
    #: the client closed the connection (its timeout) while the checks ran
    _client_gone = False

    def on_connection_close(self) -> None:
        """The client went away: a submission not made yet is not made."""
        self._client_gone = True

    def _job_body(self) -> dict[str, Any]:
        if self._body is None:
            data = validation.parse_json_object(self.request.body)
            if self.own_user:  # a user's job is hers; a service owns none
                data.setdefault("user", self.own_user)
            self._body = validation.job_request(data)
        return self._body

    def _requested_user(self) -> str:
        return str(self._job_body()["user"])

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=_requested_user)
    async def post(self) -> None:
        body = dict(self._job_body())
        user = body.pop("user")
        groups = await self.settings["groups_of"](user)
        # the checks as the user run a probe (up to seconds): off the event
        # loop, on the job service's own workers (the user's probe may be slow)
        checked = await self.jobs.check_off_loop(user, body)
        if self._client_gone:
            # its client gave up (the checks queued behind other users'
            # probes): queueing now would leave a job it believes was not
            # made, and its retry a second one
            self.log.warning("Job of %s not submitted: the client left during its checks", user)
            return
        job = self.jobs.submit(
            user, body, groups=groups, actor=self.actor, admin=self.admin, checked=checked
        )
        self.set_header("Location", f"{self.request.path}/{job['id']}")
        self.write_json(job, status=201)

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=APIHandler.named_user)
    def get(self) -> None:
        self.write_json({"jobs": self.jobs.list(self.owner)})


class JobHandler(_JobHandler):
    """``GET /api/v1/jobs/{id}`` and ``DELETE /api/v1/jobs/{id}`` (cancel:
    a queued job leaves the queue, a running one is stopped); the job's
    owner or an admin."""

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=_JobHandler.job_owner, unseen=_JobHandler.job_unseen)
    def get(self, raw_id: str) -> None:
        self.write_json(self.jobs.get(self.job_id(raw_id)))

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=_JobHandler.job_owner, unseen=_JobHandler.job_unseen)
    async def delete(self, raw_id: str) -> None:
        job_id = self.job_id(raw_id)
        reason = f"cancelled by {self.me}"
        self.write_json(await self.jobs.cancel(job_id, reason, actor=self.actor))


class JobLogsHandler(_JobHandler):
    """``GET /api/v1/jobs/{id}/logs?offset=&wait=``: the job's log from byte
    ``offset``; with ``wait`` seconds (at most 60), waits for more text
    while the job runs (follow mode: call again with the returned offset)."""

    @auth.needs(auth.ADMIN_SCOPE, unless_owner=_JobHandler.job_owner, unseen=_JobHandler.job_unseen)
    async def get(self, raw_id: str) -> None:
        job_id = self.job_id(raw_id)
        offset = validation.optional_int(self.get_argument("offset", None), "offset") or 0
        wait = validation.wait_seconds(self.get_argument("wait", None), 60.0)
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            logs = await self.jobs.logs_off_loop(job_id, offset)
            done = logs["state"] not in ("queued", "running")
            if logs["text"] or done or asyncio.get_running_loop().time() >= deadline:
                self.write_json(logs)
                return
            await asyncio.sleep(0.5)


class OpenAPIHandler(APIHandler):
    """``GET /api/v1/openapi.json``: the OpenAPI 3.1 document of this API (no auth)."""

    @auth.public
    def get(self) -> None:
        self.write_json(load_openapi())


def load_openapi() -> dict[str, Any]:
    """The packaged OpenAPI document as a dict."""
    text = resources.files("gpubroker.api").joinpath("openapi.yaml").read_text("utf-8")
    spec: dict[str, Any] = yaml.safe_load(text)
    return spec
