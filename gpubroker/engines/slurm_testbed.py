"""A real two-node Slurm cluster on this machine, for the tests and the demo.

``python -m gpubroker.engines.slurm_testbed COMMAND...`` starts it, runs
``COMMAND`` with ``SLURM_CONF`` and ``GPUBROKER_DEMO_SLURM_CONF`` naming its
``slurm.conf``, and stops it when the command ends (``make demo-slurm``
runs the demo hub so). Needs root (slurmd, ``mknod``).

Debian's ``slurm-wlm`` and ``munge`` (installed by ``make slurm``): one
``munged`` (run as the ``munge`` user, its own key and socket), one
``slurmctld`` and two ``slurmd`` daemons (``-N n1``, ``-N n2``), each node
on its own port with four fake GPUs of its own. A fake GPU is a character
device (``mknod c 195 N``, NVIDIA's major number): Slurm rejects plain files
and then sets no ``CUDA_VISIBLE_DEVICES``; it is root's alone (mode 0600),
since on a machine with GPUs it opens the real ``/dev/nvidiaN``.
Everything lives under one directory; the daemons are stopped by the PIDs
this started
(:meth:`SlurmCluster.stop`). The commands find the cluster through
``SLURM_CONF`` (:attr:`SlurmCluster.env`).

No ``slurmdbd``: finished jobs are known to ``scontrol`` for ``MinJobAge``
seconds, and ``sacct`` answers nothing (as on a cluster without
accounting).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NODES = ("n1", "n2")
GPUS_PER_NODE = 4
GPU_TYPE = "h100"


def why_not() -> str:
    """Why no cluster can start here ("" when one can)."""
    for program in ("slurmctld", "slurmd", "munged", "sbatch"):
        if shutil.which(program) is None and not Path(f"/usr/sbin/{program}").exists():
            return f"no {program} (apt-get install slurm-wlm munge; make test installs them)"
    if os.geteuid() != 0:
        return "slurmd and the fake GPU devices (mknod) need root"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SlurmCluster:
    where: Path
    conf: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's commands need to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (``scontrol``, ``sbatch``, ...) on this cluster."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=30, check=check
        )

    def log(self, name: str) -> str:
        """A daemon's log (``slurmctld``, ``slurmd-n1``, ``munged``)."""
        path = self.where / "log" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this started, by PID."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", "--full", *jobs, check=False)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
        shutil.rmtree(self.where, ignore_errors=True)

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until both nodes are up (idle or allocated)."""
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not up after {timeout}s: {out!r}\n{self.log('slurmctld')}")


def _write_config(where: Path, ports: dict[str, int], ctld_port: int) -> Path:
    etc = where / "etc"
    etc.mkdir(parents=True)
    (where / "state").mkdir()
    (where / "log").mkdir()
    for node in NODES:
        (where / "spool" / node).mkdir(parents=True)
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} "
        f"CPUs=8 RealMemory=8000 Gres=gpu:{GPU_TYPE}:{GPUS_PER_NODE} State=UNKNOWN"
        for n in NODES
    )
    conf = etc / "slurm.conf"
    conf.write_text(
        f"""ClusterName=gpubroker
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={where}/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation={where}/state
SlurmdSpoolDir={where}/spool/%n
SlurmctldPidFile={where}/slurmctld.pid
SlurmdPidFile={where}/slurmd-%n.pid
SlurmctldLogFile={where}/log/slurmctld.log
SlurmdLogFile={where}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=300
KillWait=5
InactiveLimit=0
{nodes}
PartitionName=interactive Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
PartitionName=batch Nodes={",".join(NODES)} MaxTime=INFINITE State=UP
"""
    )
    dev = where / "dev"
    dev.mkdir()
    lines = ["AutoDetect=off"]
    for node in NODES:
        for i in range(GPUS_PER_NODE):
            # root's alone: major 195 minor N is /dev/nvidiaN on a machine
            # with GPUs, which no other user may reach through this alias
            os.mknod(dev / f"{node}gpu{i}", 0o600 | stat.S_IFCHR, os.makedev(195, i))
        last = GPUS_PER_NODE - 1
        lines.append(f"NodeName={node} Name=gpu Type={GPU_TYPE} File={dev}/{node}gpu[0-{last}]")
    (etc / "gres.conf").write_text("\n".join(lines) + "\n")
    return conf


def _start_munge(where: Path) -> subprocess.Popen[bytes]:
    munge = pwd.getpwnam("munge")
    home = where / "munge"
    home.mkdir(mode=0o755)
    key = home / "munge.key"
    key.write_bytes(os.urandom(1024))
    for path in (home, key):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    key.chmod(0o400)
    argv = [
        shutil.which("munged") or "/usr/sbin/munged",
        "--foreground",
        f"--socket={home}/munge.socket.2",
        f"--key-file={key}",
        f"--pid-file={home}/munged.pid",
        f"--log-file={where}/log/munged.log",
        f"--seed-file={home}/munge.seed",
    ]
    (where / "log" / "munged.log").touch()
    os.chown(where / "log" / "munged.log", munge.pw_uid, munge.pw_gid)
    proc = subprocess.Popen(
        argv,
        user=munge.pw_uid,
        group=munge.pw_gid,
        extra_groups=[],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while not (home / "munge.socket.2").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"munged did not start: {(where / 'log' / 'munged.log').read_text()}"
            )
        time.sleep(0.1)
    return proc


def start() -> SlurmCluster:
    """Start munged, slurmctld and the two slurmd daemons in a new directory
    (mode 0755: munged runs as the ``munge`` user, so not under pytest's
    0700 temporary root), and wait until both nodes are idle."""
    where = Path(tempfile.mkdtemp(prefix="gpubroker-slurm-"))
    where.chmod(0o755)
    ports = {n: _free_port() for n in NODES}
    conf = _write_config(where, ports, _free_port())
    cluster = SlurmCluster(where, conf)
    try:
        cluster.procs["munged"] = _start_munge(where)
        env = cluster.env
        sbin = "/usr/sbin"
        cluster.procs["slurmctld"] = subprocess.Popen(
            [f"{sbin}/slurmctld", "-D", "-i", "-f", str(conf)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is not for them
        )
        for node in NODES:
            cluster.procs[f"slurmd-{node}"] = subprocess.Popen(
                [f"{sbin}/slurmd", "-D", "-N", node, "-f", str(conf)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def main(argv: list[str] | None = None) -> int:
    """Start the cluster, run ``argv`` on it, stop it (see the module)."""
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m gpubroker.engines.slurm_testbed COMMAND...", file=sys.stderr)
        return 2
    reason = why_not()
    if reason:
        print(f"cannot start a Slurm cluster here: {reason}", file=sys.stderr)
        return 1
    cluster = start()
    print(
        f"Slurm cluster up: nodes {', '.join(NODES)}, {GPUS_PER_NODE} x gpu:{GPU_TYPE} "
        f"each; SLURM_CONF={cluster.conf}",
        flush=True,
    )
    env = {**cluster.env, "GPUBROKER_DEMO_SLURM_CONF": str(cluster.conf)}
    proc = subprocess.Popen(command, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # the terminal's Ctrl-C reached the command too: let it stop its
        # servers (scancel) while the cluster still runs
        for stop in (None, signal.SIGTERM, signal.SIGKILL):
            if stop is not None:
                proc.send_signal(stop)
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                continue
        return proc.wait()
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
