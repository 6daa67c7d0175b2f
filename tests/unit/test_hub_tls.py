"""JupyterHub's internal TLS files for the broker (gpubroker.hub_tls), with
certificates made the way the hub makes them (certipy)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from certipy import Certipy
from tornado import web
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets

from gpubroker.hub_tls import (
    CERTFILE,
    CLIENT_CA,
    KEYFILE,
    InternalTLS,
    TLSConfigError,
    from_environment,
)

LOCAL = ["IP:127.0.0.1", "DNS:localhost"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, InternalTLS]:
    """A hub-ca and a notebooks-ca, the broker's pair signed by notebooks-ca
    (as JupyterHub's create_certs does for a service), the hub's pair by
    hub-ca; the broker trusts hub-ca only, the hub trusts both."""
    store = Certipy(store_dir=str(tmp_path_factory.mktemp("certs")))
    store.create_ca("hub-ca")
    store.create_ca("notebooks-ca")
    store.create_ca("stranger-ca")
    bundles = store.trust_from_graph(
        {"hub-ca": ["hub-ca", "notebooks-ca"], "notebooks-ca": ["hub-ca"], "stranger-ca": []}
    )
    out = {}
    for name, ca in (("broker", "notebooks-ca"), ("hub", "hub-ca"), ("stranger", "stranger-ca")):
        files = store.create_signed_pair(name, ca, alt_names=LOCAL)["files"]
        out[name] = InternalTLS(files["key"], files["cert"], bundles[ca])
    return out


def test_no_variables_means_no_internal_tls() -> None:
    assert from_environment({}) is None
    assert from_environment({KEYFILE: "", CERTFILE: "", CLIENT_CA: ""}) is None


def test_some_variables_name_the_missing_ones(tmp_path: Path) -> None:
    key = tmp_path / "k.pem"
    key.write_text("x")
    with pytest.raises(TLSConfigError, match=f"needs {CERTFILE}, {CLIENT_CA} as well"):
        from_environment({KEYFILE: str(key)})


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    there = tmp_path / "there.pem"
    there.write_text("x")
    env = {KEYFILE: str(there), CERTFILE: str(tmp_path / "gone.pem"), CLIENT_CA: str(there)}
    with pytest.raises(TLSConfigError, match=f"{CERTFILE}=.*gone.pem: cannot read it"):
        from_environment(env)


def test_all_three_are_read(certs: dict[str, InternalTLS]) -> None:
    tls = certs["broker"]
    env = {KEYFILE: tls.keyfile, CERTFILE: tls.certfile, CLIENT_CA: tls.cafile}
    assert from_environment(env) == tls


class _Hello(web.RequestHandler):
    def get(self) -> None:
        self.finish("hello")


async def _fetch(server_tls: InternalTLS, client: ssl.SSLContext | None) -> bytes:
    """GET from an HTTPS server with the broker's server context, as ``client``."""
    sockets = bind_sockets(0, "127.0.0.1")
    port = sockets[0].getsockname()[1]
    server = HTTPServer(web.Application([(r"/", _Hello)]), ssl_options=server_tls.server_context())
    server.add_sockets(sockets)
    http = AsyncHTTPClient(force_instance=True)
    try:
        response = await http.fetch(f"https://127.0.0.1:{port}/", ssl_options=client)
        return bytes(response.body)
    finally:
        http.close()
        server.stop()
        await server.close_all_connections()


def test_the_hub_reaches_a_broker_serving_https(certs: dict[str, InternalTLS]) -> None:
    hub = certs["hub"].client_context()
    assert asyncio.run(_fetch(certs["broker"], hub)) == b"hello"


def test_a_broker_serving_https_refuses_clients_without_a_trusted_certificate(
    certs: dict[str, InternalTLS],
) -> None:
    # no certificate at all, trusting the broker's authority
    bare = ssl.create_default_context(cafile=certs["hub"].cafile)
    with pytest.raises((ssl.SSLError, OSError)):
        asyncio.run(_fetch(certs["broker"], bare))
    # a certificate of an authority the broker does not trust
    stranger = certs["stranger"]
    context = ssl.create_default_context(cafile=certs["hub"].cafile)
    context.load_cert_chain(stranger.certfile, stranger.keyfile)
    with pytest.raises((ssl.SSLError, OSError)):
        asyncio.run(_fetch(certs["broker"], context))


def test_the_brokers_requests_trust_only_the_hubs_bundle(certs: dict[str, InternalTLS]) -> None:
    """The broker's client context checks the server against its bundle: a
    server with a certificate of another authority is refused."""
    broker = certs["broker"].client_context()
    assert broker.verify_mode == ssl.CERT_REQUIRED and broker.check_hostname
    with pytest.raises((ssl.SSLError, OSError)):
        asyncio.run(_fetch(certs["stranger"], broker))


# -- the spawner's side -----------------------------------------------------------


def _spawner(certs: dict[str, InternalTLS], url: str, internal_ssl: bool, **kw: object):
    from types import SimpleNamespace

    from jupyterhub.objects import Hub

    from gpubroker_spawner import SimpleLocalGPUSpawner

    hub_files = certs["hub"]
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    if internal_ssl:
        hub.keyfile, hub.certfile, hub.cafile = (
            hub_files.keyfile,
            hub_files.certfile,
            hub_files.cafile,
        )
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann")
    return SimpleLocalGPUSpawner(
        user=user, hub=hub, broker_url=url, internal_ssl=internal_ssl, **kw
    )


def test_the_spawner_calls_an_https_broker_with_the_hubs_certificate(
    certs: dict[str, InternalTLS],
) -> None:
    spawner = _spawner(certs, "https://127.0.0.1:10101/services/gpubroker/", internal_ssl=True)
    context = spawner.broker.ssl_options
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED
    # it works against a broker serving the hub's internal TLS
    assert asyncio.run(_fetch(certs["broker"], context)) == b"hello"


def test_the_spawner_keeps_tornados_defaults_otherwise(certs: dict[str, InternalTLS]) -> None:
    plain = _spawner(certs, "http://127.0.0.1:10101/services/gpubroker/", internal_ssl=True)
    assert plain.broker.ssl_options is None  # an http broker URL
    outside = _spawner(certs, "https://broker.example.org/", internal_ssl=False)
    assert outside.broker.ssl_options is None  # no internal TLS: the system's authorities


def test_servers_get_their_own_broker_url_when_one_is_set(certs: dict[str, InternalTLS]) -> None:
    hub_url = "http://127.0.0.1:10101/services/gpubroker/"
    assert _spawner(certs, hub_url, internal_ssl=False).get_env()["GPUBROKER_URL"] == hub_url
    proxied = "https://hub.example.org/services/gpubroker/"
    spawner = _spawner(certs, hub_url, internal_ssl=False, broker_url_for_servers=proxied)
    assert spawner.get_env()["GPUBROKER_URL"] == proxied
    assert spawner.broker.url.startswith(hub_url.rstrip("/"))  # the hub's own calls keep theirs
