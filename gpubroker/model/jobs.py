"""Batch jobs, pure: their states, the transitions between them, and the
checked spec of what a job runs.

* (none) → ``queued``: a submission;
* ``queued`` → ``running``: its lease is granted and the process started;
* ``queued`` → ``cancelled`` (a cancel, or its lease ended in the queue) or
  ``failed`` (the process could not start);
* ``running`` → ``succeeded`` (exit 0), ``failed`` (a non-zero exit, a
  signal, an end not seen, its lease taken away), ``timed-out`` (its time
  limit) or ``cancelled`` (a cancel stopped it);
* ``running`` → ``queued`` (requeued): it was preempted, or it failed and
  has retries left; it runs again on a new lease, with
  ``GPUBROKER_RESTART_COUNT`` one higher.

Where the rules come from: Slurm's job states (PENDING, RUNNING,
COMPLETED, FAILED, CANCELLED, TIMEOUT); the exit code and the signal are
kept apart, as ``sacct`` shows ``ExitCode`` as ``code:signal``.
"""

from __future__ import annotations

import json
import keyword
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from .echo import echo

QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
TIMED_OUT = "timed-out"

#: every state, and those a job never leaves
STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, TIMED_OUT)
FINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, TIMED_OUT})

#: (from, to) pairs the table allows; ``None``: a new job
TRANSITIONS = frozenset(
    {
        (None, QUEUED),
        (QUEUED, RUNNING),
        # preempted after its grant, before its launch: it waits on a new lease
        (QUEUED, QUEUED),
        (QUEUED, CANCELLED),
        (QUEUED, FAILED),
        (RUNNING, SUCCEEDED),
        (RUNNING, FAILED),
        (RUNNING, TIMED_OUT),
        (RUNNING, CANCELLED),
        (RUNNING, QUEUED),
    }
)

#: the longest time limit a job may ask for, seconds (30 days)
MAX_TIME = 30 * 86400.0
#: most parameters of one notebook job
MAX_PARAMS = 64
#: most bytes of one argument of a job's command (UTF-8): Linux's
#: ``MAX_ARG_STRLEN`` (32 pages, 131,072 bytes with the final NUL); a
#: longer one fails at the launch (E2BIG), after the job held its GPUs
MAX_ARG_BYTES = 131071
#: most bytes of a notebook job's parameters as JSON: papermill gets them
#: as one YAML argument (``-y``), which may be up to twice as long
MAX_PARAMS_BYTES = 65536
#: most retries after a failure a job may ask for
MAX_RETRIES = 10

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class JobError(ValueError):
    """A bad job spec; ``field`` names the field (``gpus``, ``time``, ``param``,
    ``notebook``, ``kernel``, ``command``, ...)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def check_transition(from_state: str | None, to_state: str) -> None:
    """Raises :class:`ValueError` for a change the table does not allow."""
    if (from_state, to_state) not in TRANSITIONS:
        raise ValueError(f"job cannot go from {from_state!r} to {to_state!r}")


def parse_time(text: Any) -> float:
    """A time limit: seconds as a number, or ``"90s"``, ``"10m"``, ``"12h"``,
    ``"2d"``; more than 0 and at most :data:`MAX_TIME`.

    Raises:
        JobError: (``time``) anything else.
    """
    if isinstance(text, bool):
        raise JobError("time", f"not a duration: {echo(text)}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        match = _DURATION.match(str(text))
        if not match:
            raise JobError(
                "time", f"not a duration: {echo(text)} (use seconds, or 90s, 10m, 12h, 2d)"
            )
        seconds = float(match[1]) * _UNITS[match[2]]
    if not 0 < seconds <= MAX_TIME:
        raise JobError(
            "time",
            f"must be more than 0 s and at most {MAX_TIME / 86400:g} days "
            f"({MAX_TIME:.0f} s), got {seconds:g} s",
        )
    return seconds


def parse_params(items: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Notebook parameters: ``["epochs=2", "lr=1e-3", "name=run a"]`` or a
    mapping. A value that is a JSON literal (number, ``true``, ``null``, a
    quoted string, a list) is that value; any other text (``NaN`` too) is a
    string.

    Raises:
        JobError: (``param``) an item without ``=``, a name that is not a
            Python identifier, a number that is not finite (``1e999``),
            more than :data:`MAX_PARAMS`, or more than
            :data:`MAX_PARAMS_BYTES` as JSON.
    """
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        for item in items:
            if not isinstance(item, str) or "=" not in item:
                raise JobError("param", f"expected NAME=VALUE, got {echo(item)}")
            name, raw = item.split("=", 1)
            pairs.append((name.strip(), _value(raw)))
    if len(pairs) > MAX_PARAMS:
        raise JobError("param", f"at most {MAX_PARAMS} parameters, got {len(pairs)}")
    params = {}
    for name, value in pairs:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or keyword.iskeyword(name):
            raise JobError("param", f"{echo(name)} is not a Python name (or is a keyword)")
        _check_depth(name, value)
        if _has_non_finite(value):
            raise JobError("param", f"{name}: a number must be finite (at most ~1.8e308)")
        params[name] = value
    size = len(json.dumps(params, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_PARAMS_BYTES:
        raise JobError(
            "param", f"the parameters may take at most {MAX_PARAMS_BYTES} bytes as JSON, got {size}"
        )
    return params


def _value(raw: str) -> Any:
    """``raw`` as a JSON literal, else the text itself; ``NaN`` and
    ``Infinity`` are text (not JSON), a number too large for a float
    (``1e999``) is refused.

    Raises:
        JobError: (``param``) a number that is not finite.
    """
    try:
        value = json.loads(raw, parse_constant=_not_json)
    except ValueError:
        return raw
    except RecursionError:  # far deeper than the limit
        _check_depth(raw, None, deeper=True)
    _check_depth(raw, value)
    if _has_non_finite(value):
        raise JobError("param", f"{raw[:40]!r}: a number must be finite (at most ~1.8e308)")
    return value


#: how deep a parameter's value may nest lists and maps (as a request body)
MAX_PARAM_DEPTH = 32


def _depth(value: Any) -> int:
    """How deep ``value`` nests lists and maps (a scalar: 0), counted no
    further than one past :data:`MAX_PARAM_DEPTH`."""
    depth, level = 0, [value]
    while depth <= MAX_PARAM_DEPTH:
        containers = [v for v in level if isinstance(v, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [x for v in containers for x in (v.values() if isinstance(v, dict) else v)]
    return depth


def _check_depth(shown: Any, value: Any, deeper: bool = False) -> None:
    """Refuse a parameter value that nests deeper than :data:`MAX_PARAM_DEPTH`
    (papermill writes it into the notebook as YAML and Python, which a
    deep value overflows at every launch); ``deeper``: it is, whatever
    ``value`` is.

    Raises:
        JobError: (``param``) naming the value (escaped and cut).
    """
    if deeper or _depth(value) > MAX_PARAM_DEPTH:
        raise JobError(
            "param", f"{echo(shown)}: a value may nest at most {MAX_PARAM_DEPTH} lists or maps"
        )


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list):
        return any(_has_non_finite(x) for x in value)
    if isinstance(value, dict):
        return any(_has_non_finite(x) for x in value.values())
    return False


@dataclass(frozen=True)
class JobSpec:
    """What a job runs, checked.

    Attributes:
        kind: ``notebook`` or ``command``.
        notebook: the notebook's path, relative to the user's root directory
            or absolute inside it (``notebook`` jobs).
        command: the program and its arguments (``command`` jobs).
        params: parameters injected after the cell tagged ``parameters``.
        kernel: the kernel to run the notebook with (``""``: the one in its
            metadata).
        cwd: the working directory relative to the user's root (``""``: the
            notebook's directory, or the root for commands).
        env: extra environment variables for the job.
        time_limit: seconds the job may run (``None``: no limit).
        retries: how often a failed run is started again (0 to
            :data:`MAX_RETRIES`).
        python: the Python whose ``ipykernel`` runs the notebook when no
            ``kernel`` is named (an absolute path: the kernel the notebook
            was submitted from, ``%gpu_submit``); ``""``: the kernel in the
            notebook's metadata.
    """

    kind: str
    notebook: str = ""
    command: tuple[str, ...] = ()
    params: Mapping[str, Any] = field(default_factory=dict)
    kernel: str = ""
    cwd: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    time_limit: float | None = None
    retries: int = 0
    python: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The spec as stored (JSON)."""
        return {
            "kind": self.kind,
            "notebook": self.notebook,
            "command": list(self.command),
            "params": dict(self.params),
            "kernel": self.kernel,
            "cwd": self.cwd,
            "env": dict(self.env),
            "time_limit": self.time_limit,
            "retries": self.retries,
            "python": self.python,
        }


def relative_path(value: Any, field_name: str) -> str:
    """A path meant to be inside the user's root directory: relative to it,
    or absolute (the broker checks it is inside), without ``..``.

    Raises:
        JobError: (``field_name``) with ``..``, empty or not text.
    """
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise JobError(field_name, "must be a path in your home directory")
    path = PurePosixPath(value)
    if ".." in path.parts:
        raise JobError(field_name, f"must stay inside your home directory: {echo(value)}")
    return str(path)


def parse_spec(data: Mapping[str, Any]) -> JobSpec:
    """A job spec from a request's fields (``notebook`` or ``command``,
    ``params``, ``kernel``, ``python``, ``cwd``, ``env``, ``time``).

    Raises:
        JobError: naming the field that is wrong.
    """
    notebook, command = data.get("notebook"), data.get("command")
    if (notebook is None) == (command is None):
        raise JobError("notebook", "give exactly one of notebook and command")
    env = data.get("env")
    env = {} if env is None else env
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and _NAME.fullmatch(k) and isinstance(v, str) for k, v in env.items()
    ):
        raise JobError("env", "must map variable names to strings")
    if any(k.startswith(("GPUBROKER_", "CUDA_", "NVIDIA_")) for k in env):
        raise JobError("env", "GPUBROKER_*, CUDA_* and NVIDIA_* are set by the broker")
    if any("\x00" in v for v in env.values()):
        raise JobError("env", "a value must not contain a NUL character")
    kernel = data.get("kernel")
    kernel = "" if kernel is None else kernel
    if not isinstance(kernel, str) or (kernel and not re.match(r"^[A-Za-z0-9._-]{1,64}$", kernel)):
        raise JobError("kernel", f"not a kernel name: {echo(kernel)}")
    python = data.get("python")
    python = "" if python is None else python
    if not isinstance(python, str) or (
        python and not (python.startswith("/") and len(python) <= 4096 and "\x00" not in python)
    ):
        shown = repr(python)[:200]
        raise JobError("python", f"must be an absolute path to a Python (<= 4096), got {shown}")
    cwd = relative_path(data["cwd"], "cwd") if data.get("cwd") else ""
    raw_time = data.get("time")
    time_limit = None if raw_time in (None, "") else parse_time(raw_time)
    retries = data.get("retries") or 0
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise JobError(
            "retries", f"must be a whole number from 0 to {MAX_RETRIES}, got {echo(retries)}"
        )
    raw_params = data.get("params") or {}
    if not isinstance(raw_params, (Mapping, list)):
        raise JobError("param", "must be a mapping or a list of NAME=VALUE")
    params = parse_params(raw_params)
    if notebook is not None:
        path = relative_path(notebook, "notebook")
        if not path.endswith(".ipynb"):
            raise JobError("notebook", f"must be a .ipynb file: {echo(notebook)}")
        python = "" if kernel else python  # a kernel named wins
        return JobSpec(
            "notebook", path, (), params, kernel, cwd, dict(env), time_limit, retries, python
        )
    if isinstance(command, str):
        if not command.strip():  # it would hold its GPUs to run nothing
            raise JobError("command", "must not be empty")
        command = ["/bin/sh", "-c", command]
    if isinstance(command, list) and command and command[0] == "":
        raise JobError("command", "its first argument (the program) must not be empty")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise JobError("command", "must be a shell line or a list of arguments")
    if any("\x00" in a for a in command):
        raise JobError("command", "must not contain a NUL character")
    longest = max(len(a.encode("utf-8", "surrogatepass")) for a in command)
    if longest > MAX_ARG_BYTES:
        raise JobError(
            "command", f"an argument may take at most {MAX_ARG_BYTES} bytes, got {longest}"
        )
    if params or python or kernel:
        field_ = "param" if params else "python" if python else "kernel"
        raise JobError(field_, "is for notebook jobs")
    return JobSpec("command", "", tuple(command), {}, "", cwd, dict(env), time_limit, retries)


def outcome(exit_code: int | None, signal: int | None, timed_out: bool, lost: bool) -> str:
    """The final state of a process that ended: ``timed-out`` when its time
    limit ended it, ``succeeded`` on exit 0, else ``failed`` (a non-zero
    exit, a signal, or an end nobody saw)."""
    if timed_out:
        return TIMED_OUT
    if not lost and signal is None and exit_code == 0:
        return SUCCEEDED
    return FAILED
