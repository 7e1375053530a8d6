"""The command line as a user runs it: config commands, exit codes, the daemon's life."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import trio

from tests.e2e.conftest import run_cli
from volunteerd.errors import ExitCode
from volunteerd.testing import local_config, open_peer

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow

FAST_DHT = ["--set", "dht.announce_period_s=1", "--set", "dht.record_ttl_s=2"]
SMALL = ["--set", "experts.hidden_dim=32", "--set", 'runtime.device="cpu"']


def test_config_path_show_and_validate(tmp_path: Path) -> None:
    path = run_cli(tmp_path, "config", "path")
    assert path.returncode == 0
    assert path.stdout.strip() == str(tmp_path / "config.toml")
    (tmp_path / "config.toml").write_text("[network]\nport = 4001\n")
    shown = run_cli(tmp_path, "config", "show", "--set", "experts.hidden_dim=64")
    assert shown.returncode == 0
    assert "port = 4001" in shown.stdout
    assert "hidden_dim = 64" in shown.stdout
    ok = run_cli(tmp_path, "config", "validate")
    assert ok.returncode == 0
    assert "valid" in ok.stdout


def test_invalid_config_exits_3_naming_key_and_value(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('[network]\nport = 99999\n[experts]\ntype = "rnn"\n')
    result = run_cli(tmp_path, "config", "validate")
    assert result.returncode == ExitCode.CONFIG
    assert "network.port = 99999" in result.stderr
    assert "experts.type = 'rnn'" in result.stderr
    served = run_cli(tmp_path, "serve")
    assert served.returncode == ExitCode.CONFIG
    assert "network.port" in served.stderr


def test_bad_command_line_is_a_usage_error(tmp_path: Path) -> None:
    assert run_cli(tmp_path, "serve", "--port", "many").returncode == ExitCode.USAGE
    assert run_cli(tmp_path, "frobnicate").returncode == ExitCode.USAGE
    bad_peer = run_cli(tmp_path, "serve", "--bootstrap", "/ip4/127.0.0.1/tcp/1")
    assert bad_peer.returncode == ExitCode.CONFIG
    assert "/p2p/" in bad_peer.stderr


def test_peer_id_is_stable_across_runs(tmp_path: Path) -> None:
    first = run_cli(tmp_path, "id")
    second = run_cli(tmp_path, "id")
    assert first.returncode == 0
    assert first.stdout == second.stdout
    assert first.stdout.startswith("12D3KooW")
    assert (tmp_path / "data" / "identity.key").stat().st_mode & 0o777 == 0o600


def test_daemon_serves_stops_on_sigterm_and_its_experts_vanish(spawn) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap")
    boot_info = boot.wait_ready()
    # Records that would live a minute: only the withdrawal can remove them at once.
    server = spawn(
        "server", "serve", "--experts", "ffn.0.[0:2]", "--bootstrap", boot_info["multiaddrs"][0],
        "--set", "dht.announce_period_s=1", "--set", "dht.record_ttl_s=60", *SMALL,
    )  # fmt: skip
    server_info = server.wait_ready()

    async def lookup() -> list[str]:
        async with open_peer(local_config(bootstrap=boot_info["multiaddrs"])) as client:
            return [p.peer_id for p in await client.dht.find_expert("ffn.0.1")]

    assert trio.run(lookup) == [server_info["peer_id"]]
    started = time.monotonic()
    assert server.stop(signal.SIGTERM) == ExitCode.INTERRUPTED
    # Bounded by timeouts.shutdown_grace_s (5 s), not hung; generous for a busy machine.
    assert time.monotonic() - started < 30, "a clean stop is bounded by its grace"
    assert "withdrew 2 experts" in server.log.read_text()
    assert trio.run(lookup) == []
    assert boot.stop(signal.SIGINT) == ExitCode.INTERRUPTED


def test_killed_daemon_vanishes_within_two_refresh_periods(spawn) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap")
    boot_info = boot.wait_ready()
    server = spawn(
        "server", "serve", "--experts", "ffn.0.0", "--bootstrap", boot_info["multiaddrs"][0],
        *FAST_DHT, *SMALL,
    )  # fmt: skip
    server.wait_ready()

    async def time_until_gone() -> float:
        async with open_peer(local_config(bootstrap=boot_info["multiaddrs"])) as client:
            assert len(await client.dht.find_expert("ffn.0.0")) == 1
            server.stop(signal.SIGKILL)  # no goodbye: only expiry can remove it
            killed = time.monotonic()
            while await client.dht.find_expert("ffn.0.0"):  # noqa: ASYNC110 - polling a remote
                await trio.sleep(0.1)
            return time.monotonic() - killed

    gone_after_s = trio.run(time_until_gone)
    # Records live record_ttl_s (2 s); a record still found after ten times that was
    # refreshed by something (the exact expiry is tested with a fake clock in
    # tests/unit/test_records.py). Generous: lookups are slow on a busy machine.
    assert gone_after_s <= 20.0, gone_after_s


def test_a_second_daemon_on_the_same_port_or_data_dir_is_refused(spawn, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    first = spawn("first", "serve", "--experts", "ffn.0.0", *SMALL)
    info = first.wait_ready()
    port = info["multiaddrs"][0].split("/tcp/")[1].split("/")[0]

    same_port = run_cli(
        tmp_path / "other", "serve", "--listen-host", "127.0.0.1", "--port", port, *SMALL
    )
    assert same_port.returncode == ExitCode.UNAVAILABLE
    assert f"cannot listen on 127.0.0.1:{port}" in same_port.stderr

    same_dir = run_cli(
        tmp_path / "first", "serve", "--listen-host", "127.0.0.1", "--port", "0", *SMALL
    )
    assert same_dir.returncode == ExitCode.UNAVAILABLE
    assert "another volunteerd is using" in same_dir.stderr
    assert first.process.poll() is None, "the first daemon keeps running"
    assert first.stop() == ExitCode.INTERRUPTED


def test_daemon_log_has_no_third_party_noise(spawn) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap")
    boot.wait_ready()
    # A bootstrap peer that is not there: py-libp2p logs dial errors on its own.
    dead = "/ip4/127.0.0.1/tcp/1/p2p/" + boot.wait_ready()["peer_id"]
    server = spawn("server", "serve", "--experts", "ffn.0.0", "--bootstrap", dead, *SMALL)
    server.wait_ready()
    assert server.stop() == ExitCode.INTERRUPTED
    lines = [line for line in server.log.read_text().splitlines() if line.strip()]
    assert lines, "the daemon logs something"
    for line in lines:
        # Every line is ours: "HH:MM:SS LEVEL volunteerd.<module>: message"
        assert " volunteerd." in line[:40], line
    assert any("bootstrap peer" in line and "did not answer" in line for line in lines)


def test_output_a_console_cannot_encode_is_escaped_not_a_traceback(tmp_path: Path) -> None:
    """An em dash on a Latin-1 console (LC_ALL=de_DE.ISO-8859-1) and a file name that
    is not UTF-8 (a Latin-1 home on a UTF-8 system) raised UnicodeEncodeError: a
    traceback for `volunteerd status`, `config default`, `paths`."""
    import subprocess
    import sys

    from tests.e2e.conftest import cli_env

    data_dir = tmp_path / "Jos\udce9 — data"  # the byte 0xe9, as Python reads it
    result = subprocess.run(
        [sys.executable, "-m", "volunteerd", "paths", "--data-dir", str(data_dir)],
        env={**cli_env(tmp_path), "PYTHONIOENCODING": "latin-1"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode("latin-1")
    assert b"Jos\\udce9 \\u2014 data" in result.stdout
    default = run_cli(tmp_path, "config", "default")
    assert default.returncode == 0
    assert default.stdout.isascii()  # what `>` writes in any code page


def test_config_default_out_writes_utf8_and_never_over_a_file(tmp_path: Path) -> None:
    """On Windows `volunteerd config default > config.toml` wrote the console's code
    page, which the daemon then refused: --out writes UTF-8, and only a new file."""
    out = tmp_path / "new config.toml"
    (tmp_path / "config.toml").write_text("[network\n")  # damaged: needs no valid config
    written = run_cli(tmp_path, "config", "default", "--out", str(out))
    assert written.returncode == 0, written.stderr
    assert written.stdout == ""
    assert out.read_bytes() == run_cli(tmp_path, "config", "default").stdout.encode()
    assert run_cli(tmp_path, "config", "validate", "--config", str(out)).returncode == 0
    again = run_cli(tmp_path, "config", "default", "--out", str(out))
    assert again.returncode == ExitCode.USAGE
    assert "the file exists" in again.stderr


def test_a_reader_that_stops_early_ends_the_output_quietly(tmp_path: Path) -> None:
    """`volunteerd status | head -1` printed "volunteerd: [Errno 32] Broken pipe" and
    exited 5 (or 120, "Exception ignored", when the pipe broke at exit)."""
    import os
    import subprocess
    import sys

    from tests.e2e.conftest import cli_env

    read_end, write_end = os.pipe()
    os.close(read_end)  # `head` has read its line and gone
    try:
        result = subprocess.run(
            [sys.executable, "-m", "volunteerd", "paths"],
            env=cli_env(tmp_path),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 128 + signal.SIGPIPE  # as a C program killed by SIGPIPE


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_daemon_started_with_closed_standard_streams_gets_the_null_device(
    tmp_path: Path,
) -> None:
    """`serve <&- >&- 2>&-` started with descriptor 0 = the data folder's lock file and
    2 = a socket: what was written to standard error went to a peer."""
    import os
    import subprocess
    import sys

    from tests.e2e.conftest import cli_env

    ready = tmp_path / "ready.json"
    process = subprocess.Popen(
        ["sh", "-c", 'exec "$0" "$@" <&- >&- 2>&-', sys.executable, "-m", "volunteerd",
         "serve", "--listen-host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
         *SMALL],
        env=cli_env(tmp_path),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180  # a hang guard: torch's import on a busy machine
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), f"exited {process.poll()} or not ready"
        opened = [os.readlink(f"/proc/{process.pid}/fd/{fd}") for fd in (0, 1, 2)]
        assert opened == [os.devnull] * 3
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(90) == ExitCode.INTERRUPTED  # as for any SIGTERM
