"""The panel's pages: the admins' (overview, queue, leases and jobs,
devices, quotas, usage, audit) and each researcher's own (``me``).

Every page reads the broker's in-memory state through its public queries
(the same the REST API answers from) and every form is one broker command
with the admin as its actor, so the audit log names her. A form answers
with a redirect back to its page (303) and a line saying what was done; a
refused value is shown inline and nothing changes.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tornado import web

from .. import views
from ..api import validation
from ..broker.release_asked import Outcome
from ..errors import BadRequest, BrokerError, Conflict
from ..model.jobs import FINAL
from . import tiles
from .base import PanelHandler

#: the lease states the leases page can filter on
LEASE_STATES = ("active", "pending", "granted", "all")
#: the holder kinds the leases page filters by ("": any)
HOLDER_KINDS = ("", "server", "job", "external")


def _idle_since(handler: PanelHandler) -> dict[int, dt.datetime]:
    """Lease id → when its GPU was last busy, from the culler's tracks."""
    idle = handler.settings.get("idle_since")
    return dict(idle()) if idle else {}


class RootHandler(PanelHandler):
    """``{base}``: admins go to the overview, everyone else to their page."""

    admin_only = False

    def get(self) -> None:
        self.redirect(self.url("overview" if self.admin else "me"))


class OverviewHandler(PanelHandler):
    """``{base}overview``: every node's devices as tiles, split into slots."""

    page = "overview"

    def get(self) -> None:
        values = overview_values(self.broker, self.log, _idle_since(self))
        self.render_page("overview.html", **values)


def overview_values(
    broker: Any, log: Any, idle_since: dict[int, dt.datetime], now: dt.datetime | None = None
) -> dict[str, Any]:
    """What the overview template shows: the node rows of tiles
    (:func:`tiles.overview`), the summary and its sentence
    (:func:`tiles.headline`), the backend and lease counts.

    Args:
        broker: the broker. log: for devices that cannot be read.
        idle_since: lease id → when its GPU was last busy (aware UTC).
        now: aware UTC (default: now).
    """
    listing = views.device_listing(broker, True, "", log)
    for device in listing["devices"]:
        pool = broker.pool_spec(device["uuid"])
        if pool.mode == "timeslice":
            device["reserve_gib"] = pool.reserve_mib / 1024
    leases = broker.list_leases()
    now = now or dt.datetime.now(dt.timezone.utc)
    pending = sum(1 for x in leases if x["state"] == "pending")
    return {
        "nodes": tiles.overview(listing, leases, idle_since, now),
        "summary": listing["summary"],
        "headline": tiles.headline(listing),
        "backend": listing["backend"],
        "running": len(leases) - pending,
        "pending": pending,
        "live": True,
    }


class QueueHandler(PanelHandler):
    """``{base}queue``: waiting requests in order; POST cancels one."""

    page = "queue"

    async def get(self) -> None:
        await self.broker.settled()
        self.render_page("queue.html", queue=self.broker.queue(), done=self.done(), live=True)

    def post(self) -> None:
        _action(self, ("cancel",))
        lease_id = _id(self.form("lease_id"), "lease_id")
        reason = _reason(self.form("reason", ""), f"cancelled by {self.me}")
        lease = self.broker.get_lease(lease_id)
        if lease["state"] != "pending":
            # granted or ended meanwhile (a form sent twice, a stale page):
            # nothing to cancel, as a second release of a lease is a 409
            raise Conflict(f"lease {lease_id}: is {lease['state']}, not waiting")
        self.broker.release_lease(lease_id, reason, actor=self.actor)
        self.broker.note_lease(lease_id, "admin-cancel", reason, notify=True, actor=self.actor)
        self.back("queue", f"Request {lease_id} of {lease['user']} cancelled.")


#: a form's id: decimal digits (ASCII), at most a 64-bit integer
_ID = re.compile(r"[0-9]{1,19}")
#: a form's number of GPUs: a plain decimal, optionally with an exponent
_NUMBER = re.compile(r"[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _id(text: str, field: str) -> int:
    """A form's id field.

    Raises:
        BadRequest: not a positive 64-bit integer, naming ``field``.
    """
    if not _ID.fullmatch(text) or not 1 <= int(text) < 2**63:
        raise BadRequest(f"{field}: must be a positive integer id, got {validation.echo(text)}")
    return int(text)


def _action(handler: PanelHandler, allowed: tuple[str, ...]) -> str:
    """The form's ``action``, one of ``allowed``.

    Raises:
        BadRequest: missing or another value, naming the allowed ones.
    """
    action = handler.form("action", "")
    if action not in allowed:
        raise BadRequest(
            f"action: must be one of {', '.join(allowed)}, got {validation.echo(action)}"
        )
    return action


def _reason(text: str, default: str) -> str:
    """The reason of a form (``default`` when empty).

    Raises:
        BadRequest: over 1000 characters.
    """
    if len(text) > 1000:
        raise BadRequest(f"reason: at most 1000 characters, got {len(text)}")
    return text or default


class LeasesHandler(PanelHandler):
    """``{base}leases?user=&state=&kind=``: leases and jobs with filters;
    POST releases, preempts or cancels one (with a reason, which goes to
    the lease's log, the audit log and a notice for its holder)."""

    page = "leases"

    async def get(self) -> None:
        await self.broker.settled()
        # as sent: Tornado's own reading would turn "%00" into "" (no filter)
        user = validation.query_argument(self.request.query_arguments, "user")
        user = validation.optional_name_arg(user or None, "user")
        state = self.arg("state", "active")
        if state not in LEASE_STATES:
            raise BadRequest(f"state: must be one of {', '.join(LEASE_STATES)}, got {state!r}")
        kind = self.arg("kind", "")
        if kind not in HOLDER_KINDS:
            raise BadRequest(
                f"kind: must be one of {', '.join(k for k in HOLDER_KINDS if k)} (or none),"
                f" got {validation.echo(kind)}"
            )
        leases = self.broker.list_leases(user=user, active=state != "all")
        if state in ("pending", "granted"):
            leases = [x for x in leases if x["state"] == state]
        if state == "all":  # the history: the newest first, so the cut keeps them
            leases.reverse()
        if kind:
            leases = [x for x in leases if x["holder_kind"] == kind]
        jobs_service = self.settings.get("jobs")
        jobs = jobs_service.list(user)[:200] if jobs_service is not None else []
        self.render_page(
            "leases.html",
            leases=leases[:1000],
            shown=min(len(leases), 1000),
            total=len(leases),
            jobs=jobs,
            filters={"user": user or "", "state": state, "kind": kind},
            states=LEASE_STATES,
            kinds=HOLDER_KINDS,
            done=self.done(),
        )

    async def post(self) -> None:
        action = _action(self, ("release", "preempt", "cancel-job"))
        reason = self.form("reason", "")
        if action == "cancel-job":
            await self._cancel_job(_id(self.form("job_id"), "job_id"), reason)
            return
        lease_id = _id(self.form("lease_id"), "lease_id")
        if action == "release":
            await self._release(lease_id, _reason(reason, f"released by {self.me}"))
        elif action == "preempt":
            if not reason:
                raise BadRequest("reason: a preemption needs a reason (the user is told it)")
            lease = self.broker.preempt_lease(lease_id, _reason(reason, ""), actor=self.actor)
            self.back("leases", f"Lease {lease_id} of {lease['user']} preempted.")

    async def _release(self, lease_id: int, text: str) -> None:
        """**Release**: its running server or job is stopped first, and its
        user is told (:mod:`gpubroker.broker.release_asked`)."""
        done = await self.broker.release_asked(
            lease_id, text, self.actor, server_running=self.settings["server_running"], tell=True
        )
        lease, holder = done.lease, done.holder
        if done.outcome is Outcome.ended_already:
            # ended already (by its user, another admin, a form sent twice):
            # no release to record, no notice for its holder
            raise Conflict(f"lease {lease_id}: is {lease['state']} already, nothing to release")
        if done.outcome is Outcome.stopping_already:
            raise Conflict(f"lease {lease_id}: its {holder} is being stopped already")
        if done.outcome is Outcome.stopping:
            what = "Server" if holder == "server" else "Job"
            self.back("leases", f"{what} of lease {lease_id} of {lease['user']} stopping.")
            return
        self.back("leases", f"Lease {lease_id} of {lease['user']} released.")

    async def _cancel_job(self, job_id: int, reason: str) -> None:
        jobs = self.settings.get("jobs")
        if jobs is None:
            raise BadRequest("action: this broker runs no batch jobs")
        why = _reason(reason, f"cancelled by {self.me}")
        before = jobs.get(job_id)
        if before["state"] in FINAL:
            # ended already (by itself, its user, a form sent twice): the
            # cancel changes nothing, as the release of an ended lease
            raise Conflict(f"job {job_id}: is {before['state']} already, nothing to cancel")
        # one being stopped (a preemption's grace) is cancelled all the same:
        # else it would be queued again after the preemption
        job = await jobs.cancel(job_id, why, actor=self.actor)
        if job.get("stopping"):
            self.back("leases", f"Job {job_id} of {job['user']} stopping.")
            return
        self.back("leases", f"Job {job_id} of {job['user']} cancelled.")


class DevicesHandler(PanelHandler):
    """``{base}devices``: drain and undrain devices; switch MIG mode."""

    page = "devices"

    def get(self) -> None:
        listing = views.device_listing(self.broker, True, self.me, self.log)
        self.render_page(
            "devices.html",
            devices=listing["devices"],
            backend=listing["backend"],
            done=self.done(),
        )

    def post(self) -> None:
        action = _action(self, ("drain", "undrain", "mig-on", "mig-off"))
        uuid = validation.check_name(self.form("uuid"), "uuid")
        if action in ("drain", "undrain"):
            held = [h for d, h in self.broker.device_rows() if d.uuid == uuid]
            self.broker.set_drained(uuid, action == "drain", actor=self.actor)
            holders = len(held[0]) if held else 0
            keep = f" {holders} holder(s) keep their leases." if action == "drain" else ""
            self.back("devices", f"Device {uuid} {action}ed.{keep}")
        else:
            self.broker.request_mig_mode(uuid, action == "mig-on", actor=self.actor)
            self.back("devices", f"MIG mode of {uuid}: asked to turn {action[4:]}.")


class QuotasHandler(PanelHandler):
    """``{base}quotas``: the quotas in force with current use; POST sets or
    removes a stored quota (errors inline, nothing changed)."""

    page = "quotas"

    def get(self) -> None:
        self._show()

    def _show(self, error: str = "", values: dict[str, str] | None = None) -> None:
        quotas = self.broker.quotas()
        use = _use_by(self.broker.list_leases())
        self.render_page(
            "quotas.html",
            quotas=quotas,
            use=use,
            form_error=error,
            values=values or {},
            done=self.done(),
        )

    async def post(self) -> None:
        values = {k: self.form(k, "") for k in ("kind", "name", "guaranteed", "limit", "action")}
        try:
            kind, name = validation.quota_path(values["kind"], values["name"])  # as the API
            if values["action"] not in ("set", "delete"):
                raise BadRequest(
                    f"action: must be set or delete, got {validation.echo(values['action'])}"
                )
            if values["action"] == "delete":
                self.broker.delete_quota(kind, name, actor=self.actor)
                self.back("quotas", f"Stored quota of {kind} {name} removed.")
                return
            body: dict[str, Any] = {"guaranteed": _number(values["guaranteed"], "guaranteed")}
            if values["limit"]:
                body["limit"] = _number(values["limit"], "limit")
            else:
                body["limit"] = None
            guaranteed, limit = validation.quota_body(body)
            self.broker.set_quota(kind, name, guaranteed, limit, actor=self.actor)
        except BrokerError as err:
            self.set_status(err.status)
            self._show(err.message, values)  # inline, under the form
            return
        done = f"Quota of {kind} {name} set; it applies from the next pass."
        if kind == "user" and await self.settings["has_user"](name) is False:
            done += " The hub has no such user (yet): it applies once it has."
        self.back("quotas", done)


def _number(text: str, field: str) -> float:
    """A form's number of GPUs: a plain decimal (optionally with an
    exponent), no sign but ``+``.

    Returns:
        the number (not yet checked to be finite: :func:`validation.quota_body`).

    Raises:
        BadRequest: anything else, with the limit the API gives
            (``guaranteed: must be a finite number of GPUs >= 0, got "-1"``).
    """
    if not _NUMBER.fullmatch(text):
        raise BadRequest(
            f"{field}: must be a finite number of GPUs >= 0, got {validation.echo(text)}"
        )
    return float(text)


def _use_by(leases: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """GPUs held now (device units) per ``user:NAME`` and ``group:NAME``."""
    use: dict[str, dict[str, float]] = {"user": {}, "group": {}}
    for lease in leases:
        if lease["state"] != "granted":
            continue
        weight = float(lease.get("weight") or 0.0)
        use["user"][lease["user"]] = use["user"].get(lease["user"], 0.0) + weight
        if lease.get("group"):
            use["group"][lease["group"]] = use["group"].get(lease["group"], 0.0) + weight
    return use


class UsageHandler(PanelHandler):
    """``{base}usage?from=&to=&by=&tz=``: the usage report with its charts;
    ``{base}usage.csv`` with the same arguments downloads it as CSV (the
    text of ``gpubroker report --format csv``)."""

    page = "usage"
    #: the format this route answers in
    fmt = "html"

    async def get(self) -> None:
        from ..usage import query, render
        from ..usage.report import BY, MAX_DAILY_DAYS, ReportError, parse_request
        from ..usage.workers import flush_before_report

        args = {k: self.arg(k, None) or None for k in ("from", "to", "by", "tz")}
        now = dt.datetime.now(dt.timezone.utc)
        try:
            request = parse_request(args["from"], args["to"], args["by"], args["tz"], "csv", now)
        except ReportError as err:
            if self.fmt == "csv":
                raise BadRequest(str(err)) from None
            self.set_status(400)
            self.render_page("usage.html", error=str(err), args=args, by=BY, rows=None)
            return
        ledger = self.settings.get("ledger")
        prices = ledger.price_per_gpu_hour if ledger is not None else {}
        factory = self.broker.session_factory
        # charts are drawn per day: only for periods a daily report may cover
        short = request.end - request.start <= dt.timedelta(days=MAX_DAILY_DAYS)
        want_plots = self.fmt == "html" and short and render.html_problem("html") is None

        def build() -> tuple[Any, list[str]]:
            rows = query.build_report(factory, request, now, prices, user=None)
            figures: list[str] = []
            if want_plots:
                figures = render.figures(query.series(factory, request, now, None))
            return rows, figures

        first = functools.partial(flush_before_report, ledger, self.log)
        rows, figures = await self.settings["reports"].run(self.me, build, first)
        if self.fmt == "csv":
            self.set_header("Content-Type", "text/csv; charset=utf-8")
            day = request.start.date().isoformat()
            self.set_header(
                "Content-Disposition", f'attachment; filename="gpubroker-usage-{day}.csv"'
            )
            self.finish(render.as_csv(request, rows))
            return
        shown = {k: v or "" for k, v in args.items()}
        self.render_page(
            "usage.html",
            error="",
            args=shown,
            by=BY,
            rows=rows,
            columns=render.HEADINGS,
            cell=render.cell,
            header=render.header(request),
            figures=figures,
            charts_note=""
            if want_plots
            else f"Charts are drawn for periods of at most {MAX_DAILY_DAYS} days.",
            csv_query=self.request.query,
        )


class UsageCSVHandler(UsageHandler):
    """``{base}usage.csv``: the report as CSV."""

    fmt = "csv"


class AuditHandler(PanelHandler):
    """``{base}audit?user=&kind=&since=&until=``: the audit log, newest first."""

    page = "audit"

    async def get(self) -> None:
        from ..observe import audit
        from ..usage.report import ReportError, parse_time

        filters = {k: self.arg(k, "") for k in ("user", "kind", "since", "until")}
        bounds: dict[str, dt.datetime | None] = {}
        error = ""
        for name in ("since", "until"):
            try:
                raw = filters[name]
                bounds[name] = parse_time(name, raw, dt.timezone.utc) if raw else None
            except ReportError as err:
                error, bounds[name] = str(err), None
        try:
            audit.check_period(bounds["since"], bounds["until"])
        except ValueError as err:
            error = str(err)
        user = validation.optional_name_arg(filters["user"] or None, "user")
        kind = validation.check_name(filters["kind"], "kind") if filters["kind"] else None
        if error:  # no entries rather than entries the bad bound did not filter
            self.set_status(400)
            self.render_page("audit.html", entries=[], filters=filters, error=error)
            return
        entries = await audit.read(
            self.broker.session_factory,
            bounds["since"],
            bounds["until"],
            user,
            kind,
            500,
            on_behalf=(self.settings.get("service_name") or "gpubroker",),
        )
        self.render_page("audit.html", entries=entries, filters=filters, error=error)


class MeHandler(PanelHandler):
    """``{base}me``: the researcher's own servers, jobs, queue places,
    usage this month against quota, and notices; nobody else's."""

    admin_only = False
    page = "me"

    async def get(self) -> None:
        me = self.own_user
        if not me:  # a service's token: a service named like a user is not that user
            raise web.HTTPError(403, "this page shows a user's own servers: a service has none")
        await self.broker.settled()
        leases = self.broker.list_leases(user=me)
        jobs_service = self.settings.get("jobs")
        jobs = jobs_service.list(me)[:50] if jobs_service is not None else []
        # what each slot's CUDA sees: a MIG instance's own memory (NVML gives
        # no utilization there), a whole or shared GPU's
        held = {s["uuid"] for lease in leases for s in lease["slots"] if s.get("uuid")}
        usage_by_uuid = {
            uuid: views.device_usage(self.broker, uuid, self.log) for uuid in sorted(held)
        }
        rows = await self._month(me)
        room = self.broker.availability(me)
        now = dt.datetime.now(dt.timezone.utc)
        self.render_page(
            "me.html",
            leases=leases,
            jobs=[self._with_link(j) for j in jobs],
            left=lambda lease: tiles.duration(_left(lease, now)),
            cell=render_cell,
            usage_by_uuid=usage_by_uuid,
            month=rows,
            room=room,
            notices=self.broker.notices(me)[:30],
            live=True,
        )

    def _with_link(self, job: dict[str, Any]) -> dict[str, Any]:
        """The job view with a link to its output notebook in the user's
        own server (``/hub/user-redirect/lab/tree/PATH``), when the output
        lies in the user's root directory."""
        jobs = self.settings.get("jobs")
        out = job.get("output")
        job = dict(job, output_link=None, output_name=None)
        if not out or jobs is None:
            return job
        try:
            relative = Path(out).relative_to(jobs.root_of(job["user"]))
        except ValueError:
            return job
        hub = str(self.settings.get("hub_url") or "/hub/")
        job["output_link"] = f"{hub}user-redirect/lab/tree/{quote(relative.as_posix())}"
        job["output_name"] = relative.as_posix()
        return job

    async def _month(self, me: str) -> Any:
        """This month's usage row of the user (UTC), or ``None``."""
        from ..usage import query
        from ..usage.report import parse_request

        now = dt.datetime.now(dt.timezone.utc)
        request = parse_request(None, None, "user", None, "json", now)
        ledger = self.settings.get("ledger")
        prices = ledger.price_per_gpu_hour if ledger is not None else {}
        factory = self.broker.session_factory
        rows = await self.settings["reports"].run(
            me, lambda: query.build_report(factory, request, now, prices, user=me)
        )
        return next((r for r in rows if r.key == me), None)


def _left(lease: dict[str, Any], now: dt.datetime) -> float | None:
    """Seconds until a lease's end (time limit), ``None`` without one."""
    ends = lease.get("ends_at")
    if not ends:
        return None
    return max(0.0, (dt.datetime.fromisoformat(ends.replace("Z", "+00:00")) - now).total_seconds())


def render_cell(value: Any) -> str:
    """A report value as the tables show it."""
    from ..usage.render import cell

    return cell(value)


class StaticHandler(web.StaticFileHandler):
    """``{base}static/…``: the panel's CSS and script (no login needed)."""

    def set_extra_headers(self, path: str) -> None:
        self.set_header("Cache-Control", "no-cache")
