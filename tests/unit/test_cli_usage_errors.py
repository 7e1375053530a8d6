"""``volunteerd demo`` and ``volunteerd train``: a bad flag is a usage error (exit 2),
said in one line before anything starts; a bad address for the trainer's node, from a
flag or the experiment file, is a configuration error (exit 3), as for a daemon."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from volunteerd.cli import main
from volunteerd.errors import ExitCode


@pytest.fixture(autouse=True)
def _signal_handlers_kept() -> Iterator[None]:
    # a trainer takes SIGINT and SIGTERM; none may stay taken in the test process
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in kept.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_demo_steps_below_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], steps: str
) -> None:
    assert main(["demo", "--steps", steps]) == ExitCode.USAGE
    assert capsys.readouterr() == ("", f"volunteerd: --steps {steps}: at least 1\n")


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_train_steps_below_one_is_a_usage_error_not_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: str
) -> None:
    # -1 started a trainer, and 0 meant the experiment's training.steps
    experiment = tmp_path / "experiment.toml"
    experiment.write_text("")  # every default; no swarm to join, which is not reached
    argv = ["train", "--config", str(experiment), "--steps", steps]
    assert main(argv) == ExitCode.USAGE
    assert capsys.readouterr() == ("", f"volunteerd: --steps {steps}: at least 1\n")


@pytest.mark.parametrize("nodes", ["0", "-1", "5"])
def test_demo_nodes_outside_one_to_four_is_a_usage_error_before_starting(
    capsys: pytest.CaptureFixture[str], nodes: str
) -> None:
    # it printed "starting a local swarm of 0 daemons ...", then failed with exit 1
    assert main(["demo", "--nodes", nodes]) == ExitCode.USAGE
    assert capsys.readouterr() == ("", f"volunteerd: --nodes {nodes}: between 1 and 4\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trainers", "0"], "--trainers 0: at least 1"),
        (["--trainers", "-2"], "--trainers -2: at least 1"),
        (["--local", "--wan", "home"], "--local trains without a network: it cannot go with --wan"),
        (
            ["--local", "--trainers", "2"],
            "--local trains without a network: it cannot go with --trainers",
        ),
    ],
)
def test_demo_flags_that_cannot_work_are_usage_errors_before_starting(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["demo", *args]) == ExitCode.USAGE
    assert capsys.readouterr() == ("", f"volunteerd: {message}\n")


def test_limit_and_schedule_flags_are_read_from_text_as_the_api_reads_json() -> None:
    """The API's bodies are strict (a JSON true or "7" is refused); what is typed on
    the command line is text, read as numbers and words before the same checks."""
    import argparse

    from volunteerd.cli import UsageError, _limit_changes, _schedule_changes

    limits = {"up": "8", "down": "20.5", "quota": None, "daily_gb": None, "disk_gb": "0"}
    assert _limit_changes(argparse.Namespace(**limits, threads="2")) == {
        "upload_mbit": 8.0,
        "download_mbit": 20.5,
        "disk_budget_gb": 0.0,
        "cpu_threads": 2,
    }
    with pytest.raises(UsageError, match="--up eight: upload_mbit"):
        _limit_changes(argparse.Namespace(**{**limits, "up": "eight"}, threads=None))
    rules = {"run": "when_idle", "idle_minutes": "5", "on_battery": "no"}
    rules |= {"compute_hours": "22:00-07:00", "network_hours": None, "gpu": None}
    assert _schedule_changes(argparse.Namespace(**rules)) == {
        "run": "when_idle",
        "idle_minutes": 5.0,
        "on_battery": False,
        "compute_hours": ["22:00-07:00"],
    }


@pytest.mark.parametrize("command", ["serve", "bootstrap"])
def test_a_ready_file_that_cannot_be_written_is_a_usage_error_before_starting(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    # found only once the daemon was up: it stopped again (exit 5), a .tmp file left
    monkeypatch.setenv("VOLUNTEERD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("VOLUNTEERD_CACHE_DIR", str(tmp_path / "cache"))
    for ready, says in (
        (tmp_path, "is a folder; name a file in it"),
        (tmp_path / "nowhere" / "ready.json", f"there is no folder {tmp_path / 'nowhere'}"),
    ):
        assert main([command, "--port", "0", "--ready-file", str(ready)]) == ExitCode.USAGE
        assert capsys.readouterr().err == f"volunteerd: --ready-file {ready}: {says}\n"
    assert not (tmp_path / "data").exists()  # nothing started
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_ready_file_that_fails_to_be_written_leaves_no_tmp_file(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from volunteerd.cli import _write_ready_file

    node = SimpleNamespace(peer_id="p", multiaddrs=[])
    (tmp_path / "ready.json").mkdir()  # made a folder after the check
    with pytest.raises(OSError):
        _write_ready_file(tmp_path / "ready.json", SimpleNamespace(node=node, control_url=None))
    assert [p.name for p in tmp_path.iterdir()] == ["ready.json"]
    _write_ready_file(tmp_path / "ok.json", SimpleNamespace(node=node, control_url=None))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.json", "ready.json"]


@pytest.mark.parametrize(
    ("args", "in_file", "says"),
    [
        (["--bootstrap", "garbage"], [], "--bootstrap: not a peer's multiaddr: 'garbage': "),
        ([], ["garbage"], "swarm.bootstrap_peers in {file}: not a peer's multiaddr: 'garbage': "),
        (["--listen-host", "999.1.1.1"], ["{peer}"], "--listen-host: not an IP address: '999.1."),
    ],
)
def test_a_bad_address_for_the_trainers_node_is_a_config_error_naming_its_flag_or_key(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    in_file: list[str],
    says: str,
) -> None:
    # it was exit 1 and an 8-frame pydantic traceback from the node's config
    from volunteerd.identity import Identity
    from volunteerd.net.peers import peer_id_for

    monkeypatch.setattr("volunteerd.cli.configure_logging", lambda level: None)
    peer = f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id_for(Identity.generate())}"
    experiment = tmp_path / "experiment.toml"
    peers = ", ".join(f'"{p.format(peer=peer)}"' for p in in_file)
    experiment.write_text(f"[swarm]\nbootstrap_peers = [{peers}]\n")
    assert main(["train", "--config", str(experiment), *args]) == ExitCode.CONFIG
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"volunteerd: {says.format(file=experiment)}"), err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_summary_json_that_cannot_be_written_is_a_usage_error_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    # found only after the whole run: exit 5, and the summary lost
    experiment = tmp_path / "experiment.toml"
    experiment.write_text("")
    config = ["--config", str(experiment)] if command == "train" else []
    for summary, says in (
        (tmp_path, "is a folder; name a file in it"),
        (tmp_path / "nowhere" / "s.json", f"there is no folder {tmp_path / 'nowhere'}"),
    ):
        argv = [command, *config, "--summary-json", str(summary)]
        assert main(argv) == ExitCode.USAGE
        assert capsys.readouterr() == ("", f"volunteerd: --summary-json {summary}: {says}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["experiment.toml"]


def test_config_default_out_where_no_file_can_be_made_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a folder said "the file exists"; a missing folder or an empty name printed
    # "[Errno 2] No such file or directory" and exited 5, as if the daemon had failed
    (tmp_path / "file").write_text("")
    cases = {
        str(tmp_path): "is a folder; give the name of a new file in it",
        str(
            tmp_path / "nope" / "c.toml"
        ): f"the folder {tmp_path / 'nope'} does not exist; make it first",
        str(tmp_path / "file" / "c.toml"): f"{tmp_path / 'file'} is not a folder",
        str(tmp_path / "file"): "the file exists; give a new name or remove it first",
    }
    for out, why in cases.items():
        assert main(["config", "default", "--out", out]) == ExitCode.USAGE, out
        assert capsys.readouterr() == ("", f"volunteerd: --out {out}: {why}\n")
    assert main(["config", "default", "--out", ""]) == ExitCode.USAGE
    assert capsys.readouterr().err == (
        "volunteerd: --out: give the name of a new file, e.g. --out config.toml\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_config_default_out_without_permission_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # [Errno 13] Permission denied, exit 5; root may write anywhere but in /sys
    if os.geteuid() == 0:
        out = Path("/sys/c.toml")
        if os.access("/sys", os.W_OK) is False or not Path("/sys").is_dir():
            pytest.skip("root, and /sys is mounted read-only here")  # EROFS, not EACCES
    else:
        (tmp_path / "read-only").mkdir(mode=0o555)
        out = tmp_path / "read-only" / "c.toml"
    assert main(["config", "default", "--out", str(out)]) == ExitCode.USAGE
    assert capsys.readouterr() == (
        "",
        f"volunteerd: --out {out}: no permission to write there; choose a folder of yours\n",
    )
