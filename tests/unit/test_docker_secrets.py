"""The Docker stack's secrets stay out of its images and out of git (the
Docker trial: every image built as documented held ``docker/.env``, because
the Dockerfiles copy the repository and a later ``rm`` leaves the file in
its layer)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_context_leaves_the_env_files_out() -> None:
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    # Docker matches .dockerignore patterns from the context's root:
    # "docker/.env" needs "**/.env" (or the path itself)
    assert {"**/.env", ".env"} <= patterns
    assert not any(p.startswith("!") for p in patterns)  # nothing lets one back in


def test_git_ignores_the_stacks_env_file() -> None:
    done = subprocess.run(
        ["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT, capture_output=True, timeout=30
    )
    assert done.returncode == 0


def test_the_notebook_image_gives_the_users_volume_to_its_user() -> None:
    dockerfile = (ROOT / "docker" / "notebook" / "Dockerfile").read_text()
    assert "chown 1000 /home/jovyan/work" in dockerfile
