"""The overview's picture as data (gpubroker.web.tiles): slot widths, the
free room, holders, ages and idle times."""

from __future__ import annotations

import datetime as dt

from gpubroker.web import tiles

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.timezone.utc)


def _device(index: int, holders: list[dict], node: str = "n1", **extra: object) -> dict:
    return {
        "uuid": f"GPU-{node}-{index}",
        "index": index,
        "name": "NVIDIA H100 80GB HBM3",
        "node": node,
        "memory_total_mib": 81920,
        "pool": "p",
        "pool_mode": "exclusive",
        "state": "leased" if holders else "free",
        "drained": False,
        "present": True,
        "mig_enabled": False,
        "holders": holders,
        "usage": {"utilization_gpu": 40, "memory_used_mib": 2048, "processes": 1},
        **extra,
    }


def _holder(lease_id: int, kind: str = "device", **extra: object) -> dict:
    return {"lease_id": lease_id, "user": f"u{lease_id}", "server_name": "", "kind": kind} | extra


def test_widths_of_whole_mig_and_share_slots_and_the_free_room() -> None:
    listing = {
        "backend": {"simulated": True},
        "devices": [
            _device(1, [_holder(1)]),
            _device(
                0, [_holder(2, "mig", profile="3g.40gb"), _holder(3, "mig", profile="1g.10gb")]
            ),
            _device(2, [_holder(4, "share", memory_gib=20.0)], node="n0"),
            _device(3, []),
        ],
    }
    leases = [
        {
            "id": 1,
            "granted_at": "2026-12-02T11:00:00Z",
            "holder_kind": "server",
            "priority_class": "interactive",
        },
        {"id": 2, "granted_at": None, "holder_kind": "job", "priority_class": "batch"},
    ]
    idle = {1: NOW - dt.timedelta(minutes=20)}
    rows = tiles.overview(listing, leases, idle, NOW)
    assert [r.name for r in rows] == ["n0", "n1"]
    n1 = rows[1].tiles
    assert [t.index for t in n1] == [0, 1, 3]  # index order
    mig = n1[0]
    assert [s.label for s in mig.slots] == ["MIG 3g.40gb", "MIG 1g.10gb", "free"]
    # 3g.40gb: four of eight memory slices (1/2) outweigh 3/7 of the compute
    assert [round(s.width, 4) for s in mig.slots] == [0.5, 0.1429, 0.3571]
    whole = n1[1]
    assert len(whole.slots) == 1 and not whole.slots[0].free  # no free room left
    assert whole.slots[0].age_seconds == 3600.0 and whole.slots[0].idle_seconds == 1200.0
    assert whole.slots[0].holder_kind == "server" and whole.simulated
    assert whole.utilization == 40 and whole.memory_used_gib == 2.0
    share = rows[0].tiles[0].slots
    assert share[0].label == "share 20 GiB" and share[0].width == 0.25
    assert share[1].free and share[1].width == 0.75
    assert n1[2].slots == (tiles.SlotTile(label="free", width=1.0),)


def test_a_holder_without_a_lease_view_and_profiles_without_slices() -> None:
    tile = tiles.device_tile(_device(0, [_holder(9, "mig", profile="odd")]), {}, False, {}, NOW)
    assert tile.slots[0].width == 1 / 7 and tile.slots[0].age_seconds is None
    assert tiles.mig_width("7g.80gb", 80) == 1.0
    assert tiles.mig_width("1g.20gb", 80) == 0.25  # memory, not compute, is what it takes


def test_full_mig_memory_leaves_no_free_room_and_a_reserve_is_drawn() -> None:
    profiles = ("3g.40gb", "2g.20gb", "1g.20gb")  # 8 of 8 memory slices, 6 of 7 compute
    holders = [_holder(i, "mig", profile=p) for i, p in enumerate(profiles)]
    tile = tiles.device_tile(_device(0, holders), {}, False, {}, NOW)
    assert not any(s.free for s in tile.slots)
    shared = _device(1, [_holder(7, "share", memory_gib=20.0)], reserve_gib=2.0)
    labels = [(s.label, s.width) for s in tiles.device_tile(shared, {}, False, {}, NOW).slots]
    assert labels == [("share 20 GiB", 0.25), ("reserved", 0.025), ("free", 0.725)]


def test_durations_read_like_a_person_would_say_them() -> None:
    assert [tiles.duration(s) for s in (None, 5, 125, 3 * 3600 + 300, 2 * 86400 + 4 * 3600)] == [
        "-",
        "5 s",
        "2 min",
        "3 h 5 min",
        "2 d 4 h",
    ]
