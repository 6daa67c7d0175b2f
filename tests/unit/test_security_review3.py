"""Security review 3: where the broker (often root) touches what a user
controls, or sends things to a user (found by a review; each test failed
before its fix)."""

from __future__ import annotations

import contextlib
import json
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpubroker.jobs.service import JobService

from ..nbutil import write_notebook as notebook

MIB = 1 << 20


def test_the_answer_of_the_check_as_the_user_is_read_bounded(jobs: JobService, home: Path) -> None:
    """The probe run as the user at submit writes what the user's files say
    (a notebook's metadata, her kernelspecs) and runs with her ``env``
    (``LD_PRELOAD``): its output is hers. The broker reads at most
    ``PROBE_MAX_OUTPUT`` of it; a longer answer counts as none (the job's own
    run tells), so one ``POST /jobs`` cannot fill the broker's memory."""
    from gpubroker.jobs.service import PROBE_MAX_OUTPUT

    path = notebook(home / "ann" / "big.ipynb", ["x = 1"])
    nb = json.loads(path.read_text())
    nb["metadata"]["language_info"] = {"name": "p" * (48 * MIB)}  # 48 MiB of the user's disk
    path.write_text(json.dumps(nb))
    tracemalloc.start()
    try:
        spec, _note, language, _ = jobs.check("ann", {"notebook": "big.ipynb", "gpus": 1})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * PROBE_MAX_OUTPUT + 4 * MIB, f"the broker held {peak / MIB:.0f} MiB"
    assert spec.notebook == "big.ipynb" and language == ""


def _library(tmp_path: Path, home: Path, name: str, source: str) -> Path:
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the user's LD_PRELOAD library")
    (tmp_path / f"{name}.c").write_text(source)
    library = home / "ann" / f"{name}.so"
    library.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(library), str(tmp_path / f"{name}.c")], check=True
    )
    return library


FLOOD = r"""
#include <string.h>
#include <unistd.h>
/* the user's code in the probe: it and a child that left its process group
   write 256 MiB each to the standard output the broker reads */
__attribute__((constructor)) static void flood(void) {
    static char buf[65536];
    memset(buf, 'x', sizeof buf);
    if (fork() == 0) setsid();
    for (int i = 0; i < 4096; i++)
        if (write(1, buf, sizeof buf) < 0) _exit(0);
    _exit(0);
}
"""


def test_a_users_ld_preload_in_the_check_cannot_flood_the_broker(
    jobs: JobService, home: Path, tmp_path: Path
) -> None:
    """A job's ``env`` reaches the check as its user (``LD_PRELOAD``
    included: it runs as her, so that is her business), and so may its
    output: endless, from a process that left the probe's group and still
    holds the pipe. The broker reads a bounded part and answers quickly."""

    from gpubroker.jobs.service import PROBE_MAX_OUTPUT

    library = _library(tmp_path, home, "flood", FLOOD)
    notebook(home / "ann" / "nb.ipynb", ["x = 1"])
    tracemalloc.start()
    try:
        spec, _, _, _ = jobs.check(
            "ann", {"notebook": "nb.ipynb", "gpus": 1, "env": {"LD_PRELOAD": str(library)}}
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * PROBE_MAX_OUTPUT + 4 * MIB, f"the broker held {peak / MIB:.0f} MiB"
    assert spec.notebook == "nb.ipynb"


SLOW = r"""
#include <stdlib.h>
#include <unistd.h>
/* the user's code in the probe: it waits (up to 30 s) for a file to appear */
__attribute__((constructor)) static void slow(void) {
    const char *go = getenv("GO_FILE");
    for (int i = 0; go && i < 600 && access(go, F_OK) != 0; i++) usleep(50000);
}
"""


async def test_a_users_slow_checks_do_not_hold_the_brokers_workers(
    jobs: JobService, home: Path, tmp_path: Path
) -> None:
    """A check runs the user's probe for up to PROBE_TIMEOUT seconds, and the
    user decides how slow it is. Her checks run on the job service's own
    workers, at most MAX_CHECKS_PER_USER at once (more: 409): the event
    loop's default workers, which carry the broker's launches, stops and
    MIG changes, stay free, and another user's check still runs."""
    import asyncio
    import os

    from gpubroker.errors import Conflict
    from gpubroker.jobs.service import MAX_CHECKS_PER_USER

    library = _library(tmp_path, home, "slow", SLOW)
    go = home / "ann" / "go"
    notebook(home / "ann" / "nb.ipynb", ["x = 1"])
    notebook(home / "bob" / "nb.ipynb", ["x = 1"])
    env = {"LD_PRELOAD": str(library), "GO_FILE": str(go)}
    slow = {"notebook": "nb.ipynb", "gpus": 1, "env": env}
    workers = min(32, (os.cpu_count() or 1) + 4)  # the default executor's
    tries = [
        asyncio.ensure_future(jobs.check_off_loop("ann", dict(slow)))
        for _ in range(workers + MAX_CHECKS_PER_USER)
    ]
    try:
        for _ in range(200):  # until every try past the limit has its answer
            refused = [t for t in tries if t.done()]
            if len(refused) >= len(tries) - MAX_CHECKS_PER_USER:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # (one more done would be a check past the limit)
        refused = [t for t in tries if t.done()]
        assert len(refused) == len(tries) - MAX_CHECKS_PER_USER
        assert all(isinstance(t.exception(), Conflict) for t in refused)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 5) == "free"
        spec, *_ = await asyncio.wait_for(
            jobs.check_off_loop("bob", {"notebook": "nb.ipynb", "gpus": 1}), 15
        )
        assert spec.notebook == "nb.ipynb"
    finally:
        go.touch()
        await asyncio.wait(tries, timeout=30)
    assert jobs._checking == {}


@contextlib.asynccontextmanager
async def _served(jobs: JobService) -> AsyncIterator[int]:
    """The broker's API with ``jobs`` on a loopback port (yielded), against
    a fake hub that knows ann's token; stopped at the end."""
    from jupyterhub.httpclient import JupyterHubHTTPClient
    from jupyterhub.services.auth import HubAuth
    from tornado.httpserver import HTTPServer

    from gpubroker.api.app import make_app

    from .test_api_scopes import ACCESS, FakeHub, _bound

    with FakeHub() as hub:
        auth = HubAuth(api_url=hub.api_url, api_token="t", access_scopes={ACCESS})
        server = HTTPServer(make_app(jobs.broker, hub_auth=auth, jobs=jobs))
        sock, port = _bound()
        server.add_sockets([sock])
        try:
            yield port
        finally:
            server.stop()
            await JupyterHubHTTPClient.loop_instance().close()


async def test_post_jobs_checks_on_the_job_services_workers(
    jobs: JobService, home: Path, tmp_path: Path
) -> None:
    """``POST /api/v1/jobs`` runs its check through
    :meth:`JobService.check_off_loop`: a third slow check of one user is a
    409, the job of a quick one is queued (201)."""
    import asyncio
    import json as json_module

    from tornado.httpclient import AsyncHTTPClient

    library = _library(tmp_path, home, "slow", SLOW)
    go = home / "ann" / "go"
    notebook(home / "ann" / "nb.ipynb", ["x = 1"])
    env = {"LD_PRELOAD": str(library), "GO_FILE": str(go)}
    async with _served(jobs) as port:
        client = AsyncHTTPClient()

        async def post(body: dict[str, object]) -> tuple[int, dict[str, str]]:
            response = await client.fetch(
                f"http://127.0.0.1:{port}/api/v1/jobs",
                method="POST",
                headers={"Authorization": "token ann-token"},
                body=json_module.dumps(body),
                raise_error=False,
                request_timeout=60,
            )
            return response.code, json_module.loads(response.body)

        slow = [
            asyncio.ensure_future(post({"notebook": "nb.ipynb", "gpus": 1, "env": env}))
            for _ in range(2)
        ]
        try:
            for _ in range(200):  # until both slow checks are under way
                if jobs._checking.get("ann", 0) == 2:
                    break
                await asyncio.sleep(0.05)
            code, said = await post({"notebook": "nb.ipynb", "gpus": 1, "env": env})
            assert code == 409 and "being checked" in said["message"], said
        finally:
            go.touch()
            done = await asyncio.gather(*slow)
        assert [code for code, _ in done] == [201, 201], done


async def test_a_submission_whose_client_left_during_its_checks_is_not_made(
    jobs: JobService, home: Path, tmp_path: Path
) -> None:
    """A client that timed out while its checks waited their turn was told
    "no answer", yet its job was queued: its retry made a second one,
    both holding GPUs. A submission whose client has left is not made."""
    import asyncio
    import json as json_module

    from tornado.httpclient import AsyncHTTPClient, HTTPClientError

    library = _library(tmp_path, home, "slow", SLOW)
    go = home / "ann" / "go"
    notebook(home / "ann" / "nb.ipynb", ["x = 1"])
    env = {"LD_PRELOAD": str(library), "GO_FILE": str(go)}
    async with _served(jobs) as port:
        try:
            with pytest.raises(HTTPClientError) as gave_up:
                await AsyncHTTPClient().fetch(
                    f"http://127.0.0.1:{port}/api/v1/jobs",
                    method="POST",
                    headers={"Authorization": "token ann-token"},
                    body=json_module.dumps({"notebook": "nb.ipynb", "gpus": 1, "env": env}),
                    request_timeout=1,
                )
            assert gave_up.value.code == 599  # the client's timeout
            go.touch()
            for _ in range(400):  # until the check has ended
                if not jobs._checking.get("ann"):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # the handler goes on after the check
            assert jobs._checking.get("ann", 0) == 0
            assert jobs.list("ann") == []
        finally:
            go.touch()
