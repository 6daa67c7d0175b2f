"""A notebook job stopped by SIGTERM (a cancel, a time limit, a preemption)
left its kernelspec folder (``gpubroker-kernel-*``) and the kernel's
connection file in the node's /tmp: ten pairs of them piled up on the test
machine. The runner now removes them and still ends by the signal, as the
job's status reads it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpubroker.jobs import nbrun

from ..nbutil import write_notebook


def test_a_stopped_notebook_run_leaves_nothing_in_tmp(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    source = write_notebook(tmp_path / "nb.ipynb", ["import time", "time.sleep(120)"])
    env = {**os.environ, "TMPDIR": str(tmp), "GPUBROKER_KERNEL_PYTHON": sys.executable}
    env.pop("GPUBROKER_WARN_SIGNAL", None)
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        run = subprocess.Popen(
            [sys.executable, nbrun.__file__, str(source), str(tmp_path / "out.ipynb")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        # the kernel runs its cell: papermill has written the output notebook
        while not (tmp_path / "out.ipynb").exists() or not list(tmp.glob("gpubroker-kernel-*")):
            assert run.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the run did not start its kernel"
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        assert run.wait(60) == -signal.SIGTERM
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert list(tmp.iterdir()) == []


def test_a_notebook_whose_kernel_dies_fails_with_exit_1_and_says_so(tmp_path: Path) -> None:
    """papermill exits 138 when the kernel dies (killed, out of memory);
    the job's shell read 129-192 as a signal, so the job ended "by signal
    10" (the broker's own warning signal) with no error line. The runner
    now exits 1 and writes why."""
    source = write_notebook(
        tmp_path / "nb.ipynb", ["x = 1", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    )
    error = tmp_path / "job.log.error"
    env = {
        **os.environ,
        "GPUBROKER_KERNEL_PYTHON": sys.executable,
        "GPUBROKER_JOB_ERROR_FILE": str(error),
    }
    env.pop("GPUBROKER_WARN_SIGNAL", None)
    run = subprocess.run(
        [sys.executable, nbrun.__file__, str(source), str(tmp_path / "out.ipynb")],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr.decode()[-2000:]
    assert error.read_text().startswith("DeadKernelError: the kernel died")
