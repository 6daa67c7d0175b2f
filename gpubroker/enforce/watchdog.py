"""The memory-cap watchdog for shares: warn, then end over-cap processes.

Each check, the broker samples the compute processes of its shared devices
(NVML ``nvmlDeviceGetComputeRunningProcesses``, as
:class:`~gpubroker.devices.base.ProcessInfo`: pid and used memory in MiB)
and calls :meth:`ShareWatchdog.judge`, which reads no clock and touches
no process (the uids it compares come from the injectable
:attr:`ShareWatchdog.uid_of_pid` and :attr:`ShareWatchdog.holder_uid`):

- a process belongs to the lease named by ``GPUBROKER_LEASE_ID`` in its
  environment or its parents' of the same uid (:func:`lease_of_pid`), and
  only when its uid is the lease holder's, where that is known
  (:attr:`ShareCap.uid`, else the holder's POSIX account,
  :attr:`ShareWatchdog.check_uid`), or, for a lease whose server runs in a
  Docker container (:attr:`ShareCap.container`), only when it runs in that
  container; processes of no lease are ignored (debug log), those of
  another uid or container too (warning log);
- the memory a lease uses on its share's device is the sum of its
  processes' memory there; the lease is *over* when that sum exceeds
  ``cap_mib + tolerance_mib``;
- when over, its largest processes on that device (largest first, as many
  as it takes to get back under the limit) are warned (:class:`Overuse`,
  with a deadline ``grace`` seconds later) and, if the lease is still over
  at the deadline, ended (:class:`Terminate`); a process is warned once and
  ended once;
- when the lease is back under the limit before the deadline, each warning
  is withdrawn (:class:`Withdrawn`);
- other leases' processes on the same device are never touched.

The broker then tells users (notices) and calls :func:`end_process` for
each :class:`Terminate`. A Jupyter server usually restarts a kernel that was
ended, which frees its memory.

Limits: after the fact (memory over the cap is held until the deadline);
sees what NVML reports, in the host's PID namespace, so the broker must run
in the host's PID namespace (not in a container of its own). Attribution
trusts the processes' environment within one uid: a user can clear
``GPUBROKER_LEASE_ID`` in a process they start with a fresh environment,
or name another of their own leases; a process of another uid that names
a lease is not that lease's where the holder's uid is known, nor is a
process outside the container of a lease whose server runs in one (a
holder with no POSIX account on the host and no container recorded is
attributed by the environment alone).
So this stops accidents, not attacks; MPS (:mod:`gpubroker.enforce.mps`)
is the hard cap. On a real node the broker must run as root (or as the notebook
users' owner) to read ``/proc/<pid>/environ`` of users' processes and to
signal them.
"""

from __future__ import annotations

import datetime as dt
import os
import pwd
import re
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from traitlets import Bool, Float, Integer
from traitlets.config import LoggingConfigurable

#: the environment variable that names a process's lease (set by the broker
#: in the lease environment, see :mod:`gpubroker.views`)
LEASE_ENV = "GPUBROKER_LEASE_ID"


@dataclass(frozen=True)
class ShareCap:
    """The memory cap of one share lease.

    Attributes:
        lease_id: the lease.
        user: its holder.
        device_uuid: NVML UUID of the shared device.
        cap_mib: device memory the lease may use on it, MiB (its ``memory_mib``).
        uid: the POSIX uid its holder's processes run as, where the caller
            knows it; ``None``: the watchdog looks it up
            (:attr:`ShareWatchdog.holder_uid`).
        container: the Docker container its holder's server runs in (the
            ID, 12 to 64 hex digits), where it runs in one: then a process
            is the lease's only inside that container
            (:attr:`ShareWatchdog.container_of_pid`), and uids are not
            compared (a container's accounts are not the host's).
    """

    lease_id: int
    user: str
    device_uuid: str
    cap_mib: int
    uid: int | None = None
    container: str | None = None


@dataclass(frozen=True)
class ProcessSample:
    """A compute process on a device as NVML reported it.

    Attributes:
        device_uuid: NVML UUID of the device.
        pid: process id (host PID namespace).
        used_memory_mib: device memory the process holds, MiB; ``None``
            where NVML does not report it (``NVML_VALUE_NOT_AVAILABLE``):
            :meth:`ShareWatchdog.judge` then estimates it from the device's
            total where it can (see there).
        estimated: set by the watchdog on a sample whose memory it
            estimated from the device's total.
    """

    device_uuid: str
    pid: int
    used_memory_mib: int | None
    estimated: bool = False


@dataclass(frozen=True)
class Overuse:
    """First seen over the cap: warn; the process is ended at ``deadline``
    unless the lease gets back under the cap.

    Attributes:
        lease_id, user, device_uuid: the lease, its holder and the device.
        pid: the process warned.
        used_mib: memory the process holds, MiB.
        cap_mib: the lease's cap, MiB.
        deadline: when the process will be ended (aware UTC, ``now + grace``).
        lease_used_mib: memory all the lease's processes hold on the device, MiB.
    """

    lease_id: int
    user: str
    device_uuid: str
    pid: int
    used_mib: int
    cap_mib: int
    deadline: dt.datetime
    lease_used_mib: int = 0


@dataclass(frozen=True)
class Withdrawn:
    """The lease got back under its cap before the deadline: the warning of
    ``pid`` is withdrawn."""

    lease_id: int
    pid: int


@dataclass(frozen=True)
class Terminate:
    """End this process: its lease is still over its cap after the grace period.

    Attributes:
        lease_id, user, device_uuid, pid, used_mib, cap_mib: as in :class:`Overuse`.
        reason: a sentence for the user and the log.
        lease_used_mib: memory all the lease's processes hold on the device, MiB.
    """

    lease_id: int
    user: str
    device_uuid: str
    pid: int
    used_mib: int
    cap_mib: int
    reason: str
    lease_used_mib: int = 0


Action = Overuse | Withdrawn | Terminate


class ShareWatchdog(LoggingConfigurable):
    """Judges shares' memory use against their caps (see the module docstring).

    Keeps, in memory, the deadline of each warned process and which
    processes it ended; :meth:`judge` forgets leases and processes that are
    gone. ``enabled`` is read by the broker, not by :meth:`judge`.
    """

    enabled = Bool(
        True,
        help="Watch the memory of time-sliced shares (NVML per-process memory) and end the "
        "processes of a share over its cap after a warning and a grace period.",
    ).tag(config=True)
    grace = Float(
        60,
        help="Seconds between the warning that a share is over its memory cap and ending its "
        "largest processes; getting back under the cap withdraws the warning.",
    ).tag(config=True)
    tolerance_mib = Integer(
        256,
        help="MiB a share may use above its cap before it counts as over (CUDA context and "
        "allocator slack).",
    ).tag(config=True)
    term_timeout = Float(
        5,
        help="Seconds an ended process gets between SIGTERM and SIGKILL.",
    ).tag(config=True)
    check_uid = Bool(
        True,
        help="Attribute a process to a share lease only when the process runs as its holder's "
        "uid (the holder's POSIX account on this host; not checked for a holder without one) "
        "or, for a lease whose server runs in a Docker container, only when it runs in that "
        "container: a process of another user that names the lease in its environment is "
        "never warned or ended for it.",
    ).tag(config=True)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        #: the real uid of a process, ``None`` when unknown (gone, no /proc)
        self.uid_of_pid: Callable[[int], int | None] = process_uid
        #: the uid of a holder's processes by user name, ``None`` when unknown
        self.holder_uid: Callable[[str], int | None] = user_uid
        #: the Docker container of a process (``""``: none), ``None`` when unknown
        self.container_of_pid: Callable[[int], str | None] = process_container
        #: (lease id, device uuid, pid) -> deadline of its warning (aware UTC)
        self.warned: dict[tuple[int, str, int], dt.datetime] = {}
        #: (lease id, device uuid, pid) of processes a Terminate was issued for
        self.ended: set[tuple[int, str, int]] = set()
        #: devices whose unreported process memory could not be attributed
        #: (warned once until that changes)
        self.unjudged: set[str] = set()

    def judge(
        self,
        samples: Iterable[ProcessSample],
        caps_by_lease: Mapping[int, ShareCap] | Iterable[ShareCap],
        lease_of_pid: Callable[[int], int | None],
        now: dt.datetime,
        device_used: Mapping[str, int] | None = None,
    ) -> list[Action]:
        """Judge one sample of the shared devices' processes.

        Args:
            samples: every compute process on the watched devices now.
            caps_by_lease: the shares to enforce: a mapping lease id -> cap,
                or any iterable of caps (a lease with shares on several
                devices has one cap per device; each is judged alone).
            lease_of_pid: the lease of a process, or ``None`` (e.g.
                :func:`lease_of_pid`); called once per pid. With
                :attr:`check_uid`, a process whose uid
                (:attr:`uid_of_pid`) is not its lease holder's
                (:attr:`ShareCap.uid`, else :attr:`holder_uid`) belongs to
                no lease; either uid unknown: not checked.
            now: the time of the sample (aware UTC); no clock is read here.
            device_used: each watched device's memory in use, MiB
                (``DeviceUsage.memory_used_mib``), for processes whose own
                memory NVML does not report: where every such process on a
                device belongs to one capped lease, they are judged as
                holding what the device's total leaves after the reported
                processes (split evenly among them; an estimate, said so in
                the reason); where they belong to several leases, or to
                none, or the total is not given, they count 0 and a warning
                is logged once until that changes (the caps there are then
                not fully enforced).

        Returns:
            Actions in order of leases and, within a lease, largest process
            first: :class:`Withdrawn` for warnings no longer needed,
            :class:`Terminate` for processes whose deadline passed while the
            lease is still over, :class:`Overuse` for newly warned processes.
            Processes already ended are left out of the lease's sum while
            NVML still reports them (their memory is being freed).
        """
        values = caps_by_lease.values() if isinstance(caps_by_lease, Mapping) else caps_by_lease
        caps = {(cap.lease_id, cap.device_uuid): cap for cap in values}
        by_share: dict[tuple[int, str], list[ProcessSample]] = {}
        seen: set[tuple[int, str, int]] = set()
        owners: dict[int, int | None] = {}
        holders: dict[int, int | None] = {}
        # a process in a recorded container is that container's lease's,
        # whatever its environment says (a user can set GPUBROKER_LEASE_ID)
        boxed = {cap.container: cap.lease_id for cap in caps.values() if cap.container}
        containers: dict[int, str | None] = {}  # each process's container, read once
        samples = list(samples)
        for sample in samples:
            if sample.pid not in owners:
                owners[sample.pid] = self._boxed_lease(sample.pid, boxed, containers)
                if owners[sample.pid] is None:
                    owners[sample.pid] = lease_of_pid(sample.pid)
        samples = self._estimated(samples, owners, caps, device_used)
        for sample in samples:
            lease_id = owners[sample.pid]
            if lease_id is None:
                self.log.debug(
                    "Process %s on %s (%s MiB) belongs to no lease; ignored",
                    sample.pid,
                    sample.device_uuid,
                    sample.used_memory_mib,
                )
                continue
            cap = caps.get((lease_id, sample.device_uuid))
            if cap is None:
                continue  # not a share lease, or not one of its shares' devices
            if not self._holders_process(cap, sample, holders, containers):
                continue
            seen.add((lease_id, sample.device_uuid, sample.pid))
            by_share.setdefault((lease_id, sample.device_uuid), []).append(sample)
        self.warned = {k: v for k, v in self.warned.items() if k in seen}
        self.ended &= seen
        actions: list[Action] = []
        for key in sorted(by_share):
            actions.extend(self._judge_lease(caps[key], by_share[key], now))
        return actions

    def _estimated(
        self,
        samples: list[ProcessSample],
        owners: Mapping[int, int | None],
        caps: Mapping[tuple[int, str], ShareCap],
        device_used: Mapping[str, int] | None,
    ) -> list[ProcessSample]:
        """``samples`` with every memory figure known: a process NVML does
        not report gets its share of what the device's total leaves after
        the reported ones, where all such processes on the device belong to
        one capped lease there, else 0 (logged once until that changes).
        See :meth:`judge`."""
        unknown: dict[str, list[ProcessSample]] = {}
        for sample in samples:
            if sample.used_memory_mib is None:
                unknown.setdefault(sample.device_uuid, []).append(sample)
        if not unknown:
            self.unjudged.clear()
            return samples
        guess: dict[tuple[str, int], int] = {}
        for device, procs in unknown.items():
            leases = {owners.get(p.pid) for p in procs}
            (lease,) = leases if len(leases) == 1 else (None,)
            total = (device_used or {}).get(device)
            if lease is None or (lease, device) not in caps or total is None:
                if device not in self.unjudged:
                    self.log.warning(
                        "NVML reports no memory for processes %s on %s (of leases %s): they "
                        "count 0 MiB, so share caps there are not fully enforced",
                        sorted(p.pid for p in procs),
                        device,
                        sorted(str(x) for x in leases),
                    )
                self.unjudged.add(device)
                continue
            self.unjudged.discard(device)
            known = sum(s.used_memory_mib or 0 for s in samples if s.device_uuid == device)
            left = max(total - known, 0)
            each, extra = divmod(left, len(procs))
            for i, proc in enumerate(sorted(procs, key=lambda p: p.pid)):
                guess[(device, proc.pid)] = each + (1 if i < extra else 0)
        self.unjudged &= set(unknown)
        out = []
        for sample in samples:
            if sample.used_memory_mib is not None:
                out.append(sample)
            else:
                mib = guess.get((sample.device_uuid, sample.pid))
                out.append(replace(sample, used_memory_mib=mib or 0, estimated=mib is not None))
        return out

    def _container(self, pid: int, containers: dict[int, str | None]) -> str | None:
        """:attr:`container_of_pid`, read once per process and judgement."""
        if pid not in containers:
            containers[pid] = self.container_of_pid(pid)
        return containers[pid]

    def _boxed_lease(
        self, pid: int, boxed: Mapping[str, int], containers: dict[int, str | None]
    ) -> int | None:
        """The lease whose recorded container (id or its prefix, a key of
        ``boxed``) process ``pid`` runs in; ``None``: in none of them, or
        unknown (then its environment attributes it)."""
        if not boxed or not self.check_uid:
            return None
        found = self._container(pid, containers)
        if not found:
            return None
        for container, lease_id in boxed.items():
            if found.startswith(container):
                return lease_id
        return None

    def _holders_process(
        self,
        cap: ShareCap,
        sample: ProcessSample,
        holders: dict[int, int | None],
        containers: dict[int, str | None],
    ) -> bool:
        """Whether ``sample``'s process may be the process of ``cap``'s lease:
        for a lease whose server runs in a container
        (:attr:`ShareCap.container`), the process runs in that container
        (or its container cannot be read); else its uid is the holder's, or
        either uid is unknown (or :attr:`check_uid` is off). ``holders``:
        the holders' uids of this judgement by lease id (each looked up
        once); ``containers``: the processes' containers read so far."""
        if not self.check_uid:
            return True
        if cap.container:
            return self._in_container(cap, sample, containers)
        if cap.lease_id not in holders:
            holders[cap.lease_id] = cap.uid if cap.uid is not None else self.holder_uid(cap.user)
        expected = holders[cap.lease_id]
        if expected is None:
            return True
        found = self.uid_of_pid(sample.pid)
        if found is None or found == expected:
            return True
        self._not_the_leases(cap, sample, f"uid {expected}", f"as uid {found}")
        return False

    def _in_container(
        self, cap: ShareCap, sample: ProcessSample, containers: dict[int, str | None]
    ) -> bool:
        """Whether ``sample``'s process runs in ``cap``'s container (or its
        container cannot be read: then the environment alone attributes it)."""
        assert cap.container
        found = self._container(sample.pid, containers)
        if found is None or found.startswith(cap.container):
            return True
        where = f"in container {found[:12]}" if found else "outside any container"
        self._not_the_leases(cap, sample, f"container {cap.container[:12]}", where)
        return False

    def _not_the_leases(self, cap: ShareCap, sample: ProcessSample, owner: str, runs: str) -> None:
        """Log that ``sample``'s process names ``cap``'s lease but is not its
        holder's (``owner``: the holder's uid or container; ``runs``: how
        the process runs)."""
        self.log.warning(
            "Process %s on %s (%s MiB) names lease %s of %s (%s) but runs %s; not the lease's,"
            " ignored",
            sample.pid,
            sample.device_uuid,
            sample.used_memory_mib,
            cap.lease_id,
            cap.user,
            owner,
            runs,
        )

    def _judge_lease(
        self, cap: ShareCap, procs: list[ProcessSample], now: dt.datetime
    ) -> list[Action]:
        """Actions for one lease's processes on its share's device."""
        key = (cap.lease_id, cap.device_uuid)
        live = [p for p in procs if (*key, p.pid) not in self.ended]
        live.sort(key=lambda p: (-_mib(p), p.pid))
        total = sum(_mib(p) for p in live)
        limit = cap.cap_mib + self.tolerance_mib
        actions: list[Action] = []
        if total <= limit:
            for proc in live:
                if self.warned.pop((*key, proc.pid), None) is not None:
                    actions.append(Withdrawn(cap.lease_id, proc.pid))
                    self.log.info(
                        "Lease %s back under its cap on %s (%s of %s MiB); warning of %s withdrawn",
                        cap.lease_id,
                        cap.device_uuid,
                        total,
                        cap.cap_mib,
                        proc.pid,
                    )
            return actions
        culprits, remaining = [], total
        for proc in live:  # largest first, until the rest fits
            culprits.append(proc)
            remaining -= _mib(proc)
            if remaining <= limit:
                break
        for proc in culprits:
            pid_key = (*key, proc.pid)
            deadline = self.warned.get(pid_key)
            if deadline is None:
                deadline = now + dt.timedelta(seconds=self.grace)
                self.warned[pid_key] = deadline
                actions.append(
                    Overuse(
                        cap.lease_id,
                        cap.user,
                        cap.device_uuid,
                        proc.pid,
                        _mib(proc),
                        cap.cap_mib,
                        deadline,
                        total,
                    )
                )
                self.log.warning(
                    "Lease %s of %s uses %s MiB on %s, cap %s MiB: process %s (%s MiB) "
                    "will be ended at %s",
                    cap.lease_id,
                    cap.user,
                    total,
                    cap.device_uuid,
                    cap.cap_mib,
                    proc.pid,
                    _mib(proc),
                    deadline.isoformat(),
                )
            elif now >= deadline:
                del self.warned[pid_key]
                self.ended.add(pid_key)
                reason = (
                    f"share over its memory cap on {cap.device_uuid}: the lease used "
                    f"{total} MiB of {cap.cap_mib} MiB (+{self.tolerance_mib} MiB tolerance) "
                    f"{self.grace:g} s after a warning; process {proc.pid} held "
                    f"{_mib(proc)} MiB"
                )
                if any(p.estimated for p in live):
                    reason += (
                        " (estimated from the device's total: NVML reports no per-process "
                        "memory there)"
                    )
                actions.append(
                    Terminate(
                        cap.lease_id,
                        cap.user,
                        cap.device_uuid,
                        proc.pid,
                        _mib(proc),
                        cap.cap_mib,
                        reason,
                        total,
                    )
                )
                self.log.warning(
                    "Ending process %s of lease %s: %s", proc.pid, cap.lease_id, reason
                )
        return actions


def _mib(sample: ProcessSample) -> int:
    """A judged sample's memory, MiB (known by then: :meth:`ShareWatchdog._estimated`)."""
    return sample.used_memory_mib or 0


# -- the OS part ----------------------------------------------------------------------


def _environ_value(pid: int, name: str) -> str | None:
    """``name``'s value in ``/proc/<pid>/environ`` (the environment the
    process was started with); ``None`` when unset or unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:  # gone, not permitted, no /proc
        return None
    prefix = name.encode() + b"="
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``comm`` (state first, ppid
    second); ``None`` when unreadable. ``comm`` may hold spaces and
    parentheses, so split after its last ``)``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    end = text.rfind(")")
    return text[end + 2 :].split() if end >= 0 else None


def process_uid(pid: int) -> int | None:
    """The real uid of ``pid`` (``Uid:`` of ``/proc/<pid>/status``), or
    ``None`` when unreadable (gone, no /proc)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            try:
                return int(fields[1])
            except (IndexError, ValueError):
                return None
    return None


#: a Docker container's ID in a line of ``/proc/<pid>/cgroup`` (cgroup v1
#: ``.../docker/<id>``, v2 ``.../docker-<id>.scope``)
_DOCKER_CGROUP = re.compile(r"docker[-/]([0-9a-f]{64})(?:\.scope)?$")


def process_container(pid: int, proc: str = "/proc") -> str | None:
    """The Docker container ``pid`` runs in (its 64-hex-digit ID, from
    ``<proc>/<pid>/cgroup``), ``""`` when it runs in none, or ``None`` when
    unreadable (gone, no /proc)."""
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        found = _DOCKER_CGROUP.search(line.rpartition(":")[2])
        if found:
            return found.group(1)
    return ""


def user_uid(user: str) -> int | None:
    """The uid of POSIX account ``user`` on this host, or ``None`` when it has none."""
    try:
        return pwd.getpwnam(user).pw_uid
    except (KeyError, UnicodeEncodeError, ValueError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` (``/proc/<pid>/stat``), or ``None`` when unreadable."""
    fields = _stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def lease_of_pid(pid: int, max_depth: int = 4) -> int | None:
    """The lease a process belongs to: ``GPUBROKER_LEASE_ID`` in its
    environment (``/proc/<pid>/environ``, NUL-separated), else in its
    parent's, up to ``max_depth`` ancestors (not init, pid 1) that run as
    the process's own uid (a parent of another uid, e.g. a root daemon that
    started it, does not lend it its lease).

    Args:
        pid: a process id in the broker's PID namespace.
        max_depth: how many ancestors to try after the process itself.

    Returns:
        The lease id, or ``None``: no such variable (or not an integer),
        the process is gone, or its environment may not be read (the broker
        must run as root or as the users' owner).
    """
    current: int | None = pid
    uid = process_uid(pid)
    for _ in range(max_depth + 1):
        if current is None or current <= 1:
            return None
        if current != pid and uid is not None and process_uid(current) != uid:
            return None
        value = _environ_value(current, LEASE_ENV)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
        current = parent_pid(current)
    return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an ended, unreaped process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    if fields is None:  # gone meanwhile; or no /proc, where kill() is all we know
        return not os.path.isdir("/proc/self")
    return bool(fields) and fields[0] not in ("Z", "X")


def end_process(pid: int, term_timeout: float = 5.0) -> None:
    """End a process: SIGTERM, then SIGKILL if it still runs after
    ``term_timeout`` seconds (polled every 50 ms). A process already gone
    (or gone meanwhile) is fine. A zombie counts as ended; it is not reaped
    here (its parent does that). Blocks up to ``term_timeout`` seconds: call
    it from a thread (``asyncio.to_thread``) in the broker's event loop.

    Args:
        pid: process id (> 1, not the broker itself).
        term_timeout: seconds between SIGTERM and SIGKILL (>= 0).

    Raises:
        ValueError: ``pid`` is 0, 1, negative or the broker's own, or
            ``term_timeout`` is negative.
        PermissionError: the process may not be signalled (the broker must
            run as root or as the notebook users' owner).
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        raise ValueError(f"pid must be a process id > 1 other than the broker's, got {pid!r}")
    if term_timeout < 0:
        raise ValueError(f"term_timeout must be >= 0 seconds, got {term_timeout}")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + term_timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    if not _alive(pid):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
