"""Start a single-user server inside a Slurm job, on a port of its node.

Run on the node by the batch script of
:class:`~gpubroker_spawner.slurm.SlurmGPUSpawner`::

    python -m gpubroker_spawner.slurm_server jupyterhub-singleuser [ARGS...]

It chooses a free TCP port on the node (one the kernel hands out for port
0: a port the hub chose would be free on the hub's host, not necessarily on
the node, batchspawner issue #58), tells it through the job's comment
(``scontrol update JobId=$SLURM_JOB_ID Comment="gpubroker server
port=N"``, which Slurm lets a job's owner do, so the server needs no token
and no shared file system), puts the port into ``JUPYTERHUB_SERVICE_URL``
and then ``exec``\\ s the command, which becomes the job's process and gets
Slurm's signals.

Exit status: 2 without a command or outside a Slurm job, 3 when the
comment cannot be written (``scontrol``'s words on standard error), 127
when the command cannot be run (its error on standard error); the job
then ends before its server answers and the spawn fails with its state.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from gpubroker.engines.slurm_json import server_comment


def free_port(host: str) -> int:
    """A TCP port free on ``host`` (``""``: every interface) now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def with_port(url: str, port: int) -> str:
    """``url`` (``JUPYTERHUB_SERVICE_URL``) with its port replaced by ``port``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme or "http", f"{host}:{port}", parts.path, "", ""))


def main(argv: Sequence[str] | None = None) -> int:
    """Choose the port, report it, exec the server (see the module's docstring)."""
    command = list(sys.argv[1:] if argv is None else argv)
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not command or not job_id.isdigit():
        print("usage: inside a Slurm job, slurm_server COMMAND [ARGS...]", file=sys.stderr)
        return 2
    url = os.environ.get("JUPYTERHUB_SERVICE_URL", "http://0.0.0.0:0/")
    port = free_port(urlsplit(url).hostname or "")
    done = subprocess.run(
        ["scontrol", "update", f"JobId={job_id}", f"Comment={server_comment(port)}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        print(f"cannot report the server's port to Slurm: {done.stderr.strip()}", file=sys.stderr)
        return 3
    os.environ["JUPYTERHUB_SERVICE_URL"] = with_port(url, port)
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    print(
        f"gpubroker: server of Slurm job {job_id} on port {port}, CUDA_VISIBLE_DEVICES={devices}",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"cannot run {command[0]}: {err.strerror or err}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
