"""Training goes on when a volunteer's machine dies in the middle of it."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from torch import nn

from volunteerd.moe import RemoteMixtureOfExperts, SwarmClient
from volunteerd.testing import local_config

# Each test starts volunteerd as a process (most, a daemon or a swarm of them).
pytestmark = pytest.mark.slow

HIDDEN = 16
SMALL = ["--set", f"experts.hidden_dim={HIDDEN}", "--set", 'runtime.device="cpu"']
FAST_DHT = ["--set", "dht.announce_period_s=1", "--set", "dht.record_ttl_s=3"]


@pytest.mark.timeout(400)  # four processes start at once: slow on a loaded machine
def test_training_survives_a_killed_daemon(spawn) -> None:  # type: ignore[no-untyped-def]
    boot = spawn("boot", "bootstrap").wait_ready()
    servers = [
        spawn(f"s{i}", "serve", "--experts", f"ffn.{i}.[0:3]",
              "--bootstrap", boot["multiaddrs"][0], *SMALL, *FAST_DHT)
        for i in range(3)
    ]  # fmt: skip
    infos = [s.wait_ready() for s in servers]
    forward_timeout_s, grace_s = 3.0, 0.1

    torch.manual_seed(0)
    with SwarmClient(local_config(bootstrap=boot["multiaddrs"]), ban_s=120) as client:
        moe = RemoteMixtureOfExperts(
            HIDDEN, (3, 3), "ffn.", k_best=2, k_min=1,
            forward_timeout_s=forward_timeout_s, backward_timeout_s=forward_timeout_s,
            grace_after_k_min_s=grace_s, client=client,
        )  # fmt: skip
        head = nn.Linear(HIDDEN, 1)
        optimizer = torch.optim.Adam([*moe.parameters(), *head.parameters()], lr=1e-2)
        x, target = torch.randn(64, HIDDEN), torch.randn(64, 1)

        def step() -> tuple[float, int, set[str]]:
            before_failed = moe.stats.failed
            counts_before = {uid: sum(v[:2]) for uid, v in moe.stats.by_uid.items()}
            start = time.perf_counter()
            loss = nn.functional.mse_loss(head(moe(x)), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            elapsed = time.perf_counter() - start
            called = {
                uid for uid, v in moe.stats.by_uid.items() if sum(v[:2]) > counts_before.get(uid, 0)
            }
            return elapsed, moe.stats.failed - before_failed, called

        for _ in range(3):
            _, failed, called = step()
            assert failed == 0
        assert any(uid.startswith("ffn.1.") for uid in moe.stats.by_uid), "row 1 was in use"

        servers[1].stop(signal.SIGKILL)
        # (how long that step waits for the dead daemon — at most the forward timeout —
        # is measured by benchmarks/churn.py: a wall-clock bound here failed in CI on a
        # loaded machine; the test's own timeout catches a step that hangs)
        _, failed, _ = step()
        assert failed >= 1, "the dead daemon's experts failed and were counted"
        assert moe.stats.failed == failed

        for _ in range(4):  # from the next step on, the dead daemon is not chosen
            _, failed, called = step()
            assert failed == 0
            assert not any(uid.startswith("ffn.1.") for uid in called), called
        assert infos[1]["peer_id"] in client.directory.banned
    for server in (servers[0], servers[2]):
        assert server.process.poll() is None
