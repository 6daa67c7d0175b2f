"""``gpubroker simulate --packing``: run the packing experiment
(:mod:`gpubroker.simulate.packing`) and print its table."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..scheduler.packing import STRATEGIES
from .cluster import ClusterError, load_cluster
from .packing import (
    HostNode,
    PackingError,
    experiment,
    pods_of,
    read_openb_nodes,
    summarise,
)
from .readers import TraceError, read_openb_pods


def load_nodes(spec: str) -> list[HostNode]:
    """Nodes from an openb node list (a ``.csv`` with ``sn, cpu_milli,
    memory_mib, gpu, model``), or a cluster spec or file
    (:func:`~gpubroker.simulate.cluster.load_cluster`; host CPU and memory
    are then not modelled).

    Raises:
        PackingError: the list or spec cannot be read (the message names
            ``--cluster``).
    """
    try:
        if spec.endswith(".csv"):
            if not Path(spec).is_file():
                raise PackingError(f"--cluster {spec}: no such file")
            return read_openb_nodes(spec)
        return [HostNode(n.name, n.gpus, n.model) for n in load_cluster(spec).nodes]
    except (TraceError, ClusterError) as err:
        raise PackingError(f"--cluster: {err}") from None


def parse_strategies(text: str) -> list[str]:
    """Comma-separated strategy names, checked.

    Raises:
        PackingError: an unknown name, or none.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise PackingError(
            f"strategies {', '.join(unknown) or '(none)'}: use some of {', '.join(STRATEGIES)}"
        )
    return names


#: the largest share of capacity the experiment draws pods for
MAX_CHECKPOINT = 10.0


def parse_checkpoints(text: str) -> list[float]:
    """Comma-separated shares of capacity (``1.0,1.3``), each > 0 and at most
    :data:`MAX_CHECKPOINT`.

    Raises:
        PackingError: not numbers, or one out of range.
    """
    try:
        marks = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PackingError(f"--packing {text!r}: give shares of capacity, e.g. 1.0,1.3") from None
    if not marks or not all(0 < m <= MAX_CHECKPOINT for m in marks):
        raise PackingError(
            f"--packing {text!r}: each share of capacity must be > 0 and at most {MAX_CHECKPOINT:g}"
        )
    return marks


def run(
    trace: str,
    cluster: str,
    checkpoints: Sequence[float],
    seeds: int,
    strategies: Sequence[str],
    host: bool = True,
) -> dict[str, Any]:
    """The experiment's figures as JSON-able data (see :func:`summarise`),
    with what was read, left out, and kept with a host request empty
    (``defaulted``: pods by field, packed as asking 0 of it).

    Raises:
        PackingError, TraceError, ClusterError: bad input.
    """
    if seeds < 1:
        raise PackingError(f"seeds {seeds}: need at least 1")
    nodes = load_nodes(cluster)
    read = read_openb_pods(trace)
    host = host and all(n.cpu_milli is not None for n in nodes)
    pods = pods_of(read, host=host)
    runs = experiment(nodes, pods, strategies, range(seeds), checkpoints)
    return {
        "trace": read.source,
        "pods": len(pods),
        "left_out": [str(p) for p in read.problems],
        "defaulted": dict(read.defaulted),
        "notes": read.notes,
        "nodes": len(nodes),
        "gpus": sum(n.gpus for n in nodes),
        "host_modelled": host,
        "checkpoints": list(checkpoints),
        "strategies": summarise(runs),
    }


def table(data: dict[str, Any]) -> str:
    """The figures as a text table: per strategy, the median (min-max) share
    of capacity placed at each checkpoint, the ratio to best fit, the
    fragmentation at the end and the placement time per pod."""
    marks = [f"{m:g}" for m in data["checkpoints"]]
    head = ["strategy", *(f"placed @{m}" for m in marks), "vs best-fit", "frag", "us/pod"]
    lines = [" | ".join(head)]
    for name, row in data["strategies"].items():
        cells = [name]
        for mark in marks:
            f = row["allocated"][mark]
            cells.append(f"{f['median']:.4f} ({f['min']:.4f}-{f['max']:.4f})")
        ratio = row["allocated"][marks[-1]].get("ratio_to_best-fit")
        cells += [
            "-" if ratio is None else f"{ratio:.4f}",
            f"{row['fragmentation_median']:.4f}",
            f"{row['place_us_median']:.0f}",
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)
