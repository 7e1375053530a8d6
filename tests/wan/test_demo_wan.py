"""``volunteerd demo --wan``: every process in a host of its own, over emulated links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.conftest import cli_env
from volunteerd.testing.wan import wan_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not wan_available(), reason=wan_available().reason or "available"),
]

# Small and quick, but a real WAN: 10 ms each way per host (20 ms host to host),
# asymmetric links, a little loss.
PROFILE = """
description = "a quick test world"
[default]
delay_ms = 10
up_mbit = 20
down_mbit = 50
loss = 0.001
"""


def namespaces_of(owner: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in listed.stdout.splitlines() if f"wan{owner}w" in line]


@pytest.mark.timeout(420)
def test_demo_over_a_wan_runs_each_process_in_its_own_host(tmp_path: Path) -> None:
    profile = tmp_path / "quick.toml"
    profile.write_text(PROFILE)
    summary_path = tmp_path / "summary.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "volunteerd", "demo", "--wan", str(profile), "--steps", "4",
         "--nodes", "2", "--summary-json", str(summary_path)],
        env=cli_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=400)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 0, stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 4
    assert summary["skipped_steps"] == 0
    assert summary["expert_calls"] > 0
    hosts = summary["hosts"]
    assert set(hosts) == {"bootstrap", "node1", "node2", "trainer"}
    # Four processes, four network namespaces, none of them this test's own.
    namespaces = {host["netns"] for host in hosts.values()}
    assert len(namespaces) == 4
    assert os.stat("/proc/self/ns/net").st_ino not in namespaces
    assert 0 not in namespaces
    # The daemons announced the emulated hosts' addresses, and the trainer reached both.
    for name in ("node1", "node2"):
        (address,) = hosts[name]["multiaddrs"]
        assert address.startswith(f"/ip4/{hosts[name]['listen_host']}/tcp/")
        assert not address.startswith("/ip4/127.")
    assert not hosts["trainer"]["listen_host"].startswith("127.")
    # node1 hosts rows 0-1 of every grid, node2 rows 2-3: both answered the trainer.
    answered: Counter[str] = Counter()
    for uid, (calls, _failed, _tokens) in summary["experts"].items():
        answered[uid.split(".")[1]] += calls
    assert answered["0"] + answered["1"] > 0
    assert answered["2"] + answered["3"] > 0
    # The dashboards cannot be reached from outside the hosts: no browser link.
    assert "in a browser" not in stderr
    assert "ip netns exec" in stderr
    assert namespaces_of(process.pid) == []


def test_demo_over_an_unknown_profile_says_so(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "volunteerd", "demo", "--wan", "no-such-profile"],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "no-such-profile" in result.stderr
    assert "Traceback" not in result.stderr
