"""Images for the Docker tests, built here from files of this machine (no
registry is reachable, so nothing is pulled).

:func:`python_base` imports a *base image* made of this machine's own
Python (its interpreter, standard library and the shared libraries they
link), a few shell tools, a user ``jovyan`` (uid 1000, as in the Jupyter
Docker Stacks) and the Python distributions gpubroker's images need,
copied from the test environment with their console scripts. It stands in
for the public bases the Dockerfiles in ``docker/`` name
(``quay.io/jupyter/...``, ``python:3.12-slim``): :func:`build` builds those
Dockerfiles ``FROM`` it, with ``PIP_INSTALL_ARGS=--no-index
--no-build-isolation`` so ``pip install`` takes every dependency from the
base instead of the network.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent

#: what the images install beside gpubroker (with its own requirements)
DISTRIBUTIONS = (
    "gpubroker[docker,postgres]",
    "jupyterhub",
    "jupyter_server",
    "ipykernel",
    "dockerspawner",
    "pip",
    "setuptools",
    "wheel",
)

#: shell tools the Dockerfiles' RUN steps and the tests use
TOOLS = (
    "/bin/sh",
    "/bin/mkdir",
    "/bin/chown",
    "/bin/chmod",
    "/bin/ln",
    "/bin/cat",
    "/bin/sleep",
    "/bin/rm",
    "/bin/ls",
    "/bin/cp",
    "/usr/bin/env",
    "/usr/bin/id",
)

#: parts of the standard library no image needs
_STDLIB_SKIP = {"test", "site-packages", "idlelib", "tkinter", "turtledemo", "ensurepip"}

_SCRIPT = """#!{python}
import sys
from {module} import {head}
sys.exit({call}())
"""


def closure(names: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` need (their requirements, with
    extras and markers evaluated, followed to the end); ``gpubroker``
    itself is left out (the Dockerfiles install it).

    Raises:
        metadata.PackageNotFoundError: a requirement is not installed here.
    """
    found: dict[str, metadata.Distribution] = {}
    todo = [Requirement(name) for name in names]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        key = (req.name.lower().replace("_", "-"), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(req.name)
        if key[0] != "gpubroker":
            found[key[0]] = dist
        for text in dist.requires or []:
            sub = Requirement(text)
            wanted = sub.marker is None or any(
                sub.marker.evaluate({"extra": extra}) for extra in (*req.extras, "")
            )
            if wanted:
                todo.append(sub)
    return list(found.values())


def _copy(source: Path, root: Path, at: str | None = None) -> None:
    target = root / (at or str(source)).lstrip("/")
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(source), target)


def _libraries(files: Iterable[Path], root: Path) -> None:
    """Copy the shared libraries ``files`` link (as ``ldd`` names them)."""
    for file in files:
        out = subprocess.run(["ldd", str(file)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            path = parts[2] if len(parts) > 2 and parts[1] == "=>" else parts[0] if parts else ""
            if path.startswith("/") and os.path.exists(path):
                _copy(Path(path), root)


def _console_scripts(dists: Iterable[metadata.Distribution], bindir: Path, python: str) -> None:
    for dist in dists:
        for entry in dist.entry_points.select(group="console_scripts"):
            module, _, attr = entry.value.partition(":")
            head = attr.split(".")[0]
            script = bindir / entry.name
            script.write_text(_SCRIPT.format(python=python, module=module, head=head, call=attr))
            script.chmod(0o755)


def python_rootfs(where: Path) -> Path:
    """A root file system tarball (see the module's documentation)."""
    root = where / "python-rootfs"
    prefix = Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = prefix / "lib" / version
    python = prefix / "bin" / version
    shutil.copytree(
        stdlib,
        root / str(stdlib).lstrip("/"),
        ignore=lambda folder, names: [
            n for n in names if folder == str(stdlib) and n in _STDLIB_SKIP
        ],
        symlinks=True,
    )
    _copy(python, root)
    for lib in (prefix / "lib").glob("libpython*.so*"):
        _copy(lib, root)
    bindir = root / str(prefix / "bin").lstrip("/")
    for alias in ("python3", "python"):
        (bindir / alias).symlink_to(version)
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "usr/local/bin/python3").symlink_to(prefix / "bin" / version)
    site = Path(sysconfig.get_paths()["purelib"])
    dists = closure(DISTRIBUTIONS)
    for dist in dists:
        for file in dist.files or []:
            path = Path(str(dist.locate_file(file))).resolve()
            if path.is_file() and path.is_relative_to(site):
                _copy(path, root, str(stdlib / "site-packages" / path.relative_to(site)))
    _console_scripts(dists, bindir, str(prefix / "bin" / "python3"))
    for tool in TOOLS:
        _copy(Path(tool), root)
    _libraries([python, *root.rglob("*.so"), *root.rglob("*.so.*"), *map(Path, TOOLS)], root)
    _accounts(root)
    tarball = where / "python-rootfs.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(root, arcname=".")
    shutil.rmtree(root)
    return tarball


def _accounts(root: Path) -> None:
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\njovyan:x:1000:100::/home/jovyan:/bin/sh\n"
    )
    (etc / "group").write_text("root:x:0:\nusers:x:100:\n")
    for path, mode in (("tmp", 0o1777), ("root", 0o755), ("home/jovyan", 0o755)):
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path).chmod(mode)
    os.chown(root / "home/jovyan", 1000, 100)


def python_base(client: Any, where: Path, tag: str = "gpubroker-test-python:1") -> str:
    """Import the base image (see the module's documentation) as ``tag``."""
    prefix = Path(sys.base_prefix)
    path = f"{prefix / 'bin'}:/usr/local/bin:/usr/bin:/bin"
    repository, _, version = tag.partition(":")
    client.api.import_image(
        src=str(python_rootfs(where)),
        repository=repository,
        tag=version,
        changes=[f"ENV PATH={path}", "ENV LANG=C.UTF-8"],
    )
    return tag


def build(client: Any, dockerfile: str, tag: str, base: str) -> str:
    """Build ``docker/<dockerfile>`` from the repository FROM ``base``,
    every dependency taken from the base (no network); return ``tag``.

    Raises:
        RuntimeError: the build failed (the end of its log is in the message).
    """
    import docker.errors

    try:
        client.images.build(
            path=str(REPO),
            dockerfile=f"docker/{dockerfile}",
            tag=tag,
            buildargs={"BASE_IMAGE": base, "PIP_INSTALL_ARGS": "--no-index --no-build-isolation"},
            network_mode="none",
            rm=True,
            forcerm=True,
        )
    except docker.errors.BuildError as err:
        log = "".join(str(x.get("stream", "")) + str(x.get("error", "")) for x in err.build_log)
        raise RuntimeError(f"docker build of {dockerfile} failed:\n{log[-3000:]}") from None
    return tag
