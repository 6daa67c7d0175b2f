"""JupyterHub's internal TLS (``JupyterHub.internal_ssl``) for the broker.

With ``internal_ssl`` on, JupyterHub gives each managed service a key, a
certificate signed by its ``notebooks-ca`` and a trust bundle in three
environment variables (the same ones a single-user server gets):
``JUPYTERHUB_SSL_KEYFILE``, ``JUPYTERHUB_SSL_CERTFILE`` and
``JUPYTERHUB_SSL_CLIENT_CA``. The hub's API then answers only over TLS, to
clients that present a certificate it trusts, and the hub and the proxy
expect the service to do the same:

- the broker serves HTTPS with its certificate and asks every client for a
  certificate the bundle trusts (the hub's and the proxy's: JupyterHub's
  ``internal_ssl_components_trust``);
- its own requests (the hub's API, the hub's token checks) present the
  same certificate and trust only the bundle.

A certificate signed by ``notebooks-ca`` (a user's server, a kernel) is not
in the broker's bundle, so servers and kernels reach the broker through the
hub's proxy (``broker_url_for_servers`` of the spawners, docs/admin.md).

The contexts trust the bundle alone: unlike
``jupyterhub.utils.make_ssl_context``, which also loads the system's
authorities, so that any publicly trusted certificate would pass.

Rule source: JupyterHub's ``init_internal_ssl`` (``jupyterhub/app.py``) and
``jupyterhub.utils.make_ssl_context`` (the same settings, less the
system's authorities).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass

#: the environment variables JupyterHub sets with ``internal_ssl`` on
KEYFILE, CERTFILE, CLIENT_CA = (
    "JUPYTERHUB_SSL_KEYFILE",
    "JUPYTERHUB_SSL_CERTFILE",
    "JUPYTERHUB_SSL_CLIENT_CA",
)


class TLSConfigError(ValueError):
    """The environment names some of the three files but not all."""


@dataclass(frozen=True)
class InternalTLS:
    """The broker's files for JupyterHub's internal TLS (paths).

    Attributes:
        keyfile: its private key (PEM).
        certfile: its certificate (PEM), signed by the hub's ``notebooks-ca``.
        cafile: the bundle of authorities it trusts (PEM).
    """

    keyfile: str
    certfile: str
    cafile: str

    def server_context(self) -> ssl.SSLContext:
        """The context the broker's HTTPS server listens with: its own
        certificate; every client must present one the bundle trusts."""
        return bundle_context(self.keyfile, self.certfile, self.cafile, ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        """The context of the broker's own requests (the hub's API):
        presents its certificate, trusts only the bundle, checks host names."""
        return bundle_context(self.keyfile, self.certfile, self.cafile, ssl.Purpose.SERVER_AUTH)


def bundle_context(
    keyfile: str, certfile: str, cafile: str, purpose: ssl.Purpose
) -> ssl.SSLContext:
    """A TLS context with the key and certificate (PEM paths) that trusts
    the authorities in ``cafile`` and no other (not the system's), and
    always verifies the other side's certificate: a server's
    (``Purpose.SERVER_AUTH``, host names checked too) or a client's
    (``Purpose.CLIENT_AUTH``: a client without one is refused).

    Raises:
        OSError, ssl.SSLError: a file cannot be read or is no PEM.
    """
    client = purpose == ssl.Purpose.SERVER_AUTH
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT if client else ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=cafile)
    context.load_cert_chain(certfile, keyfile)
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = client
    return context


def from_environment(environ: Mapping[str, str]) -> InternalTLS | None:
    """The broker's internal TLS files from ``environ`` (``os.environ``).

    Returns:
        :class:`InternalTLS`, or ``None`` when none of the three variables
        is set (the hub runs without ``internal_ssl``).

    Raises:
        TLSConfigError: one or two of the variables are set (names the
            missing ones), or a named file does not exist.
    """
    values = {name: environ.get(name, "") for name in (KEYFILE, CERTFILE, CLIENT_CA)}
    if not any(values.values()):
        return None
    missing = [name for name, value in values.items() if not value]
    if missing:
        raise TLSConfigError(
            f"internal TLS needs {', '.join(missing)} as well "
            f"(set: {', '.join(n for n, v in values.items() if v)})"
        )
    for name, path in values.items():
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise TLSConfigError(f"{name}={path}: cannot read it ({err.strerror})") from err
    return InternalTLS(values[KEYFILE], values[CERTFILE], values[CLIENT_CA])
