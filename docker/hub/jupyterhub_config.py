"""JupyterHub config of the Docker deployment (docker/compose.yaml).

The hub spawns each server as a container of the notebook image with
``DockerGPUSpawner``: the container gets exactly the GPUs, MIG instance or
share the broker leased, through the NVIDIA container toolkit. The broker
runs in its own container (an external hub service at
``http://broker:10101``); hub and broker keep their state in PostgreSQL.

Every setting comes from the environment that compose.yaml passes (see
docs/deploy-docker.md):

- ``GPUBROKER_SERVICE_TOKEN`` (required): the broker's hub token, shared
  with the spawner (``openssl rand -hex 32``);
- ``JUPYTERHUB_DB_URL`` (required): the hub's own database;
- ``CONFIGPROXY_AUTH_TOKEN`` (required): the proxy's token;
- ``JUPYTERHUB_AUTHENTICATOR``: the authenticator class (default
  ``shared-password``, for a first try: any user name with
  ``JUPYTERHUB_USER_PASSWORD``, at least 8 characters; the admins with
  ``JUPYTERHUB_ADMIN_PASSWORD``, at least 32; without a password nobody
  logs in); ``JUPYTERHUB_ADMIN_USERS``: comma-separated hub admins, who
  are broker admins too;
- ``NOTEBOOK_IMAGE``: the users' image (default ``gpubroker/notebook:0.1``);
- ``DOCKER_NETWORK_NAME``: the network hub, broker and servers share
  (default ``gpubroker``).
"""

import os

from gpubroker.api.auth import ADMIN_SCOPE, CUSTOM_SCOPES

c = get_config()  # noqa: F821 - provided by JupyterHub

BROKER_TOKEN = os.environ["GPUBROKER_SERVICE_TOKEN"]
BROKER_URL = "http://broker:10101"
ADMINS = {name for name in os.environ.get("JUPYTERHUB_ADMIN_USERS", "").split(",") if name}

# --- the hub ---------------------------------------------------------------------
c.JupyterHub.bind_url = "http://:8000"  # put TLS in front (a reverse proxy), or set ssl_cert
c.JupyterHub.hub_bind_url = "http://0.0.0.0:8081"
c.JupyterHub.hub_connect_url = "http://hub:8081"  # as the servers' containers reach it
c.JupyterHub.db_url = os.environ["JUPYTERHUB_DB_URL"]
c.JupyterHub.cookie_secret_file = "/srv/jupyterhub/jupyterhub_cookie_secret"
c.JupyterHub.allow_named_servers = True
c.ConfigurableHTTPProxy.auth_token = os.environ["CONFIGPROXY_AUTH_TOKEN"]
# servers keep running (and keep their GPUs) while the hub container is replaced
c.JupyterHub.cleanup_servers = False
c.JupyterHub.authenticator_class = os.environ.get("JUPYTERHUB_AUTHENTICATOR", "shared-password")
if c.JupyterHub.authenticator_class == "shared-password":
    # JupyterHub's SharedPasswordAuthenticator: an unset password lets nobody in
    if os.environ.get("JUPYTERHUB_USER_PASSWORD"):
        c.SharedPasswordAuthenticator.user_password = os.environ["JUPYTERHUB_USER_PASSWORD"]
    if os.environ.get("JUPYTERHUB_ADMIN_PASSWORD"):
        c.SharedPasswordAuthenticator.admin_password = os.environ["JUPYTERHUB_ADMIN_PASSWORD"]
    c.Authenticator.allow_all = True
c.Authenticator.admin_users = ADMINS

# --- the broker: an external service (its own container) ------------------------------
c.JupyterHub.custom_scopes = CUSTOM_SCOPES
c.JupyterHub.services = [
    {
        "name": "gpubroker",
        "url": BROKER_URL,
        "api_token": BROKER_TOKEN,
        "display": True,  # the web panel, in the hub's Services menu
        # panel logins carry the broker admin scope for users whose roles hold it
        "oauth_client_allowed_scopes": [ADMIN_SCOPE],
        "oauth_no_confirm": True,  # the hub's own broker: no "Authorize access" page
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
            "read:groups",
            # the culler reads kernels of servers holding GPUs with a token the hub
            # issues per read: owned by that user, limited to that one server
            "tokens",
            "access:services!service=gpubroker",
            ADMIN_SCOPE,
        ],
    },
    {"name": "user", "scopes": ["self", "access:services!service=gpubroker"]},
    {
        "name": "gpubroker-admins",
        "users": sorted(ADMINS),
        "scopes": ["access:services!service=gpubroker", ADMIN_SCOPE],
    },
]

# --- the spawner: a container per server, with its leased GPUs -------------------------
c.JupyterHub.spawner_class = "gpubroker-docker"
c.DockerGPUSpawner.broker_url = f"{BROKER_URL}/services/gpubroker/"
c.DockerGPUSpawner.broker_api_token = BROKER_TOKEN
c.DockerGPUSpawner.image = os.environ.get("NOTEBOOK_IMAGE", "gpubroker/notebook:0.1")
c.DockerGPUSpawner.network_name = os.environ.get("DOCKER_NETWORK_NAME", "gpubroker")
c.DockerGPUSpawner.remove = True  # the default; the user's files live in the volume below
c.DockerGPUSpawner.volumes = {"jupyterhub-user-{username}": "/home/jovyan/work"}
c.DockerGPUSpawner.queue_timeout = 4 * 3600  # seconds a spawn may wait for GPUs
c.Spawner.default_url = "/lab"
# kernels may call the broker with their server's token (%gpu magics)
c.Spawner.server_token_scopes = [
    "users:activity!user",
    "access:servers!server",
    "access:services!service=gpubroker",
]
c.DockerGPUSpawner.gpu_profiles = [
    {"display_name": "1 GPU", "description": "One whole GPU.", "request": {"gpus": 1}},
    # with a pool in MIG mode and a time-sliced pool in the broker's
    # gpubroker_config.py (c.Pools.pools, docs/sharing.md), offer these too:
    # {"display_name": "MIG 1g.10gb", "request": {"mig_profile": "1g.10gb"}},
    # {"display_name": "Shared GPU, 10 GiB", "request": {"memory_gib": 10}},
    {"display_name": "No GPU", "request": {}, "default": True},
]
