"""Trace readers: Philly, Helios, Alibaba ``openb`` and the native format.

Each reader turns a file into :class:`TraceJob` rows plus a list of
:class:`Problem` s (bad rows, with their line number and the reason) and
notes about what the format lacks. A bad row never stops the read: it is
reported and left out, and the rest is read.

Times are seconds. Submit times keep the format's own origin here;
:mod:`~gpubroker.simulate.workload` shifts them so that the first
submission is at 0.

Formats:

``philly``
    The Philly subset (``u_id,user,gpu_num,cpu_num,node_num,interval,
    run_time,wall_time,new_status``): the submit time is the cumulative sum
    of ``interval`` (seconds since the previous submission).
``helios``
    The Helios job format: the same columns as the Philly subset; the
    original Helios ``cluster_log.csv`` (``job_id,user,vc,gpu_num,
    submit_time,duration,...``) is read too (``vc`` becomes the group).
``openb``
    Alibaba's GPU-sharing pod list (``name,cpu_milli,memory_mib,num_gpu,
    gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,
    scheduled_time``): run time = ``deletion_time - scheduled_time``;
    ``gpu_milli`` below 1000 is a fractional GPU request.
``native``
    CSV with a header, a JSON array (or ``{"jobs": [...]}``) or JSON Lines,
    with fields ``job_id, user, gpus, submit, run_time`` and optional
    ``group, time_limit, priority_class`` (see the simulation how-to).
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

FORMATS = ("philly", "helios", "openb", "native")


class TraceError(ValueError):
    """The trace cannot be read at all (unknown format, missing columns)."""


class _Bad(ValueError):
    """One row is bad; the message says why."""


@dataclass(frozen=True)
class TraceJob:
    """One job as the trace describes it.

    Attributes:
        job_id: the trace's id for it.
        user: who submitted it; ``None`` when the format has no users.
        gpus: whole devices to place, all on one node (fractional requests
            are rounded up to one device).
        submit: submission time, seconds (the format's own origin).
        run_time: seconds it ran in the trace (it runs as long here).
        line: 1-based line of the row in the file (item number for JSON arrays).
        group: its group (account), if the trace says.
        time_limit: seconds it may run, if the trace says.
        priority_class: its class, if the trace says.
        gpu_request: GPUs actually requested when fractional (``openb``:
            ``num_gpu * gpu_milli / 1000``); ``None`` means ``gpus``.
        qos: the trace's QoS label (``openb``), for class rules.
        share: the fraction of one device's compute and memory each of its
            ``gpus`` asks for (``openb``: ``gpu_milli / 1000``; ``1.0`` a
            whole device); ``None``: whole devices.
        gpu_models: GPU models it may run on (``openb``: ``gpu_spec``);
            empty: any.
        cpu_milli: host CPU it asks for, milli-cores (``openb``); ``None``:
            not given.
        memory_mib: host memory it asks for, MiB (``openb``); ``None``: not
            given.
    """

    job_id: str
    user: str | None
    gpus: int
    submit: float
    run_time: float
    line: int
    group: str | None = None
    time_limit: float | None = None
    priority_class: str | None = None
    gpu_request: float | None = None
    qos: str | None = None
    share: float | None = None
    gpu_models: tuple[str, ...] = ()
    cpu_milli: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class Problem:
    """A row left out, and why.

    Attributes:
        line: 1-based line of the row (or item number, see ``where``).
        reason: one sentence.
        job_id: the row's job id, when it could be read.
        where: ``"line"`` or ``"item"`` (JSON arrays).
    """

    line: int
    reason: str
    job_id: str | None = None
    where: str = "line"

    def __str__(self) -> str:
        job = f" (job {self.job_id})" if self.job_id else ""
        return f"{self.where} {self.line}{job}: {self.reason}"


@dataclass
class Trace:
    """What a reader read.

    Attributes:
        source: file name (or ``"<stream>"``).
        format: one of :data:`FORMATS`.
        jobs: the good rows, in file order.
        problems: the bad rows.
        notes: what the format lacks or how it was interpreted, for the output.
        fractional: whether some request asks for a fraction of a GPU.
        defaulted: rows kept with an optional field empty, by field name
            (``openb``: ``cpu_milli``, ``memory_mib``, which the packing
            experiment then counts as 0 asked); only fields with such rows.
    """

    source: str
    format: str
    jobs: list[TraceJob] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fractional: bool = False
    defaulted: dict[str, int] = field(default_factory=dict)


# -- field parsing -------------------------------------------------------------------


def _text(row: Mapping[str, Any], name: str) -> str:
    value = row.get(name)
    return "" if value is None else str(value).strip()


def _number(row: Mapping[str, Any], name: str) -> float:
    text = _text(row, name)
    if not text:
        raise _Bad(f"{name} is missing")
    try:
        value = float(text)
    except ValueError:
        raise _Bad(f"{name} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise _Bad(f"{name} {text!r} is not a finite number")
    return value


def _seconds(row: Mapping[str, Any], name: str) -> float:
    value = _number(row, name)
    if value < 0:
        raise _Bad(f"{name} {value:g} is negative")
    return value


def _optional_seconds(row: Mapping[str, Any], name: str) -> float | None:
    return _seconds(row, name) if _text(row, name) else None


def _count(row: Mapping[str, Any], name: str) -> int:
    value = _number(row, name)
    if value != int(value):
        raise _Bad(f"{name} {value:g} is not a whole number")
    if value < 0:
        raise _Bad(f"{name} {value:g} is negative")
    return int(value)


def _gpus(row: Mapping[str, Any], name: str) -> int:
    gpus = _count(row, name)
    if gpus == 0:
        raise _Bad(f"{name} is 0: the job asks for no GPU")
    return gpus


def _instant(row: Mapping[str, Any], name: str) -> float:
    """Seconds: a number, or an ISO 8601 date-time (naive means UTC) as epoch seconds."""
    text = _text(row, name)
    try:
        return _number(row, name)
    except _Bad:
        if not text:
            raise
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise _Bad(f"{name} {text!r} is neither seconds nor an ISO 8601 date-time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


# -- sources -------------------------------------------------------------------------


def _open(source: str | Path | TextIO) -> tuple[str, TextIO]:
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            return str(path), io.StringIO(path.read_text(encoding="utf-8-sig"))
        except OSError as err:
            raise TraceError(f"cannot read trace {path}: {err.strerror or err}") from None
        except UnicodeDecodeError as err:
            raise TraceError(f"trace {path} is not UTF-8 text ({err.reason})") from None
    return getattr(source, "name", "<stream>"), source


def _csv_rows(
    stream: TextIO, required: Iterable[str], fmt: str
) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line, row)`` for each data row; the header must name ``required``."""
    reader = csv.DictReader(stream)
    header = [h.strip() for h in (reader.fieldnames or [])]
    reader.fieldnames = header
    missing = [c for c in required if c not in header]
    if missing:
        raise TraceError(
            f"not a {fmt} trace: the header lacks {', '.join(missing)} (it has {', '.join(header)})"
        )
    line = reader.line_num
    for row in reader:
        start, line = line + 1, reader.line_num
        if not any((v or "").strip() for k, v in row.items() if k is not None):
            continue  # blank line
        if None in row:
            yield start, {"__extra__": "x", **{k: v for k, v in row.items() if k is not None}}
        else:
            yield start, row


def _read_rows(
    trace: Trace,
    rows: Iterable[tuple[int, Mapping[str, Any]]],
    parse: Callable[[int, Mapping[str, Any]], TraceJob],
    where: str = "line",
) -> None:
    for line, row in rows:
        job_id = _text(row, "job_id") or _text(row, "u_id") or _text(row, "name") or None
        try:
            if "__extra__" in row:
                raise _Bad("more fields than the header names")
            trace.jobs.append(parse(line, row))
        except _Bad as bad:
            trace.problems.append(Problem(line, str(bad), job_id, where))


# -- Philly and Helios ---------------------------------------------------------------

_INTERVAL_COLUMNS = ("user", "gpu_num", "interval", "run_time")
_HELIOS_LOG_COLUMNS = ("user", "gpu_num", "submit_time", "duration")


def _read_interval(trace: Trace, stream: TextIO, fmt: str) -> None:
    """The Philly subset layout: arrival = cumulative sum of ``interval``."""
    clock = 0.0

    def parse(line: int, row: Mapping[str, Any]) -> TraceJob:
        nonlocal clock
        try:
            clock += _seconds(row, "interval")
        except _Bad as bad:
            raise _Bad(f"{bad}; later submit times leave it out") from None
        user = _text(row, "user")
        if not user:
            raise _Bad("user is missing")
        return TraceJob(
            job_id=_text(row, "u_id") or str(line),
            user=user,
            gpus=_gpus(row, "gpu_num"),
            submit=clock,
            run_time=_seconds(row, "run_time"),
            line=line,
        )

    _read_rows(trace, _csv_rows(stream, _INTERVAL_COLUMNS, fmt), parse)
    trace.notes.append(
        f"{fmt}: submit times are the cumulative sum of `interval`; each job runs for its "
        "`run_time` (status Pass, Failed or Killed alike); `node_num` is ignored: the "
        "scheduler places a request on one node"
    )


def _read_helios_log(trace: Trace, stream: TextIO) -> None:
    """The original Helios ``cluster_log.csv``: submit_time, duration, vc."""

    def parse(line: int, row: Mapping[str, Any]) -> TraceJob:
        user = _text(row, "user")
        if not user:
            raise _Bad("user is missing")
        return TraceJob(
            job_id=_text(row, "job_id") or str(line),
            user=user,
            gpus=_gpus(row, "gpu_num"),
            submit=_instant(row, "submit_time"),
            run_time=_seconds(row, "duration"),
            line=line,
            group=_text(row, "vc") or None,
        )

    _read_rows(trace, _csv_rows(stream, _HELIOS_LOG_COLUMNS, "helios"), parse)
    trace.notes.append(
        "helios: cluster_log layout; submit_time as given, run time = duration, "
        "group = vc (virtual cluster); CPU-only jobs (gpu_num 0) are reported and left out"
    )


def _read_helios(trace: Trace, stream: TextIO) -> None:
    first = stream.readline()
    rest = io.StringIO(first + stream.read())
    header = {h.strip() for h in first.split(",")}
    if "interval" not in header and {"submit_time", "duration"} <= header:
        _read_helios_log(trace, rest)
    else:
        _read_interval(trace, rest, "helios")


# -- Alibaba openb -------------------------------------------------------------------

_OPENB_COLUMNS = (
    "name",
    "num_gpu",
    "gpu_milli",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)


def _openb_times(row: Mapping[str, Any]) -> tuple[float, float]:
    """(submit, run time) of an openb row, seconds."""
    if not _text(row, "scheduled_time"):
        raise _Bad(f"scheduled_time is missing (pod_phase {_text(row, 'pod_phase') or '?'})")
    start = _seconds(row, "scheduled_time")
    end = _seconds(row, "deletion_time")
    if end < start:
        raise _Bad(f"deletion_time {end:g} is before scheduled_time {start:g}")
    return _seconds(row, "creation_time"), end - start


def _models(spec: str) -> tuple[str, ...]:
    """The models of a ``gpu_spec`` (``V100M16|V100M32``), each stripped of
    spaces, empty entries and repeats left out, in order."""
    return tuple(dict.fromkeys(m.strip() for m in spec.split("|") if m.strip()))


def _optional_count(row: Mapping[str, Any], name: str) -> int | None:
    return _count(row, name) if _text(row, name) else None


def _openb_pod(line: int, row: Mapping[str, Any], timed: bool) -> TraceJob:
    """One openb pod; ``timed``: read its times too (else submit and run
    time are 0: the packing experiment needs only the order)."""
    num_gpu = _count(row, "num_gpu")
    if num_gpu == 0:
        raise _Bad("num_gpu is 0: a CPU-only pod, nothing to schedule")
    milli = _count(row, "gpu_milli")
    if not 0 < milli <= 1000:
        raise _Bad(f"gpu_milli {milli} is not in 1..1000")
    if milli < 1000 and num_gpu > 1:
        raise _Bad(f"gpu_milli {milli} with num_gpu {num_gpu}: a share is of one GPU")
    submit, run_time = _openb_times(row) if timed else (0.0, 0.0)
    spec = _text(row, "gpu_spec")
    return TraceJob(
        job_id=_text(row, "name") or str(line),
        user=None,
        gpus=num_gpu,
        submit=submit,
        run_time=run_time,
        line=line,
        gpu_request=num_gpu * milli / 1000.0,
        qos=_text(row, "qos") or None,
        share=milli / 1000.0,
        gpu_models=_models(spec),
        cpu_milli=_optional_count(row, "cpu_milli"),
        memory_mib=_optional_count(row, "memory_mib"),
    )


def _read_openb(trace: Trace, stream: TextIO, timed: bool = True) -> None:
    def parse(line: int, row: Mapping[str, Any]) -> TraceJob:
        return _openb_pod(line, row, timed)

    columns = _OPENB_COLUMNS if timed else _OPENB_COLUMNS[:3]
    _read_rows(trace, _csv_rows(stream, columns, "openb"), parse)
    fractional = sum(1 for job in trace.jobs if job.share is not None and job.share < 1)
    trace.fractional = fractional > 0
    for name in ("cpu_milli", "memory_mib"):
        empty = sum(1 for job in trace.jobs if getattr(job, name) is None)
        if empty:
            trace.defaulted[name] = empty
    if trace.defaulted:
        counts = ", ".join(f"{n} without {name}" for name, n in trace.defaulted.items())
        trace.notes.append(
            f"openb: pods kept with a host request empty: {counts}; the packing experiment "
            "counts an empty request as 0 (it asks for none of that resource)"
        )
    trace.notes += [
        "openb: submit = creation_time, run time = deletion_time - scheduled_time; "
        "pods still Running at the end of the trace run until its end; CPU-only pods "
        "(num_gpu 0) are reported and left out; each pod keeps its share (gpu_milli / 1000 "
        "of one GPU's compute and memory), its gpu_spec models, cpu_milli and memory_mib"
        if timed
        else "openb pods in file order (times not read); CPU-only pods (num_gpu 0) are "
        "reported and left out; each keeps its share (gpu_milli / 1000 of one GPU's compute "
        "and memory), gpu_spec models, cpu_milli and memory_mib",
        f"openb: {fractional} fractional GPU requests (gpu_milli < 1000). The replay places "
        "each on one whole device (rounded up: its queue model has whole devices), while the "
        "fraction-of-capacity metrics use the requested milli-GPUs; the packing experiment "
        "(gpubroker simulate --packing) places them as shares",
    ]


def read_openb_pods(source: str | Path | TextIO) -> Trace:
    """An openb pod list in file order, times not needed (the packing
    experiment's reader; the ``multigpu20`` list has no time columns).

    Raises:
        TraceError: unreadable file, or no ``name``, ``num_gpu``, ``gpu_milli``.
    """
    name, stream = _open(source)
    trace = Trace(name, "openb")
    _read_openb(trace, stream, timed=False)
    return trace


# -- native --------------------------------------------------------------------------

NATIVE_FIELDS = ("job_id", "user", "gpus", "submit", "run_time")
NATIVE_OPTIONAL = ("group", "time_limit", "priority_class")


def _native_job(line: int, row: Mapping[str, Any]) -> TraceJob:
    job_id, user = _text(row, "job_id"), _text(row, "user")
    if not job_id:
        raise _Bad("job_id is missing")
    if not user:
        raise _Bad("user is missing")
    run_time = _seconds(row, "run_time")
    limit = _optional_seconds(row, "time_limit")
    if limit is not None and limit < run_time:
        raise _Bad(
            f"time_limit {limit:g} s is shorter than run_time {run_time:g} s "
            "(the simulator replays run times; a job's limit must cover them)"
        )
    return TraceJob(
        job_id=job_id,
        user=user,
        gpus=_gpus(row, "gpus"),
        submit=_instant(row, "submit"),
        run_time=run_time,
        line=line,
        group=_text(row, "group") or None,
        time_limit=limit,
        priority_class=_text(row, "priority_class") or None,
    )


def _json_rows(text: str) -> tuple[list[tuple[int, Mapping[str, Any]]], str]:
    """Rows of a JSON array, ``{"jobs": [...]}`` or JSON Lines, and how they count."""
    stripped = text.lstrip()
    whole: Any = None
    if stripped.startswith("["):
        whole = json.loads(text)
    elif stripped.startswith("{"):
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON Lines
        if isinstance(whole, dict) and "jobs" not in whole:
            whole = None  # a one-line JSON Lines file
    if whole is not None:
        items = whole["jobs"] if isinstance(whole, dict) else whole
        if not isinstance(items, list):
            raise TraceError('native JSON: expected an array of jobs or {"jobs": [...]}')
        return [(i, item if isinstance(item, dict) else {}) for i, item in enumerate(items, 1)], (
            "item"
        )
    rows: list[tuple[int, Mapping[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            rows.append((number, {"__json__": err.msg}))
            continue
        rows.append((number, item if isinstance(item, dict) else {"__json__": "not an object"}))
    return rows, "line"


def _read_native(trace: Trace, stream: TextIO) -> None:
    text = stream.read()
    if text.lstrip()[:1] in ("[", "{"):
        try:
            rows, where = _json_rows(text)
        except json.JSONDecodeError as err:
            raise TraceError(f"native JSON: {err}") from None

        def parse(line: int, row: Mapping[str, Any]) -> TraceJob:
            if "__json__" in row:
                raise _Bad(f"not a JSON object: {row['__json__']}")
            if not row:
                raise _Bad("not a JSON object")
            return _native_job(line, row)

        _read_rows(trace, rows, parse, where)
    else:
        _read_rows(trace, _csv_rows(io.StringIO(text), NATIVE_FIELDS, "native"), _native_job)


# -- entry point ---------------------------------------------------------------------


def read_trace(source: str | Path | TextIO, fmt: str) -> Trace:
    """Read ``source`` (a path or an open text stream) in format ``fmt``.

    Raises:
        TraceError: unknown format, unreadable file, or missing columns.
    """
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}: use one of {', '.join(FORMATS)}")
    name, stream = _open(source)
    trace = Trace(name, fmt)
    if fmt == "philly":
        _read_interval(trace, stream, "philly")
    elif fmt == "helios":
        _read_helios(trace, stream)
    elif fmt == "openb":
        _read_openb(trace, stream)
    else:
        _read_native(trace, stream)
    return trace
