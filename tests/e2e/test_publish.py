"""``volunteerd publish`` as an owner runs it, and daemons joining what was published:
one that trusts the owner serves a share of the experts, one that trusts nobody exits 3
naming the owner, one that trusts someone else exits 5 without naming anyone."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.e2e.conftest import run_cli
from volunteerd.errors import ExitCode
from volunteerd.swarm.invitation import Invitation, parse_invitation

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow

MANIFEST = """\
name = "e2e-demo"
description = "An end-to-end test's experiment"
owner_name = "The e2e suite"
homepage = "https://example.org/e2e"
hidden_dim = 16
uid_prefix = "ffn"
grid = [2, 2]
replication = 1
seed = 3
lifetime_days = 1
"""
LOCAL = ["--set", 'network.listen_host="127.0.0.1"']


def test_publish_then_a_trusting_daemon_joins_and_a_distrustful_one_exits_3(
    spawn, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap")
    address = boot.wait_ready()["multiaddrs"][0]
    owner_home = tmp_path / "owner"
    owner_id = run_cli(owner_home, "id").stdout.strip()
    manifest = tmp_path / "experiment.toml"
    manifest.write_text(MANIFEST)

    published = run_cli(owner_home, "publish", str(manifest), "--bootstrap", address, *LOCAL)
    assert published.returncode == ExitCode.OK, published.stderr
    assert f"owner: {owner_id}" in published.stdout
    assert "published experiment 'e2e-demo' (4 experts" in published.stdout
    assert "Helping: An end-to-end test's experiment by The e2e suite" in published.stdout
    # The invitation is a line of its own, naming the owner and the peer published through.
    (line,) = [x for x in published.stdout.splitlines() if x.startswith("volunteerd://join/")]
    assert parse_invitation(line) == Invitation("e2e-demo", owner_id, (address,))
    assert "must stay up" in published.stdout

    join = ["--set", "experiments.join=e2e-demo", "--set", "experiments.max_experts=2"]
    join += ["--set", 'runtime.device="cpu"', "--bootstrap", address]
    trusting = spawn(
        "trusting", "serve", *join, "--set", f'experiments.trusted_owners=["{owner_id}"]'
    )
    trusting.wait_ready()
    assert "joined experiment 'e2e-demo'" in trusting.log.read_text()
    assert "hosting 2 experts" in trusting.log.read_text()

    # Two daemons side by side (each start takes a while):
    # trusting nobody yet: exits 3 and names the owner it found, as a hint;
    distrustful = spawn("distrustful", "serve", *join)
    # trusting someone else: strangers' manifests are never suggested (anyone can
    # publish under any name); not found from a trusted owner, exit 5.
    stranger = run_cli(tmp_path / "stranger", "id").stdout.strip()
    elsewhere = spawn(
        "elsewhere", "serve", *join, "--set", f'experiments.trusted_owners=["{stranger}"]',
        "--set", "experiments.join_timeout_s=3",
    )  # fmt: skip

    assert distrustful.process.wait(60) == ExitCode.CONFIG
    log = distrustful.log.read_text()
    assert owner_id in log
    assert "experiments.trusted_owners" in log

    assert elsewhere.process.wait(60) == ExitCode.UNAVAILABLE
    log = elsewhere.log.read_text()
    assert owner_id not in log
    assert "trusted owner" in log

    assert trusting.stop(signal.SIGTERM) == ExitCode.INTERRUPTED
    assert boot.stop(signal.SIGINT) == ExitCode.INTERRUPTED


def test_publish_without_a_peer_is_a_config_error(tmp_path: Path) -> None:
    manifest = tmp_path / "experiment.toml"
    manifest.write_text(MANIFEST)
    result = run_cli(tmp_path / "owner", "publish", str(manifest))
    assert result.returncode == ExitCode.CONFIG
    assert "--bootstrap" in result.stderr


def test_publish_through_a_peer_that_cannot_be_in_an_invitation_stores_nothing(
    tmp_path: Path,
) -> None:
    manifest = tmp_path / "experiment.toml"
    manifest.write_text(MANIFEST)
    result = run_cli(
        tmp_path / "owner", "publish", str(manifest),
        "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
    )  # fmt: skip
    assert result.returncode == ExitCode.CONFIG
    assert "invitation" in result.stderr
    assert "Ed25519" in result.stderr
