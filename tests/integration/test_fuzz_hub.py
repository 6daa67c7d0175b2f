"""Schemathesis fuzzing of the REST API against its OpenAPI document, on the
real hub and broker, as a broker admin and as a plain user: no 5xx, every
answer as documented, and the broker's invariants hold afterwards."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gpubroker.api.handlers import load_openapi

from ..hubutil import RunningHub

#: generated cases per operation and caller (15 operations x 2 callers, then bursts
#: of plausible lease requests): about 2,700 requests, ~45 s on 2 cores (150 took
#: ~65 s alone and ~100 s in the full suite, for no failure found beyond 100)
EXAMPLES = 100
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def _fuzz(
    hub: RunningHub,
    token: str,
    created: set[int],
    statuses: Counter[str],
    failures: dict[str, str],
) -> None:
    schema = schemathesis.openapi.from_dict(load_openapi())
    base_url = hub.url + "/services/gpubroker"
    headers = {"Authorization": f"token {token}"}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            case=st.one_of(
                operation.as_strategy(),  # valid by the document
                operation.as_strategy(generation_mode=GenerationMode.NEGATIVE),  # invalid
            )
        )
        def run(case: Any) -> None:
            wait = (case.query or {}).get("wait")
            if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0.2:
                case.query["wait"] = 0.2  # long-polls on real leases: keep the run short
            response = case.call(base_url=base_url, headers=headers, timeout=30)
            label = f"{case.operation.method.upper()} {case.operation.path}"
            statuses[f"{label} {response.status_code}"] += 1
            if case.method.upper() == "POST" and response.status_code == 201:
                created.add(response.json()["id"])
            try:
                case.validate_response(response, checks=CHECKS, headers=headers)
            except (AssertionError, FailureGroup) as err:  # every mismatch, not the first
                failures.setdefault(f"{label} {response.status_code}", str(err)[:600])

        run()


#: plausible lease requests (the document cannot say "exactly one of"): these get granted
PLAUSIBLE = st.fixed_dictionaries(
    {"user": st.sampled_from(["fuzz-ann", "fuzz-bob", "fuzz-cy"])},
    optional={
        "server_name": st.sampled_from(["", "a", "b"]),
        "time_limit": st.sampled_from([60, 3600]),
        "priority_class": st.sampled_from(["interactive", "batch", "preemptible", "nope"]),
    },
).flatmap(
    lambda base: st.one_of(
        st.builds(lambda n: {**base, "gpus": n}, st.integers(1, 9)),
        st.builds(lambda p: {**base, "mig_profile": p}, st.sampled_from(["1g.10gb", "3g.40gb"])),
        st.builds(lambda g: {**base, "memory_gib": g}, st.sampled_from([0.25, 10, 80])),
    ).map(lambda body: {**body, "holder_kind": "external"})
)


def _fuzz_leases(
    hub: RunningHub, created: set[int], statuses: Counter[str], failures: dict[str, str]
) -> None:
    """Bursts of up to 8 concurrent plausible requests and releases, as admin."""
    schema = schemathesis.openapi.from_dict(load_openapi())
    post = next(
        r.ok()
        for r in schema.get_all_operations()
        if r.ok().path == "/api/v1/leases" and r.ok().method.upper() == "POST"
    )
    base_url = hub.url + "/services/gpubroker"
    headers = {"Authorization": f"token {hub.token}"}

    def send(case: Any, body: dict[str, Any]) -> None:
        case.body, case.query, case.headers = body, {}, {}
        response = case.call(base_url=base_url, headers=headers, timeout=30)
        statuses[f"POST /api/v1/leases (plausible) {response.status_code}"] += 1
        if response.status_code == 201:
            created.add(response.json()["id"])
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (AssertionError, FailureGroup) as err:
            failures.setdefault(f"POST /api/v1/leases {response.status_code}", str(err)[:600])

    @settings(
        max_examples=EXAMPLES // 4,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        burst=st.lists(st.tuples(post.as_strategy(), PLAUSIBLE), min_size=1, max_size=8),
        release=st.integers(0, 3),
    )
    def run(burst: list[tuple[Any, dict[str, Any]]], release: int) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda pair: send(*pair), burst))
            # release a few held leases concurrently, so slots are reused
            for lease in hub.leases()[:release]:
                pool.submit(hub.broker_api, "DELETE", f"/leases/{lease['id']}")

    run()


def _check_invariants(hub: RunningHub, created: set[int], before: set[int]) -> None:
    leases = hub.leases(state="all")
    # no allocation belongs to a refused request: every lease came from a 201
    assert {lease["id"] for lease in leases} - before - created == set()
    holders: dict[str, int] = {}
    for lease in leases:
        if lease["state"] != "granted":
            continue
        for slot in lease.get("slots") or [{"uuid": d["uuid"]} for d in lease["devices"]]:
            assert slot["uuid"] not in holders, (slot, holders[slot["uuid"]], lease["id"])
            holders[slot["uuid"]] = lease["id"]
    granted = {lease["id"] for lease in leases if lease["state"] == "granted"}
    devices = hub.broker_api("GET", "/devices").json()["devices"]
    for device in devices:
        assert device["lease_id"] is None or device["lease_id"] in granted, device


def _clean(hub: RunningHub) -> None:
    for lease in hub.leases():
        hub.broker_api("DELETE", f"/leases/{lease['id']}", json={"reason": "fuzz cleanup"})
    quotas = hub.broker_api("GET", "/quotas").json()
    for kind, key in (("user", "users"), ("group", "groups")):
        for name in quotas[key]:
            hub.broker_api("DELETE", f"/quotas/{kind}/{name}")
    for device in hub.broker_api("GET", "/devices").json()["devices"]:
        if device["drained"] or device["mig_target"] is not None:
            hub.broker_api("PATCH", f"/devices/{device['uuid']}", json={"drained": False})


def test_fuzz_api_as_admin_and_as_user(clean_hub: RunningHub) -> None:
    hub = clean_hub
    user_token = hub.create_user("fuzz-ann")
    before = {lease["id"] for lease in hub.leases(state="all")}
    created: set[int] = set()
    statuses: Counter[str] = Counter()
    failures: dict[str, str] = {}
    try:
        for token in (hub.token, user_token):
            _fuzz(hub, token, created, statuses, failures)
        _fuzz_leases(hub, created, statuses, failures)
        _check_invariants(hub, created, before)
    finally:
        _clean(hub)
    assert failures == {}, "\n\n".join(f"{k}: {v}" for k, v in failures.items())
    assert not [key for key in statuses if key.endswith(tuple(f" 5{i:02d}" for i in range(100)))]
    assert sum(statuses.values()) > 100, statuses
    assert any(" (plausible) 201" in key for key in statuses), statuses
    print(f"fuzz: {sum(statuses.values())} requests:", dict(sorted(statuses.items())))
