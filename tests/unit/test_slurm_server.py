"""The launcher a Slurm server job runs on its node (gpubroker_spawner.slurm_server)."""

from __future__ import annotations

import socket

import pytest

from gpubroker_spawner import slurm_server


def test_the_service_url_gets_the_chosen_port() -> None:
    url = "http://0.0.0.0:0/user/alice/"
    assert slurm_server.with_port(url, 40123) == "http://0.0.0.0:40123/user/alice/"
    assert slurm_server.with_port("http://[::1]:0/x/", 5) == "http://[::1]:5/x/"


def test_the_chosen_port_is_free_on_the_node() -> None:
    port = slurm_server.free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nothing holds it


def test_outside_a_slurm_job_it_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm_server.main(["true"]) == 2
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    assert slurm_server.main([]) == 2
