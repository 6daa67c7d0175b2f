"""What a researcher hits from a notebook and a terminal: the magics'
argument parsing and notebook paths, a notebook job that holds its own
``%gpu_submit``, and the sync client against a broker that redirects,
answers no JSON, is slow, or has no URL (a fake HTTP server on loopback)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.interactiveshell import InteractiveShell

from gpubroker.client import BrokerClientError
from gpubroker.client_sync import SyncBrokerClient
from gpubroker.jobs.cli import LogsCommand
from gpubroker.magics import GPUMagics

from ..nbutil import new_shell, write_notebook

Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


class FakeHTTP:
    """A loopback HTTP server whose answers a test sets (``handle``); it
    records each request's path and ``Authorization`` header."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.handle: Handler = lambda req: None
        fake = self

        class _Req(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.seen.append((self.path, self.headers.get("Authorization")))
                fake.handle(self)

            do_POST = do_DELETE = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), _Req)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *args: None  # type: ignore[method-assign]
        self.url = f"http://{host}:{self.server.server_port}/services/gpubroker/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _answer(status: int, body: bytes, ctype: str = "application/json", **headers: str) -> Handler:
    def handle(req: http.server.BaseHTTPRequestHandler) -> None:
        req.send_response(status)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            req.send_header(name, value)
        req.end_headers()
        req.wfile.write(body)

    return handle


@pytest.fixture
def fake() -> Iterator[FakeHTTP]:
    server = FakeHTTP()
    yield server
    server.close()


class Recorder:
    """The submissions the magics make."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def submit_job(self, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        return {"id": 7, "state": "queued", "queue": {"message": "waiting"}}


@pytest.fixture
def shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[InteractiveShell, Recorder]]:
    """A shell whose home is ``tmp_path`` and whose directory is its ``sub``."""
    for name in ("GPUBROKER_JOB_ID", "JPY_SESSION_NAME", "GPUBROKER_LEASE_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    ip = new_shell()
    recorder = Recorder()
    ip.register_magics(GPUMagics(ip, client=recorder))  # type: ignore[arg-type]
    yield ip, recorder
    InteractiveShell.clear_instance()


# --- the magics ---------------------------------------------------------------------


def test_quoted_names_and_values_lose_their_quotes(shell: Any) -> None:
    """IPython's ``parse_argstring`` keeps quotes: a notebook whose name has
    a space could not be named, ``--param "msg=hello world"`` sent the
    quotes (a 400: '"msg' is not a Python name), ``--param msg='a b'``
    was a usage error, and an unbalanced quote a raw ValueError."""
    ip, recorder = shell
    ip.run_line_magic(
        "gpu_submit",
        """"my run.ipynb" --gpus 1 --param "msg=hello world" --param name='Zoë b' """
        """--param 'sizes=[1, 2]' --param a=b=c""",
    )
    (body,) = recorder.bodies
    assert body["notebook"] == "sub/my run.ipynb"
    assert body["params"] == ["msg=hello world", "name=Zoë b", "sizes=[1, 2]", "a=b=c"]
    with pytest.raises(UsageError, match="No closing quotation"):
        ip.run_line_magic("gpu_submit", '"my run.ipynb --gpus 1')
    with pytest.raises(UsageError, match="invalid int value"):
        ip.run_line_magic("gpu_logs", "'seven'")


def test_a_notebook_is_named_from_this_kernels_directory(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker reads a relative path from the home directory: a kernel in
    ~/sub that named ``train.ipynb`` (the file beside it) submitted
    ~/train.ipynb. The kernel's own notebook (an absolute
    ``JPY_SESSION_NAME``) goes relative to the home directory too."""
    ip, recorder = shell
    ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1")
    ip.run_line_magic("gpu_submit", "~/top.ipynb --gpus 1")
    own = tmp_path / "sub" / "my run.ipynb"
    monkeypatch.setenv("JPY_SESSION_NAME", str(own))
    write_notebook(own, ["x = 1"])
    ip.run_line_magic("gpu_submit", "--gpus 1")
    assert [b["notebook"] for b in recorder.bodies] == [
        "sub/train.ipynb",
        "top.ipynb",
        "sub/my run.ipynb",
    ]


def test_a_session_named_by_its_api_path_is_read_from_the_home_directory(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that names no session makes Jupyter Server set
    ``JPY_SESSION_NAME`` to the API path (relative to the server's root, the
    home directory), not to the file's absolute path: it is not joined to
    the kernel's directory (``sub/sub/...``) nor called missing."""
    ip, recorder = shell
    write_notebook(tmp_path / "sub" / "nb.ipynb", ["x = 1"])
    monkeypatch.setenv("JPY_SESSION_NAME", "sub/nb.ipynb")
    ip.run_line_magic("gpu_submit", "--gpus 1")
    assert [b["notebook"] for b in recorder.bodies] == ["sub/nb.ipynb"]


def test_a_renamed_notebook_is_not_submitted_by_its_old_name(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$JPY_SESSION_NAME`` is the file the kernel started for: after the
    usual rename of ``Untitled.ipynb`` it named a file that is gone (a 400
    about an unreadable notebook), or another one made since."""
    ip, recorder = shell
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "sub" / "Untitled.ipynb"))
    with pytest.raises(UsageError, match="renamed or moved since the kernel started"):
        ip.run_line_magic("gpu_submit", "--gpus 1")
    assert recorder.bodies == []


def test_a_notebook_job_skips_its_own_submit_cell(
    shell: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A saved notebook holds the ``%gpu_submit`` cell that promoted it; run
    as a job it used to fail there (no notebook name, no broker URL in a
    job) or submit itself again."""
    ip, recorder = shell
    monkeypatch.setenv("GPUBROKER_JOB_ID", "12")
    assert ip.run_line_magic("gpu_submit", "--gpus 1 --time 1h") is None
    assert ip.run_cell_magic("gpu_job", "--gpus 1", "print(1)") is None
    assert recorder.bodies == []
    assert "not submitted: this kernel runs as job 12 already" in capsys.readouterr().out


def test_the_submitting_cell_is_not_an_unsaved_cell_and_the_warning_comes_first(
    shell: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``job = %gpu_submit ...`` run in a new cell was counted as a cell
    missing from the saved file; and with ``--release`` the question came
    before the warning, so one confirmed stopping the server unwarned."""
    ip, _ = shell
    path = tmp_path / "sub" / "nb.ipynb"
    write_notebook(path, ["x = 1"])
    monkeypatch.setenv("JPY_SESSION_NAME", str(path))
    monkeypatch.setenv("GPUBROKER_LEASE_ID", "3")
    monkeypatch.setattr(
        ip.history_manager, "input_hist_raw", ["", "x = 1", "job = %gpu_submit --gpus 1"]
    )
    ip.run_line_magic("gpu_submit", "--gpus 1")
    assert "Warning" not in capsys.readouterr().err
    ip.history_manager.input_hist_raw.append("y = 2")
    said: list[str] = []

    def ask(prompt: str) -> str:
        said.append(capsys.readouterr().err)
        return "n"

    monkeypatch.setattr("builtins.input", ask)
    with pytest.raises(UsageError, match="not confirmed"):
        ip.run_line_magic("gpu_submit", "--gpus 1 --release")
    assert "Warning: 1 cell(s) run in this kernel are not in" in said[0]


def test_the_magics_say_when_no_broker_url_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without ``$GPUBROKER_URL`` (a job's kernel, a server not spawned by
    the broker's spawner) a call raised a raw ``ValueError: unknown url
    type``; now a ``UsageError`` that names the variable."""
    monkeypatch.delenv("GPUBROKER_URL", raising=False)
    monkeypatch.delenv("GPUBROKER_JOB_ID", raising=False)
    ip = new_shell()
    try:
        ip.register_magics(GPUMagics(ip))
        with pytest.raises(UsageError, match=r"no broker URL \(GPUBROKER_URL"):
            ip.run_line_magic("gpu_jobs", "")
    finally:
        InteractiveShell.clear_instance()


# --- the sync client ----------------------------------------------------------------


def test_a_redirect_is_not_followed_so_the_token_goes_nowhere_else(fake: FakeHTTP) -> None:
    """urllib followed a redirect with the token (an ordinary header) to
    any host, then failed on the login page's HTML with a JSONDecodeError."""
    other = FakeHTTP("127.0.0.2")
    try:
        other.handle = _answer(200, b"<html>login</html>", "text/html")
        fake.handle = _answer(302, b"", Location=f"{other.url}hub/login")
        with pytest.raises(BrokerClientError) as info:
            SyncBrokerClient(fake.url, "SECRET").jobs()
        assert info.value.status == 302 and "redirects to http://127.0.0.2:" in info.value.message
        assert other.seen == [] and "SECRET" not in info.value.message
    finally:
        other.close()


@pytest.mark.parametrize(
    ("answer", "status", "message"),
    [
        (_answer(200, b"<html>hub</html>", "text/html"), 502, "did not answer JSON"),
        (
            _answer(404, b"<!DOCTYPE html><html>" + b"x" * 2000, "text/html"),
            404,
            "HTTP 404 from http://127.0.0.1:",
        ),
        (_answer(503, b'{"message": "down for upgrade"}'), 503, "down for upgrade"),
    ],
)
def test_answers_that_are_not_the_brokers_are_clear_errors(
    fake: FakeHTTP, answer: Handler, status: int, message: str
) -> None:
    fake.handle = answer
    with pytest.raises(BrokerClientError) as info:
        SyncBrokerClient(fake.url, "t").jobs()
    assert info.value.status == status and message in info.value.message
    assert "<html" not in info.value.message


def test_a_server_that_does_not_speak_http_is_unreachable_not_a_traceback(
    fake: FakeHTTP,
) -> None:
    """``http.client.BadStatusLine`` is no ``OSError``: it went through raw."""

    def ssh(req: http.server.BaseHTTPRequestHandler) -> None:
        req.wfile.write(b"SSH-2.0-OpenSSH_9.2\r\n")
        req.close_connection = True

    fake.handle = ssh
    with pytest.raises(BrokerClientError, match="broker unreachable") as info:
        SyncBrokerClient(fake.url, "t").jobs()
    assert info.value.status == 599


def test_a_submission_may_take_longer_than_a_call_and_a_timeout_says_so(
    fake: FakeHTTP,
) -> None:
    """The broker checks a job as its user for up to 20 s before answering:
    with the client's 20 s timeout a slow check looked like "broker
    unreachable" while the job was queued (and a second submit made two)."""

    def slow(req: http.server.BaseHTTPRequestHandler) -> None:
        time.sleep(1.0)
        _answer(201, b'{"id": 9, "state": "queued"}')(req)

    fake.handle = slow
    client = SyncBrokerClient(fake.url, "t", timeout=0.3)
    assert client.submit_job({"notebook": "a.ipynb", "gpus": 1})["id"] == 9
    with pytest.raises(BrokerClientError, match=r"no answer from the broker .* within 0.3 s"):
        client.jobs()


# --- the CLI ------------------------------------------------------------------------


def test_ctrl_c_stops_following_a_log_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[int] = []

    def job_logs(self: Any, job_id: int, offset: int, wait: float) -> dict[str, Any]:
        calls.append(offset)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return {"text": "step 1\n", "offset": 7, "state": "running"}

    monkeypatch.setattr(SyncBrokerClient, "job_logs", job_logs)
    LogsCommand.clear_instance()
    app = LogsCommand()
    app.initialize(["7", "--follow", "--url=http://127.0.0.1:9/"])
    with pytest.raises(SystemExit) as info:
        try:
            app.start()
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C went through as a traceback")
    assert info.value.code == 130 and calls == [0, 7]
    assert capsys.readouterr().out == "step 1\n"


def test_the_async_client_does_not_follow_a_redirect_nor_choke_on_html(fake: FakeHTTP) -> None:
    """The spawner's client (Tornado) followed a redirect with the token too,
    and raised a raw ``JSONDecodeError`` on a page that is not JSON."""
    import asyncio

    from gpubroker.client import BrokerClient

    other = FakeHTTP("127.0.0.2")
    try:
        fake.handle = _answer(302, b"", Location=f"{other.url}hub/login")
        with pytest.raises(BrokerClientError) as info:
            asyncio.run(BrokerClient(fake.url, "SECRET").health())
        assert info.value.status == 302 and other.seen == []
        fake.handle = _answer(200, b"<html>hub</html>", "text/html")
        with pytest.raises(BrokerClientError, match="did not answer JSON") as info:
            asyncio.run(BrokerClient(fake.url, "SECRET").health())
        assert info.value.status == 502
    finally:
        other.close()


# --- a researcher's trial of the demo ------------------------------------------------


class _Broker:
    """A client that must not be called (a job has no broker token)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"called the broker: {name}")


def test_a_notebook_job_showing_gpu_or_its_jobs_runs_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, a job whose notebook also held ``%gpu`` failed at that cell
    ("no broker URL"), its GPU time spent."""
    monkeypatch.setenv("GPUBROKER_JOB_ID", "11")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    ip = new_shell()
    try:
        ip.register_magics(GPUMagics(ip, client=_Broker()))  # type: ignore[arg-type]
        for name, line in (("gpu", ""), ("gpu_jobs", ""), ("gpu_logs", "3"), ("gpu_cancel", "3")):
            assert ip.run_line_magic(name, line) is None
            assert capsys.readouterr().out == (
                f"%{name}: not available inside job 11, which has no broker token "
                "(its devices: GPU-abc); run it in your server\n"
            )
    finally:
        InteractiveShell.clear_instance()


def test_release_without_yes_where_nothing_can_be_asked_is_a_usage_error(
    shell: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nbconvert, papermill and some IDEs take no input: ``input()`` raised
    a bare ``StdinNotImplementedError`` traceback."""
    ip, recorder = shell
    monkeypatch.setenv("GPUBROKER_LEASE_ID", "42")

    def no_stdin(prompt: str) -> str:
        raise StdinNotImplementedError(
            "raw_input was called, but this frontend does not support input requests."
        )

    monkeypatch.setattr("builtins.input", no_stdin)
    with pytest.raises(UsageError, match=r"cannot ask for confirmation here .*add --yes"):
        ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --release")
    assert recorder.bodies == []


class _Queued:
    def job_logs(self, job: int, offset: int, wait: float) -> dict[str, Any]:
        return {"text": "", "offset": 0, "state": "queued"}


def test_the_log_of_a_queued_job_says_there_is_none_yet(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUBROKER_JOB_ID", raising=False)
    ip = new_shell()
    try:
        ip.register_magics(GPUMagics(ip, client=_Queued()))  # type: ignore[arg-type]
        ip.run_line_magic("gpu_logs", "4")
        assert capsys.readouterr().out == "job 4 is queued: no log yet (--follow waits for it)\n"
    finally:
        InteractiveShell.clear_instance()


class _ReleaseFails(Recorder):
    def release_lease(self, lease_id: int, reason: str) -> None:
        raise BrokerClientError(503, "broker down")


def test_a_release_that_fails_after_the_submit_still_returns_the_job(
    shell: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--release``: the job was queued, then the release raised a
    UsageError, so ``job = %gpu_submit ...`` got nothing and nothing said
    that job 7 exists while the lease is still held."""
    ip, _ = shell
    failing = _ReleaseFails()
    ip.register_magics(GPUMagics(ip, client=failing))  # type: ignore[arg-type]
    monkeypatch.setenv("GPUBROKER_LEASE_ID", "42")
    job = ip.run_line_magic("gpu_submit", "train.ipynb --gpus 1 --release --yes")
    assert job["id"] == 7 and len(failing.bodies) == 1
    err = capsys.readouterr().err
    assert "job 7 is queued, but lease 42 was not released: broker down" in err


def test_a_relative_name_with_dots_is_normalised_from_the_home_directory(
    shell: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From ``~/sub`` the name was normalised, from ``~`` it went as given,
    and the broker refused ``sub/../a.ipynb`` as leaving the home directory."""
    ip, recorder = shell
    monkeypatch.chdir(tmp_path)
    ip.run_line_magic("gpu_submit", "sub/../a.ipynb --gpus 1")
    assert recorder.bodies[-1]["notebook"] == "a.ipynb"


@pytest.mark.parametrize("value", ["nan", "inf", "abc"])
def test_memory_must_be_a_finite_number(shell: Any, value: str) -> None:
    """``--memory nan`` went to the broker as JSON's NaN, refused as a
    bad body without naming the option."""
    ip, recorder = shell
    with pytest.raises(UsageError, match=r"--memory: must be a finite number of GiB"):
        ip.run_line_magic("gpu_submit", f"train.ipynb --memory {value}")
    assert recorder.bodies == []


def test_a_url_the_client_cannot_parse_is_a_client_error() -> None:
    with pytest.raises(BrokerClientError, match=r"Invalid IPv6 URL: is GPUBROKER_URL a URL"):
        SyncBrokerClient("http://[::1/", "token").jobs()
