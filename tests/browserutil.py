"""Headless Chromium (Debian's ``chromium`` package) driven by Playwright,
for the panel's browser tests and benchmark. Playwright's own browser
download is never used: ``executable_path`` names the system Chromium."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: flags for a closed network and a root account (see notes on Chromium)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium_path() -> str | None:
    """The system Chromium, or ``None`` when it is not installed."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@contextmanager
def chromium() -> Iterator[Any]:
    """A running headless Chromium (a Playwright ``Browser``), closed after.

    Raises:
        RuntimeError: no system Chromium (``make test`` installs it).
    """
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        raise RuntimeError("no chromium on PATH: run `make chromium` (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot_dir(tmp: Path) -> Path:
    """Where the tests save screenshots: ``$GPUBROKER_SCREENSHOT_DIR`` (the
    docs' images are made with ``GPUBROKER_SCREENSHOT_DIR=docs/_static/panel``)
    or a temporary folder."""
    target = Path(os.environ.get("GPUBROKER_SCREENSHOT_DIR") or tmp)
    target.mkdir(parents=True, exist_ok=True)
    return target
