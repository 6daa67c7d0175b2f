"""GPU-aware culling of idle interactive leases.

Every ``cull_every`` seconds each granted lease of a hub server is judged
from three signals:

1. hub activity: the server's ``last_activity`` (hub API);
2. kernels and terminals: the single-user server's ``/api/kernels`` (any
   ``busy``; each kernel's ``last_activity``) and ``/api/terminals`` (each
   terminal's ``last_activity``: input or output), read directly from the
   server with ``no_track_activity`` (so the check is not activity) and a
   token the hub issues for that one check: owned by the server's user,
   limited to ``access:servers!server=USER/NAME``, revoked right after (the
   broker's own token never reaches a user's server);
3. GPU use of the lease's devices (NVML utilization; for a MIG instance,
   NVML's GPM activity where the GPU has it; memory is reported).

A lease is *idle* when no kernel is busy, GPU utilization stayed below
``gpu_idle_threshold`` and no activity came, for ``timeout`` seconds.
Activity means kernel or terminal activity when the server's kernels can
be read; the hub's activity, which any browser traffic refreshes (an open
tab's keep-alives), counts only when they cannot.

Idle leases are warned (a notice with a deadline), then culled after
``grace`` seconds: a ``pre_stop_hook`` runs, the hub stops the server, the
lease is released with the reason. Activity in the grace period withdraws
the warning. A busy kernel with an idle GPU for ``busy_gpu_idle_timeout`` is
flagged to admins, and culled too if ``cull_busy_gpu_idle`` (only where the
GPU's use can be read: a whole device, or a MIG instance with GPM).

All times are aware UTC; a naive timestamp is read as UTC, so time-zone or
daylight-saving changes of the server cannot distort idle time.

Limits: utilization is per device. A MIG instance reports no utilization
in NVML; its GPM activity (Hopper and later) stands in for it. A
time-sliced share's device utilization is every sharer's, so it is not
read. Where GPU use is unknown, only the kernel, terminal and hub signals
count. Memory held is reported in the reason, not used to decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Bool, Float, Integer, List, TraitError, Unicode, validate
from traitlets.config import LoggingConfigurable

from .core import Broker, utcnow
from .devices.base import DeviceUsage
from .enforce.watchdog import lease_of_pid
from .hub import HubClient, parse_time
from .model.holdings import HeldSlot, LeaseRef
from .store.culler_repo import FIELDS, load_tracks, save_tracks

#: how far ahead of the broker's clock a server's activity time may be and
#: still count (as now); later claims are not evidence of use
CLOCK_SKEW = dt.timedelta(seconds=60)

#: largest kernels or terminals answer read from a server, bytes (a server
#: is untrusted)
MAX_KERNELS_BYTES = 1024 * 1024

#: the allowed values of the culler's number options: (lowest, whether the
#: lowest itself is allowed, highest or ``None``, what the value is); every
#: one is finite. A value outside stops the broker at start-up: a negative
#: ``timeout`` would cull everyone at once, a ``gpu_idle_threshold`` of 0
#: would count every GPU as used (nothing culled), ``cull_every`` 0 would
#: spin against the hub, an infinite ``pre_stop_timeout`` would fail every cull
NUMBER_BOUNDS: dict[str, tuple[float, bool, float | None, str]] = {
    "timeout": (0, False, None, "seconds above 0"),
    "cull_every": (0, False, None, "seconds above 0"),
    "grace": (0, True, None, "seconds, 0 or more"),
    "max_age": (0, True, None, "seconds, 0 (never) or more"),
    "gpu_idle_threshold": (0, False, 100, "a percentage above 0 and at most 100"),
    "busy_gpu_idle_timeout": (0, False, None, "seconds above 0"),
    "pre_stop_timeout": (0, False, None, "seconds above 0"),
    "request_timeout": (0, False, None, "seconds above 0"),
}


def kernel_list(data: Any) -> list[dict[str, Any]]:
    """A server's ``/api/kernels`` answer as kernels with checked fields:
    ``execution_state`` a string or ``None``, ``last_activity`` a string or
    ``None``; entries that are not objects are dropped.

    Raises:
        ValueError: the answer is not a list (the kernels are then unknown).
    """
    if not isinstance(data, list):
        raise ValueError("kernels: not a list")
    kernels = []
    for item in data[:1000]:
        if not isinstance(item, dict):
            continue
        state, last = item.get("execution_state"), item.get("last_activity")
        kernels.append(
            {
                "execution_state": state if isinstance(state, str) else None,
                "last_activity": last if isinstance(last, str) else None,
            }
        )
    return kernels


def terminal_activity(data: Any, until: dt.datetime | None = None) -> dt.datetime | None:
    """The latest ``last_activity`` of a server's ``/api/terminals`` answer
    (aware UTC; jupyter_server_terminals counts a terminal's input and
    output); ``None`` for no terminals, or an answer that is not a list
    (a server is untrusted). Times after ``until`` are left out (a claim
    of the future hides no other terminal's activity)."""
    if not isinstance(data, list):
        return None
    times = [parse_time(t.get("last_activity")) for t in data[:1000] if isinstance(t, dict)]
    return max((t for t in times if t and (until is None or t <= until)), default=None)


@dataclass(frozen=True)
class Signals:
    """What one check saw of a lease.

    Attributes:
        hub_activity: the server's last activity in the hub (aware UTC).
        kernel_activity: the latest kernel activity (aware UTC).
        kernels: number of kernels; ``None`` when the server could not be read.
        busy: whether any kernel is executing.
        gpu_util: highest utilization of the lease's devices, percent (``None``: unknown).
        gpu_memory_mib: device memory in use on the lease's devices, MiB.
        terminal_activity: the latest terminal activity (aware UTC; counts
            like kernel activity when the kernels are known).
    """

    hub_activity: dt.datetime | None
    kernel_activity: dt.datetime | None
    kernels: int | None
    busy: bool
    gpu_util: int | None
    gpu_memory_mib: int
    terminal_activity: dt.datetime | None = None


@dataclass
class Track:
    """What the culler remembers of a lease between checks (kept in the
    store, ``culler_tracks``, across broker restarts)."""

    gpu_active: dt.datetime
    busy_since_gpu_idle: dt.datetime | None = None
    warned_until: dt.datetime | None = None
    flagged: bool = False
    culled: bool = False
    #: whether a check has read the server's kernels (stored, so a
    #: restarted broker knows it too): then a check that cannot read them
    #: is no evidence of use, and the server's hub activity does not
    #: withdraw a warning
    kernels_seen: bool = False


@dataclass(frozen=True)
class Verdict:
    """Outcome of judging a lease: ``idle`` seconds and the sentence why."""

    idle: float
    reason: str
    cull: bool


def judge(
    signals: Signals,
    track: Track,
    granted_at: dt.datetime,
    now: dt.datetime,
    timeout: float,
    threshold: float,
    busy_gpu_idle_timeout: float,
    cull_busy_gpu_idle: bool,
) -> Verdict:
    """Pure: update ``track`` from ``signals`` and say whether the lease is idle.

    A busy kernel on an unused GPU is flagged only where the GPU's use is
    known (``gpu_util`` not ``None``): an unknown GPU is never called idle.
    Its clock (``busy_since_gpu_idle``) ends only on evidence, the GPU seen
    in use or the kernels read and none busy: a check that could not read
    the kernels or the GPU (a slow server, an NVML error) neither extends
    nor restarts it.

    An activity time more than :data:`CLOCK_SKEW` ahead of ``now`` is left
    out on its own: it hides no other, earlier activity.
    """
    gpu_busy = signals.gpu_util is not None and signals.gpu_util >= threshold
    if gpu_busy:
        track.gpu_active = now
    if signals.busy and signals.gpu_util is not None and not gpu_busy:
        track.busy_since_gpu_idle = track.busy_since_gpu_idle or now
    elif gpu_busy or (signals.kernels is not None and not signals.busy):
        track.busy_since_gpu_idle = None
    marks = [granted_at, track.gpu_active]
    # with kernels known, the hub's activity (which counts any browser traffic,
    # e.g. an open idle tab's keep-alives) is not evidence of use; running
    # code and terminal input or output are
    claims = [signals.hub_activity]
    if signals.kernels is not None:
        claims = [signals.kernel_activity, signals.terminal_activity]
    # a server may claim the future: beyond a little clock skew it is no evidence
    marks.extend(min(t, now) for t in claims if t is not None and t <= now + CLOCK_SKEW)
    if signals.busy:
        marks.append(now)
    idle = max(0.0, (now - max(marks)).total_seconds())
    gpu = "unknown" if signals.gpu_util is None else f"{signals.gpu_util}%"
    held = f", {signals.gpu_memory_mib / 1024:.1f} GiB held" if signals.gpu_memory_mib else ""
    kernel = "a busy kernel" if signals.busy else "no busy kernel"
    if signals.busy and track.busy_since_gpu_idle is not None and signals.gpu_util is not None:
        gpu_idle = (now - max(track.busy_since_gpu_idle, track.gpu_active)).total_seconds()
        if gpu_idle >= busy_gpu_idle_timeout:
            reason = f"kernel busy but GPU idle {gpu_idle / 60:.0f} min (GPU {gpu}{held})"
            return Verdict(gpu_idle, reason, cull_busy_gpu_idle)
    reason = f"idle {idle / 60:.0f} min, GPU {gpu}{held}, {kernel}"
    return Verdict(idle, reason, idle >= timeout)


class Culler(LoggingConfigurable):
    """Culls idle interactive leases (see the module docstring). Option names
    follow jupyterhub-idle-culler where they mean the same."""

    enabled = Bool(True, help="Run the culler in the broker.").tag(config=True)
    timeout = Float(3600, help="Seconds of idleness after which a lease is warned (above 0).").tag(
        config=True
    )
    cull_every = Float(
        60, help="Seconds between checks, above 0 (idle-culler's --cull-every)."
    ).tag(config=True)
    grace = Float(
        600, help="Seconds between the warning and the cull (0 or more); activity withdraws it."
    ).tag(config=True)
    max_age = Float(
        0, help="Seconds after which a lease is culled even if active (0: never; not negative)."
    ).tag(config=True)
    gpu_idle_threshold = Float(
        5,
        help="GPU utilization (percent, above 0 and at most 100) below which the "
        "GPU counts as unused.",
    ).tag(config=True)
    busy_gpu_idle_timeout = Float(
        4 * 3600,
        help="Seconds (above 0) a kernel may stay busy while its GPU is unused "
        "before admins are told.",
    ).tag(config=True)
    cull_busy_gpu_idle = Bool(
        False, help="Also cull leases whose kernel is busy but GPU idle past that limit."
    ).tag(config=True)
    exempt_users = List(Unicode(), help="Users never culled.").tag(config=True)
    exempt_groups = List(Unicode(), help="JupyterHub groups whose members are never culled.").tag(
        config=True
    )
    exempt_server_names = List(
        Unicode(),
        help="Regular expressions (Python's re, matched against the whole name): "
        "named servers matching one are never culled. A pattern that does not "
        "compile is refused at start-up.",
    ).tag(config=True)
    exempt_priority_classes = List(
        Unicode(),
        ["batch-urgent", "batch", "preemptible"],
        help="Priority classes never culled (batch work is governed by its time limit). "
        "A name that is no class in force is reported as a warning when the culler starts.",
    ).tag(config=True)
    pre_stop_hook = List(
        Unicode(),
        help="Command run on the broker's host before a cull; its first item an "
        "absolute path (a bare name is refused at start-up). Its "
        "environment holds exactly GPUBROKER_USER, GPUBROKER_SERVER_NAME, "
        "GPUBROKER_LEASE_ID, GPUBROKER_SERVER_URL (the server's own URL: its "
        "contents API can save work) and GPUBROKER_SERVER_TOKEN (a token of the "
        "server's user that reaches only that server, revoked when the hook "
        "ends); no PATH, and never the broker's own token.",
    ).tag(config=True)
    pre_stop_timeout = Float(60, help="Seconds (above 0) the pre-stop hook may run.").tag(
        config=True
    )
    dry_run = Bool(False, help="Only report (log and notices) what would be culled.").tag(
        config=True
    )
    request_timeout = Float(10, help="Seconds (above 0) for reading a server's kernels.").tag(
        config=True
    )
    concurrency = Integer(
        8,
        min=1,
        help="Servers whose kernels the culler reads at once (each read is "
        "bounded by request_timeout), so slow servers do not hold up the others.",
    ).tag(config=True)
    token_lifetime = Integer(
        60,
        min=1,
        help="Seconds a token the culler asks the hub for (owned by the server's "
        "user, limited to that one server) lives at most; it is revoked right "
        "after use, this bounds it if the revocation fails.",
    ).tag(config=True)

    @validate(*NUMBER_BOUNDS)
    def _valid_number(self, proposal: Any) -> float:
        """Every number option is finite and in its range
        (:data:`NUMBER_BOUNDS`), or the broker does not start."""
        name, value = proposal["trait"].name, proposal["value"]
        low, low_ok, high, what = NUMBER_BOUNDS[name]
        if (
            not math.isfinite(value)
            or value < low
            or (value == low and not low_ok)
            or (high is not None and value > high)
        ):
            raise TraitError(f"Culler.{name}: {value!r} is not allowed; give {what}")
        return float(value)

    @validate("pre_stop_hook")
    def _valid_hook(self, proposal: Any) -> list[str]:
        """The hook's command is an absolute path: it runs without ``PATH``,
        so a bare name would fail at every cull, and be found only then."""
        command = list(proposal["value"])
        if command and not os.path.isabs(command[0]):
            raise TraitError(
                f"Culler.pre_stop_hook: {command[0]!r} is not an absolute path "
                "(the hook runs without PATH)"
            )
        return command

    @validate("exempt_server_names")
    def _valid_patterns(self, proposal: Any) -> list[str]:
        """Every pattern compiles, or the broker does not start (a bad one
        would otherwise stop every check)."""
        for pattern in proposal["value"]:
            try:
                re.compile(pattern)
            except re.error as err:
                raise TraitError(
                    f"Culler.exempt_server_names: {pattern!r} is not a regular expression: {err}"
                ) from err
        return list(proposal["value"])

    def __init__(
        self,
        broker: Broker,
        hub: HubClient,
        pid_lease: Callable[[int], int | None] = lease_of_pid,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        #: called after each of :meth:`run`'s checks with whether it completed
        #: (the service counts them in its metrics)
        self.on_check: Callable[[bool], None] | None = None
        self.broker = broker
        self.hub = hub
        #: the lease of a process (for shares: whose memory on a shared device)
        self.pid_lease = pid_lease
        self.tracks: dict[int, Track] = {}
        self.groups: dict[str, list[str]] = {}
        #: the tracks as last stored (None: not read from the store yet)
        self._stored: dict[int, dict[str, Any]] | None = None
        #: whether servers' kernels can be read: not in a hub with internal
        #: TLS, where a server takes only the hub's and the proxy's
        #: certificates (set by the service; then no token is asked for)
        self.kernels_readable = True

    # -- one check -------------------------------------------------------------------

    async def check_once(self, now: dt.datetime | None = None) -> list[int]:
        """Judge every granted server lease once; return ids culled now.

        The tracks (clocks, warnings) are read from the store at the first
        check and written back after each check that changed them, so a
        broker restart keeps a warning's deadline
        (:mod:`gpubroker.store.culler_repo`)."""
        if self._stored is None:
            self._stored = load_tracks(self.broker.session_factory)
            self.tracks = {k: Track(**v) for k, v in self._stored.items()}
        servers, groups = await self.hub.active_server_models()
        self.groups = groups
        now = now or utcnow()
        leases = self.broker.server_leases()
        judged = [
            (lease, servers[(lease.user, lease.server_name)])
            for lease in leases
            if not self._exempt(lease) and (lease.user, lease.server_name) in servers
        ]  # a lease whose server is gone is left to reconciliation
        limit = asyncio.Semaphore(self.concurrency)

        async def read(lease: LeaseRef, server: dict[str, Any]) -> Signals:
            async with limit:
                return await self._signals(lease, server, now)

        seen = await asyncio.gather(*(read(*pair) for pair in judged), return_exceptions=True)

        async def act(lease: LeaseRef, signals: Signals | BaseException) -> bool:
            if isinstance(signals, BaseException):
                self.log.error("Culler: cannot judge lease %s: %s", lease.id, signals)
                return False
            try:
                return await self._act(lease, signals, now)
            except Exception:
                self.log.exception("Culler: judging lease %s failed", lease.id)
                return False

        # at once: each cull waits for its own pre-stop hook only, so no cull
        # is held up longer than pre_stop_timeout by the others' hooks
        pairs = zip(judged, seen, strict=True)
        done = await asyncio.gather(*(act(lease, signals) for (lease, _), signals in pairs))
        culled = [lease.id for (lease, _), ok in zip(judged, done, strict=True) if ok]
        # granted leases that are not exempt keep their track, also when the
        # hub's listing left their server out this once (a paged listing
        # can skip one as others stop): its warning and clocks stand. An
        # exempt or released lease's track goes (never a stale warning)
        live = {lease.id for lease in leases if not self._exempt(lease)}
        self.tracks = {k: v for k, v in self.tracks.items() if k in live}
        self._save()
        return culled

    def _save(self) -> None:
        """Store the tracks if they changed since they were last stored
        (after each check, and at once after a notice or a cull)."""
        now_stored = {k: self._stored_track(v) for k, v in self.tracks.items()}
        if now_stored != self._stored:
            save_tracks(self.broker.session_factory, now_stored)
            self._stored = now_stored

    def _stored_track(self, track: Track) -> dict[str, Any]:
        """``track`` as stored. A dry run's warnings were never sent, so they
        are not stored: a broker restarted without ``dry_run`` warns the
        user before any cull."""
        fields = {k: v for k, v in dataclasses.asdict(track).items() if k in FIELDS}
        if self.dry_run:
            fields["warned_until"] = None
        return fields

    def _exempt(self, lease: LeaseRef) -> bool:
        if lease.user in self.exempt_users or lease.priority_class in self.exempt_priority_classes:
            return True
        if set(self.groups.get(lease.user, ())) & set(self.exempt_groups):
            return True
        name = lease.server_name
        return bool(name) and any(re.fullmatch(p, name) for p in self.exempt_server_names)

    async def _signals(
        self, lease: LeaseRef, server: dict[str, Any], now: dt.datetime | None = None
    ) -> Signals:
        """What one check sees of ``lease``. The GPU's use is known only if
        every slot's is, or one slot is seen in use: an unreadable device
        next to an idle one is not an idle GPU. A kernel's activity more than
        :data:`CLOCK_SKEW` after the read (``now``, or the clock when the
        read begins if later: reads wait their turn behind
        :attr:`concurrency`) is left out, so it hides no other kernel's."""
        now = max(now or utcnow(), utcnow())
        kernels, terminals = await self._kernels(lease, now + CLOCK_SKEW)
        utils, memory, unknown = [], 0, False
        # NVML off the event loop: a call can block for seconds (persistence
        # mode off) or longer (a GPU fallen off the bus)
        read = await asyncio.to_thread(lambda: [self._slot_usage(lease, s) for s in lease.slots])
        for util, used in read:
            memory += used
            if util is None:
                unknown = True
            else:
                utils.append(util)
        gpu_util = max(utils) if utils else None
        if unknown and gpu_util is not None and gpu_util < self.gpu_idle_threshold:
            gpu_util = None  # an unread device may be the one in use
        activity = [parse_time(k.get("last_activity")) for k in kernels or []]
        return Signals(
            hub_activity=parse_time(server.get("last_activity")),
            kernel_activity=max((t for t in activity if t and t <= now + CLOCK_SKEW), default=None),
            kernels=None if kernels is None else len(kernels),
            busy=any(k.get("execution_state") == "busy" for k in kernels or []),
            gpu_util=gpu_util,
            gpu_memory_mib=memory,
            terminal_activity=terminals,
        )

    def _slot_usage(self, lease: LeaseRef, slot: HeldSlot) -> tuple[int | None, int]:
        """(utilization %, memory MiB) of one slot of ``lease``.

        A whole device: the device's. A MIG instance: the instance's memory,
        and as utilization its GPM activity (percent of the sample window
        its engines were busy; Hopper and later) where the backend gives
        it, since NVML reports no utilization per instance. A share: the
        memory of the lease's own processes on the device (by
        ``pid_lease``); the device's utilization is everyone's, so it is
        not counted.
        """
        uuid = slot.instance_uuid or slot.device_uuid
        try:
            usage = self.broker.backend.usage(uuid)
        except Exception as err:
            self.log.warning("Cannot read usage of %s: %s", uuid, err)
            return None, 0
        if slot.kind == "share":
            return None, self._share_memory(lease, usage)
        util = usage.utilization_gpu
        if util is None and slot.kind == "mig" and usage.engine_activity is not None:
            util = round(100 * usage.engine_activity)
        return util, usage.memory_used_mib

    def _share_memory(self, lease: LeaseRef, usage: DeviceUsage) -> int:
        """The memory ``lease``'s own processes hold on a shared device, MiB.
        Processes whose memory NVML does not report (``None``) hold what the
        device's total leaves after the reported ones, where all of them
        are the lease's; else they count 0."""
        owners = [(self.pid_lease(p.pid) == lease.id, p.used_memory_mib) for p in usage.processes]
        mine = sum(used or 0 for is_mine, used in owners if is_mine)
        unknown = {is_mine for is_mine, used in owners if used is None}
        if unknown == {True}:
            known = sum(used or 0 for _, used in owners)
            mine += max(usage.memory_used_mib - known, 0)
        return mine

    async def _kernels(
        self, lease: LeaseRef, until: dt.datetime | None = None
    ) -> tuple[list[dict[str, Any]] | None, dt.datetime | None]:
        """The server's kernels and its terminals' latest activity, read
        directly (not through the proxy) with a token of the server's own
        user that reaches only this server, asked from the hub for this one
        check and revoked after it (:meth:`HubClient.server_token`). The
        broker's own token is never sent to a user's server: its owner
        could record it. Kernels ``None``: the server could not be read;
        terminals ``None`` also when they cannot be read (a server without
        terminals answers 404). Terminal times after ``until`` are left out."""
        if not lease.server_url or not self.kernels_readable:
            return None, None
        base = lease.server_url.rstrip("/")
        try:
            async with self.hub.server_token(
                lease.user, lease.server_name, "culler reads kernels", self.token_lifetime
            ) as token:
                client = AsyncHTTPClient(force_instance=True, max_body_size=MAX_KERNELS_BYTES)
                try:
                    kernels = kernel_list(await self._read(client, f"{base}/api/kernels", token))
                    try:
                        terminals = terminal_activity(
                            await self._read(client, f"{base}/api/terminals", token), until
                        )
                    except Exception as err:
                        self.log.debug("No terminals of %s: %s", lease.user, err)
                        terminals = None
                finally:
                    client.close()
            return kernels, terminals
        except Exception as err:
            self.log.warning("Cannot read kernels of %s/%s: %s", lease.user, lease.server_name, err)
            return None, None

    async def _read(self, client: AsyncHTTPClient, url: str, token: str) -> Any:
        """GET ``url`` (``no_track_activity``: not activity) with ``token``;
        the JSON answer."""
        request = HTTPRequest(
            url + "?no_track_activity=1",
            headers={"Authorization": f"token {token}", "Accept-Encoding": "identity"},
            request_timeout=self.request_timeout,
            decompress_response=False,
        )
        response = await client.fetch(request)
        return json.loads(response.body)

    # -- actions -------------------------------------------------------------------

    async def _act(self, lease: LeaseRef, signals: Signals, now: dt.datetime) -> bool:
        assert lease.granted_at is not None
        track = self.tracks.setdefault(lease.id, Track(gpu_active=now))
        if track.culled:
            self.broker.stop_lease(lease.id, "culled", cause="cull")  # releases after evict_timeout
            return False
        verdict = judge(
            signals,
            track,
            lease.granted_at,
            now,
            self.timeout,
            self.gpu_idle_threshold,
            self.busy_gpu_idle_timeout,
            self.cull_busy_gpu_idle,
        )
        too_old = self.max_age > 0 and (now - lease.granted_at).total_seconds() >= self.max_age
        if too_old:
            verdict = Verdict(verdict.idle, f"older than max_age ({self.max_age:g} s)", True)
        # each notice is recorded before the track says it was given (a
        # notice the store refused is tried again at the next check: no cull
        # without a warning the user got), and the track is stored right
        # after it (a broker stopped later in this check, e.g. while another
        # lease's pre-stop hook runs, neither warns twice nor forgets a deadline)
        if signals.busy and not verdict.cull and "GPU idle" in verdict.reason and not track.flagged:
            self.broker.add_notice(lease, "busy-gpu-idle", verdict.reason)
            track.flagged = True
            self._save()
        track.kernels_seen = track.kernels_seen or signals.kernels is not None
        if not verdict.cull:
            if track.warned_until is not None:
                if signals.kernels is None and track.kernels_seen and track.gpu_active != now:
                    # the kernels could not be read this time (a slow or
                    # restarting server): the hub's activity, which an open
                    # idle tab keeps fresh, is no reason to withdraw a
                    # warning given on the kernels' word; the deadline holds
                    return False
                if signals.busy and signals.gpu_util is None and track.busy_since_gpu_idle:
                    # the GPU could not be read this time (an NVML error): a
                    # busy kernel is no reason to withdraw a warning given on
                    # the GPU's word (its clock runs on); the deadline holds
                    return False
                if not self.dry_run:
                    message = f"active again: {verdict.reason}"
                    self.broker.add_notice(lease, "cull-withdrawn", message)
                track.warned_until = None
                self._save()
            return False
        if track.warned_until is None:
            deadline = now + dt.timedelta(seconds=self.grace)
            if not self.dry_run:  # a dry run tells admins (its report), not users
                message = f"{verdict.reason}; will be culled unless used"
                self.broker.add_notice(lease, "cull-warning", message, deadline)
            track.warned_until = deadline
            self._save()
            return False
        if now < track.warned_until:
            return False
        return await self._cull(lease, track, verdict.reason, verdict.idle)

    async def _cull(self, lease: LeaseRef, track: Track, reason: str, idle: float) -> bool:
        why = f"culled: {reason}"
        if self.dry_run:
            self.broker.add_notice(lease, "cull-dry-run", f"would be {why}")
            self.log.warning("Dry run: lease %s of %s would be %s", lease.id, lease.user, why)
            track.warned_until = None
            return False
        if not await self._pre_stop(lease):
            self.log.error(
                "Not culling lease %s of %s yet: its pre-stop hook could not run "
                "(tried again at the next check)",
                lease.id,
                lease.user,
            )
            return False
        if not any(held.id == lease.id for held in self.broker.server_leases()):
            self.log.info("Lease %s of %s ended while its pre-stop hook ran", lease.id, lease.user)
            return False
        # the notice first, as for a warning: a notice the store refused
        # leaves the lease not culled until the next check, which judges it
        # again and culls it with its reason
        self.broker.add_notice(lease, "culled", why, detail={"idle_seconds": round(idle, 3)})
        self.broker.stop_lease(lease.id, why, cause="cull")
        track.culled = True
        self._save()  # a restarted broker does not cull (and notify) it again
        self.log.warning("Culled lease %s of %s: %s", lease.id, lease.user, why)
        return True

    async def _pre_stop(self, lease: LeaseRef) -> bool:
        """Run the pre-stop hook, if any; whether the cull may go on (the
        hook ran, whatever its exit status, or there is none)."""
        if not self.pre_stop_hook:
            return True
        lifetime = int(self.pre_stop_timeout) + 30
        try:
            async with self.hub.server_token(
                lease.user, lease.server_name, "culler pre-stop hook", lifetime
            ) as token:
                await self._run_hook(lease, token)
        except Exception as err:
            self.log.error("Pre-stop hook for lease %s could not run: %s", lease.id, err)
            return False
        return True

    async def _run_hook(self, lease: LeaseRef, token: str) -> None:
        # exactly these variables: no PATH, and never the broker's own token
        env = {
            "GPUBROKER_USER": lease.user,
            "GPUBROKER_SERVER_NAME": lease.server_name,
            "GPUBROKER_LEASE_ID": str(lease.id),
            "GPUBROKER_SERVER_URL": lease.server_url or "",
            "GPUBROKER_SERVER_TOKEN": token,
        }
        try:
            # its own process group: past pre_stop_timeout the whole hook is
            # killed, with what it started (a script's programs), not only
            # its first process
            proc = await asyncio.create_subprocess_exec(
                *self.pre_stop_hook, env=env, start_new_session=True
            )
        except OSError as err:  # a broken hook command does not keep GPUs held
            self.log.error("Pre-stop hook for lease %s cannot start: %s", lease.id, err)
            return
        try:
            code = await asyncio.wait_for(proc.wait(), self.pre_stop_timeout)
            self.log.info("Pre-stop hook for lease %s exited %s", lease.id, code)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            self.log.warning("Pre-stop hook for lease %s timed out; culling anyway", lease.id)

    def unknown_exempt_classes(self) -> list[str]:
        """The configured ``exempt_priority_classes`` that name no priority
        class in force (a typo such as ``bach`` exempts nothing, and its
        leases are culled); empty while the list is the default, whose
        classes an installation may have replaced on purpose."""
        if self.exempt_priority_classes == self.trait_defaults("exempt_priority_classes"):
            return []
        known = set(self.broker.priority_classes())
        return [c for c in self.exempt_priority_classes if c not in known]

    async def run(self) -> None:
        """Check every ``cull_every`` seconds until cancelled (first saying,
        as a warning, which exempt classes name no class in force)."""
        if not self.kernels_readable:
            self.log.info(
                "Culler: servers' kernels are not read (JupyterHub's internal TLS: a "
                "server takes no certificate of the broker's); servers are judged by hub "
                "activity and GPU use"
            )
        unknown = self.unknown_exempt_classes()
        if unknown:
            self.log.warning(
                "Culler.exempt_priority_classes: no priority class is named %s (classes: %s);"
                " that exempts nothing",
                ", ".join(unknown),
                ", ".join(self.broker.priority_classes()),
            )
        while True:
            await asyncio.sleep(self.cull_every)
            try:
                await self.check_once()
            except Exception:
                self.log.exception("Culler check failed")
                ok = False
            else:
                ok = True
            if self.on_check is not None:
                self.on_check(ok)
