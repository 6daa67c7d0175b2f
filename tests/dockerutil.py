"""A private Docker engine for tests: ``dockerd`` started with the only
flags allowed here (no bridge, no iptables, no forwarding or masquerade; its
own data root, exec root, pid file and socket), and an image built locally
from files of this machine (no registry is reachable).

The NVIDIA container toolkit is the one part simulated, as the GPUs are:
dockerd finds an ``nvidia-container-runtime-hook`` on its ``PATH`` (a
script that accepts the OCI state and does nothing), so a device request
of driver ``nvidia`` is accepted and Docker sets ``NVIDIA_VISIBLE_DEVICES``
to the requested devices, as on a GPU host.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker as sdk

DOCKERD = shutil.which("dockerd") or "/usr/sbin/dockerd"
_HOOK = "#!/bin/sh\ncat > /dev/null\nexit 0\n"


@dataclass
class PrivateDocker:
    url: str
    image: str
    proc: subprocess.Popen[bytes]
    log: Path
    where: Path

    def stop(self) -> None:
        """Stop the dockerd this started (by its PID), wait for it, and
        unmount what it left mounted under its directory (its data root)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        prefix = str(self.where.resolve()) + "/"
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for point in sorted((m for m in mounts if m.startswith(prefix)), reverse=True):
            subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def why_not() -> str:
    """Why no private engine can start here ("" when one can)."""
    if not os.path.exists(DOCKERD):
        return "no dockerd (apt-get install docker.io; make test installs it)"
    if os.geteuid() != 0:
        return "dockerd needs root"
    return ""


def _rootfs(where: Path) -> Path:
    """A root file system tarball: the host's /bin/sh and a few programs
    with the libraries they link (enough for shell jobs)."""
    root = where / "rootfs"
    for program in ("/bin/sh", "/bin/sleep", "/bin/cat", "/bin/mkdir"):
        real = Path(os.path.realpath(program))
        files = [real]
        out = subprocess.run(["ldd", str(real)], capture_output=True, text=True).stdout
        files += [Path(p) for p in out.split() if p.startswith("/")]
        for file in files:
            target = root / str(file).lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(file), target)
        link = root / program.lstrip("/")
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(real, link)
    (root / "tmp").mkdir(exist_ok=True)
    tarball = where / "rootfs.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(root, arcname=".")
    return tarball


def start(where: Path, image: str = "gpubroker-test-sh:1") -> PrivateDocker:
    """Start dockerd under ``where`` and import the test image.

    Raises:
        RuntimeError: it did not come up within 60 s (its log is in the message).
    """
    bin_dir = where / "bin"
    bin_dir.mkdir(parents=True)
    hook = bin_dir / "nvidia-container-runtime-hook"
    hook.write_text(_HOOK)
    hook.chmod(0o755)
    sock = where / "docker.sock"
    log = where / "dockerd.log"
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(where)}
    argv = [
        DOCKERD,
        "--bridge=none",
        "--iptables=false",
        "--ip-forward=false",
        "--ip-masq=false",
        f"--data-root={where / 'root'}",
        f"--exec-root={where / 'exec'}",
        f"--pidfile={where / 'dockerd.pid'}",
        f"-H=unix://{sock}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"unix://{sock}"
    docker = PrivateDocker(url, image, proc, log, where)
    try:
        _wait_and_import(docker, sock, image)
    except BaseException:
        docker.stop()
        raise
    return docker


def _wait_and_import(docker: PrivateDocker, sock: Path, image: str) -> None:
    """Wait for ``docker``'s dockerd to answer, then import the test image."""
    proc, log, url, where = docker.proc, docker.log, docker.url, docker.where
    client = None
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"dockerd exited: {log.read_text()[-2000:]}")
        if sock.exists():
            try:
                client = sdk.DockerClient(base_url=url)
                client.ping()
                break
            except sdk.errors.DockerException:
                if client is not None:
                    client.close()
                client = None
        time.sleep(0.1)
    else:
        raise RuntimeError(f"dockerd did not start: {log.read_text()[-2000:]}")
    assert client is not None
    repository, _, tag = image.partition(":")
    try:
        client.api.import_image(src=str(_rootfs(where)), repository=repository, tag=tag)
        client.images.get(image)  # it is there
    finally:
        client.close()
