"""Errors the broker core raises; the REST API turns each into its status.

Every error carries a message for people that names the field and the limit
involved (engineering rule 6).
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base of broker errors; ``status`` is the HTTP status the API answers."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(BrokerError):
    """Malformed or out-of-range input (HTTP 400)."""

    status = 400


class Forbidden(BrokerError):
    """The caller may not do this (HTTP 403)."""

    status = 403


class NotFound(BrokerError):
    """No such lease or device (HTTP 404)."""

    status = 404


class Conflict(BrokerError):
    """The request clashes with current state, e.g. a second active lease (HTTP 409)."""

    status = 409


class Unavailable(BrokerError):
    """Something the broker depends on does not answer now, e.g. Slurm while
    the inventory is read again (HTTP 503); try again later."""

    status = 503
