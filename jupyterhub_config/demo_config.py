"""JupyterHub config of the gpubroker demo: fake GPUs, local processes, any login.

Run it with ``make demo`` (or ``jupyterhub -f jupyterhub_config/demo_config.py``
from the repository root with the project's virtualenv active). Everything
binds to 127.0.0.1. Log in with any user name and password.

Environment variables (all optional; the tests use them to run this same
config on free ports):

- ``GPUBROKER_DEMO_DIR``: where state goes (hub and broker SQLite, secrets);
  default ``demo-run/`` in the repository.
- ``GPUBROKER_DEMO_PORT``: public port of the hub (default 8000);
  ``GPUBROKER_DEMO_HUB_PORT``, ``GPUBROKER_DEMO_PROXY_API_PORT`` and
  ``GPUBROKER_DEMO_BROKER_PORT``: internal ports (defaults 8081, 8001, 10101).
- ``GPUBROKER_DEMO_DB_URL``: the broker's store (default the SQLite file
  ``gpubroker.sqlite`` in the state dir; the tests also use PostgreSQL).
- ``GPUBROKER_DEMO_INVENTORY``: fake devices (default ``8 x NVIDIA H100 80GB HBM3``).
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
- ``GPUBROKER_DEMO_SHARING``: ``1`` (the default) splits the eight fake
  H100s into pools -- GPUs 0-3 whole, 4-5 MIG (MIG mode on), 6-7 time-sliced
  shares -- and gives the spawn form profiles ("Full H100", "MIG 1g.10gb",
  "MIG 3g.40gb", "Shared GPU, 10 GiB", "No GPU"); ``0``: eight whole GPUs
  and a GPU-count form (the tests' default).
- ``GPUBROKER_DEMO_SLURM_CONF``: the ``slurm.conf`` of a Slurm cluster
  (``make demo-slurm`` starts one of two nodes here): the broker takes its
  inventory from Slurm and runs jobs as Slurm jobs on the ``batch``
  partition, servers are Slurm jobs on the ``interactive`` partition
  (``SlurmGPUSpawner``, as this account), whole GPUs only (no sharing
  profiles: Slurm cannot split GPUs the broker's way).
  ``GPUBROKER_DEMO_INVENTORY_INTERVAL``: seconds between the broker's reads
  of Slurm's inventory (default 30).
"""

import os
import secrets
import sys
from pathlib import Path

from gpubroker.api.auth import ADMIN_SCOPE, CUSTOM_SCOPES

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

repo = Path(__file__).resolve().parent.parent
state = Path(os.environ.get("GPUBROKER_DEMO_DIR", repo / "demo-run")).resolve()
state.mkdir(parents=True, exist_ok=True)


def _port(name, fallback):
    return int(os.environ.get(f"GPUBROKER_DEMO_{name}", fallback))


def _secret(name):
    """A secret kept in the state dir, so restarts of the hub keep it."""
    path = state / name
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


broker_port = _port("BROKER_PORT", 10101)
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
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {"admin"}

proxy = repo / "node_modules" / ".bin" / "configurable-http-proxy"
c.ConfigurableHTTPProxy.command = [str(proxy) if proxy.exists() else "configurable-http-proxy"]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{_port('PROXY_API_PORT', 8001)}"
c.ConfigurableHTTPProxy.auth_token = _secret("proxy-token")
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")

# -- the broker, a hub-managed service ------------------------------------------------
c.JupyterHub.custom_scopes = CUSTOM_SCOPES
inventory = os.environ.get("GPUBROKER_DEMO_INVENTORY", "8 x NVIDIA H100 80GB HBM3")
slurm_conf = os.environ.get("GPUBROKER_DEMO_SLURM_CONF", "")
sharing = os.environ.get("GPUBROKER_DEMO_SHARING", "0" if slurm_conf else "1") == "1"
default_db = f"sqlite:///{state / 'gpubroker.sqlite'}"
broker_config = os.environ.get("GPUBROKER_DEMO_BROKER_CONFIG", str(state / "gpubroker_config.py"))
sharing_args = []
if sharing:
    sharing_args = [
        # pools and MIG mode on the command line, so a broker config file stays free
        '--Pools.pools=[{"name": "mig", "mode": "mig", "devices": ["*:4-5"]},'
        ' {"name": "shared", "mode": "timeslice", "devices": ["*:6-7"], "reserve_gib": 2}]',
        "--FakeDeviceBackend.mig_enabled=[4, 5]",
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
            f"--db-url={os.environ.get('GPUBROKER_DEMO_DB_URL', default_db)}",
            f"--device-backend={os.environ.get('GPUBROKER_DEMO_BACKEND', 'fake')}",
            f"--FakeDeviceBackend.inventory={inventory}",
            f"--FakeDeviceBackend.node_name={os.environ.get('GPUBROKER_DEMO_NODE', 'demo-node')}",
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
            "read:groups",
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
if sharing:
    c.SimpleLocalGPUSpawner.gpu_profiles = c.DockerGPUSpawner.gpu_profiles = [
        {
            "display_name": "Full H100",
            "description": "One whole NVIDIA H100 80GB.",
            "request": {"gpus": 1},
        },
        {
            "display_name": "MIG 1g.10gb",
            "description": "A 1/7 slice of an H100 with 10 GB, isolated in hardware.",
            "request": {"mig_profile": "1g.10gb"},
            "default": True,
        },
        {
            "display_name": "MIG 3g.40gb",
            "description": "A 3/7 slice of an H100 with 40 GB, isolated in hardware.",
            "request": {"mig_profile": "3g.40gb"},
        },
        {
            "display_name": "Shared GPU, 10 GiB",
            "description": "10 GiB of an H100 shared with others (time-sliced).",
            "request": {"memory_gib": 10},
        },
        {"display_name": "No GPU", "request": {}},
    ]

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
