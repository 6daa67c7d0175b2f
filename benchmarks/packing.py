"""Packing: Alibaba's openb trace (Weng et al., ATC'23) on its 1,213 nodes /
6,212 GPUs, pods drawn until they ask for 100 % and 130 % of the GPU
capacity, placed in order with no departures (host CPU and memory
modelled). Median of ten seeds per strategy on the default list (the
paper's count) and five on the others, all in this process; the
baseline of each figure is best fit's median in the same run, and the
broker's ``packing`` is also given as a ratio to FGD's.

The default pod list runs every strategy; the gpushare40 and multigpu20
lists run packing, FGD and best fit. The trace lives outside the repository
(``../shared/traces/openb``, read-only); where it is absent the benchmark
says so and is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpubroker.scheduler.packing import STRATEGIES
from gpubroker.simulate.packing import experiment, pods_of, read_openb_nodes, summarise
from gpubroker.simulate.readers import read_openb_pods

from . import figure

TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"
NODES = TRACE_DIR / "openb_node_list_gpu_node.csv"
#: (pod list, strategies, seeds)
LISTS = (
    ("default", STRATEGIES, range(10)),
    ("gpushare40", ("packing", "fgd", "best-fit"), range(5)),
    ("multigpu20", ("packing", "fgd", "best-fit"), range(5)),
)
CHECKPOINTS = (1.0, 1.3)


def describe() -> str:
    """One line: what the benchmark places."""
    return (
        "Packing: openb pod lists on 6,212 GPUs, arrivals to 100 % and 130 % of capacity, "
        "median of 10 seeds (default list) or 5 (the others); figures relative to best fit "
        "(and FGD)"
    )


def run() -> dict[str, dict[str, Any]]:
    """Run the experiment; figures: name -> {value, unit, baseline, baseline_name, ratio}."""
    if not NODES.is_file():
        print(f"Packing: skipped, no openb trace at {TRACE_DIR}")
        return {}
    nodes = read_openb_nodes(NODES)
    results: dict[str, dict[str, Any]] = {}
    for name, strategies, seeds in LISTS:
        path = TRACE_DIR / f"openb_pod_list_{name}.csv"
        if not path.is_file():
            print(f"Packing: {name} skipped, no {path}")
            continue
        pods = pods_of(read_openb_pods(path))
        summary = summarise(experiment(nodes, pods, strategies, seeds, CHECKPOINTS))
        for mark in CHECKPOINTS:
            label = f"{mark:g}"
            best = summary["best-fit"]["allocated"][label]["median"]
            for strategy in strategies:
                value = summary[strategy]["allocated"][label]["median"]
                key = f"packing.openb_{name}.{round(mark * 100)}pct.{strategy}"
                results[key] = figure(value, "fraction of GPU capacity", best, "best-fit", None)
            fgd = summary["fgd"]["allocated"][label]["median"]
            results[f"packing.openb_{name}.{round(mark * 100)}pct.packing_vs_fgd"] = figure(
                summary["packing"]["allocated"][label]["median"],
                "fraction of GPU capacity",
                fgd,
                "fgd",
                None,
            )
        results[f"packing.openb_{name}.place_us.packing"] = figure(
            summary["packing"]["place_us_median"],
            "us per pod (median)",
            summary["best-fit"]["place_us_median"],
            "best-fit",
            None,
        )
        for strategy in strategies:
            row = summary[strategy]
            spread = row["allocated"]["1.3"]
            print(
                f"  {name:<11} {strategy:<9} 130 %: {spread['median']:.4f} "
                f"({spread['min']:.4f}-{spread['max']:.4f}), 100 %: "
                f"{row['allocated']['1']['median']:.4f}, frag {row['fragmentation_median']:.4f}, "
                f"{row['place_us_median']:.0f} us/pod"
            )
    return results
