"""The local engine's cgroups: reading where cgroup v2 is mounted and which
cgroup a process is in, and choosing the launches' directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpubroker.engines import cgroups

HYBRID = (
    "25 30 0:22 / /sys/fs/cgroup rw,relatime shared:9 - tmpfs tmpfs rw,mode=755\n"
    "26 25 0:23 / /sys/fs/cgroup/cpu rw,relatime shared:10 - cgroup cgroup rw,cpu\n"
    "35 25 0:32 / /sys/fs/cgroup/unified rw,relatime shared:19 - cgroup2 cgroup2 rw\n"
)
V1_ONLY = "26 25 0:23 / /sys/fs/cgroup/cpu rw,relatime shared:10 - cgroup cgroup rw,cpu\n"


@pytest.mark.parametrize(
    ("text", "mount"),
    [
        (HYBRID, "/sys/fs/cgroup/unified"),
        (
            "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
            "/sys/fs/cgroup",
        ),
        ("30 1 0:26 / /my\\040cgroups rw - cgroup2 none rw\n", "/my cgroups"),
        (V1_ONLY, None),
    ],
)
def test_the_cgroup2_mount_is_read_from_mountinfo(
    tmp_path: Path, text: str, mount: str | None
) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(text)
    assert cgroups.cgroup2_mount(str(info)) == mount


def test_a_missing_mountinfo_or_cgroup_file_is_none(tmp_path: Path) -> None:
    assert cgroups.cgroup2_mount(str(tmp_path / "none")) is None
    assert cgroups.own_cgroup(str(tmp_path / "none")) is None


def test_the_own_cgroup_is_the_v2_line(tmp_path: Path) -> None:
    path = tmp_path / "cgroup"
    path.write_text("4:memory:/x\n0::/system.slice/gpubroker.service\n")
    assert cgroups.own_cgroup(str(path)) == "/system.slice/gpubroker.service"
    path.write_text("4:memory:/x\n")  # cgroup v1 alone
    assert cgroups.own_cgroup(str(path)) is None


def test_none_when_switched_off_or_not_a_cgroup2_directory(tmp_path: Path) -> None:
    assert cgroups.find_root("") is None
    assert cgroups.find_root(str(tmp_path / "plain")) is None
    assert not (tmp_path / "plain").exists()  # nothing is made outside a cgroup2 hierarchy
    assert cgroups.find_root(str(tmp_path / "no" / "parent")) is None
    v1 = tmp_path / "v1"  # a cgroup v1 cgroup has cgroup.procs, not cgroup.events
    v1.mkdir()
    (v1 / "cgroup.procs").write_text("")
    assert cgroups.find_root(str(v1 / "launches")) is None
    assert not (v1 / "launches").exists()


def test_a_launchs_cgroup_is_named_by_its_tag(tmp_path: Path) -> None:
    root = cgroups.LaunchCgroups(tmp_path, tmp_path)
    assert root.path("job7-0-ab12") == tmp_path / "job7-0-ab12"
    assert root.path("../x y") == tmp_path / ".._x_y"  # never outside the root
    assert root.owns(str(tmp_path / "job7-0-ab12"))
    assert not root.owns(str(tmp_path / "a" / "b"))
    assert root.absolute("/gpubroker-launches/t") == str(tmp_path / "gpubroker-launches" / "t")
    gone = tmp_path / "gone"
    assert root.pids(gone) == [] and not root.populated(gone)
    root.signal(gone, 15)  # nothing there: nothing happens
    root.remove(gone)
