"""GPUSpawnerMixin: ask the broker for a lease before starting a server.

Flow: ``apply_user_options`` checks the options (``{"gpus": N}``, or
``{"profile": SLUG}`` when ``gpu_profiles`` are configured, whose
``spawner_override`` it then applies) and turns them into a lease request;
``start()`` requests the lease, waits in the queue (reporting position and
reason through ``progress()``), sets the device variables from the grant and
starts the server; ``stop()`` releases the lease. The lease id is kept in the
spawner's state so a hub restart keeps the lease. Every way out of a start
that fails (error, time-out, cancel) releases the lease.

While the broker restarts (unreachable, or answering 5xx), nothing blames the
user: the option checks that need the broker wait for ``start()``, which
retries for up to ``broker_wait_timeout`` (saying so in the spawn progress),
and a release is retried in the background for up to
``release_retry_timeout``. A server found dead by ``poll()`` releases its
lease at once and the next start asks for the same devices back
(``restart_of``).
"""

from __future__ import annotations

import asyncio
import html
import os
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from jupyterhub.utils import maybe_future
from tornado import web
from traitlets import Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from gpubroker.client import BrokerClient, BrokerClientError

from . import form, profiles
from .progress import ProgressFeed

try:
    from jupyterhub.spawner import SpawnException
except ImportError:  # pragma: no cover - JupyterHub < 6 has no SpawnException
    SpawnException = None


def spawn_error(message: str, reason: str) -> web.HTTPError:
    """A user-facing spawn failure: JupyterHub's SpawnException where it exists."""
    if SpawnException is not None:
        return SpawnException(message, reason=reason)  # type: ignore[no-any-return]
    return web.HTTPError(500, message)


#: what a server without a GPU gets: no device visible to CUDA or the container runtime
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}

#: the spawn progress message while the broker does not answer
BROKER_RETRY_MESSAGE = "GPU broker restarting, retrying\u2026"
#: seconds before the first retry of a broker call; doubled up to broker_retry_interval
FIRST_RETRY_DELAY = 0.25
#: release reason of a lease this server still had when it was started again
REPLACED_REASON = "replaced by a new start of the server"

#: seconds before the hub's ``start_timeout`` at which a wait in the queue
#: ends with the queue's own message (:meth:`GPUSpawnerMixin._queue_limit`)
START_MARGIN = 5.0
#: seconds a cancelled spawn spends releasing a lease it was not told of
UNANSWERED_TIMEOUT = 10.0
#: background release retries, held here so the event loop keeps them alive
_BACKGROUND_RELEASES: set[asyncio.Future[None]] = set()


def _granted_slots(lease: dict[str, Any]) -> list[str]:
    """Each slot of a granted lease as the spawn progress names it: the
    device's name and the UUID the server sees in ``CUDA_VISIBLE_DEVICES``
    (a MIG instance's ``MIG-`` UUID, then its GPU's), e.g. ``NVIDIA H100
    80GB HBM3 (GPU-…)`` or ``NVIDIA H100 80GB HBM3 (MIG-…, instance of
    GPU-…)``. A lease without ``slots`` (an older broker): its devices."""
    names = {d.get("uuid"): d.get("name") for d in lease.get("devices") or []}
    slots = lease.get("slots")
    if not slots:
        return [f"{d.get('name')} ({d.get('uuid')})" for d in lease.get("devices") or []]
    shown = []
    for slot in slots:
        device, seen = slot.get("device"), slot.get("uuid") or slot.get("device")
        where = f"{seen}, instance of {device}" if seen != device else str(seen)
        shown.append(f"{names.get(device)} ({where})")
    return shown


def broker_unavailable(err: BrokerClientError) -> bool:
    """Whether ``err`` says the broker is down or restarting (unreachable:
    599, or any 5xx answer) rather than refusing the request."""
    return err.status >= 500


async def _apply_gpu_options(spawner: GPUSpawnerMixin, user_options: dict[str, Any]) -> None:
    """Default ``Spawner.apply_user_options``: check the options, apply the
    chosen profile, and remember the lease request."""
    spawner.gpu_request = await spawner.check_user_options(user_options)


class GPUSpawnerMixin(LoggingConfigurable):
    """Mix into a JupyterHub Spawner (before it in the bases) to lease GPUs.

    Options are read from ``c.GPUSpawnerMixin``, ``c.Spawner`` or the
    concrete class (e.g. ``c.SimpleLocalGPUSpawner.broker_url``), the most
    specific winning.
    """

    broker_url = Unicode(
        help="""Base URL of the broker service as the hub reaches it (default:
        $GPUBROKER_URL, else http://127.0.0.1:10101/services/gpubroker/).
        It is also passed to servers as GPUBROKER_URL, unless
        broker_url_for_servers is set.""",
    ).tag(config=True)

    broker_url_for_servers = Unicode(
        "",
        help="""Base URL servers and their kernels reach the broker at (their
        GPUBROKER_URL: the notebook magics, `gpubroker jobs`); empty means
        broker_url. Set it when servers cannot use broker_url: on other
        hosts (Docker, Slurm) where 127.0.0.1 is not the broker's, or with
        JupyterHub's internal_ssl, where the broker accepts only the hub's
        and the proxy's certificates: then use the broker's URL through the
        hub's proxy, e.g. https://hub.example.org/services/gpubroker/.""",
    ).tag(config=True)

    broker_api_token = Unicode(
        help="""JupyterHub token the spawner calls the broker with: the broker
        service's own token, whose role holds custom:gpubroker:admin (default:
        $GPUBROKER_API_TOKEN).""",
    ).tag(config=True)

    max_gpus = Integer(
        0,
        help="""Most GPUs one server may ask for; 0 means the broker's request
        limit (the largest node's device count).""",
    ).tag(config=True)

    default_gpus = Integer(
        0, help="GPUs a server gets when user_options do not say (e.g. started without the form)."
    ).tag(config=True)

    queue_timeout = Float(
        3600,
        help="""Seconds a spawn may wait in the broker's queue before it fails
        (and the request is withdrawn). Spawner.start_timeout defaults to this
        plus 120 s, since the hub's own 60 s default is too short for a queue.""",
    ).tag(config=True)

    poll_wait = Float(
        30, help="Seconds of each long-poll to the broker while waiting in the queue."
    ).tag(config=True)

    priority_class = Unicode(
        "",
        help="""Priority class of this spawner's GPU requests (a class configured
        in the broker's SchedulingPolicy); empty: the broker's default
        (interactive).""",
    ).tag(config=True)

    time_limit = Float(
        None,
        allow_none=True,
        help="""Seconds a server may hold its GPUs, told to the broker for
        reservations and backfill (None: no limit).""",
    ).tag(config=True)

    broker_wait_timeout = Float(
        60,
        help="""Seconds ``start()`` waits for a broker that does not answer
        (unreachable, or a 5xx answer, e.g. while the hub restarts the broker
        service), retrying with backoff and telling the user "GPU broker
        restarting, retrying..." in the spawn progress. Past it the spawn
        fails, saying the broker is unavailable. While the broker is down the
        spawn options are checked locally only (types, not negative); the
        checks that need the broker (GPU limit, quota dry run) run in
        ``start()`` once it answers. Counted per outage, inside
        ``Spawner.start_timeout``.""",
    ).tag(config=True)

    release_retry_timeout = Float(
        300,
        help="""Seconds a lease release (stop, cancelled or failed spawn, dead
        server) that found the broker unavailable is retried in the
        background, with backoff, before the spawner gives up and leaves the
        lease to the broker's reconciliation with the hub.""",
    ).tag(config=True)

    broker_retry_interval = Float(
        1,
        help="""Longest pause, in seconds, between two tries of a broker call
        while the broker is unavailable; the pauses start at 0.25 s and
        double up to this. Keep it below the broker's reconcile interval, so
        a retried release reaches the broker before its reconciliation ends
        the lease for a reason of its own.""",
    ).tag(config=True)

    gpu_profiles = List(
        Dict(),
        help="""Profiles offered on the spawn form instead of the GPU count menu,
        in the style of KubeSpawner's ``profile_list``. Each is a dict with:

        - ``display_name`` (str, required): the choice's title;
        - ``slug`` (str): its ``user_options`` value, ``{"profile": SLUG}``
          (default: ``display_name`` in lower case, runs of other characters
          turned into ``-``);
        - ``description`` (str): a line under the title;
        - ``request`` (dict): the GPU part of the lease request: ``{}`` (no
          GPU), ``{"gpus": N}`` (whole devices), ``{"mig_profile": "1g.10gb"}``
          (one MIG instance) or ``{"memory_gib": X, "count": N}`` (N
          time-sliced shares of X GiB on distinct devices), each optionally
          with ``"pool": NAME``;
        - ``default`` (bool): preselected, and used when ``user_options`` name
          no profile (default: the first profile);
        - ``spawner_override`` (dict): spawner settings applied when the
          profile is chosen, e.g. ``{"mem_limit": "32G", "cmd": [...]}``; a
          callable value is called with the spawner, a dict value is merged
          into the current dict (``None`` removes a key);
        - ``guarantee`` (str): what the tier guarantees (default: a sentence
          for the request's kind).

        The list is checked when it is set; a mistake raises an error naming
        the item and the field. With profiles, ``user_options`` posted to the
        hub API must be ``{"profile": SLUG}`` (or ``{}``: see below);
        ``gpus``, ``max_gpus`` and ``default_gpus`` are not used. Empty (the
        default): the spawn form offers 0 to ``max_gpus`` whole GPUs.

        A spawn that names no options (an empty API body, or ``{}``) gets the
        options the hub saved at this server's last spawn that passed
        options, even ``{}`` (JupyterHub's own rule: after
        ``{"user_options": {}}`` the default, not an earlier choice); saved
        options this spawner no longer accepts (e.g. a profile since
        removed) fall back to the default, with a notice in the spawn
        progress and the log.""",
    ).tag(config=True)

    gpu_lease_id: int | None = None
    #: the checked lease request (``{}``: no GPU); None until options are checked
    gpu_request: dict[str, Any] | None = None
    #: slug of the profile chosen for this spawn (None without profiles)
    gpu_profile: str | None = None
    #: why the broker ended this server's last lease (preemption, reconcile), shown once
    gpu_last_end: str | None = None
    #: whether that end was the user's own release (e.g. ``%gpu_submit --release``):
    #: the lease's ``released`` event has cause ``release`` and the lease's user as actor
    gpu_last_end_given: bool = False
    #: lease of this server's previous run when that run died (found by poll());
    #: the next start asks for its devices back (``restart_of``); a stop clears it
    gpu_restart_of: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: UUIDs of the devices the current lease was granted (``[]`` without one)
        self.gpu_devices: list[str] = []
        #: the values the applied profile's spawner_override replaced
        self._gpu_saved_settings: dict[str, Any] = {}
        #: the option checks that need the broker were put off to start()
        self._gpu_checks_deferred = False
        #: stop() runs (its poll() of a dead server is no restart)
        self._gpu_stopping = False
        #: when the current broker outage stops being waited for (monotonic s), or None
        self._broker_wait_until: float | None = None
        #: releases retried in the background: lease id -> (task, reason)
        self._pending_releases: dict[int, tuple[asyncio.Future[None], str]] = {}
        self._reset_progress()

    @validate("gpu_profiles")
    def _validate_gpu_profiles(self, proposal: Any) -> list[dict[str, Any]]:
        try:
            return profiles.check_profiles(list(proposal["value"]), self._may_override)
        except ValueError as err:
            raise TraitError(str(err)) from None

    def _may_override(self, name: str) -> bool:
        """Whether a profile's ``spawner_override`` may set ``name``: a
        configurable setting of this spawner, other than the profiles."""
        return (
            name != "gpu_profiles"
            and self.has_trait(name)
            and bool(self.trait_metadata(name, "config"))
        )

    def _reset_progress(self) -> None:
        #: the lease's part of the spawn progress (queue, grant)
        self._gpu_feed = ProgressFeed()
        self._gpu_env: dict[str, str] | None = None

    @default("broker_url")
    def _default_broker_url(self) -> str:
        return os.environ.get("GPUBROKER_URL", "http://127.0.0.1:10101/services/gpubroker/")

    @default("broker_api_token")
    def _default_broker_api_token(self) -> str:
        return os.environ.get("GPUBROKER_API_TOKEN", "")

    @default("start_timeout")
    def _default_start_timeout(self) -> int:
        return int(self.queue_timeout) + 120

    @default("options_form")
    def _default_options_form(self) -> Any:
        return GPUSpawnerMixin._gpu_options_form

    @default("apply_user_options")
    def _default_apply_user_options(self) -> Any:
        return _apply_gpu_options

    # -- the broker ----------------------------------------------------------------

    @property
    def broker(self) -> BrokerClient:
        """A client of the broker with the spawner's token (and, with the
        hub's ``internal_ssl``, the hub's certificate: :meth:`_broker_tls`)."""
        return BrokerClient(self.broker_url, self.broker_api_token, tls=self._broker_tls())

    def _broker_tls(self) -> tuple[str, str, str] | None:
        """The TLS files of calls to an ``https`` broker_url when the hub
        runs with ``internal_ssl``: the hub's own key, certificate and trust
        bundle, ``(keyfile, certfile, cafile)`` (the broker asks every
        client for a certificate the hub's authorities signed:
        :mod:`gpubroker.hub_tls`). ``None`` otherwise (Tornado's default:
        the system's authorities)."""
        hub = getattr(self, "hub", None)
        if not getattr(self, "internal_ssl", False) or hub is None:
            return None
        if not self.broker_url.startswith("https:") or not hub.certfile:
            return None
        return (hub.keyfile, hub.certfile, hub.cafile)

    async def gpu_limit(self) -> int:
        """The most GPUs this server may ask for now (broker limit, ``max_gpus``)."""
        devices = await self.broker.devices()
        limit = int(devices["summary"]["request_limit"])
        return min(limit, self.max_gpus) if self.max_gpus else limit

    async def _gpu_options_form(self) -> str:
        """The spawn form: profiles or GPU counts, with the user's quota room.

        The user's last choice (``self.user_options``: the hub's saved
        options, also after the hub refused them, e.g. 403 over quota) is
        preselected where it is still allowed.
        """
        last = self.user_options or {}
        try:
            if self.gpu_profiles:
                pools = await self.broker.pools(self.user.name)
            devices = await self.broker.devices()
        except BrokerClientError as err:
            self.log.error("Cannot reach the GPU broker for the spawn form: %s", err)
            return (
                '<p class="text-danger">The GPU broker is unavailable; GPUs cannot be chosen.</p>'
            )
        if self.gpu_profiles:
            page = form.render_profiles(self.gpu_profiles, pools, devices, last.get("profile"))
        else:
            try:
                quota = (await self.broker.pools(self.user.name)).get("quota")
            except BrokerClientError as err:
                self.log.warning("No GPU quota for the spawn form of %s: %s", self._log_name, err)
                quota = None
            limit = int(devices["summary"]["request_limit"])
            limit = min(limit, self.max_gpus) if self.max_gpus else limit
            page = form.render_form(limit, devices, self.default_gpus, quota, last.get("gpus"))
        if self.gpu_last_end:
            note = html.escape(self._last_end_note())
            level = "info" if self.gpu_last_end_given else "warning"
            page = f'<p class="alert alert-{level}">{note}</p>' + page
        return page

    def _last_end_note(self) -> str:
        """How the spawn form and progress tell why the last lease ended:
        given up by the user's own release, or lost (cull, preemption, an
        admin's release, reconciliation)."""
        if self.gpu_last_end_given:
            return f"Your previous server gave up its GPUs at your request: {self.gpu_last_end}"
        return f"Your previous server lost its GPUs: {self.gpu_last_end}"

    def options_from_form(self, formdata: dict[str, list[str]]) -> dict[str, Any]:
        """Form data → ``{"gpus": N}``, or ``{"profile": SLUG}`` with
        ``gpu_profiles`` (checked later, like API-posted options)."""
        if self.gpu_profiles:
            return form.profile_options_from_form(formdata)
        return form.options_from_form(formdata)

    async def check_user_options(self, user_options: dict[str, Any] | None) -> dict[str, Any]:
        """Validate ``user_options`` and return the GPU part of the lease request.

        Without profiles, ``{"gpus": N}`` becomes ``{"gpus": N}`` (``{}`` for
        none); ``gpus`` absent or ``None`` means ``default_gpus``. With
        ``gpu_profiles``, ``{"profile": SLUG}`` (or ``{}``: the default
        profile) becomes that profile's ``request``, and the profile's
        ``spawner_override`` is applied to this spawner (undoing the overrides
        of a profile applied before). A request for a GPU is then tried on the
        broker as a dry run, so a refusal (e.g. quota) is the hub's answer.

        Options the hub reused from its database (the spawn named none, see
        :meth:`_options_are_saved`) that fail the checks here, or that the
        broker's dry run refuses (4xx: a quota, a MIG profile no pool offers
        any more), fall back to the defaults, with a notice in the progress
        and the log, and the saved options are replaced by ``{}``.

        When the broker is unavailable (unreachable or 5xx), only the local
        checks run (types, not negative); the GPU limit and the dry run are
        put off to :meth:`start`, which waits for the broker.

        Returns:
            ``{}`` (no GPU), ``{"gpus": N}``, ``{"mig_profile": P}`` or
            ``{"memory_gib": X[, "count": N]}``, maybe with ``"pool"``.

        Raises:
            tornado.web.HTTPError: 400 naming the field (and the limit or the
                choices); the broker's 400/403 for the dry run; 502 when the
                broker refuses the spawner's own call for the GPU limit.
        """
        options = dict(user_options or {})
        try:
            return await self._admitted(options)
        except form.OptionsError as err:
            if not options or not self._options_are_saved():
                raise web.HTTPError(400, str(err)) from None
            refused = str(err)
        except web.HTTPError as err:
            if not options or not self._options_are_saved() or err.status_code >= 500:
                raise
            refused = err.log_message or str(err)
        try:
            request = await self._admitted({})
        except form.OptionsError as again:
            raise web.HTTPError(400, str(again)) from None
        self._saved_options_refused(options, refused)
        return request

    async def _admitted(self, options: dict[str, Any]) -> dict[str, Any]:
        """The request ``options`` stand for, checked (:meth:`_checked_request`)
        and tried on the broker as a dry run (put off when the broker is
        unavailable).

        Raises:
            form.OptionsError: the options are malformed or out of range.
            tornado.web.HTTPError: as :meth:`_checked_request`, or the
                broker's 4xx refusal of the dry run (the profile is undone).
        """
        self._gpu_checks_deferred = False
        request = await self._checked_request(options)
        if request and not self._gpu_checks_deferred:
            try:
                await self._admission(request)
            except BrokerClientError as err:
                self._defer_broker_checks(err)
            except web.HTTPError:
                self._undo_gpu_profile()
                raise
        return request

    async def _checked_request(self, options: dict[str, Any]) -> dict[str, Any]:
        """The request ``options`` stand for, checked without the dry run.

        Raises:
            form.OptionsError: the options are malformed or out of range.
            tornado.web.HTTPError: a profile's override was refused (400); the
                broker refused the GPU-limit call (502).
        """
        if self.gpu_profiles:
            profile = form.select_profile(self.gpu_profiles, options)
            await self.apply_gpu_profile(profile)
            return dict(profile["request"])
        limit: int | None = 0
        gpus = form.requested_gpus(options, self.default_gpus)
        if not (type(gpus) is int and gpus == 0):
            # any other value needs the real limit: for the grant, or for the
            # error that names it
            try:
                limit = await self.gpu_limit()
            except BrokerClientError as err:
                if not broker_unavailable(err):
                    raise web.HTTPError(
                        502, f"The GPU broker refused the spawner's call: {err}"
                    ) from None
                self._defer_broker_checks(err)
                limit = None
        count = form.check_gpu_options(options, limit, self.default_gpus)
        return {"gpus": count} if count else {}

    def _defer_broker_checks(self, err: BrokerClientError) -> None:
        if not self._gpu_checks_deferred:
            self.log.warning(
                "%s: GPU broker unavailable while checking the spawn options (%s); "
                "checked locally, the broker's checks wait for the start",
                self._log_name,
                err,
            )
        self._gpu_checks_deferred = True

    def _options_are_saved(self) -> bool:
        """Whether this spawn's ``user_options`` are the hub's saved ones.

        JupyterHub 5/6 reuses the options of the last spawn that passed
        options (``{}`` included) when a spawn names none: ``User.spawn`` (jupyterhub/user.py) takes
        ``spawner.orm_spawner.user_options`` when it is called with
        ``options=None``, and saves the options otherwise (before they are
        checked, so refused ones are saved too). ``options=None`` comes from
        the REST API (``UserServerAPIHandler.get_server_json_body`` in
        jupyterhub/apihandlers/users.py) for an empty body, ``{}``, or
        ``{"user_options": null}``, and from ``GET /hub/spawn`` of a spawner
        without a form. The request that started this spawn
        (``self.handler``) says which it was.

        Returns:
            True for such a spawn; False when options were posted (form,
            query, API body) or the spawn's request is unknown.
        """
        handler = getattr(self, "handler", None)
        get_body = getattr(handler, "get_server_json_body", None)
        if get_body is not None:
            try:
                return get_body().get("user_options") is None
            except Exception:  # a malformed body was refused before the spawn
                return False
        request = getattr(handler, "request", None)
        if request is None:
            return False
        query = set(getattr(request, "query_arguments", {}) or {}) - {"next", "display_name"}
        return request.method == "GET" and not query

    def _saved_options_refused(self, options: dict[str, Any], err: str) -> None:
        """Tell the user (progress) and the admin (log) that saved options
        fell back to the defaults (``err``: why they were refused), and
        replace the saved options by ``{}``. The options are quoted cut to
        :data:`form.MAX_SHOWN` characters."""
        if self.gpu_profiles:
            instead = f"the default profile {self.gpu_profile!r}"
        else:
            instead = f"the default ({self.default_gpus} GPUs)"
        message = (
            f"Your saved spawn options {form.shown(options)} are not "
            f"accepted now ({err}); starting with {instead} instead."
        )
        self.log.warning(
            "%s: saved user_options %s refused (%s); using %s",
            self._log_name,
            form.shown(options),
            err,
            instead,
        )
        self._gpu_feed.add(5, message)
        no_options: dict[str, Any] = {}
        self.user_options = no_options
        orm_spawner = getattr(self, "orm_spawner", None)
        if orm_spawner is not None:
            orm_spawner.user_options = {}

    async def apply_gpu_profile(self, profile: dict[str, Any]) -> None:
        """Apply a checked profile's ``spawner_override`` to this spawner, as
        KubeSpawner applies ``kubespawner_override``: a callable value is
        called with the spawner, a dict value is merged into the current dict
        (``None`` removes a key), any other value replaces the setting. The
        settings a previous profile changed are first set back.

        Raises:
            tornado.web.HTTPError: 400 naming the profile and the setting when
                a key is not a setting profiles may change or a value is refused.
        """
        self._undo_gpu_profile()
        slug = profile["slug"]
        override = profile.get("spawner_override") or {}
        for key in override:
            if not self._may_override(key):
                raise web.HTTPError(
                    400, f"profile {slug!r}: spawner_override.{key}: not a setting of this spawner"
                )
        saved: dict[str, Any] = {}
        try:
            for key, value in override.items():
                if callable(value):
                    value = await maybe_future(value(self))
                current = getattr(self, key)
                saved.setdefault(key, current)
                if isinstance(value, dict) and isinstance(current, dict):
                    value = profiles.merged(current, value)
                setattr(self, key, value)
        except Exception as err:
            for key, value in saved.items():
                setattr(self, key, value)
            raise web.HTTPError(400, f"profile {slug!r}: spawner_override.{key}: {err}") from None
        self._gpu_saved_settings = saved
        self.gpu_profile = slug
        if override:
            self.log.info(
                "%s: profile %s sets %s", self._log_name, slug, ", ".join(sorted(override))
            )

    async def apply_group_overrides(self) -> None:
        """Set back the last profile's settings, then apply JupyterHub's
        ``group_overrides`` (JupyterHub 5.3+ calls this before the user
        options): a setting the previous spawn's profile changed is undone
        before the groups' overrides apply, not after them, which would
        put back the value of before that profile over the group's."""
        self._undo_gpu_profile()
        parent = getattr(super(), "apply_group_overrides", None)
        if parent is not None:
            await parent()

    def _undo_gpu_profile(self) -> None:
        """Set back the settings the last applied profile changed."""
        saved, self._gpu_saved_settings = self._gpu_saved_settings, {}
        for key, value in saved.items():
            setattr(self, key, value)
        self.gpu_profile = None

    def _forget_restart(self, err: BrokerClientError) -> bool:
        """Whether ``err`` refuses the ``restart_of`` this spawner sent as
        no lease of this server (the server was renamed since its run died,
        or the broker's database is another): then it is dropped, so the
        caller asks again without it, and the start goes on as a first one."""
        if self.gpu_restart_of is None or err.status != 400:
            return False
        if not err.message.startswith("restart_of: "):
            return False
        self.log.warning(
            "%s: the broker knows lease %s as no lease of this server (%s); starting afresh",
            self._log_name,
            self.gpu_restart_of,
            err.message,
        )
        self.gpu_restart_of = None
        return True

    async def rename(self, old_name: str, new_name: str) -> None:
        """The server is renamed (JupyterHub 6): the lease of its last run
        that died (``gpu_restart_of``) was the old name's, which the broker
        would refuse for the new one, so it is dropped from the state the
        hub keeps (the hub builds a new spawner from it)."""
        self.gpu_restart_of = None
        orm = getattr(self, "orm_spawner", None)
        if orm is not None and orm.state and "gpu_restart_of" in orm.state:
            orm.state = {k: v for k, v in orm.state.items() if k != "gpu_restart_of"}

    def _lease_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.priority_class:
            fields["priority_class"] = self.priority_class
        if self.time_limit is not None:
            fields["time_limit"] = self.time_limit
        if self.gpu_restart_of is not None:
            fields["restart_of"] = self.gpu_restart_of
        return fields

    async def _admission(self, request: dict[str, Any]) -> None:
        """Ask the broker (dry run) whether the request would be admitted, so a
        quota refusal reaches the user as the hub's answer (403), not a failed spawn.

        Raises:
            tornado.web.HTTPError: the broker's 4xx refusal (but 409).
            BrokerClientError: the broker is unavailable (5xx, 599).
        """
        try:
            await self.broker.request_lease(
                self.user.name, self.name, dry_run=True, **request, **self._lease_fields()
            )
        except BrokerClientError as err:
            if broker_unavailable(err):
                raise
            if self._forget_restart(err):
                await self._admission(request)
                return
            if 400 <= err.status < 500 and err.status != 409:
                raise web.HTTPError(err.status, err.message) from None

    async def _broker_checks(self, request: dict[str, Any]) -> None:
        """The option checks put off while the broker was unavailable: the GPU
        limit (without profiles) and the dry run, once the broker answers.

        Raises:
            SpawnException: refused (the limit, quota), or the broker stayed
                unavailable for ``broker_wait_timeout``.
        """
        try:
            if not self.gpu_profiles and request.get("gpus"):
                limit = await self._retrying(self.gpu_limit, "checking the GPU limit")
                form.check_gpu_options(request, limit)
            await self._retrying(lambda: self._admission(request), "checking the GPU request")
        except (form.OptionsError, web.HTTPError) as err:
            message = err.log_message if isinstance(err, web.HTTPError) else str(err)
            raise spawn_error(f"GPU request refused: {message}", "gpu-refused") from err

    async def _retrying(self, call: Any, what: str) -> Any:
        """``await call()``; while the broker is unavailable, try again with
        backoff (0.25 s doubling to ``broker_retry_interval``) for up to
        ``broker_wait_timeout`` per outage, showing
        :data:`BROKER_RETRY_MESSAGE` in the spawn progress once per outage.

        Args:
            call: an async function of no arguments that calls the broker.
            what: what the call is for, for the log and the error ("requesting GPUs").

        Returns:
            what ``call()`` returns.

        Raises:
            BrokerClientError: the broker's answer other than 5xx (a refusal).
            SpawnException: the broker stayed unavailable (503-class wording).
        """
        delay = FIRST_RETRY_DELAY
        while True:
            try:
                result = await call()
            except BrokerClientError as err:
                if not broker_unavailable(err):
                    raise
                now = time.monotonic()
                if self._broker_wait_until is None:
                    self._broker_wait_until = now + self.broker_wait_timeout
                    self.log.warning(
                        "%s: GPU broker unavailable while %s (%s); retrying for up to %.0f s",
                        self._log_name,
                        what,
                        err,
                        self.broker_wait_timeout,
                    )
                    self._gpu_feed.add(5, BROKER_RETRY_MESSAGE)
                remaining = self._broker_wait_until - now
                if remaining <= 0:
                    self._broker_wait_until = None
                    raise spawn_error(
                        f"The GPU broker is unavailable (503 Service Unavailable): it did not "
                        f"answer for {self.broker_wait_timeout:.0f} s while {what} "
                        f"(last error: {err.message}). Try again later; if it persists, "
                        f"tell your administrator.",
                        "gpu-broker-unavailable",
                    ) from err
                await asyncio.sleep(min(delay, remaining))
                delay = min(delay * 2, max(self.broker_retry_interval, FIRST_RETRY_DELAY))
                continue
            if self._broker_wait_until is not None:
                self.log.info("%s: GPU broker answers again (%s)", self._log_name, what)
                self._broker_wait_until = None
            return result

    # -- state ---------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Spawner state plus ``gpu_lease_id``."""
        state: dict[str, Any] = super().get_state()  # type: ignore[misc]
        if self.gpu_lease_id is not None:
            state["gpu_lease_id"] = self.gpu_lease_id
        if self.gpu_last_end:
            state["gpu_last_end"] = self.gpu_last_end
            if self.gpu_last_end_given:
                state["gpu_last_end_given"] = True
        if self.gpu_restart_of is not None:
            state["gpu_restart_of"] = self.gpu_restart_of
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``gpu_lease_id`` (a hub restart keeps the lease),
        ``gpu_last_end`` (with ``gpu_last_end_given``) and ``gpu_restart_of``."""
        super().load_state(state)  # type: ignore[misc]
        self.gpu_lease_id = state.get("gpu_lease_id")
        if state.get("gpu_last_end"):
            self.gpu_last_end = state["gpu_last_end"]
            self.gpu_last_end_given = bool(state.get("gpu_last_end_given"))
        restart_of = state.get("gpu_restart_of")
        self.gpu_restart_of = restart_of if restart_of is not None else self.gpu_restart_of

    def clear_state(self) -> None:
        """Forget the lease id (after stop); why the last lease ended and the
        lease of a run that died (``gpu_restart_of``) stay, for the next spawn."""
        super().clear_state()  # type: ignore[misc]
        self.gpu_lease_id = None

    # -- environment -----------------------------------------------------------------

    def get_env(self) -> dict[str, str]:
        """The server's environment; the broker's variables are set last, so
        neither ``Spawner.environment`` nor user settings can override them.
        A ``PYTHONPATH`` from the broker (a share's framework caps) goes
        before the one the server would otherwise have, which is kept."""
        env: dict[str, str] = super().get_env()  # type: ignore[misc]
        gpu_env = dict(self._gpu_env if self._gpu_env is not None else NO_GPU_ENV)
        if gpu_env.get("PYTHONPATH") and env.get("PYTHONPATH"):
            theirs = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
            ours = gpu_env["PYTHONPATH"].split(os.pathsep)
            gpu_env["PYTHONPATH"] = os.pathsep.join([*ours, *(p for p in theirs if p not in ours)])
        env.update(gpu_env)
        env["GPUBROKER_URL"] = self.broker_url_for_servers or self.broker_url
        return env

    # -- start, progress, stop ---------------------------------------------------------

    async def start(self) -> Any:
        """Lease GPUs (waiting in the queue if needed), then start the server.

        While the broker is unavailable, its calls are retried for up to
        ``broker_wait_timeout`` (see :meth:`_retrying`); the option checks
        put off by :meth:`check_user_options` run first, and releases of
        this server still retried in the background are made first.

        Raises:
            SpawnException: the request was refused, waited longer than
                ``queue_timeout``, or the broker stayed unavailable; the lease
                is released.
        """
        request = self.gpu_request
        if request is None:
            request = await self.check_user_options(self.user_options)
        self.gpu_request = None
        deferred, self._gpu_checks_deferred = self._gpu_checks_deferred, False
        self._broker_wait_until = None
        self._gpu_env = dict(NO_GPU_ENV)
        self.gpu_devices = []
        if self.gpu_last_end:
            self._gpu_feed.add(5, self._last_end_note())
            self.gpu_last_end = None
            self.gpu_last_end_given = False
        await self._drop_stale_lease()
        try:
            if request:
                await self._flush_pending_releases()
                if deferred:
                    await self._broker_checks(request)
                lease = await self._acquire(request)
                self._gpu_env = dict(lease["env"])
                self.gpu_devices = [d["uuid"] for d in lease.get("devices") or []]
        except BaseException:
            # followers of progress() stop here: the hub reports the failure
            self._gpu_feed.close(failed=True)
            await self._release("spawn failed or was cancelled while waiting for GPUs")
            raise
        self._gpu_feed.close()
        try:
            url = await maybe_future(super().start())  # type: ignore[misc]
        except BaseException:
            if await self.gpu_clean_up_failed_start():
                await self._release("server failed to start")
            else:
                self.log.warning(
                    "%s: the server failed to start and what it started could not be "
                    "cleaned up; lease %s is kept until it is stopped",
                    self._log_name,
                    self.gpu_lease_id,
                )
            raise
        await self._report_url(url)
        return url

    async def _report_url(self, url: Any) -> None:
        """Tell the broker where the server listens (its culler reads kernels
        there): ``url``, or ``(ip, port)`` made into one as JupyterHub does
        (``https`` when the hub runs with ``internal_ssl``, an IPv6 address
        in brackets)."""
        if self.gpu_lease_id is None:
            return
        if isinstance(url, tuple):
            host, port = url
            proto = "https" if getattr(self, "internal_ssl", False) else "http"
            host = f"[{host}]" if ":" in str(host) else host
            url = f"{proto}://{host}:{port}"
        full = f"{str(url).rstrip('/')}{self.server.base_url if self.server else '/'}"
        try:
            record = await self.gpu_server_record()
            await self.broker.set_server_url(self.gpu_lease_id, full, **record)
        except BrokerClientError as err:
            self.log.warning("Could not report the server URL to the broker: %s", err)

    async def gpu_clean_up_failed_start(self) -> bool:
        """Undo what a start that failed after the lease was granted had
        started (e.g. a container that runs), before the lease is released.

        Returns:
            True when nothing of the server can still hold the lease's
            devices (the lease is then released); False when some of it may
            still run (the lease is kept: the hub's stop of the failed
            server, or the broker's reconciliation, ends it). Here: True
            (the parent spawner cleans up after itself);
            :class:`DockerGPUSpawner` stops and removes its container.
        """
        return True

    async def gpu_server_record(self) -> dict[str, str]:
        """What the broker is told about the started server besides its URL
        (keyword arguments of :meth:`BrokerClient.set_server_url`): nothing
        here; :class:`DockerGPUSpawner` adds its container's id and its
        Docker engine's ID."""
        return {}

    async def _drop_stale_lease(self) -> None:
        if self.gpu_lease_id is not None:
            await self._release("server restarted; previous lease replaced")

    async def _acquire(self, request: dict[str, Any]) -> dict[str, Any]:
        """Request the lease (with ``restart_of`` after a run that died) and
        wait in the queue until it is granted.

        Raises:
            SpawnException: refused, lost, timed out in the queue, or the
                broker stayed unavailable.
        """
        fields = {**request, **self._lease_fields()}
        lease: dict[str, Any]
        try:
            try:
                lease = await self._request_lease(fields)
            except BrokerClientError as err:
                if not self._forget_restart(err):
                    raise
                lease = await self._request_lease({**request, **self._lease_fields()})
        except BrokerClientError as err:
            raise spawn_error(f"GPU request refused: {err.message}", "gpu-refused") from err
        except asyncio.CancelledError:
            await self._release_unanswered()
            raise
        self.gpu_lease_id = lease["id"]
        if self.gpu_restart_of is not None:
            self.log.info(
                "%s: lease %s replaces lease %s of the run that died (restarts: %s)",
                self._log_name,
                lease["id"],
                self.gpu_restart_of,
                lease.get("restarts"),
            )
            self.gpu_restart_of = None
        limit = self._queue_limit()
        deadline = time.monotonic() + limit
        while lease["state"] == "pending":
            self._event(lease)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise spawn_error(
                    f"Waited {limit:.0f} s in the GPU queue without a grant "
                    f"(last reason: {lease['queue']['message']}); the request was withdrawn.",
                    "gpu-queue-timeout",
                )
            lease = await self._poll_until(lease, deadline)
        if lease["state"] != "granted":
            raise spawn_error(
                f"GPU lease ended before it was granted: {lease['release_reason']}", "gpu-released"
            )
        self._event(lease)
        self.log.info(
            "%s granted lease %s: %s",
            self._log_name,
            lease["id"],
            lease["env"].get("CUDA_VISIBLE_DEVICES"),
        )
        return lease

    def _queue_limit(self) -> float:
        """Seconds a spawn waits in the queue: ``queue_timeout``, but ending
        :data:`START_MARGIN` seconds before the hub's ``start_timeout`` when
        that comes first, so the user reads the queue's message rather than
        the hub's cancellation, which has none."""
        return max(0.0, min(self.queue_timeout, self.start_timeout - START_MARGIN))

    async def _request_lease(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``POST /leases`` for this server (retried while the broker is
        unavailable). When the broker answers 409 because this server
        already has an active lease, that lease is stale (the hub starts one
        instance of a server at a time, and this start is it: the lease is
        left from a start whose answer was lost or that was cancelled while
        the request was on its way, or from a stop whose release the broker
        did not get): it is released (reason :data:`REPLACED_REASON`) and the
        request made again, once.

        Raises:
            BrokerClientError: the broker refused the request (another 409
                too), or refused again after the stale lease was released.
            SpawnException: the broker stayed unavailable.
        """

        async def request() -> dict[str, Any]:
            return await self._retrying(  # type: ignore[no-any-return]
                lambda: self.broker.request_lease(self.user.name, self.name, **fields),
                "requesting GPUs",
            )

        try:
            return await request()
        except BrokerClientError as err:
            stale = self._own_active_lease(err)
            if stale is None:
                raise
            self.log.warning(
                "%s: the broker already has active lease %s for this server, left from an "
                "earlier start or stop; releasing it and requesting again",
                self._log_name,
                stale,
            )
            try:
                if await self._holder_may_run(stale):
                    await self._stop_stale(stale)
                else:
                    await self._retrying(
                        lambda: self._release_call(stale, REPLACED_REASON, note_end=False),
                        f"releasing lease {stale}",
                    )
            except BrokerClientError as release_err:
                if release_err.status != 404:
                    self.log.error("Could not release lease %s: %s", stale, release_err)
                    raise err from None
        return await request()

    async def _holder_may_run(self, lease_id: int) -> bool:
        """Whether the stale lease ``lease_id`` is granted to a server an
        engine follows (a Docker container, a Slurm job): after a stop that
        failed, the hub forgets the server, but its container or job may
        still run on the lease's devices, so it must be stopped before they
        are handed on (the broker does, when the release does not say the
        holder is stopped).

        Raises:
            BrokerClientError: the lease cannot be read (404: gone).
        """
        lease = await self._retrying(
            lambda: self.broker.get_lease(lease_id), f"reading lease {lease_id}"
        )
        followed = lease.get("container_id") or lease.get("slurm_job")
        return bool(lease["state"] == "granted" and followed)

    async def _stop_stale(self, lease_id: int) -> None:
        """Release the stale lease ``lease_id`` without saying its holder is
        stopped, so the broker stops its container or Slurm job first, and
        wait (as long as a wait in the queue, :meth:`_queue_limit`) until
        the lease has ended.

        Raises:
            SpawnException: it was still being stopped at that limit.
            BrokerClientError: the broker refused the release.
        """
        lease = await self._retrying(
            lambda: self.broker.release_lease(lease_id, REPLACED_REASON),
            f"releasing lease {lease_id}",
        )
        limit = self._queue_limit()
        deadline = time.monotonic() + limit
        while lease["state"] == "granted":
            self._gpu_feed.add(
                5,
                f"Stopping this server's previous run (lease {lease_id}, whose stop failed) "
                "before its GPUs are handed on",
                once=True,
            )
            if deadline - time.monotonic() <= 0:
                raise spawn_error(
                    f"This server's previous run (lease {lease_id}) was still being stopped "
                    f"after {limit:.0f} s; start the server again later.",
                    "gpu-previous-run",
                )
            lease = await self._poll_until(lease, deadline)

    async def _poll_until(self, lease: dict[str, Any], deadline: float) -> dict[str, Any]:
        """One long-poll of ``lease`` (at most ``poll_wait``, ending by
        ``deadline``, a ``time.monotonic()`` value); an early answer with
        nothing new (e.g. the broker's long-poll limit) waits a moment, so
        callers looping on it never poll in a tight loop.

        Raises:
            SpawnException: as :meth:`_poll`.
        """
        before, state = lease["version"], lease["state"]
        remaining = max(0.0, deadline - time.monotonic())
        lease = await self._poll(lease, min(self.poll_wait, remaining))
        if lease["version"] == before and lease["state"] == state:
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        return lease

    async def _release_unanswered(self) -> None:
        """The spawn was cancelled (the user stopped the pending server, the
        hub's ``start_timeout``) while ``POST /leases`` was on its way: the
        broker may have made the lease without this spawner learning its
        id. Release this server's active lease, if the broker has one,
        before the cancelled start ends (so no new start of the server can
        have asked for one meanwhile). Errors are logged, not raised; at
        most ``UNANSWERED_TIMEOUT`` seconds (then the next start's 409 or
        the broker's reconciliation ends it)."""
        reason = "spawn cancelled while the GPU request was on its way"

        async def release() -> None:
            for lease in await self.broker.list_leases(self.user.name):
                if lease["holder_kind"] == "server" and lease["server_name"] == self.name:
                    await self._release_call(lease["id"], reason, note_end=False)

        try:
            await asyncio.wait_for(release(), UNANSWERED_TIMEOUT)
        except (BrokerClientError, asyncio.TimeoutError) as err:
            self.log.warning(
                "%s: %s; could not release the lease it may have made: %s",
                self._log_name,
                reason,
                err,
            )

    def _own_active_lease(self, err: BrokerClientError) -> int | None:
        """The id of the active lease of this server (this user, this server
        name) that a 409 to ``POST /leases`` names, else None (a 409 for any
        other reason, or another error)."""
        if err.status != 409:
            return None
        server = f"{self.user.name}/{self.name or '(default)'}"
        match = re.fullmatch(
            rf"server_name: {re.escape(server)} already has active lease (\d+); "
            r"one active lease per server",
            err.message.strip(),
        )
        return int(match.group(1)) if match else None

    async def _poll(self, lease: dict[str, Any], wait: float) -> dict[str, Any]:
        """Long-poll the lease; while the broker restarts (unreachable or 5xx),
        retry as :meth:`_retrying` does.

        Raises:
            SpawnException: the lease is gone, or the broker stayed unavailable.
        """
        try:
            return await self._retrying(  # type: ignore[no-any-return]
                lambda: self.broker.get_lease(lease["id"], wait=wait, version=lease["version"]),
                f"waiting for lease {lease['id']}",
            )
        except BrokerClientError as err:
            raise spawn_error(f"GPU lease lost: {err.message}", "gpu-lost") from err

    def _event(self, lease: dict[str, Any]) -> None:
        summary = lease.get("summary")
        if lease["state"] == "granted":
            names = ", ".join(_granted_slots(lease))
            what = f"{summary} on {names}" if summary else names
            event = {"progress": 40, "message": f"GPUs granted: {what}"}
        else:
            queue = lease.get("queue") or {}
            what = summary or f"{lease.get('gpus')} GPU(s)"
            place = "" if queue.get("position") is None else f"position {queue['position']} "
            event = {
                "progress": 10,
                "message": f"Queued for {what}: {place}({queue.get('reason')})"
                f" - {queue.get('message')}",
            }
        self._gpu_feed.add(event["progress"], event["message"], once=True)

    async def progress(self) -> AsyncIterator[dict[str, Any]]:
        """Spawn progress: queue position and reason while waiting, then the
        grant, then the server's own start; when the GPU step failed (refused,
        timed out in the queue, cancelled), nothing after its events."""
        async for event in self._gpu_feed.follow():
            yield event
        if self._gpu_feed.failed:
            return
        async for event in super().progress():  # type: ignore[misc]
            yield event

    async def poll(self) -> int | None:
        """Poll the server; when it has exited, release its lease at once
        (reason ``server exited (status N)``) and remember the lease as
        ``gpu_restart_of``, so the next start asks for its devices back.

        The hub calls this every ``poll_interval`` and does not call
        ``stop()`` for a server that already died (e.g. killed from outside).
        The lease id is read first: the parent's ``poll()`` clears the state
        (``clear_state``) when it finds the process gone.

        Returns:
            None while the server runs, else its exit status.
        """
        lease_id = self.gpu_lease_id
        status: Any = await self.gpu_poll_server()
        if status is not None and lease_id is not None and not self._gpu_stopping:
            self.gpu_lease_id = None
            self.gpu_restart_of = lease_id
            await self._release(self.gpu_exit_reason(status), lease_id)
        return status  # type: ignore[no-any-return]

    async def gpu_poll_server(self) -> Any:
        """The parent spawner's ``poll()``: None while the server runs, else
        its exit status. :class:`DockerGPUSpawner` asks Docker about its
        own container, and answers None when Docker cannot say."""
        return await maybe_future(super().poll())  # type: ignore[misc]

    def gpu_exit_reason(self, status: Any) -> str:
        """The release reason of a server found exited with ``status``."""
        return f"server exited (status {status})"

    async def stop(self, now: bool = False) -> None:
        """Stop the server, then release its lease (reason: server stopped).

        A stop that raises releases nothing (the error propagates): the
        server's process, container or job may still hold the devices, so
        the lease is left to the broker's reconciliation, which releases it
        when the hub no longer lists the server, or, for a Slurm job, once
        it has cancelled the job. A stop is not a restart: ``gpu_restart_of``
        is cleared. The lease id is read first: LocalProcessSpawner.stop()
        clears state, and polls first (a server found dead there is
        released here, as stopped).
        """
        lease_id = self.gpu_lease_id
        self._gpu_stopping = True
        try:
            await maybe_future(super().stop(now=now))  # type: ignore[misc]
        except BaseException:
            # the holder may still run on the lease's devices: JupyterHub
            # forgets the server all the same, and the broker's
            # reconciliation ends the lease once the holder is seen gone (a
            # Slurm job: cancelled, then released)
            self.gpu_lease_id = None
            self.log.warning(
                "%s: the server's stop failed; lease %s is kept until the broker's "
                "reconciliation finds its holder gone",
                self._log_name,
                lease_id,
            )
            raise
        else:
            await self._release("server stopped", lease_id)
        finally:
            self._gpu_stopping = False
            self.gpu_restart_of = None
            self._reset_progress()

    async def _release(self, reason: str, lease_id: int | None = None) -> None:
        """Release ``lease_id`` (default: this server's lease) with ``reason``.

        Never raises: a broker that is unavailable gets the release again in
        the background (:meth:`_retry_release`); other errors are logged.
        """
        lease_id = lease_id if lease_id is not None else self.gpu_lease_id
        self.gpu_lease_id = None
        if lease_id is None:
            return
        try:
            await self._release_call(lease_id, reason)
        except BrokerClientError as err:
            if broker_unavailable(err):
                self.log.warning(
                    "%s: could not release lease %s (%s): the broker is unavailable; "
                    "retrying in the background for up to %.0f s",
                    self._log_name,
                    lease_id,
                    err,
                    self.release_retry_timeout,
                )
                self._release_later(lease_id, reason)
            elif err.status != 404:
                self.log.error("Could not release lease %s: %s", lease_id, err)

    async def _release_call(self, lease_id: int, reason: str, note_end: bool = True) -> None:
        """``DELETE /leases/{id}``; with ``note_end``, keep the broker's own
        reason (preemption, cull, the user's release) when it had ended the
        lease first, to be shown at the next spawn, and whether it was the
        user's own release (:meth:`_given_up`).

        Raises:
            BrokerClientError: as :meth:`BrokerClient.release_lease`.
        """
        # the spawner releases once the server is stopped (or never started)
        lease = await self.broker.release_lease(lease_id, reason, holder_stopped=True)
        self.log.info("%s released lease %s: %s", self._log_name, lease_id, reason)
        if note_end and lease.get("release_reason") not in (None, reason):
            self.gpu_last_end = lease["release_reason"]
            self.gpu_last_end_given = await self._given_up(lease)

    async def _given_up(self, lease: dict[str, Any]) -> bool:
        """Whether the lease's user released it herself (e.g. ``%gpu_submit
        --release``), not the broker (cull, preemption, time limit,
        reconciliation) nor an admin: its ``released`` event has cause
        ``release`` and the lease's user as actor. False when the events
        cannot be read (logged): the next spawn then says the GPUs were lost.
        """
        try:
            events = await self.broker.lease_events(lease["id"])
        except BrokerClientError as err:
            self.log.warning(
                "%s: cannot read who released lease %s (%s); the next spawn says its "
                "GPUs were lost",
                self._log_name,
                lease["id"],
                err,
            )
            return False
        released = [e for e in events if e.get("kind") == "released"]
        if not released:
            return False
        last = released[-1]
        cause = (last.get("detail") or {}).get("cause")
        # a user named like one of the broker's own actors is recorded as
        # user/NAME (gpubroker.model.lifecycle.caller_actor)
        user = lease.get("user")
        return cause == "release" and last.get("actor") in (user, f"user/{user}")

    def _release_later(self, lease_id: int, reason: str) -> None:
        task = asyncio.ensure_future(self._retry_release(lease_id, reason))
        _BACKGROUND_RELEASES.add(task)
        task.add_done_callback(_BACKGROUND_RELEASES.discard)
        self._pending_releases[lease_id] = (task, reason)

    async def _retry_release(self, lease_id: int, reason: str) -> None:
        """Try the release again, with backoff (0.25 s doubling to
        ``broker_retry_interval``), until the broker answers or
        ``release_retry_timeout`` seconds have passed; then log the outcome."""
        deadline = time.monotonic() + self.release_retry_timeout
        delay = FIRST_RETRY_DELAY
        tries = 1
        try:
            while True:
                await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, max(self.broker_retry_interval, FIRST_RETRY_DELAY))
                tries += 1
                try:
                    await self._release_call(lease_id, reason, note_end=False)
                except BrokerClientError as err:
                    if err.status == 404:
                        return
                    if not broker_unavailable(err):
                        self.log.error("Could not release lease %s: %s", lease_id, err)
                        return
                    if time.monotonic() >= deadline:
                        self.log.error(
                            "%s: gave up releasing lease %s after %s tries in %.0f s (%s); "
                            "the broker releases it when it reconciles with the hub",
                            self._log_name,
                            lease_id,
                            tries,
                            self.release_retry_timeout,
                            err,
                        )
                        return
                    continue
                self.log.info(
                    "%s: lease %s released after %s tries (the broker was unavailable)",
                    self._log_name,
                    lease_id,
                    tries,
                )
                return
        finally:
            entry = self._pending_releases.get(lease_id)
            if entry is not None and entry[0] is asyncio.current_task():
                del self._pending_releases[lease_id]

    async def _flush_pending_releases(self) -> None:
        """Make the releases still retried in the background now, waiting
        for the broker as :meth:`_retrying` does, so the new request does not
        meet this server's old lease.

        Raises:
            SpawnException: the broker stayed unavailable.
        """
        for lease_id, (task, reason) in list(self._pending_releases.items()):
            task.cancel()
            self._pending_releases.pop(lease_id, None)
            try:
                await self._retrying(
                    lambda lease_id=lease_id, reason=reason: self._release_call(
                        lease_id, reason, note_end=False
                    ),
                    f"releasing lease {lease_id}",
                )
            except BrokerClientError as err:
                if err.status != 404:
                    self.log.error("Could not release lease %s: %s", lease_id, err)
