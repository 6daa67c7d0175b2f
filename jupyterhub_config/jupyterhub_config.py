"""Production example: JupyterHub with gpubroker on real GPUs (NVML).

Copy it next to your hub, adjust the marked lines, and read the admin guide
(docs/admin.md). What it sets up:

- the broker as a hub-managed service at /services/gpubroker/, on real
  NVIDIA GPUs through NVML (``--device-backend=nvml`` fails loudly if the
  driver is missing, instead of silently simulating GPUs);
- a PostgreSQL store for the broker (``pip install 'gpubroker[postgres]'``);
- the custom scope ``custom:gpubroker:admin`` for the broker's role and for
  your admins;
- ``LocalGPUSpawner``: one system user per hub user (JupyterHub's
  LocalProcessSpawner), each server seeing only its leased GPUs;
- at hub shutdown, the servers stop before the broker service, so their
  leases are released then (JupyterHub stops managed services first).
"""

import os
import sys

from jupyterhub.app import JupyterHub

from gpubroker.api.auth import ADMIN_SCOPE, CUSTOM_SCOPES
from gpubroker_spawner.shutdown import stop_servers_before_services

c = get_config()  # noqa: F821 - provided by JupyterHub

# --- secrets: generate once (`openssl rand -hex 32`) and keep them out of git ---
BROKER_TOKEN = os.environ["GPUBROKER_API_TOKEN"]  # shared by the broker and the spawner
BROKER_DB = os.environ.get(  # CHANGE: your PostgreSQL database
    "GPUBROKER_DB_URL", "postgresql+psycopg://gpubroker@127.0.0.1/gpubroker"
)
BROKER_PORT = 10101

# --- the hub ---------------------------------------------------------------------
c.JupyterHub.bind_url = "https://0.0.0.0:443"  # CHANGE: behind TLS
c.JupyterHub.allow_named_servers = True
c.ConfigurableHTTPProxy.auth_token = os.environ["CONFIGPROXY_AUTH_TOKEN"]
# at shutdown, stop the servers (releasing their GPUs) before the broker service
if JupyterHub.initialized():  # loaded by the hub itself
    stop_servers_before_services(JupyterHub.instance())
# c.JupyterHub.authenticator_class = "oauthenticator.GenericOAuthenticator"  # CHANGE

# --- the broker service --------------------------------------------------------------
c.JupyterHub.custom_scopes = CUSTOM_SCOPES
c.JupyterHub.services = [
    {
        "name": "gpubroker",
        "url": f"http://127.0.0.1:{BROKER_PORT}",
        "api_token": BROKER_TOKEN,
        "display": True,  # the web panel, in the hub's Services menu
        # panel logins carry the broker admin scope for users whose roles hold it
        "oauth_client_allowed_scopes": [ADMIN_SCOPE],
        "oauth_no_confirm": True,  # the hub's own broker: no "Authorize access" page
        "command": [
            sys.executable,
            "-m",
            "gpubroker",
            "serve",
            "--device-backend=nvml",
            "--config=/etc/gpubroker/gpubroker_config.py",  # optional; missing is fine
        ],
        # the store's URL (its password) in the environment, never on the command
        # line: every local user can read a process's arguments (ps, /proc)
        "environment": {"GPUBROKER_DB_URL": BROKER_DB},
    }
]
c.JupyterHub.load_roles = [
    {
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
    {"name": "user", "scopes": ["self", "access:services!service=gpubroker"]},
    {
        # hub admins who may see and change every lease through the broker API
        "name": "gpubroker-admins",
        "users": ["alice"],  # CHANGE
        "scopes": ["access:services!service=gpubroker", ADMIN_SCOPE],
    },
]

# --- the spawner ---------------------------------------------------------------------
c.JupyterHub.spawner_class = "gpubroker-local"
c.LocalGPUSpawner.broker_url = f"http://127.0.0.1:{BROKER_PORT}/services/gpubroker/"
c.LocalGPUSpawner.broker_api_token = BROKER_TOKEN
c.LocalGPUSpawner.queue_timeout = 4 * 3600  # seconds a spawn may wait for GPUs
c.LocalGPUSpawner.max_gpus = 4  # most GPUs one server may ask for
c.Spawner.default_url = "/lab"
# kernels may call the broker with their server's token (%gpu magics)
c.Spawner.server_token_scopes = [
    "users:activity!user",
    "access:servers!server",
    "access:services!service=gpubroker",
]
