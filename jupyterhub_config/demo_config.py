"""JupyterHub config of the gpubroker demo: fake GPUs, local processes, any user name.

Run it with ``make demo`` (or ``jupyterhub -f jupyterhub_config/demo_config.py``
from the repository root with the project's virtualenv active). Everything
binds to 127.0.0.1. Log in with any user name and the demo's password
(JupyterHub's ``SharedPasswordAuthenticator``); the user ``admin`` with the
admin password. The hub prints both at its start; they are made at the first
start and kept in the state dir (``demo-password``, ``demo-admin-password``).
Every server runs as the account that started the demo (root, if root did),
so anyone who could log in without a password could act as that account:
other accounts of the machine reach 127.0.0.1 too.

Environment variables (all optional; the tests use them to run this same
config on free ports):

- ``GPUBROKER_DEMO_DIR``: where state goes (hub and broker SQLite, secrets);
  default ``demo-run/`` in the repository. The settings that decide the
  devices (inventory, backend, node, Slurm or not) are kept there in
  ``demo-setup.json``: a start with other ones stops at once with a message
  naming the folder to delete (its broker database holds the old devices).
  A change of ``GPUBROKER_DEMO_SHARING`` alone is fine: the simulated MIG
  mode is set to match (:func:`set_simulated_mig_mode`).
- ``GPUBROKER_DEMO_PORT``: public port of the hub (default 8000);
  ``GPUBROKER_DEMO_HUB_PORT``, ``GPUBROKER_DEMO_PROXY_API_PORT`` and
  ``GPUBROKER_DEMO_BROKER_PORT``: internal ports (defaults 8081, 8001, 10101).
- ``GPUBROKER_DEMO_PASSWORD`` (at least 8 characters) and
  ``GPUBROKER_DEMO_ADMIN_PASSWORD`` (at least 32): the login passwords
  (default: made at the first start, kept in the state dir).
- ``GPUBROKER_DEMO_DB_URL``: the broker's store (default the SQLite file
  ``gpubroker.sqlite`` in the state dir; the tests also use PostgreSQL).
- ``GPUBROKER_DEMO_INVENTORY``: fake devices (default ``8 x NVIDIA H100 80GB HBM3``;
  ``N x MODEL``, or a Python list of such strings for several models).
- ``GPUBROKER_DEMO_RECONCILE_INTERVAL``: seconds between broker/hub
  reconciliations (default 30); ``GPUBROKER_DEMO_POLL_INTERVAL``: the hub's
  server poll interval (default 30).
- ``GPUBROKER_DEMO_CHECK_STATE``: ``off`` (the default), ``log`` or
  ``raise``: the broker's ``Broker.check_state`` (the tests use ``raise``).
- ``GPUBROKER_DEMO_HUB_GONE_TIMEOUT``: seconds after which the broker exits
  when its hub is gone (default: the broker's, 60).
- ``GPUBROKER_DEMO_LEDGER_INTERVAL``: seconds between the usage ledger's
  writes (``Ledger.flush_interval``, default 10); its GPU-use samples come at
  three times that (the tests use short ones).
- ``GPUBROKER_DEMO_API_TOKEN``: if set, a service ``demo-admin`` with this
  token and admin scopes (hub and broker) is registered, for scripted use.
- ``GPUBROKER_DEMO_EXTRA_CONFIG``: a hub config file loaded after this one.
- ``GPUBROKER_DEMO_EXTERNAL_BROKER``: ``1``: the hub does not start the
  broker; one started elsewhere (e.g. from docker/broker) serves at the
  broker port, with the service token of the state dir.
- ``GPUBROKER_DEMO_BROKER_CONFIG``: the broker's config file (default
  ``gpubroker_config.py`` in the state dir, if it exists): quotas, classes…
- ``GPUBROKER_DEMO_SHARING``: ``1`` (the default) splits the devices into
  pools (:func:`sharing_layout`): a quarter (at least one) time-sliced
  shares, as many MIG (MIG mode on), the rest whole -- for the eight fake
  H100s GPUs 0-3 whole, 4-5 MIG, 6-7 shared -- and gives the spawn form
  profiles ("Full H100", "MIG 1g.10gb", "MIG 3g.40gb", "Shared GPU, 10 GiB",
  "No GPU"; the MIG profiles are the model's). Fewer than three devices get
  no pools, devices without MIG no MIG pool (the log says so). ``0``: every
  GPU whole and a GPU-count form (the tests' default).
- ``GPUBROKER_DEMO_SLURM_CONF``: the ``slurm.conf`` of a Slurm cluster
  (``make demo-slurm`` starts one of two nodes here): the broker takes its
  inventory from Slurm and runs jobs as Slurm jobs on the ``batch``
  partition, servers are Slurm jobs on the ``interactive`` partition
  (``SlurmGPUSpawner``, as this account), whole GPUs only (no sharing
  profiles: Slurm cannot split GPUs the broker's way).
  ``GPUBROKER_DEMO_INVENTORY_INTERVAL``: seconds between the broker's reads
  of Slurm's inventory (default 30).
- ``GPUBROKER_DEMO_INTERNAL_SSL``: ``1``: JupyterHub's internal TLS
  (``internal_ssl``): the hub's API, the proxy's API and the servers answer
  HTTPS with certificates the hub makes (in ``internal-ssl/`` of the state
  dir); the broker calls the hub with its own (docs/admin.md, "Internal TLS").

At shutdown (Ctrl-C) the hub stops the servers before the broker
(:func:`gpubroker_spawner.shutdown.stop_servers_before_services`), so their
leases are released then.
"""

import ast
import html
import json
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any, NoReturn

from jupyterhub.app import JupyterHub
from traitlets.log import get_logger

from gpubroker.api.auth import ADMIN_SCOPE, CUSTOM_SCOPES
from gpubroker.devices.base import DeviceBackendError
from gpubroker.devices.fake import MIG_STATE_KEY, fake_uuid, parse_inventory_entry
from gpubroker.devices.mig import spec_for
from gpubroker.devices.models import GPUModel
from gpubroker_spawner.shutdown import stop_servers_before_services

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file
log = get_logger()  # the hub's log when JupyterHub loads this file


def _fail(message: str) -> NoReturn:
    """Stop the hub before it starts, saying why (a config error, not a traceback)."""
    log.error("gpubroker demo: %s", message)
    raise SystemExit(1)


repo = Path(__file__).resolve().parent.parent
state = Path(os.environ.get("GPUBROKER_DEMO_DIR", repo / "demo-run")).resolve()
state.mkdir(parents=True, exist_ok=True)


def _port(name, fallback):
    return int(os.environ.get(f"GPUBROKER_DEMO_{name}", fallback))


def _secret(name, make=lambda: secrets.token_hex(32)):
    """A secret kept in the state dir (mode 0600 from its creation), so
    restarts of the hub keep it; ``make()`` makes it at the first start."""
    path = state / name
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make())
    return path.read_text().strip()


def _password(name, variable, nbytes):
    """A login password of the demo: ``$GPUBROKER_DEMO_<variable>``, else
    one of ``nbytes`` random bytes (URL-safe text) kept in the state dir."""
    return os.environ.get(f"GPUBROKER_DEMO_{variable}") or _secret(
        name, lambda: secrets.token_urlsafe(nbytes)
    )


# -- the simulated GPUs and how the demo shares them -------------------------------------
DEFAULT_INVENTORY = "8 x NVIDIA H100 80GB HBM3"
#: the memory of the spawn form's time-sliced share, and what each shared GPU keeps back
SHARE_GIB, SHARE_RESERVE_GIB = 10, 2
#: fewest devices split into whole, MIG and shared pools (one each)
SHARING_MIN_DEVICES = 3


def _switch(name: str, default: bool) -> bool:
    """An on/off environment variable: ``1``/``0`` (or true/false, yes/no, on/off)."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 (on) or 0 (off)")


def inventory_models(text: str) -> list[GPUModel]:
    """The model of each simulated device, by index, as the broker's
    ``FakeDeviceBackend.inventory`` numbers them: ``text`` is one entry
    (``"4 x A100-80GB"``) or a list of entries (``'["4 x H100", "4 x L40S"]'``).

    Raises:
        ValueError: a malformed entry or an unknown model (the message says which).
    """
    text = text.strip()
    entries: Any = [text]
    if text.startswith("["):
        try:
            entries = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            entries = None
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ValueError(
                f"GPUBROKER_DEMO_INVENTORY={text!r}: expected 'N x MODEL' or a Python list"
                " of such strings"
            )
    models: list[GPUModel] = []
    for entry in entries:
        try:
            count, model = parse_inventory_entry(entry)
        except DeviceBackendError as err:
            raise ValueError(f"GPUBROKER_DEMO_INVENTORY: {err}") from None
        models += [model] * count
    return models


def inventory_text(models: list[GPUModel]) -> str:
    """``"4 x NVIDIA A100-SXM4-80GB"``: the devices, however the inventory was spelled."""
    groups: list[list[Any]] = []
    for model in models:
        if groups and groups[-1][1] == model.name:
            groups[-1][0] += 1
        else:
            groups.append([1, model.name])
    return ", ".join(f"{count} x {name}" for count, name in groups)


def short_name(models: list[GPUModel]) -> str:
    """``H100`` for NVIDIA H100 80GB HBM3, ``A100`` for NVIDIA A100-SXM4-80GB;
    ``GPU`` for devices of several models."""
    names = {model.name for model in models}
    if len(names) != 1:
        return "GPU"
    (name,) = names
    match = re.search(r"\b[A-Z]+\d+[A-Z]*", name.removeprefix("NVIDIA ").removeprefix("Tesla "))
    return match.group(0) if match else name


def _a(word: str) -> str:
    """``an H100``, ``a T4``: the article as the letters are spoken."""
    return f"{'an' if word[:1] in 'AEFHILMNORSX' else 'a'} {word}"


def _ranges(indices: list[int]) -> str:
    """``0-3,6``: device indices as ``Pools.pools`` selectors write them."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _gpus(indices: list[int]) -> str:
    return f"GPU{'s' if len(indices) > 1 else ''} {_ranges(indices)}"


def sharing_layout(models: list[GPUModel]) -> dict[str, Any]:
    """How the demo shares its devices (``GPUBROKER_DEMO_SHARING=1``).

    A quarter of the devices (at least one) are handed out as time-sliced
    shares (the highest indices), as many as MIG instances (the highest
    MIG-capable ones below those), the rest whole: eight give 0-3 whole,
    4-5 MIG, 6-7 shared; four give 0-1, 2, 3. With fewer than three
    devices there are no pools (whole GPUs and the GPU-count menu); without
    a MIG-capable device there is no MIG pool.

    Returns:
        ``pools`` (``Pools.pools``), ``mig_enabled``
        (``FakeDeviceBackend.mig_enabled``), ``profiles`` (the spawners'
        ``gpu_profiles``; ``[]``: the GPU-count menu), ``summary`` (a line
        for the log) and ``skipped`` (whether a pool was left out).
    """
    n = len(models)
    off = "GPUBROKER_DEMO_SHARING=0: whole GPUs only"
    if n < SHARING_MIN_DEVICES:
        summary = (
            f"sharing is on, but {n} simulated GPU{'s are' if n != 1 else ' is'} too few for"
            f" whole, MIG and shared pools (they take {SHARING_MIN_DEVICES} at least): no MIG or"
            " shared pools, every GPU is handed out whole and the spawn page has the GPU-count"
            f" menu (more GPUs with GPUBROKER_DEMO_INVENTORY, or {off})"
        )
        return {"pools": [], "mig_enabled": [], "profiles": [], "summary": summary, "skipped": True}
    k = max(1, n // 4)
    shared = list(range(n - k, n))
    # MIG on the highest MIG-capable devices below the shared ones, all of one MIG geometry
    kinds = {i: spec_for(models[i].name) for i in range(n - k)}
    capable = [i for i, kind in kinds.items() if kind is not None]
    spec = kinds[capable[-1]] if capable else None
    mig = [i for i in capable if spec is not None and kinds[i] == spec][-k:]
    whole = [i for i in range(n - k) if i not in mig]

    def name(indices: list[int]) -> str:
        return short_name([models[i] for i in indices])

    whole_names = {models[i].name for i in whole}
    profiles: list[dict[str, Any]] = [
        {
            "display_name": f"Full {name(whole)}",
            "description": f"One whole {whole_names.pop() if len(whole_names) == 1 else 'GPU'}.",
            "request": {"gpus": 1},
        }
    ]
    pools: list[dict[str, Any]] = []
    parts = [f"{_gpus(whole)} whole"]
    if spec is not None:
        pools.append({"name": "mig", "mode": "mig", "devices": [f"*:{_ranges(mig)}"]})
        parts.append(f"{_gpus(mig)} MIG instances (MIG mode on)")
        plain = sorted(
            (p for p in spec.profiles.values() if not p.media_extensions),
            key=lambda p: (p.compute_slices, p.memory_slices),
        )
        small = plain[0]
        medium = next((p for p in plain if p.compute_slices == 3), None) or next(
            (p for p in plain if p.compute_slices == spec.compute_slices // 2), small
        )
        for profile in dict.fromkeys((small, medium)):
            profiles.append(
                {
                    "display_name": f"MIG {profile.name}",
                    "description": f"A {profile.compute_slices}/{spec.compute_slices} slice of"
                    f" {_a(name(mig))} with {profile.memory_gib} GB, isolated in hardware.",
                    "request": {"mig_profile": profile.name},
                    **({"default": True} if profile is small else {}),
                }
            )
    pools.append(
        {
            "name": "shared",
            "mode": "timeslice",
            "devices": [f"*:{_ranges(shared)}"],
            "reserve_gib": SHARE_RESERVE_GIB,
        }
    )
    parts.append(f"{_gpus(shared)} time-sliced shares")
    profiles.append(
        {
            "display_name": f"Shared GPU, {SHARE_GIB} GiB",
            "description": f"{SHARE_GIB} GiB of {_a(name(shared))} shared with others"
            " (time-sliced).",
            "request": {"memory_gib": SHARE_GIB},
            **({} if spec is not None else {"default": True}),
        }
    )
    profiles.append({"display_name": "No GPU", "request": {}})
    if spec is None:
        parts.append(f"no MIG pool: {name(list(range(n - k)))} cannot do MIG")
    return {
        "pools": pools,
        "mig_enabled": mig,
        "profiles": profiles,
        "summary": f"sharing is on: {'; '.join(parts)} ({off})",
        "skipped": spec is None,
    }


#: what the state dir's broker and simulated GPUs were set up for
SETUP_FILE = "demo-setup.json"


def check_state_dir(state: Path, devices: dict[str, str], sharing: bool) -> bool | None:
    """Refuse to start on the state of a demo on other GPUs; return the last
    run's sharing setting (``None``: not known).

    The broker's database and the simulated GPUs' state in ``state``
    describe the devices of the run that made them: on other devices (another
    inventory, node name, backend, or Slurm) the old ones linger as absent
    devices in the broker. ``devices`` (the settings that decide them) and
    ``sharing`` are kept in ``state``; when ``devices`` differ from the last
    run's, the hub stops with a message naming the folder to delete (or
    another folder to use). A change of ``sharing`` alone is the caller's to
    handle (:func:`set_simulated_mig_mode`).
    """
    record = state / SETUP_FILE
    try:
        before = json.loads(record.read_text())
    except (OSError, ValueError):
        before = None  # a new state dir, or one from before this record
    if not isinstance(before, dict):
        before = {}
    changes = "; ".join(
        f"{name} was {before[name]!r}, now {value!r}"
        for name, value in devices.items()
        if name in before and before[name] != value
    )
    if changes:
        _fail(
            f"the demo's state in {state} was made for other GPUs ({changes}). Its broker"
            " database still holds those devices, so the demo would run with stale, absent"
            f" ones. Start afresh by deleting it:  rm -rf {state}  (this also deletes the"
            " demo's users, usage records and home directories), or keep it and run this"
            " set-up in another folder:  GPUBROKER_DEMO_DIR=/some/other/dir make demo"
        )
    setup = {**devices, "GPUBROKER_DEMO_SHARING": "1" if sharing else "0"}
    record.write_text(json.dumps(setup, indent=1) + "\n")
    last = before.get("GPUBROKER_DEMO_SHARING")
    return None if last not in ("0", "1") else last == "1"


def set_simulated_mig_mode(
    state_file: Path, node: str, models: list[GPUModel], mig_enabled: list[int]
) -> None:
    """Set the simulated MIG mode of the demo's GPUs to ``mig_enabled``.

    The fake backend's state file keeps each GPU's MIG mode once the broker
    has changed it, and that wins over ``FakeDeviceBackend.mig_enabled``: a
    run without sharing turns MIG mode off (no MIG pool), and the next run
    with sharing would find its MIG pool's GPUs with MIG mode off. GPUs that
    still hold MIG instances are left as they are (the broker sorts them out).
    """
    try:
        data = json.loads(state_file.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as err:
        log.warning("gpubroker demo: cannot read %s (%s): MIG mode left as it is", state_file, err)
        return
    section = data.get(MIG_STATE_KEY) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        return
    for index, model in enumerate(models):
        entry = section.get(fake_uuid(node, index, model.name))
        if isinstance(entry, dict) and not entry.get("instances"):
            entry["enabled"] = index in mig_enabled
    temporary = state_file.with_name(state_file.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    temporary.replace(state_file)


broker_port = _port("BROKER_PORT", 10101)
try:
    # JupyterHub's internal TLS: the hub, the proxy, the broker and the servers
    # talk HTTPS with certificates the hub makes (docs/admin.md, "Internal TLS")
    internal_ssl = _switch("GPUBROKER_DEMO_INTERNAL_SSL", False)
except ValueError as err:
    _fail(str(err))
broker_url = f"http://127.0.0.1:{broker_port}/services/gpubroker/"
broker_token = _secret("gpubroker-service-token")

# -- the hub ------------------------------------------------------------------------
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = _port("PORT", 8000)
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = _port("HUB_PORT", 8081)
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
c.JupyterHub.allow_named_servers = True
c.JupyterHub.cleanup_servers = True
if JupyterHub.initialized():  # loaded by the hub itself (not read by a test)
    stop_servers_before_services(JupyterHub.instance())
# any user name, with the demo's password: every server runs as the account
# that started the demo, so a login without one would be that account's for
# anyone who reaches 127.0.0.1 (other accounts of the machine included)
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = _password("demo-password", "PASSWORD", 9)
c.SharedPasswordAuthenticator.admin_password = _password(
    "demo-admin-password", "ADMIN_PASSWORD", 24
)
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {"admin"}


def _kept(name, variable):
    """Where a login password of the demo comes from, for the login page."""
    if os.environ.get(f"GPUBROKER_DEMO_{variable}"):
        return f"${{GPUBROKER_DEMO_{variable}}}"
    return f"kept in {state / name}"


# the login page says where the password is (never the password itself)
c.JupyterHub.template_vars = {
    "announcement_login": html.escape(
        "gpubroker demo: any user name, with the password the hub printed at its start "
        f"({_kept('demo-password', 'PASSWORD')}; "
        f"admin's: {_kept('demo-admin-password', 'ADMIN_PASSWORD')})"
    )
}
if JupyterHub.initialized():  # the hub's start: say how to log in
    passwords = c.SharedPasswordAuthenticator
    print(
        f"gpubroker demo: log in at http://127.0.0.1:{c.JupyterHub.port} with any user name "
        f"and the password {passwords.user_password}; as 'admin' (hub and broker "
        f"admin) with {passwords.admin_password} (set by "
        "$GPUBROKER_DEMO_PASSWORD and $GPUBROKER_DEMO_ADMIN_PASSWORD, else kept in "
        f"{state}/demo-password and demo-admin-password).",
        file=sys.stderr,
        flush=True,
    )

proxy = repo / "node_modules" / ".bin" / "configurable-http-proxy"
c.ConfigurableHTTPProxy.command = [str(proxy) if proxy.exists() else "configurable-http-proxy"]
proxy_api_scheme = "https" if internal_ssl else "http"
c.ConfigurableHTTPProxy.api_url = f"{proxy_api_scheme}://127.0.0.1:{_port('PROXY_API_PORT', 8001)}"
if internal_ssl:
    c.JupyterHub.internal_ssl = True
    c.JupyterHub.internal_certs_location = str(state / "internal-ssl")
c.ConfigurableHTTPProxy.auth_token = _secret("proxy-token")
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")

# -- the broker, a hub-managed service ------------------------------------------------
c.JupyterHub.custom_scopes = CUSTOM_SCOPES
inventory = os.environ.get("GPUBROKER_DEMO_INVENTORY", DEFAULT_INVENTORY)
slurm_conf = os.environ.get("GPUBROKER_DEMO_SLURM_CONF", "")
backend = os.environ.get("GPUBROKER_DEMO_BACKEND", "fake")
node_name = os.environ.get("GPUBROKER_DEMO_NODE", "demo-node")
try:
    sharing = _switch("GPUBROKER_DEMO_SHARING", not slurm_conf)
    models = inventory_models(inventory)
except ValueError as err:
    _fail(str(err))
devices = {
    "GPUBROKER_DEMO_INVENTORY": inventory_text(models),
    "GPUBROKER_DEMO_BACKEND": backend,
    "GPUBROKER_DEMO_NODE": node_name,
    "GPUBROKER_DEMO_SLURM_CONF": "set" if slurm_conf else "unset",
}
sharing_before = check_state_dir(state, devices, sharing)
default_db = f"sqlite:///{state / 'gpubroker.sqlite'}"
broker_config = os.environ.get("GPUBROKER_DEMO_BROKER_CONFIG", str(state / "gpubroker_config.py"))
layout = sharing_layout(models) if sharing else None
if sharing_before is not None and sharing_before != sharing:
    # the simulated GPUs keep the MIG mode the last run left them in
    set_simulated_mig_mode(
        state / "fake-gpu-usage.json", node_name, models, layout["mig_enabled"] if layout else []
    )
sharing_args = []
if layout is not None:
    (log.warning if layout["skipped"] else log.info)("gpubroker demo: %s", layout["summary"])
    if layout["pools"]:
        sharing_args = [
            # pools and MIG mode on the command line, so a broker config file stays free
            f"--Pools.pools={json.dumps(layout['pools'])}",
            f"--FakeDeviceBackend.mig_enabled={json.dumps(layout['mig_enabled'])}",
        ]
extra_broker_args = []
if os.environ.get("GPUBROKER_DEMO_CHECK_STATE"):
    extra_broker_args.append(f"--Broker.check_state={os.environ['GPUBROKER_DEMO_CHECK_STATE']}")
if os.environ.get("GPUBROKER_DEMO_HUB_GONE_TIMEOUT"):
    extra_broker_args.append(
        f"--GPUBrokerApp.hub_gone_timeout={os.environ['GPUBROKER_DEMO_HUB_GONE_TIMEOUT']}"
    )
if os.environ.get("GPUBROKER_DEMO_LEDGER_INTERVAL"):
    interval = float(os.environ["GPUBROKER_DEMO_LEDGER_INTERVAL"])
    extra_broker_args += [
        f"--Ledger.flush_interval={interval}",
        f"--Ledger.sample_interval={3 * interval}",
    ]
if slurm_conf:
    extra_broker_args += [
        "--Broker.engine_kind=slurm",
        f"--Broker.inventory_interval={os.environ.get('GPUBROKER_DEMO_INVENTORY_INTERVAL', '30')}",
        f"--SlurmEngine.slurm_conf={slurm_conf}",
        "--SlurmEngine.partition=batch",
        "--JobService.runner=slurm",
    ]
c.JupyterHub.services = [
    {
        "name": "gpubroker",
        # plain HTTP on loopback, also with internal TLS (docs/admin.md)
        "url": f"http://127.0.0.1:{broker_port}",
        "api_token": broker_token,
        # the panel: Services -> gpubroker; a panel login carries the admin
        # scope for users whose roles hold it (admin pages), none for others
        "display": True,
        "oauth_client_allowed_scopes": [ADMIN_SCOPE],
        "oauth_no_confirm": True,  # the hub's own broker: no "Authorize access" page
        "command": [
            sys.executable,
            "-m",
            "gpubroker",
            "serve",
            f"--device-backend={backend}",
            f"--FakeDeviceBackend.inventory={inventory}",
            f"--FakeDeviceBackend.node_name={node_name}",
            f"--FakeDeviceBackend.state_file={state / 'fake-gpu-usage.json'}",
            f"--GPUBrokerApp.reconcile_interval="
            f"{os.environ.get('GPUBROKER_DEMO_RECONCILE_INTERVAL', '30')}",
            f"--config={broker_config}",
            # batch jobs run in the same home directories as the servers, as this account
            f"--JobService.root_dir_template={state / 'home' / '{username}'}",
            "--JobService.run_as_self=True",
            *sharing_args,
            *extra_broker_args,
        ],
        "cwd": str(state),
        # the store's URL (a password, for PostgreSQL) in the environment, not
        # the command line, which every local user can read (ps, /proc)
        "environment": {"GPUBROKER_DB_URL": os.environ.get("GPUBROKER_DEMO_DB_URL", default_db)},
    }
]
if os.environ.get("GPUBROKER_DEMO_EXTERNAL_BROKER") == "1":
    # the broker is started by someone else (e.g. from its image) at the same URL
    del c.JupyterHub.services[0]["command"], c.JupyterHub.services[0]["cwd"]
c.JupyterHub.load_roles = [
    {
        # the broker (and the spawner, which calls the broker with the same token)
        "name": "gpubroker-service",
        "services": ["gpubroker"],
        "scopes": [
            "list:users",
            "read:users",
            "read:servers",
            "delete:servers",
            # the culler reads kernels of servers holding GPUs with a token the hub
            # issues per read: owned by that user, limited to that one server
            "tokens",
            "access:services!service=gpubroker",
            ADMIN_SCOPE,
        ],
    },
    {
        # every user may call the broker (for their own leases only)
        "name": "user",
        "scopes": ["self", "access:services!service=gpubroker"],
    },
    {
        # the demo's hub admin is a broker admin too (quotas, drains, MIG mode)
        "name": "gpubroker-admin",
        "users": ["admin"],
        "scopes": ["access:services!service=gpubroker", ADMIN_SCOPE],
    },
]
demo_token = os.environ.get("GPUBROKER_DEMO_API_TOKEN")
if demo_token:
    c.JupyterHub.services.append({"name": "demo-admin", "api_token": demo_token})
    c.JupyterHub.load_roles.append(
        {
            "name": "demo-admin",
            "services": ["demo-admin"],
            "scopes": [
                "admin:users",
                "admin:groups",
                "admin:servers",
                "admin:server_state",
                "tokens",
                "access:services!service=gpubroker",
                ADMIN_SCOPE,
            ],
        }
    )

# -- the spawner ------------------------------------------------------------------------
c.JupyterHub.spawner_class = "gpubroker-simple"
# (DockerGPUSpawner too, for a hub that switches to it in GPUBROKER_DEMO_EXTRA_CONFIG)
for spawner in (c.SimpleLocalGPUSpawner, c.DockerGPUSpawner):
    spawner.broker_url = broker_url
    spawner.broker_api_token = broker_token
c.SimpleLocalGPUSpawner.home_dir_template = str(state / "home" / "{username}")
c.Spawner.poll_interval = _port("POLL_INTERVAL", 30)
c.Spawner.default_url = "/lab"
c.Spawner.cmd = [str(Path(sys.executable).parent / "jupyterhub-singleuser")]
if os.getuid() == 0:
    c.Spawner.args = ["--allow-root"]
# kernels may call the broker with the server's token (for %gpu magics)
c.Spawner.server_token_scopes = [
    "users:activity!user",
    "access:servers!server",
    "access:services!service=gpubroker",
]
if layout is not None and layout["profiles"]:
    c.SimpleLocalGPUSpawner.gpu_profiles = c.DockerGPUSpawner.gpu_profiles = layout["profiles"]

if slurm_conf:
    # servers as Slurm jobs on the interactive partition, all as this account
    # (the demo's users have no system accounts), each in its own directory
    import getpass

    c.JupyterHub.spawner_class = "gpubroker-slurm"
    c.SlurmGPUSpawner.broker_url = broker_url
    c.SlurmGPUSpawner.broker_api_token = broker_token
    c.SlurmGPUSpawner.system_user = getpass.getuser()
    c.SlurmEngine.slurm_conf = slurm_conf
    c.SlurmEngine.partition = "interactive"
    c.Spawner.notebook_dir = str(state / "home" / "{username}")
    c.SlurmGPUSpawner.output_template = str(state / "home" / "{username}" / "slurm{servername}.log")

    def _make_home(spawner):
        (state / "home" / spawner.user.name).mkdir(parents=True, exist_ok=True)

    c.Spawner.pre_spawn_hook = _make_home

# a spawn may wait in the GPU queue: answer the spawn request quickly
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 3}

# an extra config file loaded last (the tests use it for their variations)
if os.environ.get("GPUBROKER_DEMO_EXTRA_CONFIG"):
    load_subconfig(os.environ["GPUBROKER_DEMO_EXTRA_CONFIG"])  # noqa: F821 - from JupyterHub
