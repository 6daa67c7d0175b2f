"""What Slurm's commands answer, read into the engine protocol's values.

Pure functions (no I/O, no clock) over the JSON of ``sinfo --json`` and
``squeue --json`` (Slurm 22.05, OpenAPI plugin v0.0.38) and the parsable
text of ``sacct -P``. The JSON of later Slurm releases (``data_parser``
v0.0.39 of 23.02, v0.0.40 of 23.11, v0.0.41 of 24.05, v0.0.42 of 24.11:
states as lists of flags, numbers as ``{"set", "infinite", "number"}``
objects, exit codes as ``{"status", "return_code", "signal"}``) is read
into 22.05's shape first (:func:`as_v38`); there ``sinfo --json`` lists
grouped rows (``"sinfo"``), and the nodes come from ``scontrol show nodes
--json`` instead. Read here: node states, GRES strings (``gpu:h100:4``,
``gpu:h100:2(IDX:0-1)``), host lists (``n[1-3,7]``), job states and exit
codes. Used by :class:`gpubroker.engines.slurm.SlurmEngine`.

Rules taken from Slurm's documentation: a job's ``exit_code`` in the JSON
is the raw wait status (exit code in the high byte, the signal in the low
7 bits, as ``waitpid``); ``sacct``'s ``ExitCode`` is ``code:signal``;
node states are a base state (``idle``, ``mixed``, ``allocated``, ``down``,
...) plus flags (``DRAIN``, ``NOT_RESPONDING``, ...). A drained or draining
node runs what it has and takes nothing new.
"""

from __future__ import annotations

import re
import uuid as uuid_module
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from .base import NodeState, Status

#: job states that are an end (Slurm's base states other than pending,
#: running and suspended, and a federation's revoked sibling); every other
#: state, known or not (``PENDING``, ``RESV_DEL_HOLD``, ``SPECIAL_EXIT``,
#: ``REQUEUE_HOLD``, ``CONFIGURING``, ``COMPLETING``, ...), is a job still in
#: Slurm's hands: it holds or may yet hold its allocation
FINAL_JOB_STATES = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "REVOKED",
    }
)

#: job states in which a job's batch script has started (its processes run,
#: are stopped or are being ended); a job in any other state that is no end
#: has no processes to signal
STARTED_JOB_STATES = frozenset(
    {"RUNNING", "SUSPENDED", "STOPPED", "SIGNALING", "COMPLETING", "STAGE_OUT", "RESIZING"}
)

#: pending reasons that waiting does not clear (Slurm's squeue(1) REASON
#: CODES: the job asks what its partition, account or QOS never gives): a
#: job pending for one of them never starts as it is. Not an admin's hold
#: (``JobHeldAdmin``): a batch job waits through it (a maintenance hold is
#: released), as in Slurm; the spawner, whose user waits at the spawn
#: page, fails at once on it too
NEVER_STARTS = frozenset(
    {
        "PartitionTimeLimit",
        "PartitionNodeLimit",
        "PartitionConfig",
        "AccountNotAllowed",
        "QOSNotAllowed",
        "InvalidAccount",
        "InvalidQOS",
        "BadConstraints",
    }
)

#: final states of a job Slurm ended before its own end: a status that
#: reads as a success (``NODE_FAIL 0:0``, ``PREEMPTED 0:0``) is not one
_KILLED = frozenset({"NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "REVOKED"})


def is_active(state: str) -> bool:
    """Whether a job in Slurm state ``state`` (``squeue``'s or ``sacct``'s
    first word) has not ended: every state but those of
    :data:`FINAL_JOB_STATES`, unknown ones too (never taken for an end)."""
    return state.strip().upper() not in FINAL_JOB_STATES


#: node states and flags in which a node takes no new work, and which of
#: the two it is (drained: runs what it has; down: runs nothing). Not
#: ``POWERED_DOWN``: power saving turns idle nodes off, and Slurm powers one
#: up for the next job sent to it
_DOWN = frozenset({"DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "UNKNOWN"})
_DRAINED = frozenset(
    {"DRAIN", "DRAINED", "DRAINING", "MAINTENANCE", "RESERVED", "REBOOT_REQUESTED", "FUTURE"}
)

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_GPU = re.compile(r"^gpu(?::([^:(]+))?(?::(\d+))?(?:\((.*)\))?$")
_HOST = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")


def split_top(text: str) -> list[str]:
    """Split ``text`` at the commas outside brackets and parentheses
    (``"gpu:a:2(S:0,1),gpu:b:1"`` -> ``["gpu:a:2(S:0,1)", "gpu:b:1"]``)."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def index_set(text: str) -> set[int]:
    """The indices of a Slurm index list: ``"0-2,5"`` -> ``{0, 1, 2, 5}``;
    ``"N/A"`` or ``""`` -> none.

    Raises:
        ValueError: a part is neither ``N`` nor ``N-M``.
    """
    found: set[int] = set()
    if text.strip() in ("", "N/A"):
        return found
    for part in text.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ValueError(f"not a Slurm index list: {text!r}")
        low = int(match.group(1))
        high = int(match.group(2) or low)
        found.update(range(low, high + 1))
    return found


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list notation expanded: ``"n[1-3],gpu07"`` ->
    ``["n1", "n2", "n3", "gpu07"]`` (zero padding kept: ``g[01-02]`` ->
    ``g01, g02``); ``""`` or ``"(null)"`` -> ``[]``."""
    names: list[str] = []
    for part in split_top(text):
        if part == "(null)":
            continue
        match = _HOST.match(part)
        if match is None:
            names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        rests = expand_hostlist(suffix) if suffix else [""]
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            width = len(low)
            for n in range(int(low), int(high or low) + 1):
                names.extend(f"{prefix}{n:0{width}d}{rest}" for rest in rests)
    return names


@dataclass(frozen=True)
class GpuGres:
    """One ``gpu`` entry of a GRES string.

    Attributes:
        type: the GRES type (``h100``), ``""`` when the entry has none.
        count: how many GPUs.
        indices: the GPU indices named by ``IDX:`` (empty when not named).
    """

    type: str
    count: int
    indices: frozenset[int] = frozenset()


def gpu_gres(text: str) -> list[GpuGres]:
    """The ``gpu`` entries of a GRES string (``sinfo``'s ``gres`` and
    ``gres_used``, a job's ``gres_detail``); other GRES are left out.
    ``"gpu:h100:2(IDX:0-1),shard:4"`` -> ``[GpuGres("h100", 2, {0, 1})]``.
    A count-less entry (``gpu:h100``) counts 1."""
    found: list[GpuGres] = []
    for entry in split_top(text or ""):
        match = _GPU.match(entry)
        if match is None:
            continue
        kind, count, detail = match.groups()
        if kind is not None and kind.isdigit() and count is None:
            kind, count = None, kind  # "gpu:4": a count, no type
        indices: set[int] = set()
        key = ""
        for item in split_top(detail or ""):
            # "IDX:1,3" and "S:0,1": a list goes on after its comma
            key, _, value = item.partition(":") if ":" in item else (key, "", item)
            if key == "IDX":
                indices |= index_set(value)
        found.append(GpuGres(kind or "", int(count or 1), frozenset(indices)))
    return found


def node_state(state: str, flags: Iterable[str]) -> NodeState:
    """A node's :data:`~gpubroker.engines.base.NodeState` from ``sinfo
    --json``'s ``state`` (``"idle"``, ``"mixed"``, ``"down"``, ...) and
    ``state_flags`` (``["DRAIN"]``, ...): down or not responding is
    ``down``; drained, draining or in maintenance is ``drained``."""
    words = {state.upper(), *(f.upper() for f in flags)}
    if words & _DOWN:
        return "down"
    if words & _DRAINED:
        return "drained"
    return "up"


#: fields that data_parser v0.0.38 (Slurm 22.05) gives as a string or a
#: number, and later ones (v0.0.39+, Slurm 23.02+) as a list or an object;
#: :func:`as_v38` reads them back into v0.0.38's shape
_SCALAR_FIELDS = ("state", "job_state", "exit_code", "start_time", "end_time", "submit_time")

#: job state flags in the order Slurm's ``job_state_string()`` names a job
#: by them before its base state (src/common/slurm_protocol_defs.c, 22.05
#: to 24.11): v0.0.38 prints that one word, v0.0.40+ the base state and
#: every flag (``["CANCELLED", "COMPLETING"]``)
_JOB_FLAG_ORDER = (
    "COMPLETING",
    "STAGE_OUT",
    "CONFIGURING",
    "RESIZING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
    "REVOKED",
    "RESV_DEL_HOLD",
    "SIGNALING",
)


def number(value: Any) -> int | None:
    """A number of Slurm's JSON: v0.0.38's plain ``5``, or v0.0.39+'s
    ``{"set": true, "infinite": false, "number": 5}``; ``None`` when not
    set, infinite or not a number."""
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def job_state_word(state: Any) -> str:
    """A job's state as one word, as v0.0.38 (Slurm 22.05) prints it:
    v0.0.39's string as is; v0.0.40+'s list (``["PENDING",
    "REQUEUE_HOLD"]``) as Slurm's ``job_state_string()`` names it: its
    first flag of :data:`_JOB_FLAG_ORDER`, else its base state."""
    if not isinstance(state, list | tuple):
        return str(state or "")
    words = [str(w).upper() for w in state]
    for flag in _JOB_FLAG_ORDER:
        if flag in words:
            return flag
    return words[0] if words else ""


def raw_exit_code(value: Any) -> int:
    """A job's exit status as v0.0.38 gives it, a raw wait status (exit
    code in the high byte, the signal in the low 7 bits), from any shape:
    v0.0.38's number; v0.0.39's ``{"set", "infinite", "number"}`` of that
    wait status; v0.0.40+'s ``{"status": [...], "return_code": {...},
    "signal": {"id": {...}, "name": ...}}``. Not set: 0."""
    if not isinstance(value, Mapping) or "number" in value:
        return number(value) or 0
    signal = value.get("signal")
    signum = number(signal.get("id")) if isinstance(signal, Mapping) else None
    if signum:
        return signum & 0x7F
    return ((number(value.get("return_code")) or 0) & 0xFF) << 8


def as_v38(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--json`` ``answer`` of ``sinfo``, ``scontrol show nodes`` or
    ``squeue`` in v0.0.38's (Slurm 22.05's) shape, which the rest of this
    module reads; an answer already in it is returned as it is. Nodes: a
    list ``state`` (``["IDLE", "DRAIN"]``, v0.0.39+) becomes ``state``
    (its first word, lower case) and ``state_flags`` (the others). Jobs:
    ``job_state`` one word (:func:`job_state_word`), ``exit_code`` a raw
    wait status (:func:`raw_exit_code`), times plain epochs (0: not set)."""
    fixed = dict(answer)
    nodes = answer.get("nodes")
    if isinstance(nodes, list):
        fixed["nodes"] = [_node_v38(n) if isinstance(n, Mapping) else n for n in nodes]
    jobs = answer.get("jobs")
    if isinstance(jobs, list):
        fixed["jobs"] = [_job_v38(j) if isinstance(j, Mapping) else j for j in jobs]
    return fixed


def _node_v38(node: Mapping[str, Any]) -> dict[str, Any]:
    fixed = dict(node)
    state = node.get("state")
    if isinstance(state, list | tuple):
        words = [str(w) for w in state]
        fixed["state"] = words[0].lower() if words else ""
        fixed["state_flags"] = [*words[1:], *(node.get("state_flags") or [])]
    return fixed


def _job_v38(job: Mapping[str, Any]) -> dict[str, Any]:
    fixed = dict(job)
    if "job_state" in job:
        fixed["job_state"] = job_state_word(job["job_state"])
    if "exit_code" in job:
        fixed["exit_code"] = raw_exit_code(job["exit_code"])
    for key in ("start_time", "end_time", "submit_time"):
        if isinstance(job.get(key), Mapping):
            fixed[key] = number(job[key]) or 0
    return fixed


def unsupported_format(answer: Mapping[str, Any]) -> str:
    """Why the ``--json`` ``answer`` of ``sinfo``/``squeue``, as
    :func:`as_v38` leaves it, is in a format this module does not read
    (``""``: v0.0.38's shape). A field still a list or an object would be
    misread (a drained node up, an ended job running), so such an answer
    is refused instead."""
    for key in ("nodes", "jobs"):
        for item in answer.get(key) or []:
            if not isinstance(item, Mapping):
                continue
            for field in _SCALAR_FIELDS:
                if isinstance(item.get(field), list | Mapping):
                    meta = answer.get("meta") or {}
                    release = (meta.get("Slurm") or meta.get("slurm") or {}).get("release")
                    return (
                        f"{key}[].{field} is a {type(item[field]).__name__}: this shape of "
                        f"Slurm {release or '?'}'s JSON is not read"
                    )
    return ""


def errors(answer: Mapping[str, Any]) -> str:
    """The errors a ``--json`` answer reports (``""``: none): Slurm 22.05's
    ``squeue --json`` and ``sinfo --json`` exit 0 with an empty list and an
    ``errors`` entry (``"Failed while looking for jobs"``) when slurmctld
    does not answer."""
    found = []
    for error in answer.get("errors") or []:
        if isinstance(error, Mapping):
            words = error.get("description") or error.get("error") or "error"
            source = error.get("source")
            found.append(f"{words} ({source})" if source else str(words))
        else:
            found.append(str(error))
    return "; ".join(found)


def device_uuid(cluster: str, node: str, index: int) -> str:
    """A stable ``GPU-`` UUID for GPU ``index`` of ``node`` (Slurm knows
    no NVML UUIDs): the same cluster, node and index give the same UUID
    across broker restarts."""
    return (
        f"GPU-{uuid_module.uuid5(uuid_module.NAMESPACE_URL, f'slurm://{cluster}/{node}/{index}')}"
    )


def job_gpus(job: Mapping[str, Any]) -> dict[str, frozenset[int]]:
    """The GPU indices a job holds on each of its nodes, from ``squeue
    --json``'s ``nodes`` and ``gres_detail`` (one entry per node, in the
    order of the expanded host list); ``{}`` while it holds none."""
    nodes = expand_hostlist(str(job.get("nodes") or ""))
    detail = list(job.get("gres_detail") or [])
    held: dict[str, frozenset[int]] = {}
    for node, gres in zip(nodes, detail, strict=False):
        indices = frozenset(i for g in gpu_gres(str(gres)) for i in g.indices)
        if indices:
            held[node] = indices
    return held


def utc(epoch: Any) -> datetime | None:
    """An aware UTC time of a Slurm epoch (seconds); ``None`` for 0,
    none or one that is not a number (Slurm's "not set")."""
    try:
        seconds = int(epoch)
    except (TypeError, ValueError):
        return None
    return datetime.fromtimestamp(seconds, timezone.utc) if seconds > 0 else None


def wait_status(raw: int) -> tuple[int | None, int | None]:
    """``(exit_code, signal)`` of a raw wait status as Slurm's JSON gives
    a job's ``exit_code`` (``768`` -> ``(3, None)``, ``9`` -> ``(None, 9)``)."""
    signum = raw & 0x7F
    return (None, signum) if signum else ((raw >> 8) & 0xFF, None)


def job_status(job: Mapping[str, Any]) -> Status:
    """A :class:`~gpubroker.engines.base.Status` of one job of ``squeue
    --json``: a job in any state that is no end (:func:`is_active`:
    pending, running, held, being set up, or a state not known here) is
    ``running`` (it holds or may yet hold its allocation); one whose batch
    script has not started (not in :data:`STARTED_JOB_STATES`) is
    ``waiting`` with its state and reason (``PENDING (Resources)``), and
    ``never_starts`` where that reason is one of :data:`NEVER_STARTS`; a
    final state is ``exited`` with its exit code or signal, as
    :func:`final_status` reads it."""
    state = str(job.get("job_state") or "").upper()
    started = utc(job.get("start_time"))
    if is_active(state):
        if state in STARTED_JOB_STATES:
            return Status("running", started=started)
        reason = str(job.get("state_reason") or "")
        reason = "" if reason == "None" else reason
        waiting = f"{state or 'UNKNOWN'} ({reason})" if reason else state or "UNKNOWN"
        return Status(
            "running", started=started, waiting=waiting, never_starts=reason in NEVER_STARTS
        )
    code, signum = wait_status(int(job.get("exit_code") or 0))
    return final_status(state, code, signum, started, utc(job.get("end_time")))


def final_status(
    state: str,
    code: int | None,
    signum: int | None,
    started: datetime | None = None,
    ended: datetime | None = None,
) -> Status:
    """The ``exited`` status of a job that ended in final Slurm state
    ``state`` with exit ``code`` or signal ``signum``. ``TIMEOUT`` and
    ``DEADLINE`` are ``timed_out``; ``CANCELLED`` without a signal or code
    counts as SIGTERM (what ``scancel`` sends); ``OUT_OF_MEMORY`` is the
    kernel's SIGKILL (sacct's ``0:125`` names no signal); a job Slurm ended
    before its own end (``NODE_FAIL``, ``PREEMPTED``, ``BOOT_FAIL``,
    ``REVOKED``) with a status that reads as a success (Slurm often records
    ``0:0``) counts as SIGKILL, and ``FAILED 0:0`` as exit status 1: none
    of them is ever a success."""
    state = state.upper()
    failed_quietly = signum is None and not code
    killed = state in _KILLED and failed_quietly
    if state == "CANCELLED" and failed_quietly:
        code, signum = None, 15
    elif killed or (state == "OUT_OF_MEMORY" and (signum is None or signum > 64)):
        code, signum = None, 9
    elif state == "FAILED" and failed_quietly:
        code = 1
    timed_out = state in ("TIMEOUT", "DEADLINE")
    return Status("exited", code, signum, started=started, ended=ended, timed_out=timed_out)


def sacct_status(text: str) -> Status | None:
    """The status from ``sacct -n -P -X -j ID -o State,ExitCode,Start,End``
    (``"COMPLETED|0:0|2026-12-03T07:07:24|2026-12-03T07:08:00"``): final
    once ended, ``running`` while it runs or pends (a job ``squeue`` did
    not list, e.g. hidden from it); ``None`` when it lists no job. Times are
    read as UTC (set ``TZ=UTC`` for the command)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    state, exit_code, start, end = ([*lines[0].split("|"), "", "", ""])[:4]
    state = state.split()[0].upper() if state.strip() else ""
    if not state:
        return None
    if is_active(state):
        return Status("running", started=_sacct_time(start))
    code_text, _, signal_text = exit_code.partition(":")
    code = int(code_text) if code_text.isdigit() else None
    signum = int(signal_text) if signal_text.isdigit() and int(signal_text) else None
    if signum is not None:
        code = None
    return final_status(state, code, signum, _sacct_time(start), _sacct_time(end))


#: the ``sacct`` fields :func:`sacct_records` reads, in this order
SACCT_FIELDS = "JobID,JobName,Submit,State,ExitCode,Start,End"


@dataclass(frozen=True)
class SacctRecord:
    """One job record of ``sacct -n -P -X -D -o`` :data:`SACCT_FIELDS`.

    Attributes:
        job_id: Slurm's job id (``"42"``).
        name: the job's name (``sbatch --job-name``).
        submitted: when it was submitted (aware, UTC), ``None`` if unreadable.
        status: its status, as :func:`sacct_status` reads it.
    """

    job_id: str
    name: str
    submitted: datetime | None
    status: Status


def sacct_records(text: str) -> list[SacctRecord]:
    """The job records of ``sacct -n -P -X -D -o`` :data:`SACCT_FIELDS`
    (``"42|gpubroker-lease-5|2026-12-03T07:07:20|COMPLETED|0:0|2026-12-03T07:07:24|
    2026-12-03T07:08:00"``), in ``sacct``'s order; lines without a state are
    left out. With ``--duplicates`` (``-D``) ``sacct`` lists every record of
    a job id, also those of older jobs that had the same id before Slurm's
    ids were reset (sacct(1), ``--duplicates``). Times are read as UTC (set
    ``TZ=UTC`` for the command)."""
    found: list[SacctRecord] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        job_id, name, submitted, rest = ([*line.split("|", 3), "", "", ""])[:4]
        status = sacct_status(rest)
        if status is None:
            continue
        found.append(SacctRecord(job_id.strip(), name, _sacct_time(submitted), status))
    return found


def sacct_pick(
    records: Iterable[SacctRecord],
    job_id: str,
    prefix: str,
    name: str | None = None,
    since: datetime | None = None,
) -> SacctRecord | None:
    """The record of ``records`` that is the broker's job ``job_id``, or
    ``None``: Slurm reuses job ids (a ``slurmctld`` whose state was reset
    starts again at ``FirstJobId``), so a record of that id may be another
    job's. A record counts only if its name starts with ``prefix`` (every
    job the engine submits is named so), is ``name`` where that is known,
    and was submitted at or after ``since`` (aware UTC) where that is
    known; of those, the newest (latest submit time) wins."""
    mine = [
        r
        for r in records
        if r.job_id == job_id
        and r.name.startswith(prefix)
        and (name is None or r.name == name)
        and (since is None or (r.submitted is not None and r.submitted >= since))
    ]
    if not mine:
        return None
    oldest = datetime.min.replace(tzinfo=timezone.utc)
    return max(mine, key=lambda r: r.submitted or oldest)


def _sacct_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.strip()).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


#: how a server job tells its port: the job's comment (``scontrol update
#: JobId=N Comment=...``, which Slurm lets a job's owner do), written by
#: :mod:`gpubroker_spawner.slurm_server` on the node
SERVER_COMMENT = "gpubroker server port="

_SERVER_PORT = re.compile(r"^gpubroker server port=(\d{1,5})$")


def server_comment(port: int) -> str:
    """The comment a server job sets once it has chosen ``port`` (1-65535)."""
    return f"{SERVER_COMMENT}{int(port)}"


def server_port(comment: str) -> int | None:
    """The port in a server job's comment (:func:`server_comment`), or
    ``None`` when the comment is not one (not yet written, or another)."""
    match = _SERVER_PORT.fullmatch(comment.strip())
    if match is None:
        return None
    port = int(match.group(1))
    return port if 0 < port < 65536 else None


@dataclass(frozen=True)
class JobView:
    """One job of ``squeue --json``, as a spawner follows it.

    Attributes:
        job_id: Slurm's job id.
        state: Slurm's job state, upper case (``PENDING``, ``RUNNING``, ...).
        reason: Slurm's state reason (``Resources``, ``Priority``,
            ``NonZeroExitCode``, ...), ``""`` for none.
        node: the node its batch script runs on (``""`` while pending).
        port: the port its server reported (:func:`server_port`), or ``None``.
        status: its :class:`~gpubroker.engines.base.Status`, with the
            devices it is bound to while running (UUIDs of ``cluster``).
    """

    job_id: str
    state: str
    reason: str
    node: str
    port: int | None
    status: Status


def job_view(job: Mapping[str, Any], cluster: str) -> JobView:
    """The :class:`JobView` of one job of ``squeue --json`` on ``cluster``
    (the name in its devices' UUIDs, see :func:`device_uuid`)."""
    status = job_status(job)
    if status.running:
        bound = tuple(
            device_uuid(cluster, node, index)
            for node, indices in job_gpus(job).items()
            for index in sorted(indices)
        )
        status = replace(status, devices=bound)
    nodes = expand_hostlist(str(job.get("nodes") or ""))
    reason = str(job.get("state_reason") or "")
    return JobView(
        job_id=str(job.get("job_id")),
        state=str(job.get("job_state") or "").upper(),
        reason="" if reason == "None" else reason,
        node=str(job.get("batch_host") or (nodes[0] if nodes else "")),
        port=server_port(str(job.get("comment") or "")),
        status=status,
    )
