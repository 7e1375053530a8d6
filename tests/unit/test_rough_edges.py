"""Issue 15's rough edges, in pure parts: the control port a second daemon takes,
limits kept per data folder (and moved there once), mistakes named as typed, and the
low priority (the process's own, and what the service files ask for)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from volunteerd.config import Config, Flag, load_config
from volunteerd.control.server import bind_control
from volunteerd.errors import ConfigError, ResourceUnavailable
from volunteerd.paths import Paths
from volunteerd.service.files import Launch, render


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"ok": True, "version": "0.1.0"}).encode()
        self.send_response(200 if self.path == "/api/v1/health" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def another_volunteerd() -> Iterator[int]:
    """A control API's health route on a port of its own: the port it holds."""
    server = HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_a_control_port_another_volunteerd_holds_gives_way_to_a_free_one(
    another_volunteerd: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    with bind_control(another_volunteerd) as sock:
        taken = sock.getsockname()
    assert taken[0] == "127.0.0.1"
    assert taken[1] not in (0, another_volunteerd)
    assert f"another volunteerd's control API uses port {another_volunteerd}" in caplog.text


def test_a_control_port_another_program_holds_is_a_clear_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ResourceUnavailable, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_control(port)


def test_limits_live_in_the_data_folder_and_an_old_file_moves_there_once(tmp_path: Path) -> None:
    config_file = tmp_path / "config" / "config.toml"
    first = Paths(config_file=config_file, data_dir=tmp_path / "a", cache_dir=tmp_path)
    second = Paths(config_file=config_file, data_dir=tmp_path / "b", cache_dir=tmp_path)
    assert first.limits_file == tmp_path / "a" / "limits.toml"
    assert first.schedule_file.parent == first.limits_file.parent
    assert not first.adopt_old_limits_file()  # nothing to move

    config_file.parent.mkdir()
    first.old_limits_file.write_text("[limits]\nupload_mbit = 7.0\n")
    assert first.adopt_old_limits_file()
    assert not first.old_limits_file.exists()
    assert load_config(config_file, env={}, run_time_dir=first.data_dir).limits.upload_mbit == 7
    # the other daemon sharing the config file keeps its own (none)
    assert not second.adopt_old_limits_file()
    assert load_config(config_file, env={}, run_time_dir=second.data_dir).limits.upload_mbit == 0


def test_a_data_folders_limits_are_not_replaced_by_an_old_file(tmp_path: Path) -> None:
    paths = Paths(config_file=tmp_path / "config.toml", data_dir=tmp_path / "d", cache_dir=tmp_path)
    paths.old_limits_file.write_text("[limits]\nupload_mbit = 1.0\n")
    paths.limits_file.parent.mkdir()
    paths.limits_file.write_text("[limits]\nupload_mbit = 2.0\n")
    assert not paths.adopt_old_limits_file()
    assert paths.limits_file.read_text() == "[limits]\nupload_mbit = 2.0\n"


@pytest.mark.parametrize(
    "text",
    [
        "# some other tool\n[limits]\nmax_open_files = 1024\n",
        "[limits]\nupload_mbit = -1\n",
        "[limits]\nupload_mbit = 1\n[network]\nport = 1\n",
        "limits = [",
        "",
    ],
    ids=["unknown-key", "bad-value", "other-section", "not-toml", "empty"],
)
def test_a_limits_file_that_is_not_volunteerds_stays_where_it_is(tmp_path: Path, text: str) -> None:
    # beside a --config file of another project: moved, then the daemon refused to start
    from volunteerd.cli import _adopt_old_limits
    from volunteerd.config.loading import check_limits_overlay

    paths = Paths(config_file=tmp_path / "config.toml", data_dir=tmp_path / "d", cache_dir=tmp_path)
    paths.old_limits_file.write_text(text)
    with pytest.raises(ConfigError):
        paths.adopt_old_limits_file(check_limits_overlay)
    (note,) = _adopt_old_limits(paths)
    assert note.startswith(f"{paths.old_limits_file} left where it is, not read: ")
    assert "\n" not in note
    assert paths.old_limits_file.read_text() == text
    assert not paths.limits_file.exists()
    config = load_config(paths.config_file, env={}, run_time_dir=paths.data_dir)
    assert config.limits.upload_mbit == 0


def test_errors_name_the_flag_the_user_typed() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, flags=[Flag("experts.uids", "ffn.[0:x]", "--experts ffn.[0:x]")])
    assert "experts.uids = 'ffn.[0:x]'" in str(info.value)
    assert "(flag --experts ffn.[0:x])" in str(info.value)
    # a flag wins over --set, as it always did
    config = load_config(
        None, env={}, overrides=["network.port=1"], flags=[Flag("network.port", 2, "--port 2")]
    )
    assert config.network.port == 2


_ID = "12D3KooWQvG1AFqZsbTjZxfLvS5oqHZHUJmBNRsPTVQ3MmWLKrnD"


@pytest.mark.parametrize(
    "peer",
    [
        "/ip4/1.2.3.4/tcp/1",
        "1.2.3.4:38400",
        "/ip4/1.2.3.4/tcp/1/p2p/",
        "/ip4/1.2.3.4/tcp/1/p2p/not-a-peer-id",
        # what the shape allowed but the network layer cannot use: a socket path takes
        # in the /p2p/ part, an unknown protocol, an IP out of range, not a peer id
        f"/unix/a/p2p/{_ID}",
        f"/foo/bar/p2p/{_ID}",
        f"/ip4/1.2.3.999/tcp/1/p2p/{_ID}",
        f"/ip4/1.2.3.4/tcp/1/p2p/{'1' * 44}",
        f"/ip4/1.2.3.4/tcp/1/ipfs/{_ID}",
    ],
)
def test_a_bootstrap_peer_must_end_in_its_peer_id(peer: str) -> None:
    with pytest.raises(ConfigError, match=r"/p2p/<peer id>"):
        load_config(None, env={}, flags=[Flag("network.bootstrap_peers", [peer], "--bootstrap")])
    with pytest.raises(ConfigError, match=r"reachability.relays = .*/p2p/<peer id>"):
        load_config(None, env={}, overrides=[f"reachability.relays=[{peer!r}]"])


def test_bootstrap_peers_as_peers_print_them_are_accepted() -> None:
    peers = [
        "/ip4/127.0.0.1/tcp/38400/p2p/12D3KooWQvG1AFqZsbTjZxfLvS5oqHZHUJmBNRsPTVQ3MmWLKrnD",
        "/dns4/boot.example.org/tcp/38400/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
    ]
    assert Config.model_validate({"network": {"bootstrap_peers": peers}}).network.bootstrap_peers
    config = Config.model_validate({"reachability": {"relays": peers}})
    assert config.reachability.relays == peers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_lowering_the_priority_reaches_nice_10_and_best_effort_7() -> None:
    # in a child process: lowering is one way, this test process must keep its own
    probe = (
        "import os; from volunteerd.detached import io_priority, lower_priority;"
        "done = lower_priority(); print(os.getpriority(os.PRIO_PROCESS, 0), io_priority(0), done)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("10 (2, 7) ['nice 10', 'I/O best-effort 7']"), out
    # never raised: a process at nice 15 stays there
    again = subprocess.run(
        ["nice", "-n", "15", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert again.startswith("15 "), again


def test_the_service_files_follow_the_priority_chosen() -> None:
    low = {f.name: f.content for f in render("linux", Launch(argv=("volunteerd",)))}
    unit = low["volunteerd.service"].decode()
    assert "\nNice=10\nIOSchedulingClass=best-effort\nIOSchedulingPriority=7\n" in unit
    normal = render("linux", Launch(argv=("volunteerd",), low_priority=False))[0].content.decode()
    assert "Nice=" not in normal
    assert "IOScheduling" not in normal
    plist = render("macos", Launch(argv=("volunteerd",)))[0].content.decode()
    assert "<key>LowPriorityIO</key>" in plist
    task = render("windows", Launch(argv=("volunteerd",)))[0].content.decode("utf-16-le")
    assert "<Priority>7</Priority>" in task  # below normal


def test_the_configuration_page_lists_every_section() -> None:
    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    table = page.split("## Sections", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE))
    sections = {name for name in Config.model_fields if name != "version"}
    assert sections - listed == set()
