"""Batch-job benchmark (#12): seconds from a submission (what ``%gpu_submit``
sends) to the notebook's first cell running on a free GPU, through an
in-process broker and its job service (the local engine, papermill),
against starting the same papermill run directly; median of ``ROUNDS``."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat

from . import fake_broker, figure

ROUNDS = 3


def describe() -> str:
    return "Jobs: submission to the first cell running, via the broker vs papermill run directly"


def _notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nb.metadata["kernelspec"]["language"] = "python"
    first = nbformat.v4.new_code_cell("mark = 'started'")
    first.metadata["tags"] = ["parameters"]
    nb.cells = [first, nbformat.v4.new_code_cell("open(mark, 'w').write('x')")]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _wait_for(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _direct(home: Path, i: int) -> float:
    notebook = _notebook(home / f"direct{i}.ipynb")
    mark = home / f"direct{i}.started"
    t0 = time.perf_counter()
    output = str(home / f"direct{i}.out.ipynb")
    argv = [sys.executable, "-m", "papermill", str(notebook), output, "-p", "mark", str(mark)]
    proc = subprocess.Popen(
        [*argv, "--no-progress-bar"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for(mark)
    elapsed = time.perf_counter() - t0
    proc.wait(120)
    return elapsed


def _brokered(tmp: str, home: Path, i: int) -> float:
    from gpubroker.jobs.service import JobService

    broker, engine = fake_broker(tmp)
    jobs = JobService(broker, broker.engine, run_as_self=True, poll_interval=0.05)
    jobs.root_dir_template = str(home.parent / "{username}")
    _notebook(home / f"job{i}.ipynb")
    mark = home / f"job{i}.started"

    async def run() -> float:
        task = asyncio.ensure_future(jobs.run())
        t0 = time.perf_counter()
        job = jobs.submit(
            home.name, {"notebook": f"job{i}.ipynb", "gpus": 1, "params": [f"mark={mark}"]}
        )
        while not mark.exists():
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - t0
        while jobs.get(job["id"])["state"] in ("queued", "running"):
            await asyncio.sleep(0.05)
        task.cancel()
        return elapsed

    try:
        return asyncio.run(run())
    finally:
        broker._world.close()
        engine.dispose()


def run() -> dict[str, dict[str, Any]]:
    """The median of ``ROUNDS`` alternating runs of each."""
    ours, direct = [], []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home" / "bench"
        for i in range(ROUNDS):
            direct.append(_direct(home, i))
            with tempfile.TemporaryDirectory() as store:
                ours.append(_brokered(store, home, i))
    return {
        "jobs.submit_to_first_cell": figure(
            statistics.median(ours), "s", statistics.median(direct), "papermill run directly"
        )
    }


if __name__ == "__main__":
    for name, value in run().items():
        print(name, value)
