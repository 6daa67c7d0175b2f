"""The researcher's own page (me.html): what each held slot shows of its use."""

from __future__ import annotations

import re
from typing import Any

from gpubroker.web.base import frame, render
from gpubroker.web.pages import render_cell

MIG = "MIG-0a329db2-79a1-5499-81a2-e10c85965bfd"
SHARED = "GPU-40e0a8cf-ac7f-5230-8524-1796808d02ae"
WHOLE = "GPU-f2f3e1ab-a072-5252-af2f-2035542531de"
PARENT = "GPU-306c23e6-a7ff-5203-b3d0-5bc701ac773b"


def _lease(lease_id: int, summary: str, slot: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": lease_id,
        "holder_kind": "server",
        "server_name": "",
        "state": "granted",
        "summary": summary,
        "slots": [slot],
        "queue": None,
    }


def _slot(kind: str, device: str, uuid: str, profile: str | None = None) -> dict[str, Any]:
    return {"kind": kind, "device": device, "uuid": uuid, "profile": profile}


def _rows(usage: dict[str, Any]) -> dict[str, str]:
    leases = [
        _lease(1, "1 x MIG 1g.10gb", _slot("mig", PARENT, MIG, "1g.10gb")),
        _lease(2, "1 x shared GPU (10 GiB)", _slot("share", SHARED, SHARED)),
        _lease(3, "1 x GPU", _slot("device", WHOLE, WHOLE)),
    ]
    html = render(
        "me.html",
        frame(me="ann", page="me", live=True)
        | {
            "leases": leases,
            "jobs": [],
            "left": lambda lease: "-",
            "cell": render_cell,
            "usage_by_uuid": usage,
            "month": None,
            "room": {},
            "notices": [],
        },
    )
    rows = re.findall(r'<tr data-lease="(\d+)">(.*?)</tr>', html, re.S)
    return {lease_id: re.sub(r"<[^>]+>", "", row) for lease_id, row in rows}


def test_a_mig_instance_shows_its_profile_and_memory_not_none_percent() -> None:
    rows = _rows(
        {
            MIG: {"utilization_gpu": None, "memory_used_mib": 2048, "processes": 1},
            SHARED: {"utilization_gpu": 30, "memory_used_mib": 5120, "processes": 2},
            WHOLE: {"utilization_gpu": 80, "memory_used_mib": 20480, "processes": 1},
        }
    )
    assert "None" not in "".join(rows.values())
    assert "n/a (MIG 1g.10gb), 2.0 GiB" in rows["1"]
    assert "30 %, 5.0 GiB (whole GPU, shared)" in rows["2"]
    assert "80 %, 20.0 GiB" in rows["3"]


def test_a_slot_whose_use_cannot_be_read_shows_a_dash() -> None:
    rows = _rows({})
    for lease_id in ("1", "2", "3"):
        assert "None" not in rows[lease_id] and " %" not in rows[lease_id]
