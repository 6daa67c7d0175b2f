"""``gpubroker simulate``: replay a trace through the scheduler, write metrics and plots.

A traitlets Application. Options come from the command line and from the
``--policy`` file: a Python traitlets config file that sets the broker's
:class:`~gpubroker.policy_config.SchedulingPolicy` (as in
``gpubroker_config.py``) and, optionally, the simulator's own classes
(:class:`~gpubroker.simulate.workload.Enrichment`, :class:`SlurmLikeConfig`,
``SimulateCommand.checkpoint_classes``). Command-line options win.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from traitlets import Bool, Enum, Float, Integer, List, TraitError, Unicode
from traitlets.config import Application, Configurable, catch_config_error
from traitlets.config.loader import PyFileConfigLoader

from .. import __version__
from ..logfmt import OneLineFormatter
from ..policy_config import SchedulingPolicy
from .baselines import SlurmSettings
from .cluster import Cluster, ClusterError, load_cluster
from .compare import SCHEDULERS, replay, report
from .readers import FORMATS, TraceError, read_trace
from .workload import Enrichment, Workload, prepare

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*$")
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
#: bad rows shown in the log; metrics.json has all
SHOW_PROBLEMS = 20


def parse_duration(text: str) -> float:
    """``"3600"``, ``"90m"``, ``"12h"``, ``"7d"``, ``"2w"`` -> seconds.

    Raises:
        ValueError: anything else.
    """
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (use seconds, or 90m, 12h, 7d, 2w)")
    return float(match[1]) * _UNITS[match[2]]


def human(seconds: float | None) -> str:
    """``"3,761 s (1.0 h)"``; ``"-"`` for ``None``/NaN."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    if seconds >= 86400:
        return f"{seconds:,.0f} s ({seconds / 86400:.1f} d)"
    if seconds >= 3600:
        return f"{seconds:,.0f} s ({seconds / 3600:.1f} h)"
    return f"{seconds:,.0f} s"


class SlurmLikeConfig(Configurable):
    """Knobs of the Slurm-like baseline (multifactor priority, EASY backfill)."""

    age_weight = Float(1000.0, help="PriorityWeightAge.").tag(config=True)
    fairshare_weight = Float(10000.0, help="PriorityWeightFairshare.").tag(config=True)
    job_size_weight = Float(1000.0, help="PriorityWeightJobSize.").tag(config=True)
    max_age = Float(
        7 * 86400.0, help="PriorityMaxAge, seconds: waiting this long gives the full age factor."
    ).tag(config=True)
    favor_small = Bool(False, help="PriorityFavorSmall: smaller jobs get more size priority.").tag(
        config=True
    )
    max_job_test = Integer(0, help="bf_max_job_test: requests examined per pass (0: all).").tag(
        config=True
    )

    def settings(self) -> SlurmSettings:
        """The pure settings for :func:`gpubroker.simulate.baselines.schedule`."""
        return SlurmSettings(
            age=self.age_weight,
            fairshare=self.fairshare_weight,
            job_size=self.job_size_weight,
            max_age=self.max_age,
            favor_small=self.favor_small,
            max_job_test=self.max_job_test or None,
        )


class SimulateCommand(Application):
    """``gpubroker simulate``: replay a trace through the scheduler and baselines."""

    _log_formatter_cls = OneLineFormatter  # messages on one line (gpubroker.logfmt)

    name = "gpubroker-simulate"
    version = __version__
    description = """Replay a job trace through the broker's scheduling policy
    and the FIFO and Slurm-like baselines on a simulated cluster; print the
    figures and write metrics.json and plots to --out."""
    examples = """
    gpubroker simulate --trace philly.csv --format philly --cluster 16x8xA100-80GB
    gpubroker simulate --trace jobs.csv --format native --cluster nodes.txt \
        --policy policy.py --out sim
    gpubroker simulate --trace openb_pod_list.csv --format openb --cluster 100x8xV100 --until 30d
    """

    classes = [SchedulingPolicy, Enrichment, SlurmLikeConfig]

    aliases = {
        "trace": "SimulateCommand.trace",
        "format": "SimulateCommand.trace_format",
        "cluster": "SimulateCommand.cluster",
        "policy": "SimulateCommand.policy_file",
        "until": "SimulateCommand.until",
        "out": "SimulateCommand.out",
        "schedulers": "SimulateCommand.schedulers",
        "seed": "SimulateCommand.seed",
        "packing": "SimulateCommand.packing",
        "seeds": "SimulateCommand.seeds",
        "strategies": "SimulateCommand.strategies",
        "time-limit-factor": "Enrichment.time_limit_factor",
        "groups": "Enrichment.groups",
        "log-level": "Application.log_level",
    }
    flags = {
        "quiet": ({"SimulateCommand": {"quiet": True}}, "No progress bar."),
        "no-plots": ({"SimulateCommand": {"plots": False}}, "Write metrics.json only."),
        "debug": ({"Application": {"log_level": 10}}, "Log at DEBUG level."),
    }

    trace = Unicode("", help="The trace file to replay.").tag(config=True)
    trace_format = Enum(
        list(FORMATS), "native", help="Trace format: philly, helios, openb or native."
    ).tag(config=True)
    cluster = Unicode(
        "16x8xA100-80GB",
        help="Cluster: NODESxGPUSxMODEL (several joined by +), or a file with one "
        "'NAME GPUS [MODEL]' or spec per line.",
    ).tag(config=True)
    topology = Enum(
        ["flat", "dgx"],
        "flat",
        help="Node topology: flat (all GPU pairs equally close) or dgx (NVLink islands "
        "of 4, as the fake devices have; placement then prefers one island).",
    ).tag(config=True)
    policy_file = Unicode(
        "",
        help="Python traitlets config file with the broker's SchedulingPolicy "
        "(c.SchedulingPolicy....) and simulator settings; default: the default policy.",
    ).tag(config=True)
    until = Unicode(
        "", help="Stop at this virtual time after the first submission: seconds, or 12h, 30d."
    ).tag(config=True)
    out = Unicode("simulate-out", help="Directory for metrics.json and the plots.").tag(config=True)
    schedulers = Unicode(
        ",".join(SCHEDULERS),
        help="Comma-separated schedulers to replay: broker, fifo, slurm-like.",
    ).tag(config=True)
    seed = Integer(0, help="Seed of the enrichment's random draws (time-limit jitter).").tag(
        config=True
    )
    packing = Unicode(
        "",
        help="""Run the packing experiment instead of the replay: openb pods
        (--trace, --format openb) drawn at random until they ask for these
        comma-separated shares of the GPU capacity (e.g. 1.0,1.3), placed in order, none
        leaving; prints the share placed at each. --cluster is then an openb
        node list (.csv: host CPU and memory modelled) or a cluster spec.""",
    ).tag(config=True)
    seeds = Integer(5, help="Packing experiment: seeds of the draws (0..seeds-1).").tag(config=True)
    strategies = Unicode(
        "packing,fgd,best-fit,first-fit,random",
        help="Packing experiment: comma-separated placement strategies "
        "(packing, fgd, best-fit, first-fit, random).",
    ).tag(config=True)
    quiet = Bool(False, help="No progress bar (it is off anyway when stderr is not a TTY).").tag(
        config=True
    )
    plots = Bool(True, help="Write allocation.png and queueing_delay_cdf.png.").tag(config=True)
    checkpoint_classes = List(
        Unicode(),
        help="""Priority classes whose jobs checkpoint: a preempted job of such a
        class resumes with the run time it had left instead of restarting from
        zero; '*' for all. Set it in the --policy file.""",
    ).tag(config=True)

    @catch_config_error
    def initialize(self, argv: list[str] | None = None) -> None:
        """Parse the command line, then load the --policy file (command line wins)."""
        super().initialize(argv)
        if self.policy_file:
            self.load_policy_file(self.policy_file)

    def load_policy_file(self, path: str) -> None:
        """Load ``path`` with traitlets' PyFileConfigLoader; command-line options still win.

        Exits (status 2, one line naming ``--policy``) when the file is
        missing, does not run (a syntax error, any exception it raises) or
        sets a value its option refuses.
        """
        if not os.path.isfile(path):
            self.log.critical("--policy %s: no such file", path)
            self.exit(2)
        directory, filename = os.path.split(os.path.abspath(path))
        try:
            config = PyFileConfigLoader(filename, path=directory, log=self.log).load_config()
            self.update_config(config)
            self.update_config(self.cli_config)
        except Exception as err:  # the file is user code: any error is its error
            self.log.critical("--policy %s: %s", path, _one_line(err))
            self.exit(2)

    def _check_settings(self) -> None:
        """Build the scheduling policy and the simulator's settings once up
        front, so that a bad value (a quota with guaranteed above its limit,
        an unknown class) stops the run before any work, with one line
        naming ``--policy`` (or the option) instead of a traceback."""
        try:
            SchedulingPolicy(parent=self).build()
            Enrichment(parent=self)
            SlurmLikeConfig(parent=self).settings()
        except (TraitError, ValueError, TypeError) as err:
            where = f"--policy {self.policy_file}" if self.policy_file else "policy"
            self.log.critical("%s: %s", where, _one_line(err))
            self.exit(2)

    def _check_out(self, name: str) -> Path:
        """The ``--out`` directory, checked before any work: it must be a
        directory (or not exist yet, under a directory) this process may
        write, and ``name`` in it must not be a directory. Exits (status 2,
        one line naming ``--out``) otherwise."""
        out = Path(self.out)
        problem = ""
        if out.exists() and not out.is_dir():
            problem = "exists and is not a directory"
        elif (out / name).is_dir():
            problem = f"{out / name} is a directory"
        else:
            base = out
            while not base.exists() and base != base.parent:
                base = base.parent
            if not base.is_dir():
                problem = f"{base} is not a directory"
            elif not os.access(base, os.W_OK | os.X_OK):
                problem = f"{base} is not writable"
        if problem:
            self.log.critical("--out %s: %s", out, problem)
            self.exit(2)
        return out

    def _write(self, out: Path, name: str, text: str) -> Path:
        """Write ``text`` to ``out / name``; exits (status 2, naming ``--out``)
        when it cannot."""
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(text, encoding="utf-8")
        except OSError as err:
            self.log.critical("--out %s: cannot write %s: %s", out, name, err.strerror or err)
            self.exit(2)
        return out / name

    # -- the run -----------------------------------------------------------------------

    def _names(self) -> list[str]:
        names = [n.strip() for n in self.schedulers.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCHEDULERS]
        if unknown or not names:
            self.log.critical(
                "Unknown schedulers %s: use some of %s", ", ".join(unknown), ", ".join(SCHEDULERS)
            )
            self.exit(2)
        return names

    def _load(self) -> tuple[Workload, Cluster]:
        if not self.trace:
            self.log.critical("No trace: give --trace FILE (and --format)")
            self.exit(2)
        try:
            cluster = load_cluster(self.cluster)
            if self.topology == "dgx":
                cluster = cluster.with_dgx_topology()
        except ClusterError as err:
            self.log.critical("--cluster: %s", err)
            self.exit(2)
        try:
            trace = read_trace(self.trace, self.trace_format)
            workload = prepare(trace, cluster, Enrichment(parent=self), self.seed)
        except (TraceError, TraitError) as err:
            self.log.critical("%s", err)
            self.exit(2)
        return workload, cluster

    def _settings(self) -> dict[str, Any]:
        enrichment = Enrichment(parent=self)
        slurm = SlurmLikeConfig(parent=self)
        policy = SchedulingPolicy(parent=self)
        return {
            "schedulers": self._names(),
            "policy_file": self.policy_file or None,
            "scheduling_policy": {
                name: getattr(policy, name) for name in policy.trait_names(config=True)
            },
            "checkpoint_classes": list(self.checkpoint_classes),
            "seed": self.seed,
            "until_s": parse_duration(self.until) if self.until else None,
            "topology": self.topology,
            "enrichment": {
                name: getattr(enrichment, name) for name in enrichment.trait_names(config=True)
            },
            "slurm_like": {name: getattr(slurm, name) for name in slurm.trait_names(config=True)},
        }

    def _log_problems(self, workload: Workload) -> None:
        problems = workload.problems
        if not problems:
            return
        self.log.warning(
            "%s rows of %s were left out (all listed in metrics.json):",
            len(problems),
            workload.source,
        )
        for problem in problems[:SHOW_PROBLEMS]:
            self.log.warning("  %s", problem)
        if len(problems) > SHOW_PROBLEMS:
            self.log.warning("  ... and %s more", len(problems) - SHOW_PROBLEMS)

    def start(self) -> None:
        """Read, replay under each scheduler, print the figures, write the outputs.

        Bad options exit with status 2 and one line naming the option,
        checked before the work where they can be (``--out``, ``--policy``).
        """
        if self.packing:
            self._pack()
            return
        names = self._names()
        try:
            until = parse_duration(self.until) if self.until else None
        except ValueError as err:
            self.log.critical("--until: %s", err)
            self.exit(2)
        out = self._check_out("metrics.json")
        self._check_settings()
        workload, cluster = self._load()
        self._log_problems(workload)
        for note in workload.notes:
            self.log.info("Note: %s", note)
        policy = SchedulingPolicy(parent=self).build()
        unknown = sorted({j.priority_class for j in workload.jobs} - set(policy.classes))
        if unknown:
            self.log.warning(
                "Priority classes %s are not in the policy: they rank lowest and are not "
                "preemptible, so their jobs run only within guarantees",
                ", ".join(unknown),
            )
        self.log.info(
            "Replaying %s jobs of %s on %s under %s",
            len(workload.jobs),
            workload.source,
            cluster.describe(),
            ", ".join(names),
        )
        results = replay(
            workload,
            cluster,
            names,
            policy,
            frozenset(self.checkpoint_classes),
            until,
            SlurmLikeConfig(parent=self).settings(),
            quiet=self.quiet or not sys.stderr.isatty(),
        )
        data = report(workload, cluster, results, until, self._settings())
        written = [self._write(out, "metrics.json", json.dumps(data, indent=2) + "\n")]
        if self.plots and importlib.util.find_spec("matplotlib") is None:
            self.log.warning("No plots: they need matplotlib (pip install 'gpubroker[sim]')")
        elif self.plots:
            from .plots import write

            written += write(data, results, out)
        print(summary_table(data))
        print("wrote " + ", ".join(str(p) for p in written))

    def _pack(self) -> None:
        """The packing experiment: print its table, write packing.json to --out."""
        from . import packing_cli
        from .packing import PackingError

        if self.trace_format != "openb" or not self.trace:
            self.log.critical("--packing needs an openb pod list: --trace FILE --format openb")
            self.exit(2)
        self._check_settings()  # a --policy file that sets a bad quota stops it too
        out = self._check_out("packing.json")
        try:
            strategies = packing_cli.parse_strategies(self.strategies)
            marks = packing_cli.parse_checkpoints(self.packing)
            data = packing_cli.run(self.trace, self.cluster, marks, self.seeds, strategies)
        except (PackingError, TraceError, ClusterError) as err:
            self.log.critical("%s", err)
            self.exit(2)
        defaulted = data["defaulted"]
        if defaulted and data["host_modelled"]:
            self.log.warning(
                "Pods with a host request empty, packed as asking none of it: %s",
                ", ".join(f"{n} without {name}" for name, n in defaulted.items()),
            )
        written = self._write(out, "packing.json", json.dumps(data, indent=2) + "\n")
        print(packing_cli.table(data))
        print(f"wrote {written}")


def _one_line(err: BaseException) -> str:
    """``err`` in one line: a value error's message, else its type's name
    and message (``SyntaxError: '(' was never closed (p.py, line 1)``)."""
    text = " ".join(str(err).split())
    if text and isinstance(err, (TraitError, ValueError)) and not isinstance(err, UnicodeError):
        return text  # their messages name the value or the option
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _number(value: float | None, spec: str) -> str:
    if value is None or math.isnan(value):
        return "-"
    return format(value, spec)


def summary_table(data: dict[str, Any]) -> str:
    """The figures of each run, and their ratios to FIFO, as text."""
    lines = [
        f"trace: {data['trace']['source']} ({data['trace']['format']}): "
        f"{data['trace']['jobs']:,} jobs replayed, {data['trace']['problems']:,} rows left out",
        f"cluster: {data['cluster']['gpus']} GPUs on {data['cluster']['nodes']} nodes",
        "",
        f"{'scheduler':<11} {'queue mean':>24} {'queue median':>24} {'queue p95':>24} "
        f"{'JCT mean':>24} {'alloc':>6} {'preempt':>7} {'Jain':>5} {'jobs/s':>8}",
    ]
    for name, run in data["runs"].items():
        delay, jct = run["queueing_delay_s"], run["jct_s"]
        times = [delay["mean"], delay["median"], delay["p95"], jct["mean"]]
        lines.append(
            f"{name:<11} "
            + " ".join(f"{human(t):>24}" for t in times)
            + f" {_number(run['allocation']['ratio'], '.3f'):>6}"
            + f" {run['preemptions']['evictions']:>7}"
            + f" {_number(run['fairness']['jain_index'], '.3f'):>5}"
            + f" {_number(run['simulation']['jobs_per_s'], ',.0f'):>8}"
        )
        fractional = run.get("fractional")
        if fractional:
            lines.append(
                f"{'':<11} fractional: capacity allocated "
                f"{_number(fractional['capacity_allocated'], '.3f')}, fragmentation rate "
                f"{_number(fractional['fragmentation_rate'], '.3f')}"
            )
    if data["ratios_to_fifo"]:
        lines += ["", "ratios to FIFO (lower delay is better, higher allocation is better):"]
        for name, ratios in data["ratios_to_fifo"].items():
            if name == "fifo":
                continue
            parts = [f"{k} {_number(v, '.3f')}" for k, v in ratios.items()]
            lines.append(f"  {name:<11} " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run ``SimulateCommand`` on its own (``python -m gpubroker.simulate``)."""
    app = SimulateCommand()
    app.initialize(argv)
    app.start()
