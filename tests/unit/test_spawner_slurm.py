"""SlurmGPUSpawner's parts that need no cluster: what the job runs, and
that a Slurm that cannot be asked never ends a server (the whole spawner
runs against the real two-node cluster in tests/integration/test_slurm_hub.py)."""

from __future__ import annotations

import getpass
import pwd
from types import SimpleNamespace

import pytest
from jupyterhub.objects import Hub
from traitlets.config import Config

from gpubroker_spawner.slurm import SERVER_MODULE, SlurmGPUSpawner


def make_spawner(**kwargs: object) -> SlurmGPUSpawner:
    user = SimpleNamespace(name="ann", url="/user/ann/", escaped_name="ann", id=1)
    hub = Hub(ip="127.0.0.1", port=8081, base_url="/hub/")
    config = Config()
    config.SlurmEngine.bin_dir = "/nonexistent/slurm/bin"  # every Slurm command fails
    return SlurmGPUSpawner(
        user=user,
        hub=hub,
        config=config,
        broker_url="http://broker:10101/services/gpubroker/",
        system_user=getpass.getuser(),
        **kwargs,
    )


def test_the_job_runs_the_launcher_then_the_server_with_the_leases_devices() -> None:
    spawner = make_spawner(cmd=["jupyterhub-singleuser"], notebook_dir="~/work")
    spawner.gpu_devices, spawner.gpu_lease_id, spawner.time_limit = ["GPU-a", "GPU-b"], 7, 600.0
    spec = spawner.launch_spec()
    home = pwd.getpwnam(getpass.getuser()).pw_dir
    assert spec.argv[1:4] == ("-m", SERVER_MODULE, "jupyterhub-singleuser")
    assert (spec.devices, spec.lease_id, spec.time_limit) == (("GPU-a", "GPU-b"), 7, 600.0)
    assert spec.cwd == f"{home}/work"
    assert spec.stdout == spec.stderr == f"{home}/.jupyterhub-slurm-.log"
    assert spec.env["HOME"] == home and spec.env["USER"] == getpass.getuser()
    # the server listens on its node, on the port its launcher chooses
    assert spec.env["JUPYTERHUB_SERVICE_URL"].startswith("http://0.0.0.0:")


def test_an_unknown_system_user_fails_the_spawn_by_name() -> None:
    spawner = make_spawner()
    spawner.system_user = "no-such-user-{username}"
    with pytest.raises(Exception, match="No system user 'no-such-user-ann'"):
        spawner.launch_spec()


async def test_a_failing_squeue_is_unknown_and_the_server_counts_as_running() -> None:
    spawner = make_spawner()
    spawner.load_state({"slurm_job_id": "41", "slurm_node": "n1"})
    assert await spawner.poll() is None
    assert spawner.get_state()["slurm_job_id"] == "41"  # nothing forgotten


async def test_without_a_job_there_is_no_server() -> None:
    assert await make_spawner().poll() == 0


def test_the_output_shown_is_only_the_users_own_regular_file(tmp_path) -> None:
    import os

    from gpubroker_spawner.slurm import output_tail

    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(20)))
    uid = os.getuid()
    assert output_tail(str(log), uid, lines=2) == "line 18\nline 19"
    assert output_tail(str(log), uid + 1) == ""  # not the user's: not read
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    link = tmp_path / "link.log"
    link.symlink_to(secret)
    assert output_tail(str(link), uid) == ""  # a link the user planted: not followed
    assert output_tail(str(tmp_path / "missing.log"), uid) == ""


async def test_progress_events_added_while_one_is_read_are_all_yielded() -> None:
    from gpubroker_spawner.progress import ProgressFeed

    feed = ProgressFeed()
    feed.add(10, "one")
    seen = []
    async for event in feed.follow():
        seen.append(event["message"])
        if event["message"] == "one":  # while the reader is busy with "one"
            feed.add(20, "two")
            feed.add(30, "three")
            feed.close()
    assert seen == ["one", "two", "three"]


def _system_account() -> str:
    """A system account of this host (uid below 1000), not root."""
    return next(e.pw_name for e in pwd.getpwall() if 0 < e.pw_uid < 1000)


@pytest.mark.parametrize("name", ["root", _system_account()])
def test_a_hub_user_named_like_a_system_account_gets_no_server_as_it(name: str) -> None:
    # an OAuth login may pick any name: "root" ran the server as root
    spawner = make_spawner()
    spawner.user.name = name
    spawner.system_user = "{username}"
    with pytest.raises(Exception, match=rf"Servers do not run as '{name}' \(uid \d+\)"):
        spawner.launch_spec()
    spawner.min_uid = 0  # the check off
    assert spawner.launch_spec().user == name


def test_a_fixed_system_user_is_the_admins_choice() -> None:
    spawner = make_spawner()  # system_user: this account, named without {username}
    assert spawner.launch_spec().user == getpass.getuser()
