"""The control API's edges: what the client does with a stale or damaged
``control.json`` or ``api-token``, what it refuses before asking, and how the app
answers a failing handler or a challenge. Fake servers on 127.0.0.1 stand in for the
daemon (and for a program that took its port); the app is called as ASGI, in
process."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest

from volunteerd.cli import main
from volunteerd.control.api import build_app
from volunteerd.control.auth import is_token_text, load_or_create_token, prove
from volunteerd.control.client import ControlClient, read_endpoint
from volunteerd.control.models import (
    MAX_SNOOZE_S,
    LimitsChange,
    LimitsView,
    ScheduleChange,
    ScheduleView,
    SnoozeBody,
)
from volunteerd.errors import ControlError, DaemonNotAnswering, DaemonNotRunning, ExitCode
from volunteerd.paths import DataDirLock

TOKEN = "the-token-of-this-daemon"
PORT = 38999  # the test client's Host (no socket is bound for the app)


class _Server(ThreadingHTTPServer):
    """Records every request; proves ``token`` when asked (None: a program that is not
    the daemon); answers everything else with ``reply``."""

    def __init__(self, token: str | None, reply: tuple[int, dict[str, Any]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.token = token
        self.reply = reply
        self.seen: list[tuple[str, str, dict[str, str]]] = []


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keeps the connection open, as the daemon does

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.seen.append((self.command, self.path, dict(self.headers.items())))
        parts = urlsplit(self.path)
        status, body = self.server.reply
        if parts.path == "/api/v1/health":
            status, body = 200, {"ok": True, "version": "0"}
            challenge = parse_qs(parts.query).get("challenge")
            if challenge and self.server.token is not None:
                body["proof"] = prove(self.server.token, challenge[0])
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def serving() -> Iterator[Any]:
    """Start fake servers: ``serving(token, reply)`` -> the server (stopped after)."""
    started: list[_Server] = []

    def start(token: str | None, reply: tuple[int, dict[str, Any]] = (404, {})) -> _Server:
        server = _Server(token, reply)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def record(data_dir: Path, url: str, pid: Any, token: bytes = TOKEN.encode()) -> None:
    """What a daemon writes when its API listens (``control.json``, ``api-token``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "control.json").write_text(json.dumps({"url": url, "pid": pid}))
    (data_dir / "api-token").write_bytes(token + b"\n")


def url_of(server: _Server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def a_dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    return child.pid


async def ask(
    app: Any, method: str, path: str, query: dict[str, str] | None = None, body: Any = None
) -> tuple[int, dict[str, str], Any]:
    """``app``'s reply to one request from a client that holds the token."""
    payload = b"" if body is None else json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": urlencode(query or {}).encode(),
        "root_path": "",
        "headers": [
            (b"host", f"127.0.0.1:{PORT}".encode()),
            (b"authorization", f"Bearer {TOKEN}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", PORT),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": payload, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, json.loads(data)


def app_of(controls: Any) -> Any:
    app = build_app(controls, token=TOKEN)
    app.set_port(PORT)
    return app


def cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str) -> int:
    monkeypatch.setenv("VOLUNTEERD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("VOLUNTEERD_CACHE_DIR", str(tmp_path / "cache"))
    return main(list(argv))


# -- a stale control.json never gets the token sent -----------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="the pid check is POSIX only")
def test_a_dead_daemons_port_is_never_asked(tmp_path: Path) -> None:
    # kill -9 left control.json; another program listens on its port now
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        squatter.settimeout(0.2)
        record(tmp_path, f"http://127.0.0.1:{squatter.getsockname()[1]}", a_dead_pid())
        with pytest.raises(
            DaemonNotRunning,
            match=r"volunteerd is not running \(process \d+ of .*control.json has ended\)",
        ):
            ControlClient.for_data_dir(tmp_path)
        with pytest.raises(TimeoutError):
            squatter.accept()  # nobody knocked


def test_status_while_a_daemon_restarts_says_so_and_not_to_start_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # A join or leave restarts the daemon in place: no control.json for a few seconds,
    # the data folder's lock held throughout. "Not running; start it with `volunteerd
    # serve`" was wrong: one started then would be refused.
    data = tmp_path / "data"
    with DataDirLock(data / "volunteerd.lock"):
        assert cli(monkeypatch, tmp_path, "status") == ExitCode.UNAVAILABLE
        err = capsys.readouterr().err
        assert err.startswith(
            f"volunteerd: volunteerd is starting or restarting (pid {os.getpid()})"
        )
        assert "try again in a moment" in err
        assert "not running" not in err
        assert "volunteerd serve" not in err
        record(data, "http://127.0.0.1:1", a_dead_pid())  # a killed one's, a new one starting
        assert cli(monkeypatch, tmp_path, "pause") == ExitCode.UNAVAILABLE
        assert "is starting or restarting" in capsys.readouterr().err
    (data / "control.json").unlink()
    assert cli(monkeypatch, tmp_path, "status") == ExitCode.UNAVAILABLE  # nothing holds it
    assert "volunteerd is not running (no " in capsys.readouterr().err


def test_a_daemon_that_runs_but_does_not_answer_in_time_is_busy_not_gone(tmp_path: Path) -> None:
    # a listening socket nobody accepts on: the connection is made, no answer comes
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        record(tmp_path, url, os.getpid())  # a process that runs
        with pytest.raises(DaemonNotAnswering, match=r"runs \(pid \d+\) but did not answer"):
            ControlClient.for_data_dir(tmp_path, timeout_s=0.3).status()
        record(tmp_path, url, None)  # no pid recorded: nothing says it runs
        with pytest.raises(DaemonNotRunning, match="does not answer") as gone:
            ControlClient.for_data_dir(tmp_path, timeout_s=0.3).status()
        assert not isinstance(gone.value, DaemonNotAnswering)


def test_a_program_on_the_port_that_cannot_prove_the_token_never_gets_it(
    tmp_path: Path, serving: Any
) -> None:
    # the recorded pid runs (reused, or a daemon of another user): only the proof tells
    squatter = serving(None, (200, {}))
    record(tmp_path, url_of(squatter), os.getpid())
    client = ControlClient.for_data_dir(tmp_path)
    with pytest.raises(DaemonNotRunning, match="cannot prove it knows the API token"):
        client.status()
    with pytest.raises(DaemonNotRunning):
        client.dashboard_url  # noqa: B018 - the page there would read the token
    assert squatter.seen  # it was asked, but never told
    for _, path, headers in squatter.seen:
        assert "authorization" not in {k.lower() for k in headers}
        assert TOKEN not in path + json.dumps(headers)


def test_the_token_goes_to_the_daemon_that_proves_it(tmp_path: Path, serving: Any) -> None:
    daemon = serving(TOKEN, (200, {"stopping": True}))
    record(tmp_path, url_of(daemon), os.getpid())
    client = ControlClient.for_data_dir(tmp_path)
    client.shutdown()
    assert client.dashboard_url == f"{url_of(daemon)}/#token={TOKEN}"
    asked = [
        (method, urlsplit(path).path, h.get("Authorization")) for method, path, h in daemon.seen
    ]
    assert asked[:2] == [
        ("GET", "/api/v1/health", None),
        ("POST", "/api/v1/shutdown", f"Bearer {TOKEN}"),
    ]


async def test_the_token_never_travels_on_another_connection_than_the_proof(
    tmp_path: Path, serving: Any
) -> None:
    # closing after the proof: a new connection might reach another process
    daemon = serving(TOKEN, (200, {"stopping": True}))
    daemon.RequestHandlerClass = type("_Closing", (_Handler,), {"protocol_version": "HTTP/1.0"})
    record(tmp_path, url_of(daemon), os.getpid())
    with pytest.raises(DaemonNotRunning, match="does not answer"):
        ControlClient.for_data_dir(tmp_path).shutdown()
    assert [urlsplit(path).path for _, path, _ in daemon.seen] == ["/api/v1/health"]


async def test_the_app_proves_the_token_only_when_challenged() -> None:
    app = app_of(_Controls())
    code, _, health = await ask(app, "GET", "/api/v1/health", {"challenge": "abc"})
    assert code == 200
    assert health["proof"] == prove(TOKEN, "abc") != prove("another", "abc")
    _, _, plain = await ask(app, "GET", "/api/v1/health")
    assert plain["proof"] is None  # as before: what `bind_control` probes
    code, _, error = await ask(app, "GET", "/api/v1/health", {"challenge": "x" * 129})
    assert (code, error["field"]) == (422, "challenge")


# -- damaged files: one line, no traceback ---------------------------------------------


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://[::1", "http://127.0.0.1:abc"])
def test_a_malformed_address_is_an_unreadable_control_json(tmp_path: Path, url: str) -> None:
    record(tmp_path, url, os.getpid())
    with pytest.raises(DaemonNotRunning, match=r"control\.json is unreadable"):
        ControlClient.for_data_dir(tmp_path)


@pytest.mark.parametrize("token", [b"\xff\xfe", "jet\u00e9".encode()])
def test_a_damaged_token_file_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, serving: Any, token: bytes
) -> None:
    record(tmp_path / "data", url_of(serving(TOKEN)), os.getpid(), token=token)
    with pytest.raises(ControlError, match="api-token is damaged"):
        read_endpoint(tmp_path / "data" / "control.json", tmp_path / "data" / "api-token")
    assert cli(monkeypatch, tmp_path, "status") == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"volunteerd: the API token in {tmp_path / 'data' / 'api-token'} is damaged "
        "(not plain text): restart volunteerd, which makes a new one"
    ]


@pytest.mark.parametrize("damaged", [b"\xff\xfe\n", "jet\u00e9\n".encode(), b"a b\n"])
def test_the_daemon_replaces_a_damaged_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damaged: bytes
) -> None:
    path = tmp_path / "api-token"
    path.write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="volunteerd.control.auth"):
        token = load_or_create_token(path)
    assert is_token_text(token)
    assert path.read_text().strip() == token
    assert load_or_create_token(path) == token  # kept from now on
    if os.name == "posix":
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} does not hold a token (damaged?): making a new one"
    ]


# -- refused before asking, as the daemon would ----------------------------------------


def test_an_empty_time_window_is_a_usage_error_before_asking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    with pytest.raises(ValueError, match="an empty time window"):
        ScheduleChange(compute_hours=["07:00-22:00", "22:00-22:00"])
    # no daemon runs: the value is judged first (not "volunteerd is not running", 5)
    assert cli(monkeypatch, tmp_path, "schedule", "--network-hours", "10:00-10:00") == 2
    assert capsys.readouterr().err == (
        "volunteerd: --network-hours 10:00-10:00: network_hours: an empty time window: "
        "'10:00-10:00' (leave the list empty for any time)\n"
    )


async def test_the_api_refuses_an_empty_time_window_as_malformed() -> None:
    controls = _Controls()
    code, _, error = await ask(
        app_of(controls), "PATCH", "/api/v1/schedule", body={"compute_hours": ["22:00-22:00"]}
    )
    assert (code, error["field"]) == (422, "compute_hours.0")
    assert "an empty time window" in error["error"]
    assert controls.schedule_changes == []  # nothing applied


@pytest.mark.parametrize("raw", ["", "  ", ",", " , "])
@pytest.mark.parametrize("flag", ["--compute-hours", "--network-hours"])
def test_hours_without_a_window_are_a_usage_error_not_any_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, flag: str, raw: str
) -> None:
    # an empty shell variable cleared the hours, as `any` does
    assert cli(monkeypatch, tmp_path, "schedule", flag, raw) == 2
    assert capsys.readouterr().err == (
        f"volunteerd: {flag} {raw!r}: no time window: give `any` to clear the hours\n"
    )


def test_a_snooze_longer_than_the_api_allows_is_a_usage_error_before_asking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    assert MAX_SNOOZE_S == 7 * 86400
    SnoozeBody(seconds=MAX_SNOOZE_S)
    with pytest.raises(ValueError, match="less than or equal"):
        SnoozeBody(seconds=MAX_SNOOZE_S + 1)
    # no daemon runs: the value is judged first (not "volunteerd is not running", 5)
    for too_long in ("8d", "7d1s", "604801"):
        assert cli(monkeypatch, tmp_path, "snooze", too_long) == 2
        assert capsys.readouterr().err == f"volunteerd: snooze {too_long}: at most 7 days\n"
    assert cli(monkeypatch, tmp_path, "snooze", "7d") == 5  # allowed: the daemon is asked
    assert "volunteerd is not running" in capsys.readouterr().err


@pytest.mark.parametrize(
    "field",
    ["upload_mbit", "download_mbit", "monthly_quota_gb", "daily_quota_gb", "disk_budget_gb"],
)
async def test_a_limit_of_minus_zero_is_zero(field: str) -> None:
    changed = LimitsChange.model_validate({field: -0.0}).changes()
    assert changed == {field: 0.0}
    assert math.copysign(1.0, changed[field]) == 1.0
    controls = _Echoing()
    code, _, reply = await ask(app_of(controls), "PATCH", "/api/v1/limits", body={field: -0.0})
    assert code == 200
    assert math.copysign(1.0, reply[field]) == 1.0  # echoed as 0.0, not -0.0
    assert math.copysign(1.0, getattr(controls.limits_changes[0], field)) == 1.0


@pytest.mark.parametrize("name", ["a/b", "", "..", "."])
def test_leaving_a_name_no_project_can_have_says_so_with_a_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, serving: Any, name: str
) -> None:
    # the daemon's static files answer such a path with 405 ("DELETE is not allowed")
    daemon = serving(TOKEN, (405, {"error": "DELETE is not allowed on /api/v1/projects/x"}))
    record(tmp_path / "data", url_of(daemon), os.getpid())
    assert cli(monkeypatch, tmp_path, "leave", name) == 2
    assert capsys.readouterr().err == (
        f"volunteerd: not in a project named {name!r} (see `volunteerd projects`)\n"
    )
    assert not any(method == "DELETE" for method, _, _ in daemon.seen)


# -- a failing handler ------------------------------------------------------------------


async def test_a_statistics_file_failing_is_a_json_500_naming_it_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="volunteerd.control.api"):
        code, _, error = await ask(app_of(_Controls()), "GET", "/api/v1/stats")
    assert code == 500
    assert error == {"error": "the daemon could not read its statistics file: disk I/O error"}
    logged = [r for r in caplog.records if r.name == "volunteerd.control.api"]
    assert [r.getMessage() for r in logged] == [
        "GET /api/v1/stats failed: the statistics file: disk I/O error"
    ]
    assert logged[0].exc_info is None


async def test_a_file_error_in_a_handler_is_a_json_500_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="volunteerd.control.api"):
        code, headers, error = await ask(
            app_of(_Controls()), "PATCH", "/api/v1/limits", body={"upload_mbit": 3}
        )
    assert code == 500
    assert error == {
        "error": "the daemon could not read or write a file: "
        "[Errno 28] No space left on device: 'limits.toml'"
    }
    assert headers["x-frame-options"] == "DENY"  # still through the guard
    logged = [r for r in caplog.records if r.name == "volunteerd.control.api"]
    assert [r.getMessage() for r in logged] == ["PATCH /api/v1/limits failed"]
    assert logged[0].exc_info is not None  # with its traceback


async def test_any_other_failure_in_a_handler_is_a_json_500_with_the_traceback_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Failing(_Controls):
        async def set_limits(self, change: LimitsChange) -> Any:
            raise LookupError("a bug")

    with caplog.at_level(logging.ERROR, logger="volunteerd.control.api"):
        code, headers, error = await ask(
            app_of(Failing()), "PATCH", "/api/v1/limits", body={"upload_mbit": 3}
        )
    assert code == 500
    assert headers["content-type"] == "application/json"
    assert "its log says why" in error["error"]
    assert "a bug" not in error["error"]
    logged = [r for r in caplog.records if r.name == "volunteerd.control.api"]
    assert [r.getMessage() for r in logged] == ["PATCH /api/v1/limits failed"]
    assert logged[0].exc_info is not None


def test_joining_through_a_unix_socket_address_is_a_one_line_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /unix/ takes all that follows as a file path: multiaddr's own error escaped. A
    # mistyped invitation is a bad argument: exit 2, not 3 ("invalid configuration").
    peer = "12D3KooWN2cK7Wt448ipDy2ZHnA1dhJcHcwcL4T48AvWZFauku7K"
    invitation = f"volunteerd://join/abc?owner={peer}&peer=%2Funix%2Fa%2Fp2p%2F{peer}"
    assert cli(monkeypatch, tmp_path, "join", invitation, "--yes") == 2
    err = capsys.readouterr().err
    assert err.startswith("volunteerd: not a valid invitation: the peer '/unix/a/p2p/")
    assert err.count("\n") == 1
    assert not (tmp_path / "data" / "projects.toml").exists()


class _Controls:
    """The part of ``Controls`` these tests reach."""

    events: Any = None

    def __init__(self) -> None:
        self.schedule_changes: list[ScheduleChange] = []

    async def set_limits(self, change: LimitsChange) -> Any:
        raise OSError(28, "No space left on device", "limits.toml")

    async def stats(self, since: float) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    async def set_schedule(self, change: ScheduleChange) -> ScheduleView:
        self.schedule_changes.append(change)
        raise AssertionError("a refused change reached the daemon")


class _Echoing(_Controls):
    """Applies a limits change by echoing it, as the daemon does."""

    def __init__(self) -> None:
        super().__init__()
        self.limits_changes: list[LimitsChange] = []

    async def set_limits(self, change: LimitsChange) -> LimitsView:
        self.limits_changes.append(change)
        now = {"upload_mbit": 1.0, "download_mbit": 1.0, "monthly_quota_gb": 1.0}
        return LimitsView(duty_cycle=1.0, max_batch_size=0, **{**now, **change.changes()})


def test_a_client_gone_mid_reply_is_not_logged_as_the_daemons_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Hypercorn logs "Error in ASGI Framework" with a traceback when its own task and
    the app's both write to the socket of a client that read its 413 and hung up (seen
    once in CI); other errors of the app still show."""
    import trio

    from volunteerd.control import server

    log = server._HTTP_LOG
    with caplog.at_level(logging.INFO, logger=log.name):
        for gone in (
            trio.BusyResourceError("another task is currently sending data on this SocketStream"),
            trio.BrokenResourceError(),
            ExceptionGroup("hypercorn", [trio.ClosedResourceError()]),
        ):
            try:
                raise gone
            except BaseException:
                log.exception("Error in ASGI Framework")
        try:
            raise ValueError("a bug of ours")
        except ValueError:
            log.exception("Error in ASGI Framework")
    shown = [r for r in caplog.records if r.name == log.name]
    assert len(shown) == 1
    assert shown[0].exc_info is not None
    assert isinstance(shown[0].exc_info[1], ValueError)


# -- a control.json that cannot be written -----------------------------------------


async def test_a_daemon_whose_control_json_cannot_be_written_serves_on_and_writes_it_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk at start: the ~50-byte control.json failed and the whole daemon
    exited (and systemd's restarts did the same, each time). The API serves on, says
    why the CLI cannot find it, and names itself once the file can be written."""
    import trio

    from volunteerd.control import server as control_server

    monkeypatch.setattr(control_server, "CONTROL_FILE_RETRY_S", 0.05)
    blocked = tmp_path / "data"
    blocked.write_text("a file where the folder should be: nothing can be written in it")
    control_file = blocked / "control.json"
    sock = control_server.bind_control(0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(
                functools.partial(
                    control_server.serve_control,
                    cast(Any, None),
                    sock=sock,
                    token_file=tmp_path / "api-token",
                    control_file=control_file,
                )
            )
            assert "cannot find this daemon until it can" in caplog.text
            health = await trio.to_thread.run_sync(
                lambda: urllib.request.urlopen(f"{url}/api/v1/health", timeout=10).status
            )
            assert health == 200
            blocked.unlink()
            blocked.mkdir()  # space again
            while not control_file.exists():  # noqa: ASYNC110 - the daemon's retry
                await trio.sleep(0.02)
            assert json.loads(control_file.read_text()) == {"url": url, "pid": os.getpid()}
            nursery.cancel_scope.cancel()
    assert not control_file.exists()  # removed on the way out, as before


async def test_a_file_name_that_is_not_utf8_never_makes_a_reply_fail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A path with a Latin-1 byte (a home on a UTF-8 system) reads as a surrogate,
    which UTF-8 cannot encode: after one reload error naming it, GET /api/v1/events
    answered 500 for good (a 35-line traceback a poll), and a failing limits change
    a bare "HTTP 500" in place of what failed."""
    from volunteerd.control.events import EventLog

    name = "/home/Jos\udce9/.local/share/volunteerd/limits.toml"

    class Damaged(_Controls):
        async def set_limits(self, change: LimitsChange) -> Any:
            raise OSError(5, "Input/output error", name)

    controls = Damaged()
    controls.events = EventLog()
    controls.events.post("error", f"{name}: not valid TOML")
    app = app_of(controls)
    code, _, found = await ask(app, "GET", "/api/v1/events", {"since": "0"})
    assert code == 200
    assert found["events"][0]["message"] == name + ": not valid TOML"  # the same surrogate
    code, _, error = await ask(app, "PATCH", "/api/v1/limits", body={"upload_mbit": 7})
    assert code == 500
    assert error["error"].endswith(f"[Errno 5] Input/output error: {name!r}")
    assert not [r for r in caplog.records if "non-finite" in r.getMessage()]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_stale_control_json_whose_pid_has_a_name_cut_inside_a_letter(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/proc/PID/stat read as UTF-8: a reused pid whose name the kernel cut at 15 bytes
    inside a letter made `volunteerd status`, `pause`, `dashboard` exit 1 with a
    UnicodeDecodeError, every login."""
    import shutil

    cut = tmp_path / ("a" * 14 + "é")
    shutil.copy(shutil.which("sleep") or "/bin/sleep", cut)
    program = subprocess.Popen([cut, "60"])
    try:
        record(tmp_path / "data", "http://127.0.0.1:9", program.pid)
        assert cli(monkeypatch, tmp_path, "status") == ExitCode.UNAVAILABLE
        assert capsys.readouterr().err.startswith("volunteerd: ")
    finally:
        program.kill()
        program.wait(10)
