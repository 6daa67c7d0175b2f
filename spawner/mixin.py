"""GPUSpawnerMixin: ask the broker for a lease before starting a server.

Flow: ``apply_user_options`` checks the options (``{"gpus": N}``, or
``{"profile": SLUG}`` when ``gpu_profiles`` are configured, whose
``spawner_override`` it then applies) and turns them into a lease request;
``start()`` requests the lease, waits in the queue (reporting position and
reason through ``progress()``), sets the device variables from the grant and
starts the server; ``stop()`` releases the lease. The lease id is kept in the
spawner's state so a hub restart keeps the lease. Every way out of a start
that fails (error, time-out, cancel) releases the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from jupyterhub.utils import maybe_future
from tornado import web
from traitlets import Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from gpubroker.client import BrokerClient, BrokerClientError

from . import form, profiles

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
        help="""Base URL of the broker service as the hub reaches it, e.g.
        http://127.0.0.1:10101/services/gpubroker/ (default: $GPUBROKER_URL).
        It is also passed to servers as GPUBROKER_URL.""",
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
        hub API must be ``{"profile": SLUG}`` (or ``{}`` for the default);
        ``gpus``, ``max_gpus`` and ``default_gpus`` are not used. Empty (the
        default): the spawn form offers 0 to ``max_gpus`` whole GPUs.""",
    ).tag(config=True)

    gpu_lease_id: int | None = None
    #: the checked lease request (``{}``: no GPU); None until options are checked
    gpu_request: dict[str, Any] | None = None
    #: slug of the profile chosen for this spawn (None without profiles)
    gpu_profile: str | None = None
    #: why the broker ended this server's last lease (preemption, reconcile), shown once
    gpu_last_end: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the values the applied profile's spawner_override replaced
        self._gpu_saved_settings: dict[str, Any] = {}
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
        self._gpu_events: list[dict[str, Any]] = []
        self._gpu_changed = asyncio.Event()
        self._gpu_wait_over = False
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
        """A client of the broker with the spawner's token."""
        return BrokerClient(self.broker_url, self.broker_api_token)

    async def gpu_limit(self) -> int:
        """The most GPUs this server may ask for now (broker limit, ``max_gpus``)."""
        devices = await self.broker.devices()
        limit = int(devices["summary"]["request_limit"])
        return min(limit, self.max_gpus) if self.max_gpus else limit

    async def _gpu_options_form(self) -> str:
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
            page = form.render_profiles(self.gpu_profiles, pools, devices)
        else:
            limit = int(devices["summary"]["request_limit"])
            limit = min(limit, self.max_gpus) if self.max_gpus else limit
            page = form.render_form(limit, devices, self.default_gpus)
        if self.gpu_last_end:
            note = html.escape(f"Your previous server lost its GPUs: {self.gpu_last_end}")
            page = f'<p class="alert alert-warning">{note}</p>' + page
        return page

    def options_from_form(self, formdata: dict[str, list[str]]) -> dict[str, Any]:
        """Form data → ``{"gpus": N}``, or ``{"profile": SLUG}`` with
        ``gpu_profiles`` (checked later, like API-posted options)."""
        if self.gpu_profiles:
            return form.profile_options_from_form(formdata)
        return form.options_from_form(formdata)

    async def check_user_options(self, user_options: dict[str, Any] | None) -> dict[str, Any]:
        """Validate ``user_options`` and return the GPU part of the lease request.

        Without profiles, ``{"gpus": N}`` becomes ``{"gpus": N}`` (``{}`` for
        none). With ``gpu_profiles``, ``{"profile": SLUG}`` (or ``{}``: the
        default profile) becomes that profile's ``request``, and the profile's
        ``spawner_override`` is applied to this spawner (undoing the overrides
        of a profile applied before). A request for a GPU is then tried on the
        broker as a dry run, so a refusal (e.g. quota) is the hub's answer.

        Returns:
            ``{}`` (no GPU), ``{"gpus": N}``, ``{"mig_profile": P}`` or
            ``{"memory_gib": X[, "count": N]}``, maybe with ``"pool"``.

        Raises:
            tornado.web.HTTPError: 400 naming the field (and the limit or the
                choices); the broker's 400/403 for the dry run.
        """
        if self.gpu_profiles:
            try:
                profile = form.select_profile(self.gpu_profiles, user_options)
            except form.OptionsError as err:
                raise web.HTTPError(400, str(err)) from None
            await self.apply_gpu_profile(profile)
            request = dict(profile["request"])
        else:
            limit = await self.gpu_limit() if (user_options or {}).get("gpus") else 0
            try:
                gpus = form.check_gpu_options(user_options, limit, self.default_gpus)
            except form.OptionsError as err:
                raise web.HTTPError(400, str(err)) from None
            request = {"gpus": gpus} if gpus else {}
        if request:
            try:
                await self._admission(request)
            except web.HTTPError:
                self._undo_gpu_profile()
                raise
        return request

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

    def _undo_gpu_profile(self) -> None:
        """Set back the settings the last applied profile changed."""
        saved, self._gpu_saved_settings = self._gpu_saved_settings, {}
        for key, value in saved.items():
            setattr(self, key, value)
        self.gpu_profile = None

    def _lease_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.priority_class:
            fields["priority_class"] = self.priority_class
        if self.time_limit is not None:
            fields["time_limit"] = self.time_limit
        return fields

    async def _admission(self, request: dict[str, Any]) -> None:
        """Ask the broker (dry run) whether the request would be admitted, so a
        quota refusal reaches the user as the hub's answer (403), not a failed spawn."""
        try:
            await self.broker.request_lease(
                self.user.name, self.name, dry_run=True, **request, **self._lease_fields()
            )
        except BrokerClientError as err:
            if 400 <= err.status < 500 and err.status != 409:
                raise web.HTTPError(err.status, err.message) from None

    # -- state ---------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Spawner state plus ``gpu_lease_id``."""
        state: dict[str, Any] = super().get_state()  # type: ignore[misc]
        if self.gpu_lease_id is not None:
            state["gpu_lease_id"] = self.gpu_lease_id
        if self.gpu_last_end:
            state["gpu_last_end"] = self.gpu_last_end
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore ``gpu_lease_id`` (a hub restart keeps the lease)."""
        super().load_state(state)  # type: ignore[misc]
        self.gpu_lease_id = state.get("gpu_lease_id")
        self.gpu_last_end = state.get("gpu_last_end") or self.gpu_last_end

    def clear_state(self) -> None:
        """Forget the lease id (after stop); why the last lease ended stays,
        to be shown on the next spawn."""
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
        env["GPUBROKER_URL"] = self.broker_url
        return env

    # -- start, progress, stop ---------------------------------------------------------

    async def start(self) -> Any:
        """Lease GPUs (waiting in the queue if needed), then start the server.

        Raises:
            SpawnException: the request was refused, or waited longer than
                ``queue_timeout``; the lease is released.
        """
        request = self.gpu_request
        if request is None:
            request = await self.check_user_options(self.user_options)
        self.gpu_request = None
        self._gpu_env = dict(NO_GPU_ENV)
        if self.gpu_last_end:
            message = f"Your previous server lost its GPUs: {self.gpu_last_end}"
            self._gpu_events.append({"progress": 5, "message": message})
            self.gpu_last_end = None
        await self._drop_stale_lease()
        try:
            if request:
                lease = await self._acquire(request)
                self._gpu_env = dict(lease["env"])
        except BaseException:
            await self._release("spawn failed or was cancelled while waiting for GPUs")
            raise
        finally:
            self._gpu_wait_over = True
            self._gpu_changed.set()
        try:
            url = await maybe_future(super().start())  # type: ignore[misc]
        except BaseException:
            await self._release("server failed to start")
            raise
        await self._report_url(url)
        return url

    async def _report_url(self, url: Any) -> None:
        """Tell the broker where the server listens (its culler reads kernels there)."""
        if self.gpu_lease_id is None:
            return
        if isinstance(url, tuple):
            url = f"http://{url[0]}:{url[1]}"
        full = f"{str(url).rstrip('/')}{self.server.base_url if self.server else '/'}"
        try:
            await self.broker.set_server_url(self.gpu_lease_id, full)
        except BrokerClientError as err:
            self.log.warning("Could not report the server URL to the broker: %s", err)

    async def _drop_stale_lease(self) -> None:
        if self.gpu_lease_id is not None:
            await self._release("server restarted; previous lease replaced")

    async def _acquire(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            lease = await self.broker.request_lease(
                self.user.name, self.name, **request, **self._lease_fields()
            )
        except BrokerClientError as err:
            raise spawn_error(f"GPU request refused: {err.message}", "gpu-refused") from err
        self.gpu_lease_id = lease["id"]
        deadline = time.monotonic() + self.queue_timeout
        while lease["state"] == "pending":
            self._event(lease)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise spawn_error(
                    f"Waited {self.queue_timeout:.0f} s in the GPU queue without a grant "
                    f"(last reason: {lease['queue']['message']}); the request was withdrawn.",
                    "gpu-queue-timeout",
                )
            lease = await self._poll(lease, min(self.poll_wait, remaining))
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

    async def _poll(self, lease: dict[str, Any], wait: float) -> dict[str, Any]:
        """Long-poll the lease; while the broker restarts (unreachable or 5xx),
        keep the last known state and try again a second later."""
        try:
            return await self.broker.get_lease(lease["id"], wait=wait, version=lease["version"])
        except BrokerClientError as err:
            if err.status < 500:
                raise spawn_error(f"GPU lease lost: {err.message}", "gpu-lost") from err
            self.log.warning("Broker unavailable while waiting for lease %s: %s", lease["id"], err)
            await asyncio.sleep(1)
            return lease

    def _event(self, lease: dict[str, Any]) -> None:
        summary = lease.get("summary")
        if lease["state"] == "granted":
            names = ", ".join(
                f"{d.get('name')} ({d.get('uuid')})" for d in lease.get("devices") or []
            )
            what = f"{summary} on {names}" if summary else names
            event = {"progress": 40, "message": f"GPUs granted: {what}"}
        else:
            queue = lease.get("queue") or {}
            what = summary or f"{lease.get('gpus')} GPU(s)"
            event = {
                "progress": 10,
                "message": f"Queued for {what}: position {queue.get('position')}"
                f" ({queue.get('reason')}) - {queue.get('message')}",
            }
        if not self._gpu_events or self._gpu_events[-1] != event:
            self._gpu_events.append(event)
            self._gpu_changed.set()

    async def progress(self) -> AsyncIterator[dict[str, Any]]:
        """Spawn progress: queue position and reason while waiting, then the grant."""
        sent = 0
        while True:
            self._gpu_changed.clear()
            events = self._gpu_events
            for event in events[sent:]:
                yield event
            sent = len(events)
            if self._gpu_wait_over:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._gpu_changed.wait(), 5)
        async for event in super().progress():  # type: ignore[misc]
            yield event

    async def poll(self) -> int | None:
        """Poll the server; when it has exited, release its lease at once.

        The hub calls this every ``poll_interval`` and does not call
        ``stop()`` for a server that already died (e.g. killed from outside).
        """
        status: int | None = await maybe_future(super().poll())  # type: ignore[misc]
        if status is not None and self.gpu_lease_id is not None:
            await self._release(f"server exited (status {status})")
        return status

    async def stop(self, now: bool = False) -> None:
        """Stop the server, then release its lease (reason: server stopped).

        The lease id is read first: LocalProcessSpawner.stop() clears state.
        """
        lease_id = self.gpu_lease_id
        try:
            await maybe_future(super().stop(now=now))  # type: ignore[misc]
        finally:
            await self._release("server stopped", lease_id)
            self._reset_progress()

    async def _release(self, reason: str, lease_id: int | None = None) -> None:
        lease_id = lease_id if lease_id is not None else self.gpu_lease_id
        self.gpu_lease_id = None
        if lease_id is None:
            return
        try:
            lease = await self.broker.release_lease(lease_id, reason)
            self.log.info("%s released lease %s: %s", self._log_name, lease_id, reason)
            if lease.get("release_reason") not in (None, reason):
                self.gpu_last_end = lease["release_reason"]
        except BrokerClientError as err:
            if err.status == 599:  # e.g. at hub shutdown, which stops the broker first
                self.log.warning(
                    "Could not release lease %s (%s); the broker releases it when it "
                    "reconciles with the hub",
                    lease_id,
                    err,
                )
            elif err.status != 404:
                self.log.error("Could not release lease %s: %s", lease_id, err)
