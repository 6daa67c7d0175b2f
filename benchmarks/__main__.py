"""Run every benchmark, print the figures and write ``bench-results.json``."""

from __future__ import annotations

import json
from pathlib import Path

from . import api, jobs, packing, panel, scheduler, sharing, simulate, slurm, usage


def main() -> None:
    results = {}
    print(scheduler.describe())
    results.update(scheduler.run())
    print(simulate.describe())
    results.update(simulate.run())
    print(packing.describe())
    results.update(packing.run())
    print(sharing.describe())
    results.update(sharing.run())
    print(usage.describe())
    results.update(usage.run())
    print(jobs.describe())
    results.update(jobs.run())
    print(panel.describe())
    results.update(panel.run())
    print(slurm.describe())
    results.update(slurm.run())
    print(f"API: {api.PAIRS} lease request/release pairs on loopback vs a bare Tornado handler")
    results.update(api.run())
    width = max(len(name) for name in results)
    print(f"{'figure':<{width}}  {'value':>10}  {'baseline':>10}  {'ratio':>7}  unit")
    for name, r in results.items():
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(
            f"{name:<{width}}  {r['value']:>10.2f}  {r['baseline']:>10.2f}  {ratio:>7}  {r['unit']}"
        )
    out = Path("bench-results.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out.resolve()}")


if __name__ == "__main__":
    main()
