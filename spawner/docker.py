"""DockerGPUSpawner: DockerSpawner whose containers get the GPUs the broker leases.

On top of :class:`dockerspawner.DockerSpawner` (whose settings all apply):

* the granted device or MIG UUIDs go into the container's device requests
  (driver ``nvidia``, ``device_ids``, capabilities ``[["gpu"]]``), so the
  NVIDIA container toolkit exposes exactly those devices; a server without a
  GPU gets no device request and ``NVIDIA_VISIBLE_DEVICES=void``;
* the environment is the local spawner's (``CUDA_VISIBLE_DEVICES``,
  ``NVIDIA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
  ``GPUBROKER_LEASE_ID``, ``GPUBROKER_URL``, a share's memory caps); the
  broker's start-up hook directory on ``PYTHONPATH`` becomes
  ``share_startup_dir``, where the notebook image holds the same hook;
* MPS is not passed into containers: an MPS client must share the IPC
  namespace of the daemon (NVIDIA's MPS documentation), and joining the
  host's would let users' containers read each other's shared memory; a
  share's ``CUDA_MPS_*`` variables are dropped (its memory caps and the
  watchdog still apply) and a warning is logged;
* containers are removed when they stop (``remove`` defaults to True), by
  the spawner, after it has read how they ended (Docker's ``auto_remove``
  is always off: it would delete the exit status and the ``OOMKilled``
  flag with the container); the device request is fixed when a container
  is made, so a container left from an earlier lease (``remove = False``)
  is made anew when its devices or lease variables differ from the new
  lease's (its writable layer is lost: keep users' files in ``volumes``);
* the container's id and its engine's ID are told to the broker with the
  server's URL, so the broker's reconciliation asks that Docker engine
  whether the container still runs (a container killed or removed out of band releases its lease
  within one ``GPUBrokerApp.reconcile_interval``, whatever the hub knows);
* with ``network_name = "host"`` each server listens on a port of its own on
  ``host_ip`` (DockerSpawner's fixed 8888 would collide), chosen when its
  container is made, after the lease is granted.

Stopping the server (or the container dying, found by ``poll()``) releases
the lease, as with the local spawners, with how the container ended
(``"server exited (status 137: killed for running out of memory
(OOMKilled))"``). ``poll()`` asks Docker about the container it made (by
id): only Docker's answer that the container is gone (404) or has stopped
ends the lease; any other error (an engine answering 500, or not
answering) leaves the server taken for running and the lease kept.
A start that fails after the container was started (say
``get_ip_and_port()`` cannot find ``network_name``) stops and removes the
container before the lease is released; if that cleanup fails the lease
is kept and the container reported to the broker, whose reconciliation
stops it.
"""

from __future__ import annotations

import os
from typing import Any

from docker.errors import NotFound
from dockerspawner import DockerSpawner
from jupyterhub.utils import random_port
from traitlets import Unicode, default

from .mixin import GPUSpawnerMixin

#: how the broker's start-up hook directory ends (gpubroker/enforce/startup)
BROKER_STARTUP_SUFFIX = os.sep.join(("gpubroker", "enforce", "startup"))


def device_ids(env: dict[str, str]) -> list[str]:
    """The UUIDs a lease's environment names (``NVIDIA_VISIBLE_DEVICES``):
    ``[]`` for none (``void``, empty)."""
    visible = env.get("NVIDIA_VISIBLE_DEVICES", "")
    if visible in ("", "void", "none"):
        return []
    return [uuid for uuid in visible.split(",") if uuid]


#: the variables of a lease that a container made for another lease would have stale
LEASE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPUBROKER_LEASE_ID")


def gpu_host_config(env: dict[str, str]) -> dict[str, Any]:
    """The part of a container's host config a lease's environment asks for.

    Args:
        env: the lease's environment (``lease["env"]``, or the no-GPU one).

    Returns:
        ``{"device_requests": [...]}`` naming exactly the leased UUIDs
        (an empty list without devices).
    """
    uuids = device_ids(env)
    if not uuids:
        return {"device_requests": []}
    return {
        "device_requests": [{"driver": "nvidia", "device_ids": uuids, "capabilities": [["gpu"]]}]
    }


def _merged(configured: dict[str, Any], gpu: dict[str, Any]) -> dict[str, Any]:
    """``configured`` host config with the GPU part on top. The device
    requests are always the lease's (none without one): a configured
    request (say ``count: -1``, every GPU) would hand out devices the
    broker does not know are taken. ``auto_remove`` is always off: Docker
    would delete an ended container before its exit status (and whether
    the kernel killed it for memory) is read; the spawner removes it
    itself (``remove``)."""
    return dict(configured) | {
        "device_requests": gpu.get("device_requests", []),
        "auto_remove": False,
    }


def exit_reason(state: dict[str, Any]) -> str:
    """The release reason of a container that has ended, from its inspect
    data's ``State``: ``"server exited (status 137: killed for running out
    of memory (OOMKilled))"``, ``"server exited (status 0)"``, with
    Docker's ``Error`` when it gives one."""
    code = int(state.get("ExitCode") or 0)
    notes = []
    if state.get("OOMKilled"):
        notes.append("killed for running out of memory (OOMKilled)")
    if state.get("Error"):
        notes.append(f"Docker: {state['Error']}")
    return f"server exited (status {code}{': ' + '; '.join(notes) if notes else ''})"


def is_stale(container: dict[str, Any], env: dict[str, str]) -> bool:
    """Whether an existing container (its inspect data) was made for other
    devices or another lease than ``env`` (the new lease's environment)."""
    requests = container.get("HostConfig", {}).get("DeviceRequests") or []
    had = [uuid for r in requests for uuid in (r.get("DeviceIDs") or [])]
    if had != device_ids(env):
        return True
    old = dict(x.split("=", 1) for x in container.get("Config", {}).get("Env") or [] if "=" in x)
    return any(old.get(name, "") != env.get(name, "") for name in LEASE_VARIABLES)


class DockerGPUSpawner(GPUSpawnerMixin, DockerSpawner):  # type: ignore[misc]
    """:class:`dockerspawner.DockerSpawner` whose containers get the GPUs
    the broker leases to them (see the module's documentation)."""

    share_startup_dir = Unicode(
        "/opt/gpubroker/startup",
        help="""Where the notebook image holds gpubroker's start-up hook
        (``gpubroker/enforce/startup``, which caps PyTorch and TensorFlow
        to a shared GPU's memory). The broker's own path to the hook on
        ``PYTHONPATH`` is replaced by this one in the container; the image
        of docker/notebook/ links it there.""",
    ).tag(config=True)

    @property
    def _host_network(self) -> bool:
        return bool(self.network_name == "host")

    #: the container was made by this start (so it has this lease's devices)
    _made_now = False

    @default("remove")
    def _default_remove(self) -> bool:
        return True

    @default("use_internal_ip")
    def _default_use_internal_ip(self) -> bool:
        # on the host network nothing is published: the server's own port is used
        return bool(self.network_name != "bridge")

    def get_env(self) -> dict[str, str]:
        """The environment of the local spawners, with the broker's start-up
        hook directory on ``PYTHONPATH`` replaced by ``share_startup_dir``."""
        env: dict[str, str] = super().get_env()
        mps = sorted(name for name in env if name.startswith("CUDA_MPS_"))
        if mps:
            self.log.warning(
                "%s: MPS is not passed into containers (it would need the host's IPC "
                "namespace); dropped %s",
                self._log_name,
                ", ".join(mps),
            )
            for name in mps:
                del env[name]
        if env.get("PYTHONPATH"):
            entries = env["PYTHONPATH"].split(os.pathsep)
            env["PYTHONPATH"] = os.pathsep.join(
                self.share_startup_dir if p.rstrip(os.sep).endswith(BROKER_STARTUP_SUFFIX) else p
                for p in entries
            )
        return env

    async def create_object(self) -> Any:
        """Create the container with the lease's device requests merged into
        ``extra_host_config``; on the host network, on a free port."""
        if self._host_network:
            self.ip = self.host_ip
            self.port = random_port()
        self._made_now = True
        configured = self.extra_host_config
        gpu = gpu_host_config(dict(self._gpu_env or {}))

        async def with_gpus(spawner: Any) -> dict[str, Any]:
            value = spawner._eval_if_callable(configured)
            if hasattr(value, "__await__"):
                value = await value
            return _merged(dict(value or {}), gpu)

        self.extra_host_config = with_gpus
        try:
            return await super().create_object()
        finally:
            self.extra_host_config = configured

    async def start_object(self) -> None:
        """Start the container; one left from an earlier lease whose devices
        or lease variables differ from this lease's (see :func:`is_stale`),
        or any old one on the host network (its port is not known), is
        removed and made anew first."""
        made_now, self._made_now = self._made_now, False
        if not made_now:
            await self._replace_if_stale()
        await super().start_object()

    async def _replace_if_stale(self) -> None:
        container = await self.docker("inspect_container", self.container_id)
        if self._host_network or is_stale(container, dict(self._gpu_env or {})):
            self.log.info(
                "%s: container %s was made for another lease; making it anew",
                self._log_name,
                self.container_id[:12],
            )
            await self.remove_object()
            self.object_id = (await self.create_object())[self.object_id_key]
            self._made_now = False

    #: how the container ended, as :meth:`gpu_poll_server` last found it
    _gpu_exit: str | None = None
    #: the container :meth:`gpu_poll_server` removed after reading its end:
    #: not found later, it is not "gone from the Docker engine"
    _gpu_removed: str | None = None

    async def gpu_poll_server(self) -> int | None:
        """Ask Docker about this server's container (its remembered id, else
        its name).

        Returns:
            None while it runs, and while Docker cannot say (an error other
            than 404, e.g. a 500 from an unhealthy engine, or no answer: the
            container may still hold the lease's devices); else its exit
            status (0 when Docker no longer knows it). An ended container
            is removed here when ``remove`` is set, after its end was read.
        """
        target = self.object_id or self.object_name
        try:
            container = await self.docker("inspect_container", target)
        except NotFound:
            if target == self._gpu_removed:
                return 0  # removed here, after its end was read and logged
            self.log.warning(
                "%s: container %s is gone from the Docker engine", self._log_name, target[:12]
            )
            self._gpu_exit = (
                f"server's container {target[:12]} is gone from the Docker engine "
                "(exit status unknown)"
            )
            # the id is kept: the hub's stop() that follows finds it gone (404)
            return 0
        except Exception as err:
            self.log.warning(
                "%s: cannot read container %s (%s); taking it for running, its lease is kept",
                self._log_name,
                target[:12],
                err,
            )
            return None
        state = container.get("State") or {}
        if state.get("Running"):
            return None
        self._gpu_exit = exit_reason(state)
        self.log.info("%s: container %s ended: %s", self._log_name, target[:12], self._gpu_exit)
        if self.remove:
            try:
                await self.remove_object()
                self._gpu_removed = target
            except Exception as err:
                self.log.warning(
                    "%s: cannot remove ended container %s: %s", self._log_name, target[:12], err
                )
        return int(state.get("ExitCode") or 0)

    def gpu_exit_reason(self, status: Any) -> str:
        """How the container ended, as :meth:`gpu_poll_server` read it."""
        reason, self._gpu_exit = self._gpu_exit, None
        return reason or super().gpu_exit_reason(status)

    async def gpu_clean_up_failed_start(self) -> bool:
        """Stop the container of a start that failed (and remove it when
        ``remove`` is set), so the lease's devices are free before the
        lease is released.

        Returns:
            True when no container of this start is left running; False
            when Docker could not stop or remove it (logged; the container
            is then reported to the broker, whose reconciliation stops it
            and releases the lease).
        """
        if not self.object_id:
            return True
        container = self.object_id
        try:
            await self.stop_object()
            if self.remove:
                # the id is kept: the hub's stop() of the failed server finds it gone
                await self.remove_object()
        except Exception as err:
            self.log.error(
                "%s: cannot stop container %s of the start that failed: %s",
                self._log_name,
                container[:12],
                err,
            )
            await self._report_url((self.ip or "127.0.0.1", self.port))
            return False
        return True

    async def get_ip_and_port(self) -> tuple[str, int]:
        """``(host_ip, port)`` on the host network, else DockerSpawner's answer."""
        if self._host_network:
            return self.host_ip, self.port
        ip, port = await super().get_ip_and_port()
        return ip, int(port)

    async def gpu_server_record(self) -> dict[str, str]:
        """What the broker is told besides the server's URL: the container's
        id and the ID of the Docker engine that runs it (``docker info``;
        left out when the engine does not say)."""
        if not self.object_id:
            return {}
        record = {"container_id": self.object_id}
        try:
            info = await self.docker("info")
        except Exception as err:  # the engine that just started the container
            self.log.warning("%s: cannot read the Docker engine's ID: %s", self._log_name, err)
            return record
        if info.get("ID"):
            record["docker_engine"] = str(info["ID"])
        return record
