"""JupyterHub's internal TLS files for the broker (gpubroker.hub_tls), with
certificates made the way the hub makes them (certipy)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from types import SimpleNamespace

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


class _Health(web.RequestHandler):
    def get(self) -> None:
        self.finish({"status": "ok"})


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
    hub = certs["hub"]
    spawner = _spawner(certs, "https://127.0.0.1:10101/services/gpubroker/", internal_ssl=True)
    assert spawner.broker.tls == (hub.keyfile, hub.certfile, hub.cafile)

    async def call() -> dict:
        # the spawner's own client, against a broker that asks for the hub's certificate
        sockets = bind_sockets(0, "127.0.0.1")
        port = sockets[0].getsockname()[1]
        app = web.Application([(r"/services/gpubroker/api/v1/health", _Health)])
        server = HTTPServer(app, ssl_options=certs["broker"].server_context())
        server.add_sockets(sockets)
        spawner.broker_url = f"https://127.0.0.1:{port}/services/gpubroker/"
        try:
            return await spawner.broker.health()
        finally:
            server.stop()
            await server.close_all_connections()

    assert asyncio.run(call()) == {"status": "ok"}


def test_the_spawner_keeps_tornados_defaults_otherwise(certs: dict[str, InternalTLS]) -> None:
    plain = _spawner(certs, "http://127.0.0.1:10101/services/gpubroker/", internal_ssl=True)
    assert plain.broker.tls is None  # an http broker URL
    outside = _spawner(certs, "https://broker.example.org/", internal_ssl=False)
    assert outside.broker.tls is None  # no internal TLS: the system's authorities


def test_servers_get_their_own_broker_url_when_one_is_set(certs: dict[str, InternalTLS]) -> None:
    hub_url = "http://127.0.0.1:10101/services/gpubroker/"
    assert _spawner(certs, hub_url, internal_ssl=False).get_env()["GPUBROKER_URL"] == hub_url
    proxied = "https://hub.example.org/services/gpubroker/"
    spawner = _spawner(certs, hub_url, internal_ssl=False, broker_url_for_servers=proxied)
    assert spawner.get_env()["GPUBROKER_URL"] == proxied
    assert spawner.broker.url.startswith(hub_url.rstrip("/"))  # the hub's own calls keep theirs


def test_the_contexts_trust_the_bundle_and_not_the_systems_authorities(
    certs: dict[str, InternalTLS], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stranger's authority in the system's store (``SSL_CERT_FILE``) is
    not trusted by the broker's contexts: not as a server's, not as a
    client's (jupyterhub.utils.make_ssl_context would trust it)."""
    stranger = certs["stranger"]
    monkeypatch.setenv("SSL_CERT_FILE", stranger.cafile)
    with pytest.raises((ssl.SSLError, OSError)):
        asyncio.run(_fetch(stranger, certs["broker"].client_context()))
    context = ssl.create_default_context(cafile=certs["hub"].cafile)
    context.load_cert_chain(stranger.certfile, stranger.keyfile)
    with pytest.raises((ssl.SSLError, OSError)):
        asyncio.run(_fetch(certs["broker"], context))


def test_the_service_calls_with_its_certificate_once_tls_is_set(
    certs: dict[str, InternalTLS], monkeypatch: pytest.MonkeyPatch
) -> None:
    """BrokerService reads the three variables the hub sets, and from then
    on every Tornado request of the process (the hub's API, the culler's)
    presents the broker's certificate; it serves plain HTTP unless its
    service URL is https. Its culler then reads no kernels."""
    import logging

    from gpubroker.service import BrokerService

    tls = certs["broker"]
    for name, value in ((KEYFILE, tls.keyfile), (CERTFILE, tls.certfile), (CLIENT_CA, tls.cafile)):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101/")
    app = SimpleNamespace(ip="127.0.0.1", port=10101, base_url="/services/gpubroker/")
    service = BrokerService(app=app, log=logging.getLogger("test"))  # type: ignore[arg-type]
    assert service.tls == tls
    try:
        assert service._use_tls() == {}  # plain HTTP: the service URL is http
        # a hub that asks for a certificate of the hub's authorities: the
        # process's plain AsyncHTTPClient now presents the broker's
        assert asyncio.run(_fetch(certs["hub"], None)) == b"hello"
        monkeypatch.setenv("JUPYTERHUB_SERVICE_URL", "https://127.0.0.1:10101/")
        assert isinstance(service._use_tls()["ssl_options"], ssl.SSLContext)
        assert service._url().startswith("https://")
    finally:
        AsyncHTTPClient.configure(None)  # Tornado's defaults again


def test_the_culler_asks_for_no_token_when_kernels_cannot_be_read() -> None:
    from gpubroker.culler import Culler

    asked: list[tuple[object, ...]] = []

    class Hub:
        def server_token(self, *args: object) -> None:
            asked.append(args)
            raise RuntimeError("no token here")

    culler = Culler(broker=None, hub=Hub())  # type: ignore[arg-type]
    culler.kernels_readable = False
    lease = SimpleNamespace(server_url="https://127.0.0.1:1/user/ann/", user="ann", server_name="")
    assert asyncio.run(culler._kernels(lease, None)) == (None, None)  # type: ignore[arg-type]
    assert asked == []  # not even tried


def test_a_server_url_is_reported_as_the_hub_would_make_it(
    certs: dict[str, InternalTLS], monkeypatch: pytest.MonkeyPatch
) -> None:
    """https with internal TLS, an IPv6 address in brackets."""
    from gpubroker.client import BrokerClient

    sent: list[str] = []

    async def record(self: object, lease_id: int, url: str, *args: object, **kw: object) -> None:
        sent.append(url)

    monkeypatch.setattr(BrokerClient, "set_server_url", record)
    tls = _spawner(certs, "http://127.0.0.1:10101/services/gpubroker/", internal_ssl=True)
    plain = _spawner(certs, "http://127.0.0.1:10101/services/gpubroker/", internal_ssl=False)
    for spawner, where in ((tls, ("127.0.0.1", 8888)), (plain, ("::1", 8889))):
        spawner.gpu_lease_id = 3
        asyncio.run(spawner._report_url(where))
    assert sent == ["https://127.0.0.1:8888/", "http://[::1]:8889/"]


def test_the_slurm_spawner_refuses_internal_ssl_by_name() -> None:
    from .test_spawner_slurm import make_spawner

    spawner = make_spawner(internal_ssl=True)
    with pytest.raises(Exception, match="does not support JupyterHub's internal_ssl"):
        asyncio.run(spawner.start())
