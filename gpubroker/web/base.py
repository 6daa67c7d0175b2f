"""The panel's base handler: login through the hub (OAuth), XSRF-checked
forms, templates that escape everything.

Who may see what (the same scopes as the API, :mod:`gpubroker.api.auth`):
every page needs the service's access scope (``access:services!service=NAME``);
admin pages need ``custom:gpubroker:admin`` in the OAuth token, which the
hub puts there when the service's ``oauth_client_allowed_scopes`` lists it
and the user's roles hold it. A browser without a login is sent to the
hub's OAuth login (no second login when the hub session is open).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from jupyterhub.services.auth import HubOAuthenticated, UserNotAllowed
from markupsafe import Markup
from tornado import web

from ..api import auth
from ..errors import BrokerError
from . import tiles

#: the templates; autoescape on for every file (names come from users)
TEMPLATES = Environment(
    loader=PackageLoader("gpubroker.web", "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
)
TEMPLATES.filters["duration"] = tiles.duration

#: the query argument that carries a form's outcome back to its page
#: (:meth:`PanelHandler.back`), and how long such a link stays good, days
DONE = "done"
DONE_MAX_AGE_DAYS = 1

#: the admin pages, as the navigation lists them: (path, title)
ADMIN_PAGES = (
    ("overview", "Overview"),
    ("queue", "Queue"),
    ("leases", "Leases and jobs"),
    ("devices", "Devices"),
    ("quotas", "Quotas"),
    ("usage", "Usage"),
    ("audit", "Audit"),
)


def frame(**values: Any) -> dict[str, Any]:
    """The values every page's frame (``base.html``) reads, with defaults:
    ``me``, ``admin``, ``page``, ``url`` (path → panel URL), ``xsrf`` (the
    form field), ``xsrf_token``, ``hub_url``, ``simulated``, ``refresh``
    (seconds), ``done`` and ``error`` (lines to show), ``live``, ``now``."""
    defaults: dict[str, Any] = {
        "me": "",
        "admin": False,
        "pages": ADMIN_PAGES,
        "page": "",
        "url": lambda path="": "/" + path,
        "xsrf": "",
        "xsrf_token": "",
        "hub_url": "/hub/",
        "simulated": False,
        "refresh": 5,
        "done": "",
        "error": "",
        "live": False,
        "now": dt.datetime.now(dt.timezone.utc),
    }
    return defaults | values


def render(template: str, values: dict[str, Any]) -> str:
    """The HTML of ``template`` with ``values`` (see :func:`frame`)."""
    return TEMPLATES.get_template(template).render(**values)


class PanelHandler(HubOAuthenticated, web.RequestHandler):  # type: ignore[misc]
    """Base of every panel page: HTML, logged in through the hub."""

    #: whether the page needs the broker admin scope
    admin_only = True
    #: the page's path below the panel's base (for the navigation)
    page = ""

    @property
    def hub_auth(self) -> Any:
        """The panel's :class:`~jupyterhub.services.auth.HubOAuth`."""
        return self.settings["panel_auth"]

    @hub_auth.setter
    def hub_auth(self, value: Any) -> None:
        raise AttributeError("hub_auth comes from the application settings")

    @property
    def broker(self) -> Any:
        return self.settings["broker"]

    @property
    def log(self) -> Any:
        return self.settings["log"]

    def set_default_headers(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Frame-Options", "DENY")
        self.set_header(
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline';"
            " frame-ancestors 'none'",
        )

    def get_current_user(self) -> dict[str, Any] | None:
        """The user :meth:`prepare` found; never asks the hub itself."""
        model: dict[str, Any] | None = getattr(self, "_hub_auth_user_cache", None)
        return model

    async def prepare(self) -> None:
        """Find the user from the panel's OAuth cookie without blocking the
        loop; send a browser with none to the hub's login (GET), refuse a
        form post without a valid XSRF token (403), and refuse admin pages
        to users without the admin scope (403)."""
        post = self.request.method not in ("GET", "HEAD")
        if post:
            self.check_xsrf_cookie()  # 403 names the missing token first
        model = await self.hub_auth.get_user(self, sync=False)
        if model:
            try:
                model = self.check_hub_user(model)
            except UserNotAllowed:
                raise web.HTTPError(403, "you may not use the GPU broker panel") from None
        self._hub_auth_user_cache = model
        if not model:
            if post:
                raise web.HTTPError(403, "not logged in")
            self.redirect(self.get_login_url())
            return
        self.current_user = model
        if self.admin_only and not self.admin:
            raise web.HTTPError(403, f"this page needs the scope {auth.ADMIN_SCOPE}")

    @property
    def me(self) -> str:
        """The caller's name (a user's, or a service's: the actor of what
        it does)."""
        return auth.caller_name(self.current_user or {})

    @property
    def actor(self) -> str:
        """Who the caller's changes are recorded as (:func:`auth.caller_actor`)."""
        return auth.caller_actor(self.current_user or {})

    @property
    def own_user(self) -> str:
        """The user the caller is, whose leases and jobs are its own; ``""``
        for a service (one named like a user is not that user:
        :func:`auth.own_user`)."""
        return auth.own_user(self.current_user or {}) or ""

    @property
    def admin(self) -> bool:
        """Whether the user holds the broker admin scope."""
        return auth.is_admin(self.current_user or {})

    def url(self, path: str = "") -> str:
        """The panel URL of ``path`` (below the service's base URL)."""
        return str(self.settings["panel_base"]) + path

    def render_page(self, template: str, **values: Any) -> None:
        """Render ``template`` (the page's script refreshes the part in
        ``#live`` by asking for the same URL again)."""
        token = self.xsrf_token
        frame_values = frame(
            me=self.me,
            admin=self.admin,
            page=self.page,
            url=self.url,
            xsrf=Markup(self.xsrf_form_html()),  # Tornado escapes the token
            xsrf_token=token.decode() if isinstance(token, bytes) else token,
            hub_url=self.settings.get("hub_url") or "/hub/",
            simulated=self.broker.inventory_source()["simulated"],
            refresh=self.settings.get("panel_refresh", 5),
        )
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(render(template, frame_values | values))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = self._reason
        if isinstance(exc, web.HTTPError) and exc.log_message:
            message = exc.log_message % exc.args if exc.args else exc.log_message
        elif isinstance(exc, BrokerError):
            message = exc.message
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(
            TEMPLATES.get_template("error.html").render(
                status=status_code,
                message=message,
                url=self.url,
                hub_url=self.settings.get("hub_url") or "/hub/",
            )
        )

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, BrokerError):
            self.send_error(e.status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def form(self, name: str, default: str | None = None) -> str:
        """A form field, stripped (``default`` when absent).

        Raises:
            BadRequest: the field is missing and has no default.
        """
        value = self.get_body_argument(name, default)
        if value is None:
            from ..errors import BadRequest

            raise BadRequest(f"{name}: missing from the form")
        return value.strip()

    def arg(self, name: str, default: Any = None) -> Any:
        """The query argument ``name`` exactly as sent (``default`` when
        absent): Tornado's own reading turns control characters into spaces
        and strips them, so ``?user=%00`` became no filter at all and
        ``?user=%01zed`` the filter ``zed``; the checks now see and refuse
        them, as the API's do (:func:`gpubroker.api.validation.query_argument`).

        Raises:
            BadRequest: the argument is given more than once (as the API
                refuses it: which one would count is not for the server to
                guess), or is not UTF-8.
        """
        from ..api import validation

        value = validation.query_argument(self.request.query_arguments, name)
        return default if value is None else value

    def back(self, path: str, message: str = "") -> None:
        """Redirect (303) to the panel page ``path`` after a form, with a
        message shown there (:meth:`done`). The message travels in the URL
        signed with the panel's cookie secret, so a link made elsewhere
        cannot put words on a panel page."""
        from urllib.parse import urlencode

        target = self.url(path)
        if message:
            signed = self.create_signed_value(DONE, message).decode()
            target += ("&" if "?" in target else "?") + urlencode({DONE: signed})
        self.redirect(target, status=303)

    def done(self) -> str:
        """The message :meth:`back` sent with the redirect to this page;
        ``""`` when there is none, or when it is not signed by this panel
        or older than :data:`DONE_MAX_AGE_DAYS` (it is then ignored)."""
        value = self.arg(DONE)
        if not value:
            return ""
        message = web.decode_signed_value(
            self.settings["cookie_secret"], DONE, value, max_age_days=DONE_MAX_AGE_DAYS
        )
        return message.decode("utf-8", "replace") if message else ""
