"""Who may do what: JupyterHub scopes as the broker reads them.

Callers authenticate with JupyterHub tokens (``Authorization: token …``),
checked by :class:`jupyterhub.services.auth.HubAuth`. Every caller needs the
access scope of the service (``access:services!service=gpubroker``). Beyond
that:

- ``custom:gpubroker:admin`` (a JupyterHub custom scope, defined in the hub's
  ``c.JupyterHub.custom_scopes``) lets the holder read and change every lease
  and create leases for any user. The broker service's own role has it, and
  the spawner calls the broker with the service's token.
- anyone else may read, create and release only leases whose ``user`` is
  their own name.

Each handler method declares what it needs, in the manner of JupyterHub's
``@needs_scope``::

    @auth.public                                   # no token
    @auth.needs(auth.ACCESS_SCOPE)                 # any caller of the service
    @auth.needs(auth.ADMIN_SCOPE)                  # broker admins only
    @auth.needs(auth.ADMIN_SCOPE, unless_owner=f)  # admins, or the owner f finds

and :meth:`gpubroker.api.handlers.APIHandler.prepare` checks the
declaration (:func:`check`) before the method runs: the one place where a
request is refused for who sent it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import Forbidden, NotFound
from ..model import lifecycle

#: custom scope for broker administration (define it in the hub's config)
ADMIN_SCOPE = "custom:gpubroker:admin"

#: stands for the access scope of the service in declarations; HubAuth
#: (``access_scopes``) holds its exact form, ``access:services!service=NAME``
ACCESS_SCOPE = "access:services"

#: custom scope for reading the broker's Prometheus metrics (the default of
#: ``GPUBrokerApp.metrics_scope``; admins may read them too)
METRICS_SCOPE = "custom:gpubroker:metrics"

#: what to put in ``c.JupyterHub.custom_scopes``
CUSTOM_SCOPES = {
    ADMIN_SCOPE: {
        "description": "Administer the GPU broker: every lease, device and queue entry.",
    },
    METRICS_SCOPE: {
        "description": "Read the GPU broker's Prometheus metrics (no user names in them).",
    },
}

#: a declared scope that names an application setting holding the scope
SETTING = "setting:"


def setting_scope(name: str) -> str:
    """Declare the scope held in the application setting ``name`` (e.g. the
    configurable ``metrics_scope``); holders of :data:`ADMIN_SCOPE` pass too."""
    return SETTING + name


#: ``(handler, *path_args) -> user or None``: how a handler finds the user
#: a request acts on (None: it names none, i.e. the caller's own)
OwnerFinder = Callable[..., "str | None"]
#: ``(handler, *path_args) -> what or None``: a part of the request only
#: admins may ask for, as the 403 names it (None: nothing such)
AdminPart = Callable[..., "str | None"]
#: ``(handler, *path_args) -> message``: the 404 a caller who is neither the
#: owner nor an admin gets for a thing of another user named by its id
#: (its existence and owner are not told: ids can be walked)
Unseen = Callable[..., str]

_F = TypeVar("_F", bound=Callable[..., Any])

#: the attribute of a handler method that holds its :class:`Need`
ATTRIBUTE = "__gpubroker_needs__"


@dataclass(frozen=True)
class Need:
    """What a handler method needs; made by :func:`needs` and :data:`public`.

    Attributes:
        scope: ``None`` (no token), :data:`ACCESS_SCOPE` (any caller of the
            service) or a scope the caller's token must hold, e.g.
            :data:`ADMIN_SCOPE`.
        unless_owner: with ``scope``, the caller may also be the owner this
            finds (a user acting on her own name), see :func:`check_owner`.
        admin_for: with ``unless_owner``, a part of the request that needs
            ``scope`` even from the owner.
        action: what the 403 says needs the scope (``"this endpoint needs
            scope …"``).
        unseen: with ``unless_owner``, for a path naming another user's
            lease or job: the caller who is neither its owner nor holds
            ``scope`` gets this 404, as for an id nobody has, instead of a
            403 naming the owner.
    """

    scope: str | None
    unless_owner: OwnerFinder | None = None
    admin_for: AdminPart | None = None
    action: str = "this endpoint"
    unseen: Unseen | None = None

    @property
    def token(self) -> bool:
        """Whether the caller must authenticate."""
        return self.scope is not None

    @property
    def kind(self) -> str:
        """The need in the API reference's words: ``no token``, ``access``
        (the service's access scope), ``admin`` (and ``custom:gpubroker:admin``),
        ``owner or admin``; another scope by its name."""
        if self.scope is None:
            return "no token"
        if self.scope == ACCESS_SCOPE:
            return "access"
        name = "admin" if self.scope == ADMIN_SCOPE else self.scope
        return f"owner or {name}" if self.unless_owner is not None else name


def needs(
    scope: str,
    *,
    unless_owner: OwnerFinder | None = None,
    admin_for: AdminPart | None = None,
    action: str = "this endpoint",
    unseen: Unseen | None = None,
) -> Callable[[_F], _F]:
    """Declare what a handler method needs (checked by the base handler's
    ``prepare`` before the method runs).

    Args:
        scope: :data:`ACCESS_SCOPE` (every caller of the service) or a scope
            the token must hold, e.g. :data:`ADMIN_SCOPE`.
        unless_owner: ``(handler, *path_args) -> user | None``; the caller
            acting on her own name (or naming no one) needs no ``scope``.
            The finder may raise (400, 404): that answers the request.
        admin_for: ``(handler, *path_args) -> what | None``: a part of the
            request that needs ``scope`` even from the owner.
        action: what the 403 of a caller without ``scope`` names.
        unseen: ``(handler, *path_args) -> message``: a caller who is not
            the owner and lacks ``scope`` gets 404 with it (see :class:`Need`).
    """
    if not scope or (scope == ACCESS_SCOPE and (unless_owner or admin_for)):
        raise ValueError(f"needs({scope!r}): unless_owner/admin_for need a scope beyond access")
    if admin_for is not None and unless_owner is None:
        raise ValueError("needs: admin_for goes with unless_owner")
    if unseen is not None and unless_owner is None:
        raise ValueError("needs: unseen goes with unless_owner")
    need = Need(scope, unless_owner, admin_for, action, unseen)

    def declare(method: _F) -> _F:
        setattr(method, ATTRIBUTE, need)
        return method

    return declare


def public(method: _F) -> _F:
    """Declare a handler method open to everyone, no token needed."""
    setattr(method, ATTRIBUTE, Need(None))
    return method


def need_of(method: Any) -> Need | None:
    """The declaration of a handler method, ``None`` without one."""
    need = getattr(method, ATTRIBUTE, None)
    return need if isinstance(need, Need) else None


def has_scope(model: dict[str, Any], scope: str) -> bool:
    """Whether the caller (a HubAuth user/service model) holds ``scope``."""
    return scope in set(model.get("scopes") or ())


def is_admin(model: dict[str, Any]) -> bool:
    """Whether the caller (a HubAuth user/service model) holds ``ADMIN_SCOPE``."""
    return has_scope(model, ADMIN_SCOPE)


def caller_name(model: dict[str, Any]) -> str:
    """The caller's name (user or service name)."""
    return str(model.get("name", ""))


def caller_actor(model: dict[str, Any]) -> str:
    """The actor the caller's changes are recorded as
    (:func:`gpubroker.model.lifecycle.caller_actor`)."""
    return lifecycle.caller_actor(caller_name(model), str(model.get("kind", "user")))


def own_user(model: dict[str, Any]) -> str | None:
    """The user the caller is, whose leases, jobs and usage are its own;
    ``None`` for a service (JupyterHub's services and users are separate
    names: a service named like a user owns nothing of that user's)."""
    return caller_name(model) if model.get("kind", "user") == "user" else None


def check_owner(model: dict[str, Any], user: str, scope: str = ADMIN_SCOPE) -> None:
    """Allow holders of ``scope`` (admins), and users acting on their own name.

    Raises:
        Forbidden: the caller is neither ``user`` nor holds ``scope``.
    """
    if has_scope(model, scope):
        return
    if own_user(model) == user:
        return
    raise Forbidden(
        f"user: {caller_name(model)!r} may not act on leases of {user!r} (needs scope {scope})"
    )


def check(need: Need, model: dict[str, Any], handler: Any, *args: Any) -> str | None:
    """Refuse the request of an authenticated caller that ``need`` does not
    allow (the access scope is checked by HubAuth, before this).

    Args:
        need: the handler method's declaration.
        model: the caller's HubAuth model.
        handler: the request's handler, given to the declaration's finders.
        args: the path arguments, given to the finders.

    Returns:
        with ``unless_owner``, the user the request acts for: the owner it
        names, else the caller's own name (a user's; a service without the
        scope is refused), or ``None`` (everyone) for a holder of the scope;
        without, ``None``.

    Raises:
        Forbidden: naming the scope that is missing.
        NotFound: with ``unseen``, another user's lease or job.
    """
    scope = need.scope
    if scope is None or scope == ACCESS_SCOPE:
        return None
    if scope.startswith(SETTING):
        if has_scope(model, ADMIN_SCOPE):
            return None
        scope = str(handler.settings.get(scope[len(SETTING) :]) or ADMIN_SCOPE)
    held = has_scope(model, scope)
    if need.unless_owner is None:
        if not held:
            raise Forbidden(f"{need.action} needs scope {scope}")
        return None
    owner = need.unless_owner(handler, *args)  # always: it may answer 400/404 first
    hide = owner is not None and need.unseen is not None and not held
    if hide and own_user(model) != owner:
        assert need.unseen is not None
        raise NotFound(need.unseen(handler, *args))
    if owner is not None:
        check_owner(model, owner, scope)
    elif not held:
        owner = own_user(model)
        if owner is None:  # a service without the scope: nothing here is its own
            raise Forbidden(f"{need.action} needs scope {scope} (a service owns no leases)")
    if not held and need.admin_for is not None:
        part = need.admin_for(handler, *args)
        if part is not None:
            raise Forbidden(f"{part} needs {scope}")
    return owner
