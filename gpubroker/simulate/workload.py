"""From a trace to the jobs the simulator replays: enrichment and admission.

Traces lack some of what the broker's policy reads. :class:`Enrichment`
fills it in, deterministically, and says so in the output's notes:

- users, where the trace has none (``openb``): a hash of the job id into
  ``Enrichment.users`` synthetic users;
- groups: ``Enrichment.group_map``, else a hash of the user name into
  ``Enrichment.groups`` groups (crc32, the same on every machine);
- priority classes: by user, by QoS label, by size, else a default;
- time limits: run time x ``Enrichment.time_limit_factor`` with optional
  seeded jitter, never below the run time.

Admission: a job larger than the largest node can never be placed (the
scheduler places a request on one node only), so it is reported as a
problem with its line and left out; the rest of the run continues.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from traitlets import Dict, Float, Integer, TraitError, Unicode, validate
from traitlets.config import Configurable

from .cluster import Cluster
from .readers import Problem, Trace, TraceJob


@dataclass(frozen=True)
class SimJob:
    """A job as the simulator replays it.

    Attributes:
        index: position in :attr:`Workload.jobs` (submit order).
        job_id: the trace's id.
        user: its user.
        group: its group, or ``None``.
        gpus: whole devices, on one node.
        submit: seconds after the first submission of the trace.
        run_time: seconds it runs once started (from zero after a restart).
        time_limit: seconds it may run, ``>= run_time``.
        priority_class: its class name.
        demand: GPUs it asked for (fractional for ``openb``; else ``gpus``).
        line: its line in the trace.
        kind: :class:`~gpubroker.scheduler.SlotKind` value: ``gpus`` (whole
            devices), ``mig`` (one instance of ``mig_profile``) or ``share``
            (``gpus`` shares of ``memory_mib`` MiB each); traces only make
            ``gpus`` jobs, the others come from callers building jobs.
        mig_profile: the MIG profile (``mig`` only).
        memory_mib: memory of each share, MiB (``share`` only).
    """

    index: int
    job_id: str
    user: str
    group: str | None
    gpus: int
    submit: float
    run_time: float
    time_limit: float
    priority_class: str
    demand: float
    line: int
    kind: str = "gpus"
    mig_profile: str = ""
    memory_mib: int = 0


@dataclass
class Workload:
    """The jobs to replay, the rows left out, and what was assumed.

    Attributes:
        jobs: admitted jobs in submit order (ties: trace order).
        problems: rows left out by the reader or by admission.
        notes: how the trace was read and enriched, for the output.
        fractional: whether some job asks for a fraction of a GPU.
        source: trace file name.
        format: trace format.
        origin: the trace's own time of the first submission (seconds).
    """

    jobs: tuple[SimJob, ...]
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fractional: bool = False
    source: str = ""
    format: str = ""
    origin: float = 0.0


def stable_hash(text: str) -> int:
    """A hash of ``text`` that is the same in every process (crc32)."""
    return zlib.crc32(text.encode("utf-8"))


class Enrichment(Configurable):
    """How the simulator fills in what a trace lacks (stated in the output's notes)."""

    groups = Integer(
        8,
        help="""Groups that users are hashed into (crc32 of the user name) when
        the trace names none and group_map has no entry; 0: no groups.""",
    ).tag(config=True)

    group_map = Dict(
        help="Group of each user, {'ann': 'vision'}; wins over hashing.",
    ).tag(config=True)

    users = Integer(
        100,
        help="""Synthetic users that jobs of a trace without users (openb) are
        hashed into (crc32 of the job id).""",
    ).tag(config=True)

    default_class = Unicode(
        "batch",
        help="Priority class of jobs no rule below names (and the trace names none).",
    ).tag(config=True)

    class_by_user = Dict(
        help="Priority class per user, {'ann': 'batch-urgent'}; first rule tried.",
    ).tag(config=True)

    class_by_qos = Dict(
        help="""Priority class per QoS label of the trace (openb: LS, Burstable,
        BE), e.g. {'LS': 'interactive', 'BE': 'preemptible'}; tried after class_by_user.""",
    ).tag(config=True)

    class_by_size = Dict(
        help="""Priority class by size: {max GPUs: class}; a job gets the class of
        the smallest bound >= its GPUs, e.g. {1: 'interactive', 8: 'batch'};
        tried after class_by_qos.""",
    ).tag(config=True)

    time_limit_factor = Float(
        1.5,
        help="""Time limit = run time x this factor (>= 1) for jobs whose trace
        gives none; users over-estimate, which is what backfill sees.""",
    ).tag(config=True)

    time_limit_jitter = Float(
        0.0,
        help="""Relative random spread of the time limit: factor x (1 +/- up to
        this), drawn from the run's seed; never below the run time.""",
    ).tag(config=True)

    @validate("time_limit_factor")
    def _check_factor(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if value < 1:
            raise TraitError(
                f"time_limit_factor must be >= 1 (a limit below the run time would end "
                f"the job early), got {value}"
            )
        return value

    @validate("time_limit_jitter", "groups", "users")
    def _check_non_negative(self, proposal: Any) -> Any:
        if proposal["value"] < 0:
            raise TraitError(f"{proposal['trait'].name} must be >= 0, got {proposal['value']}")
        return proposal["value"]

    def size_rules(self) -> list[tuple[int, str]]:
        """``class_by_size`` as ``(max GPUs, class)``, smallest bound first."""
        rules = []
        for bound, name in self.class_by_size.items():
            try:
                rules.append((int(bound), str(name)))
            except (TypeError, ValueError):
                raise TraitError(f"class_by_size: {bound!r} is not a number of GPUs") from None
        return sorted(rules)

    def priority_class(self, job: TraceJob, user: str, rules: list[tuple[int, str]]) -> str:
        """The class of ``job`` (of ``user``) by the rules, in order."""
        if job.priority_class:
            return job.priority_class
        if user in self.class_by_user:
            return str(self.class_by_user[user])
        if job.qos is not None and job.qos in self.class_by_qos:
            return str(self.class_by_qos[job.qos])
        for bound, name in rules:
            if job.gpus <= bound:
                return name
        return self.default_class

    def group(self, job: TraceJob, user: str) -> str | None:
        """The group of ``job``: the trace's, the map's, else a hash into ``groups``."""
        if job.group:
            return job.group
        if user in self.group_map:
            return str(self.group_map[user])
        if self.groups <= 0:
            return None
        return f"group{stable_hash(user) % self.groups:02d}"

    def time_limit(self, job: TraceJob, rng: random.Random) -> float:
        """The job's time limit, seconds: the trace's, else run time x factor (+ jitter)."""
        if job.time_limit is not None:
            return job.time_limit
        factor = self.time_limit_factor
        if self.time_limit_jitter > 0:
            factor *= 1.0 + rng.uniform(-self.time_limit_jitter, self.time_limit_jitter)
        return max(job.run_time, float(math.ceil(job.run_time * factor)))

    def notes(self, trace: Trace, counts: Mapping[str, int]) -> list[str]:
        """What was filled in, in sentences."""
        out = []
        if counts["users"]:
            out.append(
                f"users: the trace has none; {counts['users']} jobs were hashed into "
                f"{self.users} synthetic users (crc32 of the job id)"
            )
        if counts["groups"]:
            how = f"hashed into {self.groups} groups (crc32 of the user name)"
            if self.groups <= 0:
                how = "no group (Enrichment.groups is 0)"
            if self.group_map:
                how = f"taken from group_map, else {how}"
            out.append(f"groups: the trace names none for {counts['groups']} jobs; {how}")
        if counts["classes"]:
            rules = [
                name
                for name, used in (
                    ("by user", self.class_by_user),
                    ("by QoS", self.class_by_qos),
                    ("by size", self.class_by_size),
                )
                if used
            ]
            how = (", ".join(rules) + ", else ") if rules else ""
            out.append(
                f"priority classes: the trace names none for {counts['classes']} jobs; "
                f"set {how}{self.default_class!r}"
            )
        if counts["limits"]:
            jitter = (
                f" x (1 +/- up to {self.time_limit_jitter:g}, seeded)"
                if self.time_limit_jitter
                else ""
            )
            out.append(
                f"time limits: the trace gives none for {counts['limits']} jobs; run time x "
                f"{self.time_limit_factor:g}{jitter}, rounded up to whole seconds, never "
                "below the run time"
            )
        return out


def prepare(trace: Trace, cluster: Cluster, enrichment: Enrichment, seed: int = 0) -> Workload:
    """Enrich ``trace`` and admit its jobs to ``cluster``.

    Submit times are shifted so that the first submission is at 0. Jobs that
    ask for more GPUs than the largest node are reported in ``problems``
    (with their line) and left out.
    """
    rng = random.Random(seed)
    rules = enrichment.size_rules()
    problems = list(trace.problems)
    origin = min((j.submit for j in trace.jobs), default=0.0)
    counts = {"users": 0, "groups": 0, "classes": 0, "limits": 0}
    jobs: list[SimJob] = []
    for job in sorted(trace.jobs, key=lambda j: (j.submit, j.line)):
        if job.gpus > cluster.largest_node:
            problems.append(
                Problem(
                    job.line,
                    f"asks for {job.gpus} GPUs on one node, but the largest node has "
                    f"{cluster.largest_node} (the scheduler places a request on one node only)",
                    job.job_id,
                )
            )
            continue
        user = job.user
        if user is None:
            counts["users"] += 1
            user = f"user{stable_hash(job.job_id) % max(enrichment.users, 1):03d}"
        counts["groups"] += job.group is None
        counts["classes"] += job.priority_class is None
        counts["limits"] += job.time_limit is None
        jobs.append(
            SimJob(
                index=len(jobs),
                job_id=job.job_id,
                user=user,
                group=enrichment.group(job, user),
                gpus=job.gpus,
                submit=job.submit - origin,
                run_time=job.run_time,
                time_limit=enrichment.time_limit(job, rng),
                priority_class=enrichment.priority_class(job, user, rules),
                demand=float(job.gpus) if job.gpu_request is None else job.gpu_request,
                line=job.line,
            )
        )
    problems.sort(key=lambda p: p.line)
    notes = [*trace.notes, *enrichment.notes(trace, counts)]
    if origin:
        notes.append(f"times are seconds after the first submission (trace time {origin:g} s)")
    return Workload(
        tuple(jobs), problems, notes, trace.fractional, trace.source, trace.format, origin
    )
