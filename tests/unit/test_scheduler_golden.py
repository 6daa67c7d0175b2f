"""Differential test: the pure scheduler's decisions on fixed-seed workloads
are exactly those frozen in ``tests/data/scheduler_golden.json``.

The golden file was written by the scheduler *before* its speed-up (the
indexes, caches and batched waits of the pass), so any change of behaviour
-- a grant, a wait's position, reason, message or ETA, a preemption, an
eviction, a withdrawn preemption, the reclaimable set -- fails here.

The workloads come from :mod:`benchmarks.scheduler` (the benchmark's own
states, and small ones with the rare paths switched on: shares and MIG
instances, static and foreign MIG instances, quotas and guarantees, fair
share, preemptible and non-preemptible classes, time limits, drained
devices, told victims and earmarked requests, preferred devices). Small
workloads are stored in full (a failure shows the first difference);
large ones as a SHA-256 of the same JSON. Each entry also holds a digest of
its input state, so a change of the workload generator is told apart from
a change of the scheduler.

Regenerate (only when a behaviour change is intended)::

    python -m tests.unit.test_scheduler_golden --write
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import scheduler as bench
from gpubroker.scheduler import Decisions, SchedulerState, schedule

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "scheduler_golden.json"


def _iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def serialize(d: Decisions) -> dict[str, Any]:
    """Every field of ``d`` as plain JSON (order kept, sets sorted)."""
    return {
        "grants": [
            [g.lease_id, list(g.devices), [list(dataclasses.astuple(p)) for p in g.parts]]
            for g in d.grants
        ],
        "preemptions": [
            [p.lease_id, p.for_lease, list(p.devices), p.reason, _iso(p.deadline)]
            for p in d.preemptions
        ],
        "evictions": [[e.lease_id, e.reason] for e in d.evictions],
        "waits": [
            [w.lease_id, w.position, w.reason.value, w.message, _iso(w.eta), list(w.earmarked)]
            for w in d.waits
        ],
        "reclaimable": sorted(d.reclaimable),
        "withdrawn": list(d.withdrawn),
    }


def _digest(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _later(state: SchedulerState) -> SchedulerState:
    return dataclasses.replace(state, sharing_strategy="first-fit")


def _fewer_shares(state: SchedulerState) -> SchedulerState:
    """Every second share lease gone, so shares are granted (and some weigh
    more than estimated)."""
    shares = [r for r in state.running if r.parts and r.parts[0].kind == "share"]
    gone = {r.lease_id for r in shares[::2]}
    return dataclasses.replace(
        state, running=tuple(r for r in state.running if r.lease_id not in gone)
    )


#: name -> (state builder, now, stored in full)
CASES: dict[str, tuple[Callable[[], SchedulerState], dt.datetime, bool]] = {
    "mixed-8-extras-s1": (lambda: bench.mixed_workload(8, 1, True), bench.NOW, True),
    "mixed-16-s2": (lambda: bench.mixed_workload(16, 2, False), bench.NOW, True),
    "mixed-16-extras-s3-first-fit-later": (
        lambda: _later(bench.mixed_workload(16, 3, True)),
        bench.NOW + dt.timedelta(seconds=60),
        True,
    ),
    "mixed-16-extras-s6-fewer-shares": (
        lambda: _fewer_shares(bench.mixed_workload(16, 6, True)),
        bench.NOW,
        True,
    ),
    "mixed-64-extras-s4": (lambda: bench.mixed_workload(64, 4, True), bench.NOW, False),
    "bench-whole-1024": (bench.workload, bench.NOW, False),
    "bench-mixed-1024": (lambda: bench.mixed_workload(128), bench.NOW, False),
    "mixed-256-extras-s5": (lambda: bench.mixed_workload(256, 5, True), bench.NOW, False),
    "mixed-128-s7-fewer-shares": (
        lambda: _fewer_shares(bench.mixed_workload(128, 7)),
        bench.NOW,
        False,
    ),
}


def _entry(name: str) -> dict[str, Any]:
    build, now, full = CASES[name]
    state = build()
    decisions = serialize(schedule(state, now))
    entry: dict[str, Any] = {"state": _digest(repr(state)), "decisions": _digest(decisions)}
    if full:
        entry["full"] = decisions
    return entry


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(GOLDEN.read_text())
    return data


@pytest.mark.parametrize("name", list(CASES))
def test_decisions_match_golden(name: str, golden: dict[str, Any]) -> None:
    expected = golden[name]
    build, now, _full = CASES[name]
    state = build()
    assert _digest(repr(state)) == expected["state"], "the workload generator changed"
    got = serialize(schedule(state, now))
    if "full" in expected:
        for key, want in expected["full"].items():
            have = got[key]
            for i, (a, b) in enumerate(zip(have, want, strict=False)):
                assert a == b, f"{key}[{i}] differs"
            assert len(have) == len(want), f"{key}: {len(have)} entries, expected {len(want)}"
    assert _digest(got) == expected["decisions"]


@pytest.mark.parametrize(
    "name", ["mixed-16-extras-s6-fewer-shares", "mixed-64-extras-s4", "bench-whole-1024"]
)
def test_without_sentences_the_decisions_are_the_same(name: str) -> None:
    build, now, _full = CASES[name]
    state = build()
    told = schedule(state, now)
    quiet = schedule(dataclasses.replace(state, explain=False), now)
    assert {w.message for w in quiet.waits} == {""}
    blank = [dataclasses.replace(w, message="") for w in told.waits]
    assert dataclasses.replace(told, waits=tuple(blank)) == quiet


def test_golden_covers_the_paths() -> None:
    """The stored workloads exercise what the pass optimizes."""
    data = json.loads(GOLDEN.read_text())
    reasons: set[str] = set()
    kinds: set[str] = set()
    etas = grants_parts = 0
    for entry in data.values():
        full = entry.get("full")
        if full is None:
            continue
        reasons.update(w[2] for w in full["waits"])
        etas += sum(w[4] is not None for w in full["waits"])
        grants_parts += sum(bool(g[2]) for g in full["grants"])
        kinds.update(p[1] for g in full["grants"] for p in g[2])
        assert full["grants"] and full["waits"]
    assert {"Priority", "Resources", "QuotaUserLimit", "Fragmented", "OverGuarantee"} <= reasons
    assert {"Preempting", "PoolDrained", "Reserved"} & reasons
    assert kinds == {"mig", "share"} and etas > 0 and grants_parts > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the golden file")
    args = parser.parse_args()
    data = {name: _entry(name) for name in CASES}
    text = json.dumps(data, separators=(",", ":")) + "\n"
    if args.write:
        GOLDEN.write_text(text)
        print(f"wrote {GOLDEN} ({len(text):,} bytes)")
    else:
        old = json.loads(GOLDEN.read_text())
        for name in CASES:
            same = old.get(name, {}).get("decisions") == data[name]["decisions"]
            print(f"{name}: {'same' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
