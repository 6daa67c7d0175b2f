"""The Slurm engine: holders' processes as Slurm jobs on cluster nodes.

The broker keeps the policy (who runs, in what order, on which node, how
many GPUs); Slurm launches and supervises the processes. Everything goes
through Slurm's command-line tools (``sinfo``, ``squeue``, ``sbatch``,
``scancel``, ``sacct``), which every Slurm site has and which need no
``slurmrestd`` and no token; a REST engine can come later behind the same
protocol.

* **Inventory** (:meth:`SlurmEngine.nodes`): ``sinfo --json`` gives each
  node, its state (drained or down nodes take no new work, with Slurm's
  reason) and its GPUs from GRES (``gpu:h100:4``); each GPU gets a stable
  ``GPU-`` UUID made from the cluster, node and index (Slurm knows no NVML
  UUIDs). ``squeue --json`` says which GPU indices every job that has not
  ended holds (running, suspended, completing, being set up): those of
  jobs this engine did not launch are *outside* the broker (a job someone
  ran with ``sbatch`` directly), so the broker never grants them. A job
  launched or polled here is this engine's own only until it is seen
  ended or stopped (:meth:`SlurmEngine._forget`): Slurm may give its id to
  someone else's job later, and a job a stop could not end is no lease's.
* **Launch** (:meth:`SlurmEngine.launch`): ``sbatch --parsable
  --nodelist=NODE --gres=gpu:TYPE:N`` (the GRES type of the leased GPUs,
  so a node with several types binds the leased one) of a batch script
  read from standard input, with the partition, account, QOS and extra
  arguments configured, ``--time`` from the spec's time limit (rounded up to whole minutes, Slurm's
  unit) and ``--no-requeue`` (the broker requeues its jobs itself). The job
  gets exactly the spec's environment (the trust rule: the user's, never
  the broker's), set by ``export`` lines at the top of the batch script;
  ``sbatch`` itself runs with an environment of the broker's making only
  (its ``PATH`` and ``SLURM_CONF``), which ``--export=ALL`` passes on, so
  nothing a user put in a job's environment (``LD_PRELOAD``,
  ``SLURM_CONF``, ``SBATCH_*``) reaches ``sbatch``, which may run as root.
  A broker run as root submits for another user with ``--uid``/``--gid``.
  Slurm picks which GPU indices of the node it binds (``--gres`` cannot
  name them): :meth:`SlurmEngine.poll` reports them as
  :attr:`~gpubroker.engines.base.Status.devices` once the job runs, and
  Slurm sets the job's ``CUDA_VISIBLE_DEVICES`` (the broker's own is left
  out of the environment).
* **Finding a launch again** (:meth:`SlurmEngine.find`): a spec's
  :attr:`~gpubroker.engines.base.LaunchSpec.tag` ends the job's comment
  (``gpubroker lease N launch TAG``); a broker that crashed between
  ``sbatch`` and recording the job id finds the job in ``squeue`` by it,
  instead of submitting a second one; so does a launch whose ``sbatch``
  ran past ``command_timeout`` (slurmctld may have queued it all the same).
  Only the user's own jobs count (a comment is public and its owner may
  rewrite it).
* **Status** (:meth:`SlurmEngine.poll`): ``squeue --json --states=all``,
  which keeps a finished job for ``MinJobAge`` seconds (300 by default;
  Slurm 22.05's ``squeue --json`` ignores ``--jobs`` and ``--states`` and
  lists every job, so the engine picks the job by id itself);
  once it is gone, ``sacct`` where accounting runs (only a record of this
  engine's job: Slurm reuses job ids, see :meth:`SlurmEngine._accounted`); otherwise ``lost``
  (also where ``sacct`` still says it runs: a runaway record slurmctld no
  longer knows). Only Slurm's final states are an end; every other one,
  known or not, is a job Slurm still holds; a final state that Slurm
  forced (``NODE_FAIL``, ``PREEMPTED``, ...) is never a success
  (:func:`gpubroker.engines.slurm_json.final_status`). A
  command that fails or times out raises :class:`EngineError`: the state is
  *unknown*, and callers retry later; nothing is ended on it. So is an
  answer with ``errors`` (Slurm 22.05's ``squeue --json`` and ``sinfo
  --json`` exit 0, with an empty list and ``errors``, when slurmctld does
  not answer).
* **Signals and stop**: ``scancel --full --signal=N`` (the batch shell and
  every process of the job); :meth:`SlurmEngine.stop` sends SIGTERM, waits
  ``grace`` seconds, then ``scancel`` (Slurm's SIGKILL after its
  ``KillWait``), and waits for the job to end as long as Slurm will before
  its SIGKILL plus ``stop_margin`` (``KillWait`` read once from ``scontrol
  show config``); meanwhile it asks ``squeue --jobs=ID`` about that job
  alone, less often as it waits (0.2 s doubling up to 2 s).

Units: seconds (timeouts, intervals, limits), GiB (memory), UTC.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import pwd
import re
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from traitlets import Dict, Float, List, Unicode
from traitlets.config import LoggingConfigurable

from gpubroker.devices.base import DeviceInfo, DeviceUsage

from . import slurm_json
from .base import EngineError, Handle, LaunchSpec, LaunchUnknown, Node, OutsideHold, Status

#: environment variables Slurm sets for a job itself from its binding: the
#: broker's values (UUIDs of its own choosing) are left out
SLURM_SET = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")

#: seconds between looks while :meth:`SlurmEngine.stop` waits: the
#: first, doubled after each look up to the last
_STOP_POLL = (0.2, 2.0)

#: seconds Slurm waits between SIGTERM and SIGKILL when the cluster's
#: ``KillWait`` cannot be read (Slurm's default, slurm.conf(5))
KILL_WAIT = 30.0

_KILL_WAIT_LINE = re.compile(r"^\s*KillWait\s*=\s*(\d+)", re.MULTILINE)

#: how every job this engine submits is named (``--job-name``), followed
#: by its lease id: a record of another job that had the same id is not ours
JOB_NAME_PREFIX = "gpubroker-lease-"

#: seconds the broker's clock may be ahead of slurmctld's: a ``sacct``
#: record submitted this much before ``sbatch`` ran may still be ours
SUBMIT_SKEW = 60.0

_SACCT_FIELDS = slurm_json.SACCT_FIELDS

#: how many jobs' ``sacct`` marks (name, submit time) are kept, the oldest
#: dropped first: a job is polled again after its end only briefly
_MARKS_KEPT = 4096


class SlurmEngine(LoggingConfigurable):
    """Runs holders' processes as Slurm jobs (see the module's docstring).

    Safe to call from several threads: the only shared state is the set of
    job ids this engine launched or was asked about, under a lock.
    """

    name = "slurm"

    bin_dir = Unicode(
        "",
        help="Directory of Slurm's commands (sinfo, squeue, sbatch, scancel, sacct, scontrol); "
        "'' finds each on the broker's PATH.",
    ).tag(config=True)

    slurm_conf = Unicode(
        "",
        help="SLURM_CONF for Slurm's commands (the path of slurm.conf); '' uses "
        "Slurm's own default (/etc/slurm/slurm.conf or configless DNS).",
    ).tag(config=True)

    cluster = Unicode(
        "slurm",
        help="A name for the cluster, part of each GPU's UUID (GPU- plus a UUID of "
        "cluster, node and index): change it and every device is a new one.",
    ).tag(config=True)

    partition = Unicode(
        "", help="Partition (sbatch --partition) of jobs; '' is Slurm's default partition."
    ).tag(config=True)

    account = Unicode("", help="Account (sbatch --account) of every job; '' none.").tag(config=True)

    qos = Unicode("", help="QOS (sbatch --qos) of every job; '' the account's default.").tag(
        config=True
    )

    extra_args = List(
        Unicode(),
        help="More sbatch arguments for every job, e.g. ['--cpus-per-task=4', "
        "'--mem=32G']. Not for --nodelist, --gres or --time: the broker sets those.",
    ).tag(config=True)

    command_timeout = Float(
        20.0,
        help="Seconds a Slurm command may take; one that takes longer counts as "
        "failed (the state is unknown: retried later, nothing is ended on it).",
    ).tag(config=True)

    gpu_memory_gib = Dict(
        {},
        help="GPU memory in GiB per GRES type (e.g. {'h100': 80, 'a100': 40}); Slurm "
        "does not report it. Types not named get default_gpu_memory_gib.",
    ).tag(config=True)

    default_gpu_memory_gib = Float(
        80.0, help="GPU memory in GiB of a GRES type not in gpu_memory_gib."
    ).tag(config=True)

    stop_margin = Float(
        10.0,
        help="Seconds a stop waits for a job to end beyond the cluster's KillWait "
        "(read once from 'scontrol show config') after its scancel: Slurm sends "
        "SIGKILL KillWait seconds after SIGTERM, then runs the epilog and ends the "
        "job. A job still running then makes the stop report it running.",
    ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._lock = threading.Lock()
        #: the cluster's KillWait in seconds, once read
        self._kill_wait: float | None = None
        #: job ids this engine launched or was asked to poll (its own jobs),
        #: until it sees them end or stops them (:meth:`_forget`)
        self._ours: set[str] = set()
        #: server jobs the broker's leases name now (replaced by each adopt)
        self._servers: set[str] = set()
        #: (node, index) of each device UUID of the last inventory
        self._where: dict[str, tuple[str, int]] = {}
        #: the GRES type (``h100``; ``""`` for none) of each device UUID
        self._types: dict[str, str] = {}
        #: each node's address (Slurm's NodeAddr) of the last inventory
        self._addresses: dict[str, str] = {}
        #: what makes a job id's ``sacct`` record ours: its job's name and
        #: the earliest time (aware UTC) it can have been submitted, from
        #: ``sbatch`` or from ``squeue``'s view of the job
        self._marks: dict[str, tuple[str, dt.datetime | None]] = {}

    # -- commands --------------------------------------------------------------

    def _command(self, name: str) -> str:
        """The path of Slurm command ``name`` (``bin_dir``, else the broker's PATH)."""
        if self.bin_dir:
            return os.path.join(self.bin_dir, name)
        return shutil.which(name) or name

    def _env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    def _submit_env(self) -> dict[str, str]:
        """What ``sbatch`` runs with: the broker's ``PATH`` and Slurm
        configuration (``slurm_conf``, else the broker's ``SLURM_CONF``),
        nothing else: no job's variables, no other broker variables."""
        env = {"PATH": os.environ.get("PATH", os.defpath)}
        conf = self.slurm_conf or os.environ.get("SLURM_CONF", "")
        if conf:
            env["SLURM_CONF"] = conf
        return env

    def _run(
        self,
        argv: Sequence[str],
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Run a Slurm command and return its standard output.

        Raises:
            EngineError: it could not run, timed out (:class:`_TimedOut`:
                what it asked may have been done) or exited non-zero (the
                message names the command and Slurm's words).
        """
        full = [self._command(argv[0]), *argv[1:]]
        try:
            done = subprocess.run(
                full,
                input=stdin,
                env=self._env(env),
                capture_output=True,
                text=True,
                timeout=self.command_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            raise _TimedOut(f"{argv[0]} took over {self.command_timeout:g}s") from err
        except OSError as err:
            raise EngineError(f"{argv[0]} could not run: {err.strerror or err}") from err
        if done.returncode != 0:
            words = (done.stderr or done.stdout).strip().splitlines()
            raise EngineError(
                f"{argv[0]} failed (exit {done.returncode}): {' '.join(words[-3:]) or '-'}"
            )
        return done.stdout

    def _json(self, argv: Sequence[str]) -> dict[str, Any]:
        out = self._run(argv)
        try:
            value = json.loads(out)
        except ValueError as err:
            raise EngineError(f"{argv[0]} --json answered no JSON: {out[:200]!r}") from err
        if not isinstance(value, dict):
            raise EngineError(f"{argv[0]} --json answered {type(value).__name__}, not an object")
        errors = slurm_json.errors(value)
        if errors:
            # Slurm 22.05 exits 0 with an empty list and "errors" when
            # slurmctld does not answer: that list is not the truth
            raise EngineError(f"{argv[0]} --json failed: {errors}")
        # Slurm 23.02+ (data_parser v0.0.39+): lists of state flags, numbers
        # as objects; read into 22.05's shape, which the engine reads
        value = slurm_json.as_v38(value)
        unread = slurm_json.unsupported_format(value)
        if unread:
            raise EngineError(f"{argv[0]} --json: {unread}")
        return value

    # -- inventory -------------------------------------------------------------

    def nodes(self) -> list[Node]:
        """The cluster's nodes with their GPUs (``sinfo --json``; on Slurm
        23.02 and later, whose ``sinfo --json`` lists grouped rows, ``scontrol
        show nodes --json``), and the GPUs Slurm jobs not launched by this
        engine hold (``squeue --json``). The JSON of Slurm 22.05 to 24.11
        is read (:func:`~gpubroker.engines.slurm_json.as_v38`).

        Raises:
            EngineError: either command failed (the inventory is unknown).
        """
        info = self._json(["sinfo", "--json"])
        if "nodes" not in info and "sinfo" in info:
            # Slurm 23.02+: sinfo --json lists rows of nodes grouped as sinfo
            # prints them (a row's GRES is its first node's); scontrol lists
            # each node, as 22.05's sinfo --json does
            info = self._json(["scontrol", "show", "nodes", "--json"])
        # no --states: a job being set up (CONFIGURING) holds its GPUs too
        jobs = self._json(["squeue", "--json", "--all"])
        outside = self._outside(jobs.get("jobs") or [])
        seen: dict[str, Node] = {}
        where: dict[str, tuple[str, int]] = {}
        types: dict[str, str] = {}
        addresses: dict[str, str] = {}
        for raw in info.get("nodes") or []:
            name = str(raw.get("name") or "")
            if not name or name in seen:  # sinfo lists a node once per partition
                continue
            node = self._node(raw, outside.get(name, {}))
            seen[name] = node
            where.update({d.uuid: (name, d.index) for d in node.devices})
            types.update({d.uuid: _gres_type(d.name) for d in node.devices})
            addresses[name] = str(raw.get("address") or raw.get("hostname") or name)
        with self._lock:
            self._where = where
            self._types = types
            self._addresses = addresses
        return sorted(seen.values(), key=lambda n: n.name)

    def _node(self, raw: Mapping[str, Any], held: Mapping[int, OutsideHold]) -> Node:
        name = str(raw["name"])
        devices: list[DeviceInfo] = []
        for gres in slurm_json.gpu_gres(str(raw.get("gres") or "")):
            gib = float(self.gpu_memory_gib.get(gres.type, self.default_gpu_memory_gib))
            for _ in range(gres.count):
                index = len(devices)
                devices.append(
                    DeviceInfo(
                        node=name,
                        index=index,
                        uuid=slurm_json.device_uuid(self.cluster, name, index),
                        name=f"Slurm gpu:{gres.type}" if gres.type else "Slurm gpu",
                        memory_total_mib=int(gib * 1024),
                        pci_bus_id="",
                    )
                )
        state = slurm_json.node_state(str(raw.get("state") or ""), raw.get("state_flags") or [])
        outside = {d.uuid: held[d.index] for d in devices if d.index in held}
        reason = str(raw.get("reason") or "") if state != "up" else ""
        return Node(name, state, tuple(devices), reason=reason, outside=outside)

    def _outside(self, jobs: Iterable[Mapping[str, Any]]) -> dict[str, dict[int, OutsideHold]]:
        """GPU indices per node held by running jobs this engine did not launch."""
        with self._lock:
            ours = self._ours | self._servers
        held: dict[str, dict[int, OutsideHold]] = {}
        for job in jobs:
            job_id = str(job.get("job_id"))
            # Slurm 22.05's squeue --json ignores --states and --jobs: filter here
            # a job that has not ended holds the GPUs Slurm allocated it
            # (running, suspended, completing, being set up); pending: none
            if job_id in ours or not slurm_json.is_active(str(job.get("job_state") or "")):
                continue
            what = OutsideHold(f"Slurm job {job_id}", str(job.get("user_name") or ""))
            for node, indices in slurm_json.job_gpus(job).items():
                held.setdefault(node, {}).update(dict.fromkeys(indices, what))
        return held

    def node_address(self, node: str) -> str:
        """The address the hub reaches ``node`` at: Slurm's ``NodeAddr``
        (``sinfo --json``'s ``address``), read again when not yet known.

        Raises:
            EngineError: no such node, or the inventory cannot be read.
        """
        with self._lock:
            address = self._addresses.get(node)
        if address is None:
            self.nodes()
            with self._lock:
                address = self._addresses.get(node)
        if address is None:
            raise EngineError(f"no Slurm node {node!r}")
        return address

    def adopt(self, job_ids: Iterable[str]) -> None:
        """Count exactly the jobs ``job_ids`` as the broker's servers (not
        *outside*): jobs another process launched for the broker, such as
        the notebook servers :class:`gpubroker_spawner.slurm.SlurmGPUSpawner`
        submits from the hub, whose granted leases name them. Each call
        replaces the last: a server job whose lease has ended (one a failed
        stop left running) counts as outside again, so its GPUs are not
        granted twice."""
        with self._lock:
            self._servers = {str(j) for j in job_ids if str(j).isdigit()}

    def telemetry(self, uuids: Iterable[str]) -> dict[str, DeviceUsage]:
        """Slurm reports no GPU utilization or memory per device: always
        ``{}`` (the culler judges Slurm holders by kernel activity alone)."""
        return {}

    # -- launch ------------------------------------------------------------------

    def _placement(self, devices: Sequence[str]) -> tuple[str, dict[str, int]]:
        """The node of ``devices`` (UUIDs of one node) and how many of them
        are of each GRES type (``{"h100": 2}``; ``""``: GPUs without one).

        Raises:
            EngineError: a device is on no node, or they are on several.
        """
        with self._lock:
            where, types = dict(self._where), dict(self._types)
        if any(uuid not in where for uuid in devices):
            self.nodes()
            with self._lock:
                where, types = dict(self._where), dict(self._types)
        unknown = [u for u in devices if u not in where]
        if unknown:
            raise EngineError(f"devices not on any Slurm node: {', '.join(unknown)}")
        nodes = {where[u][0] for u in devices}
        if len(nodes) > 1:
            raise EngineError(
                f"devices on several nodes ({', '.join(sorted(nodes))}): one job, one node"
            )
        counts: dict[str, int] = {}
        for uuid in devices:
            counts[types.get(uuid, "")] = counts.get(types.get(uuid, ""), 0) + 1
        return nodes.pop(), counts

    def sbatch_args(
        self,
        spec: LaunchSpec,
        node: str | None,
        gpus: int,
        types: Mapping[str, int] | None = None,
    ) -> list[str]:
        """The ``sbatch`` arguments of ``spec`` on ``node`` with ``gpus``
        GPUs; ``types``, where given, says how many of them are of each GRES
        type (``{"h100": 2}``), so that ``--gres`` names them
        (``gpu:h100:2``) and Slurm binds GPUs of the leased type on a node
        with several (``""``: no type)."""
        for path in {spec.stdout, spec.stderr} - {None}:
            if path is not None and "\\" in path:
                # Slurm reads a backslash in --output as "no patterns" and
                # drops it: the job's output would go to another path
                raise EngineError(
                    f"output path {path!r} has a backslash, which Slurm's --output "
                    "does not keep: use a directory without one"
                )
        args = ["sbatch", "--parsable", f"--job-name={JOB_NAME_PREFIX}{spec.lease_id}"]
        comment = f"gpubroker lease {spec.lease_id}" + (f" launch {spec.tag}" if spec.tag else "")
        args += [f"--comment={comment}", "--no-requeue", "--export=ALL"]
        args += [f"--chdir={spec.cwd}", "--ntasks=1", "--open-mode=append"]
        args += [f"--output={_pattern(spec.stdout)}", f"--error={_pattern(spec.stderr)}"]
        if node is not None:
            args.append(f"--nodelist={node}")
        if gpus:
            args.append(f"--gres={_gres(gpus, types)}")
        if spec.time_limit is not None:
            args.append(f"--time={max(1, math.ceil(spec.time_limit / 60))}")
        args += [f"--partition={self.partition}"] if self.partition else []
        args += [f"--account={self.account}"] if self.account else []
        args += [f"--qos={self.qos}"] if self.qos else []
        args += self._as_user(spec.user)
        return [*args, *self.extra_args]

    def _as_user(self, user: str) -> list[str]:
        """``--uid``/``--gid`` when the job's user is not the broker's own."""
        try:
            entry = pwd.getpwnam(user)
        except KeyError as err:
            raise EngineError(f"no such user: {user!r}") from err
        if entry.pw_uid == os.getuid():
            return []
        if os.geteuid() != 0:
            raise EngineError(f"cannot submit as {user!r}: the broker is not root")
        return [f"--uid={entry.pw_uid}", f"--gid={entry.pw_gid}"]

    def launch(self, spec: LaunchSpec) -> Handle:
        """Submit ``spec`` as a batch job on the node of its devices.

        Returns:
            the job's handle (id: the Slurm job id; node: the node asked for).

        ``sbatch`` that fails or runs past ``command_timeout`` may have
        been queued all the same: slurmctld answered late, or its answer
        was lost ("Socket timed out on send/recv operation", exit 1, with
        the job queued). A spec with a
        :attr:`~gpubroker.engines.base.LaunchSpec.tag` is then looked for
        (:meth:`find`), and the job found is this launch.

        Raises:
            LaunchUnknown: ``sbatch`` failed or timed out, and whether
                Slurm queued the job cannot be told (``squeue`` failed too).
            EngineError: the devices are not on one node of the cluster, the
                user is unknown (or another user while the broker is not
                root), its output path has a backslash (Slurm would write
                its output elsewhere), or ``sbatch`` refused (its message)
                or timed out and no job of the spec's tag is found.
        """
        node, types = self._placement(spec.devices) if spec.devices else (None, {})
        gpus = sum(types.values())
        # with --gres Slurm sets the device variables from its binding;
        # without, the spec's (a server without GPUs: none visible) stay
        env = {k: v for k, v in spec.env.items() if not gpus or k not in SLURM_SET}
        script = _script(spec, env)
        argv = self.sbatch_args(spec, node, gpus, types)
        asked = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=SUBMIT_SKEW)
        try:
            out = self._run(argv, stdin=script, env=self._submit_env())
        except EngineError as err:
            # slurmctld may have queued the job although sbatch failed or was
            # killed: a job of this launch's tag is this launch, not a failure
            found = self._found_after(spec, err)
            self.log.warning(
                "sbatch of lease %s failed (%s), but Slurm queued its job %s",
                spec.lease_id,
                err,
                found.id,
            )
            return Handle(self.name, found.id, found.node or node or "")
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise EngineError(f"sbatch answered no job id: {out.strip()[:200]!r}")
        with self._lock:
            self._ours.add(job_id)
            self._mark({job_id: (f"{JOB_NAME_PREFIX}{spec.lease_id}", asked)})
        self.log.info(
            "Slurm job %s submitted for lease %s on %s (%s GPUs)",
            job_id,
            spec.lease_id,
            node or "any node",
            gpus,
        )
        return Handle(self.name, job_id, node or "")

    def _found_after(self, spec: LaunchSpec, err: EngineError) -> Handle:
        """The job of ``spec``'s launch that Slurm queued although its
        ``sbatch`` failed with ``err`` (:meth:`find` by its tag).

        Raises:
            EngineError: ``err`` itself: the spec has no tag, or no job of
                its tag is queued (``sbatch`` really failed).
            LaunchUnknown: whether a job was queued cannot be told now.
        """
        if not spec.tag or isinstance(err, LaunchUnknown):
            raise err
        try:
            found = self.find(spec.tag, spec.user)
        except EngineError as unknown:
            raise LaunchUnknown(
                f"{err}; whether Slurm queued the job of launch {spec.tag} is not known ({unknown})"
            ) from err
        if found is None:
            raise err
        return found

    def find(self, tag: str, user: str) -> Handle | None:
        """The job of the launch tagged ``tag`` as ``user`` (its comment
        ends ``launch TAG``), pending, running or ended, while ``squeue``
        lists it (``MinJobAge`` seconds after its end); ``None`` when it
        lists none. The job counts as this engine's own from now on.

        Jobs of other users whose comment carries the tag (a job's owner
        may rewrite its comment) are not this launch.

        Raises:
            EngineError: ``squeue`` failed (not known), or the only jobs of
                that tag are other users'.
        """
        answer = self._json(["squeue", "--json", "--all", "--states=all"])
        tagged = [
            job
            for job in answer.get("jobs") or []
            if str(job.get("comment") or "").split()[-2:] == ["launch", tag]
        ]
        if not tagged:
            return None
        # a comment is public and its job's owner may rewrite it: another
        # user's job that carries the tag is not this launch
        mine = [job for job in tagged if str(job.get("user_name") or "") == user]
        if not mine:
            job = min(tagged, key=lambda j: int(j.get("job_id") or 0))
            raise EngineError(f"Slurm job {job.get('job_id')} of launch {tag} is not {user!r}'s")
        job = min(mine, key=lambda j: int(j.get("job_id") or 0))
        view = slurm_json.job_view(job, self.cluster)
        node = view.node or str(job.get("required_nodes") or "")
        self._remember([job])
        with self._lock:
            self._ours.add(view.job_id)
        self.log.info("Slurm job %s of launch %s found (%s)", view.job_id, tag, view.state)
        return Handle(self.name, view.job_id, node)

    # -- status, signals, stop ----------------------------------------------------

    def _check(self, handle: Handle, claim: bool = True) -> str:
        """The handle's job id; with ``claim``, the job counts as this
        engine's own from now on (a job a restarted broker polls is one it
        launched before)."""
        if handle.engine != self.name or not handle.id.isdigit():
            raise EngineError(f"not a Slurm job handle: {handle}")
        if claim:
            with self._lock:
                self._ours.add(handle.id)
        return handle.id

    def poll(self, handle: Handle, claim: bool = True) -> Status:
        """The job's status: from ``squeue``; once it is gone from there,
        from ``sacct``; ``lost`` when neither knows it. With ``claim`` the
        job counts as this engine's own from now on (a batch job a
        restarted broker polls is one it launched before).

        Raises:
            EngineError: not a Slurm handle, or ``squeue`` failed (unknown).
        """
        job_id = self._check(handle, claim)
        view = self._views({job_id}).get(job_id)
        status = view.status if view is not None else self._accounted(job_id)
        if not status.running:
            self._forget([job_id])
        return status

    def poll_many(self, handles: Iterable[Handle], claim: bool = True) -> dict[str, Status]:
        """The status of each job of ``handles``, by job id, from one
        ``squeue`` (Slurm 22.05 lists every job however it is asked); jobs
        gone from it are asked of ``sacct`` one by one. With ``claim`` the
        jobs count as this engine's own from now on (batch jobs); servers'
        jobs are counted by :meth:`adopt` instead.

        Raises:
            EngineError: a handle is not a Slurm one, or ``squeue`` failed.
        """
        wanted = {self._check(h, claim) for h in handles}
        if not wanted:
            return {}
        views = self._views(wanted)
        statuses = {
            job_id: views[job_id].status if job_id in views else self._accounted(job_id)
            for job_id in sorted(wanted, key=int)
        }
        self._forget(job_id for job_id, status in statuses.items() if not status.running)
        return statuses

    def _forget(self, job_ids: Iterable[str]) -> None:
        """``job_ids`` are no longer this engine's own: they have ended (a
        later job Slurm gives the same id, after a reset of its state, is
        someone else's, and its GPUs are *outside*), or a stop gave up on
        them (:meth:`stop`: the broker ends their lease, so GPUs they still
        hold are outside). A poll with ``claim`` counts a job again."""
        with self._lock:
            for job_id in job_ids:
                self._ours.discard(job_id)

    def describe(self, handle: Handle) -> slurm_json.JobView | None:
        """What ``squeue`` says of the job: state, reason, node, the port
        its server reported and its status; ``None`` when ``squeue`` no
        longer lists it (ended more than ``MinJobAge`` ago, or never was).
        Describing a job does not make it this engine's own (nor do
        :meth:`signal` and :meth:`stop`): a server's job that a stop failed
        to end counts as outside once :meth:`adopt` no longer names it.

        Raises:
            EngineError: not a Slurm handle, or ``squeue`` failed (unknown).
        """
        job_id = self._check(handle, claim=False)
        return self._views({job_id}).get(job_id)

    def _views(self, job_ids: set[str]) -> dict[str, slurm_json.JobView]:
        # no --jobs: 22.05 ignores it, and later versions refuse a job id
        # already purged (MinJobAge), which would read as "unknown" forever;
        # --all: jobs in hidden partitions too
        answer = self._json(["squeue", "--json", "--all", "--states=all"])
        listed = [job for job in answer.get("jobs") or [] if str(job.get("job_id")) in job_ids]
        jobs = [job for job in listed if self._listed_is_ours(job)]
        self._remember(jobs)
        return {str(job.get("job_id")): slurm_json.job_view(job, self.cluster) for job in jobs}

    def _listed_is_ours(self, job: Mapping[str, Any]) -> bool:
        """Whether a job ``squeue`` lists under an id of this engine's is
        this engine's job, not another that Slurm gave the same id after a
        reset of its state (as :meth:`_accounted` tells ``sacct``'s
        records apart): named :data:`JOB_NAME_PREFIX` plus a lease id, the
        very name and no earlier submit time than this engine saw, where
        it saw them. A job that is not is left out (logged): the id's job
        is then looked for in ``sacct``."""
        job_id = str(job.get("job_id"))
        name = str(job.get("name") or "")
        with self._lock:
            want, since = self._marks.get(job_id, (None, None))
        submitted = slurm_json.utc(job.get("submit_time"))
        ours = name.startswith(JOB_NAME_PREFIX) and (want is None or name == want)
        if ours and since is not None and submitted is not None:
            ours = submitted >= since
        if not ours:
            self.log.warning(
                "Slurm job %s in squeue is %r submitted %s, not this engine's job of that id "
                "(Slurm reused the id): looked for in sacct",
                job_id,
                name,
                submitted,
            )
        return ours

    def expect(self, names: Mapping[str, str]) -> None:
        """Record the name each job id of ``names`` must have (a server's
        job, which the hub submitted: :data:`JOB_NAME_PREFIX` plus its
        lease id), so that a job Slurm later gave the same id, of another
        name, is not taken for it (:meth:`_listed_is_ours`,
        :meth:`_accounted`). A submit time already seen under that name is
        kept."""
        with self._lock:
            marks: dict[str, tuple[str, dt.datetime | None]] = {
                job_id: (name, None)
                for job_id, name in names.items()
                if self._marks.get(job_id, (None, None))[0] != name
            }
            self._mark(marks)

    def _remember(self, jobs: Iterable[Mapping[str, Any]]) -> None:
        """Note the name and submit time (``squeue``'s, UTC) of each of
        ``jobs`` that this engine submitted (named :data:`JOB_NAME_PREFIX`
        ...), so that its ``sacct`` record is told from another job's of the
        same id once ``squeue`` forgets it (:meth:`_accounted`)."""
        marks: dict[str, tuple[str, dt.datetime]] = {}
        for job in jobs:
            name = str(job.get("name") or "")
            submitted = slurm_json.utc(job.get("submit_time"))
            if name.startswith(JOB_NAME_PREFIX) and submitted is not None:
                marks[str(job.get("job_id"))] = (name, submitted)
        if marks:
            with self._lock:
                self._mark(marks)

    def _mark(self, marks: Mapping[str, tuple[str, dt.datetime | None]]) -> None:
        """Record ``marks`` (under the lock), keeping the newest
        :data:`_MARKS_KEPT` only: they outlive the jobs' end (a job may be
        polled again once ended), not for ever."""
        for job_id, mark in marks.items():
            self._marks.pop(job_id, None)
            self._marks[job_id] = mark
        for job_id in list(self._marks)[: max(0, len(self._marks) - _MARKS_KEPT)]:
            del self._marks[job_id]

    def _accounted(self, job_id: str) -> Status:
        """The final status ``sacct`` records of a job ``squeue`` (which
        answered) no longer lists; ``lost`` without accounting, or where
        ``sacct`` still says it pends or runs: slurmctld, which runs every
        job, knows it no more, so that record is a "runaway" one whose end
        slurmdbd never got (``sacctmgr show runawayjobs``), not a job that
        still holds its GPUs.

        Slurm reuses job ids (a reset slurmctld starts again at
        ``FirstJobId``), and ``sacct --jobs=ID`` gives the newest job of
        that id, which may be another's (sacct(1), ``--duplicates``). So
        ``sacct -D`` lists every record of the id, and only one of this
        engine's jobs counts (:func:`~gpubroker.engines.slurm_json.sacct_pick`):
        named :data:`JOB_NAME_PREFIX` plus a lease id, the very name and no
        earlier submit time than this engine saw at ``sbatch``
        (:data:`SUBMIT_SKEW` seconds of clock difference allowed) or in
        ``squeue``, where it saw either; the newest such record wins.
        ``lost`` when no record is ours."""
        try:
            out = self._run(
                ["sacct", "-n", "-P", "-X", "-D", f"--jobs={job_id}", "-o", _SACCT_FIELDS],
                env={**os.environ, "TZ": "UTC"},
            )
        except EngineError as err:
            self.log.debug("Slurm job %s: sacct: %s", job_id, err)
            return Status("lost")
        with self._lock:
            name, since = self._marks.get(job_id, (None, None))
        records = slurm_json.sacct_records(out)
        record = slurm_json.sacct_pick(records, job_id, JOB_NAME_PREFIX, name, since)
        if record is None:
            if records:
                self.log.warning(
                    "Slurm job %s: sacct knows only other jobs of that id (%s): taken as lost",
                    job_id,
                    ", ".join(f"{r.name!r} submitted {r.submitted}" for r in records[:3]),
                )
            return Status("lost")
        status = record.status
        if status.running:
            self.log.warning(
                "Slurm job %s: sacct says it still runs, but slurmctld no longer lists it "
                "(a runaway job record?): taken as lost",
                job_id,
            )
            return Status("lost")
        return status

    def signal(self, handle: Handle, signum: int) -> None:
        """``scancel --full --signal=signum``: the batch shell and every
        process of the job get it; nothing happens once the job ended.

        Raises:
            EngineError: not a Slurm handle, or ``scancel`` failed for
                another reason than the job having ended.
        """
        job_id = self._check(handle, claim=False)
        try:
            self._run(["scancel", "--full", f"--signal={int(signum)}", job_id])
        except EngineError as err:
            if not _gone(str(err)):
                raise

    def stop(self, handle: Handle, grace: float) -> Status:
        """SIGTERM to every process of the job, ``grace`` seconds, then
        ``scancel`` (Slurm kills what is left after its ``KillWait``); waits
        up to the cluster's ``KillWait`` (:meth:`kill_wait`) plus
        ``stop_margin`` seconds more for the job to end. Afterwards the job
        is no longer this engine's own (:meth:`_forget`), also where the stop
        failed or the job still runs: its caller ends the job's lease, so
        GPUs it still holds count as *outside*. A job whose
        batch script has not started (pending, held, requeued, being set
        up) has no processes, and ``scancel --signal`` on it hangs until
        the command's timeout on 22.05: it is cancelled at once.

        Raises:
            EngineError: not a Slurm handle, or Slurm could not be asked.
        """
        try:
            status = self._stop(handle, grace)
        except EngineError:
            self._forget([handle.id])
            raise
        if status.running:
            self.log.warning(
                "Slurm job %s still runs after its stop: its GPUs count as outside the broker",
                handle.id,
            )
        self._forget([handle.id])
        return status

    def _stop(self, handle: Handle, grace: float) -> Status:
        view = self.describe(handle)  # one squeue: the state and the status
        status = view.status if view is not None else self._accounted(handle.id)
        if not status.running:
            return status
        if view is None or view.state in slurm_json.STARTED_JOB_STATES:
            self.signal(handle, 15)
            status = self._wait(handle, grace)
        if status.running:
            try:
                self._run(["scancel", handle.id])
            except EngineError as err:
                if not _gone(str(err)):
                    raise
            status = self._wait(handle, self.kill_wait() + self.stop_margin)
        return status

    def kill_wait(self) -> float:
        """Seconds Slurm waits between a ``scancel``'s SIGTERM and its
        SIGKILL: the cluster's ``KillWait`` (``scontrol show config``), read
        once and kept; :data:`KILL_WAIT` (Slurm's default) while it cannot
        be read (logged; read again next time). Never raises."""
        with self._lock:
            known = self._kill_wait
        if known is not None:
            return known
        try:
            match = _KILL_WAIT_LINE.search(self._run(["scontrol", "show", "config"]))
        except EngineError as err:
            match = None
            self.log.warning("Cannot read Slurm's KillWait (%s): taking %gs", err, KILL_WAIT)
        if match is None:
            return KILL_WAIT
        seconds = float(match.group(1))
        with self._lock:
            self._kill_wait = seconds
        return seconds

    def _wait(self, handle: Handle, seconds: float) -> Status:
        """The job's status once it has ended, or after ``seconds`` (then
        still running). Meanwhile only this job is asked about (``squeue
        --jobs=ID``, :meth:`_state`), at :data:`_STOP_POLL` intervals that
        double from 0.2 s up to 2 s, not the whole queue; the status itself
        is read once at the end (:meth:`poll`).

        Raises:
            EngineError: Slurm could not be asked.
        """
        deadline = time.monotonic() + seconds
        delay, longest = _STOP_POLL
        while True:
            state = self._state(handle.id)
            left = deadline - time.monotonic()
            if state is None or not slurm_json.is_active(state) or left <= 0:
                return self.poll(handle, claim=False)
            time.sleep(min(delay, left))
            delay = min(delay * 2, longest)

    def _state(self, job_id: str) -> str | None:
        """Slurm's state of one job (``squeue --jobs=ID --states=all``,
        text: ``squeue --json`` of 22.05 ignores ``--jobs``), upper case;
        ``None`` once ``squeue`` no longer knows it (``Invalid job id``:
        ended over ``MinJobAge`` seconds ago).

        Raises:
            EngineError: ``squeue`` failed for another reason.
        """
        try:
            out = self._run(
                ["squeue", "-h", "--all", "--states=all", f"--jobs={job_id}", "-o", "%T"]
            )
        except EngineError as err:
            if "invalid job id" in str(err).lower():
                return None
            raise
        words = out.split()
        return words[0].upper() if words else None


class _TimedOut(EngineError):
    """A Slurm command ran past ``command_timeout`` and was killed: what it
    asked slurmctld may have been done all the same."""


def _gres_type(name: str) -> str:
    """The GRES type of a device named ``Slurm gpu:TYPE`` (``""``: none)."""
    return name.partition(":")[2]


def _gres(gpus: int, types: Mapping[str, int] | None) -> str:
    """``--gres``'s value for ``gpus`` GPUs, typed where ``types`` (GPUs
    per GRES type, adding up to ``gpus``) names types: ``gpu:h100:2``,
    ``gpu:a100:1,gpu:h100:1``; ``gpu:N`` without types."""
    if not types or sum(types.values()) != gpus or set(types) == {""}:
        return f"gpu:{gpus}"
    return ",".join(
        f"gpu:{kind}:{count}" if kind else f"gpu:{count}" for kind, count in sorted(types.items())
    )


def _pattern(path: str | None) -> str:
    """A path for sbatch's ``--output`` (``%`` is Slurm's pattern sign)."""
    return "/dev/null" if path is None else path.replace("%", "%%")


#: a variable name a shell can ``export``
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _script(spec: LaunchSpec, env: Mapping[str, str]) -> str:
    """The batch script: ``export`` the job's environment ``env`` (values
    quoted for ``sh``), then ``exec`` the program, so it is the batch shell
    and gets the signals Slurm sends the job.

    Raises:
        EngineError: a variable name a shell cannot export.
    """
    bad = sorted(name for name in env if not _SHELL_NAME.match(name))
    if bad:
        raise EngineError(f"environment variable names a shell cannot export: {bad[:5]}")
    lines = ["#!/bin/sh", f"# gpubroker lease {spec.lease_id}"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    lines.append(f"exec {shlex.join(spec.argv)}")
    return "\n".join(lines) + "\n"


def _gone(message: str) -> bool:
    """Whether a ``scancel`` error only says the job has ended."""
    words = message.lower()
    return "already completing or completed" in words or "invalid job id" in words
