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
"""

from __future__ import annotations

from typing import Any

from ..errors import Forbidden

#: custom scope for broker administration (define it in the hub's config)
ADMIN_SCOPE = "custom:gpubroker:admin"

#: what to put in ``c.JupyterHub.custom_scopes``
CUSTOM_SCOPES = {
    ADMIN_SCOPE: {
        "description": "Administer the GPU broker: every lease, device and queue entry.",
    },
}


def is_admin(model: dict[str, Any]) -> bool:
    """Whether the caller (a HubAuth user/service model) holds ``ADMIN_SCOPE``."""
    return ADMIN_SCOPE in set(model.get("scopes") or ())


def caller_name(model: dict[str, Any]) -> str:
    """The caller's name (user or service name)."""
    return str(model.get("name", ""))


def check_owner(model: dict[str, Any], user: str) -> None:
    """Allow admins, and users acting on their own name.

    Raises:
        Forbidden: the caller is neither ``user`` nor a broker admin.
    """
    if is_admin(model):
        return
    if model.get("kind", "user") == "user" and caller_name(model) == user:
        return
    raise Forbidden(
        f"user: {caller_name(model)!r} may not act on leases of {user!r} "
        f"(needs scope {ADMIN_SCOPE})"
    )
