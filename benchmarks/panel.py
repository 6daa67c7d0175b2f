"""Panel benchmark (#14): the overview of 1,024 fake devices holding 2,000
leases (512 whole devices, 1,488 shares of 10 GiB on the other 512), drawn
by the broker's template and rendered by headless Chromium, against the
same page of 8 devices (8 leases) in the same run.

Figures: the server's time to build the page (state → HTML), and the
browser's time from loading that HTML to its first full layout (load event
plus one forced layout, read with ``performance.now()``); medians of
``ROUNDS``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import figure

BIG = (1024, 2000)
SMALL = (8, 8)
ROUNDS = 5


def describe() -> str:
    return (
        f"Panel: the overview of {BIG[0]:,} fake devices and {BIG[1]:,} leases, built and "
        f"rendered in headless Chromium, vs a page of {SMALL[0]} devices"
    )


def _broker(tmp: str, devices: int, leases: int) -> Any:
    """A broker with ``devices`` fake H100s, the upper half a time-sliced
    pool, holding ``leases`` leases (whole devices first, then shares)."""
    from traitlets.config import Config

    from gpubroker.broker.passloop import PassLoop
    from gpubroker.core import Broker
    from gpubroker.devices.fake import FakeDeviceBackend
    from gpubroker.store.db import make_engine, make_session_factory, upgrade

    url = f"sqlite:///{tmp}/panel-{devices}.sqlite"
    upgrade(url)
    half = devices // 2
    config = Config()
    config.Pools.pools = [
        {"name": "shared", "mode": "timeslice", "devices": [f"bench:{half}-{devices - 1}"]}
    ]
    backend = FakeDeviceBackend(inventory=[f"{devices} x H100"], node_name="bench")
    broker = Broker(
        session_factory=make_session_factory(make_engine(url)), backend=backend, config=config
    )
    broker.check_state = "off"
    broker.sync_inventory()
    broker.adopt()
    broker.passes = PassLoop(0.001)  # coalesce: one pass grants them all
    whole = min(half, leases)
    for i in range(leases):
        if i < whole:
            broker.request_lease(f"user{i % 97:02d}", f"s{i}", gpus=1, holder_kind="external")
        else:
            broker.request_lease(
                f"user{i % 97:02d}", f"s{i}", memory_gib=10, pool="shared", holder_kind="external"
            )
    broker.schedule_now()
    granted = sum(1 for x in broker.list_leases() if x["state"] == "granted")
    if granted != leases:
        raise RuntimeError(f"panel bench: {granted} of {leases} leases granted")
    return broker


def _html(broker: Any) -> tuple[str, float]:
    """The overview's HTML and the seconds it took to build."""
    import logging

    from gpubroker.web.base import frame, render
    from gpubroker.web.pages import overview_values

    start = time.perf_counter()
    values = overview_values(broker, logging.getLogger("bench"), {})
    text = render("overview.html", frame(admin=True, page="overview", simulated=True) | values)
    return text, time.perf_counter() - start


def _css() -> str:
    from importlib import resources

    return resources.files("gpubroker.web").joinpath("static/panel.css").read_text("utf-8")


def _browser_seconds(page: Any, html: str) -> float:
    """Seconds from handing Chromium the page to its layout being done."""
    styled = html.replace("</head>", f"<style>{_css()}</style></head>")
    start = time.perf_counter()
    page.set_content(styled, wait_until="load")
    page.evaluate("() => document.body.getBoundingClientRect().height")  # force layout
    return time.perf_counter() - start


def run() -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests import browserutil

    with tempfile.TemporaryDirectory() as tmp:
        small, big = _broker(tmp, *SMALL), _broker(tmp, *BIG)
        build = {"small": [], "big": []}  # type: dict[str, list[float]]
        draw = {"small": [], "big": []}  # type: dict[str, list[float]]
        with browserutil.chromium() as browser:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            for _ in range(ROUNDS):
                for name, broker in (("small", small), ("big", big)):
                    html, seconds = _html(broker)
                    build[name].append(seconds)
                    draw[name].append(_browser_seconds(page, html))
            tiles = page.locator("article.tile").count()
        if tiles != BIG[0]:
            raise RuntimeError(f"panel bench: {tiles} tiles drawn, not {BIG[0]}")
    med = {
        k: {n: statistics.median(v) * 1000 for n, v in d.items()}
        for k, d in (("build", build), ("draw", draw))
    }
    return {
        "panel.overview_build_1024": figure(
            med["build"]["big"], "ms", med["build"]["small"], "8 devices"
        ),
        "panel.overview_render_1024": figure(
            med["draw"]["big"], "ms", med["draw"]["small"], "8 devices"
        ),
    }


if __name__ == "__main__":
    for key, value in run().items():
        print(key, value)
