"""The admin panel overview's headline counts every device (a new-user
trial of the demo: `8 devices: 3 leased whole, 1 free whole, 0 drained`
left the four MIG and shared devices out)."""

from __future__ import annotations

import logging
from pathlib import Path

from gpubroker.web import base, tiles
from gpubroker.web.pages import overview_values

from .test_sharing_core import sharing_broker

LOG = logging.getLogger("test-overview")


def test_the_headline_of_the_demos_sharing_layout_counts_every_device(
    db_url: str, tmp_path: Path
) -> None:
    # 8 x H100: GPUs 0-1 in a MIG pool, 2-3 time-sliced, 4-7 whole
    broker = sharing_broker(db_url, tmp_path)
    for user in ("ann", "bob", "cat"):
        assert broker.request_lease(user, "", 1)["state"] == "granted"
    assert broker.request_lease("dan", "", mig_profile="1g.10gb")["state"] == "granted"
    assert broker.request_lease("eve", "", memory_gib=10)["state"] == "granted"
    values = overview_values(broker, LOG, {})
    expected = (
        "8 devices: 3 leased whole, 1 free whole, 2 MIG (1 in use), 2 shared (1 in use), 0 drained"
    )
    assert values["headline"] == expected
    page = base.render("overview.html", base.frame(admin=True) | values)
    assert f'<p class="summary">{expected} ·' in page


def test_a_drained_device_counts_once_whatever_its_pool_and_absent_ones_are_said_after() -> None:
    def device(mode: str, state: str, **flags: bool) -> dict[str, object]:
        return {"pool_mode": mode, "state": state, "present": True, "drained": False} | flags

    listing = {
        "devices": [
            device("exclusive", "leased", drained=True),  # draining: running on
            device("mig", "drained", drained=True),
            device("mig", "free"),
            device("timeslice", "shared"),
            device("exclusive", "outside"),
            device("exclusive", "free"),
            device("exclusive", "free", present=False),
        ]
    }
    assert tiles.headline(listing) == (
        "6 devices: 0 leased whole, 1 free whole, 1 MIG (0 in use), 1 shared (1 in use), "
        "2 drained, 1 outside the broker; 1 more absent"
    )
