"""A joined daemon follows its experiment's manifest: a newer one from the owner is
taken (its experts re-seated in the new shape), an expired one's experts are no longer
hosted, a lookup that fails changes nothing, and a join after the expiry says so.

A running daemon used to read the manifest once: after the owner published experts
twice as wide, it kept serving the old shapes under the same uids beside newcomers
serving the new ones, and it hosted an expired manifest for as long as it ran; after a
restart it was told "not found: are the bootstrap peers right?" (an outside probe).
Virtual time, a DHT in memory, real expert backends on the CPU."""

from __future__ import annotations

import json
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from tests.unit.test_activity import signals
from volunteerd.config import ExperimentsConfig, ExpertsConfig
from volunteerd.errors import ResourceUnavailable
from volunteerd.experts import ExpertBackend
from volunteerd.identity import Identity
from volunteerd.net import PeerAddress
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import ManifestRecord
from volunteerd.server.activity import Activity, decide_activity
from volunteerd.swarm.assignment import tie_break
from volunteerd.swarm.expiries import ManifestExpiries
from volunteerd.swarm.joiner import Joiner
from volunteerd.swarm.manifest import ExperimentManifest, sign_manifest

OWNER = Identity.generate()
OWNER_ID = str(peer_id_for(OWNER))
LIFETIME_S = 3600.0


class MemoryDHT:
    """The manifest lookups and replica lookups a joiner makes; storing peers drop a
    manifest once it expires, as ``net.store`` does."""

    def __init__(self) -> None:
        self.manifests: list[ManifestRecord] = []
        self.failing = False
        self.replicas: dict[str, list[Any]] = {}  # uid -> other daemons' records
        self.clock = types.SimpleNamespace(now=trio.current_time)  # the swarm's time, right

    async def get_manifests(self, name: str, owner: str | None = None) -> list[ManifestRecord]:
        await trio.lowlevel.checkpoint()
        if self.failing:
            raise OSError("network is unreachable")
        now = trio.current_time()
        return [
            r
            for r in self.manifests
            if r.name == name and owner in (None, r.owner) and r.expires_at > now
        ]

    async def get(self, uids: list[str]) -> dict[str, list[Any]]:
        await trio.lowlevel.checkpoint()
        return {uid: self.replicas.get(uid, []) for uid in uids}

    async def put_manifest(self, record: ManifestRecord) -> int:
        await trio.lowlevel.checkpoint()
        return 1


class Runtime:
    """The runtime calls a joiner makes, with the backends it hosts."""

    def __init__(self) -> None:
        self.backends: dict[str, ExpertBackend] = {}

    def make_backend(self, uid: str, experts: ExpertsConfig) -> ExpertBackend:
        return ExpertBackend(uid, experts, torch.device("cpu"), 1024)

    async def add_expert(self, backend: ExpertBackend) -> None:
        self.backends[backend.uid] = backend

    async def remove_expert(self, uid: str) -> ExpertBackend:
        return self.backends.pop(uid)


class NoDownloads:
    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> object:
        raise AssertionError("no replica to download from")

    async def discard(self, uid: str) -> None:
        pass


def publish(dht: MemoryDHT, hidden_dim: int, grid: tuple[int, ...]) -> ExperimentManifest:
    """The owner's manifest of "upd", issued now, in place of its older one."""
    now = trio.current_time()
    manifest = ExperimentManifest(
        name="upd",
        hidden_dim=hidden_dim,
        grid=grid,
        replication=1,
        owner=OWNER_ID,
        issued_at=now,
        expires_at=now + LIFETIME_S,
    )
    dht.manifests = [r for r in dht.manifests if r.owner != OWNER_ID]
    dht.manifests.append(sign_manifest(manifest, OWNER))
    return manifest


def joiner_of(
    dht: MemoryDHT,
    runtime: Runtime,
    expiries: ManifestExpiries,
    clock: Callable[[], float] | None = trio.current_time,
    **experiments: Any,
) -> Joiner:
    config = ExperimentsConfig(
        **{
            "join": "upd",
            "trusted_owners": [OWNER_ID],
            "rebalance_every_s": 10.0,
            "manifest_check_every_s": 60.0,
            "min_stay_s": 0.0,
            "join_timeout_s": 5.0,
            **experiments,
        }
    )
    return Joiner(
        types.SimpleNamespace(dht=dht, peer_id="me"),  # type: ignore[arg-type]
        runtime,  # type: ignore[arg-type]
        lambda: None,
        None,
        NoDownloads(),
        config,
        lambda experts: 8,
        expiries=expiries,
        **({} if clock is None else {"clock": clock}),  # None: the node's swarm clock
    )


def activity_of(joiner: Joiner) -> Activity:
    """What status says of a daemon in this project alone, well connected."""
    return decide_activity(
        signals(
            experts=0,
            projects=[joiner],
            port=None,
            last_answered_at=None,
            now=trio.current_time(),
        )
    )


def widths(runtime: Runtime) -> dict[str, int]:
    return {uid: b.info.hidden_dim for uid, b in runtime.backends.items()}


@pytest.mark.usefixtures("inline_threads")
async def test_a_newer_manifest_is_followed_and_an_expired_one_is_no_longer_hosted(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    dht, runtime = MemoryDHT(), Runtime()
    expiries = ManifestExpiries(tmp_path / "manifests.json")
    first = publish(dht, 16, (2,))
    joiner = joiner_of(dht, runtime, expiries)
    async with trio.open_nursery() as nursery:
        await nursery.start(joiner.serve)
        assert widths(runtime) == {"ffn.0": 16, "ffn.1": 16}

        await trio.sleep(30)
        second = publish(dht, 32, (4,))  # wider experts, a larger grid
        await trio.sleep(60)  # a lookup is due by then, and the rebalance that follows
        assert joiner.manifest == second
        # the same uids in the new shape only: none kept its old weights
        assert widths(runtime) == {f"ffn.{i}": 32 for i in range(4)}
        assert set(joiner.hosted) == set(second.uids())
        assert joiner.state == "joined"

        dht.failing = True  # the network goes: the experts stay
        await trio.sleep(300)
        assert set(joiner.hosted) == set(second.uids())
        assert (joiner.state, joiner.error) == ("joined", None)
        dht.failing = False

        await trio.sleep_until(second.expires_at + 30)  # the owner let it expire
        assert joiner.hosted == {}
        assert runtime.backends == {}
        assert joiner.manifest is None
        assert joiner.state == "failed"
        assert joiner.expired_at == second.expires_at
        assert "manifest expired on 1970-01-01" in (joiner.error or "")
        assert "its owner must publish it again" in (joiner.error or "")

        # published again: hosted again
        third = publish(dht, 32, (4,))
        await trio.sleep(75)  # looked up again at each check
        assert joiner.manifest == third
        assert set(joiner.hosted) == set(third.uids())
        assert (joiner.state, joiner.error, joiner.expired_at) == ("joined", None, None)
        nursery.cancel_scope.cancel()
    assert first.issued_at < second.issued_at < third.issued_at


@pytest.mark.usefixtures("inline_threads")
async def test_a_join_after_the_manifest_expired_says_so(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Kept across restarts: "not found, are the bootstrap peers right?" sent a volunteer
    with working peers to check the network."""
    dht, runtime = MemoryDHT(), Runtime()
    expiries = ManifestExpiries(tmp_path / "manifests.json")
    manifest = publish(dht, 16, (2,))
    with trio.CancelScope() as running:
        async with trio.open_nursery() as nursery:
            await nursery.start(joiner_of(dht, runtime, expiries).serve)
            running.cancel()  # the daemon stops
    assert json.loads((tmp_path / "manifests.json").read_text()) == {
        "upd": {OWNER_ID: manifest.expires_at}
    }
    await trio.sleep_until(manifest.expires_at + 1)

    restarted = joiner_of(dht, Runtime(), ManifestExpiries(tmp_path / "manifests.json"))
    with pytest.raises(ResourceUnavailable) as failed:
        await restarted.serve()
    assert str(failed.value) == (
        "the experiment's manifest expired on 1970-01-01 01:00 UTC; its owner must publish it again"
    )
    assert restarted.state == "failed"
    assert restarted.expired_at == manifest.expires_at
    activity = activity_of(restarted)
    assert activity.message == f"could not join upd: {restarted.error}"
    assert "internet" not in activity.hint
    assert "volunteerd leave upd" in activity.hint

    # a manifest never taken here, or one still valid: the network's hint as before
    other = joiner_of(dht, Runtime(), ManifestExpiries(tmp_path / "none.json"))
    with pytest.raises(ResourceUnavailable, match="was not found in the DHT"):
        await other.serve()


async def test_a_join_whose_experts_do_not_fit_is_not_blamed_on_the_network(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    # a project refused for the memory budget said "check the internet connection"
    from volunteerd.errors import ConfigError

    dht = MemoryDHT()
    publish(dht, 16, (2,))
    joiner = joiner_of(dht, Runtime(), ManifestExpiries(tmp_path / "manifests.json"))

    def too_big(experts: object) -> int:
        raise ConfigError("one expert of this experiment needs 480 MiB, more than the budget")

    joiner._capacity_of = too_big
    with pytest.raises(ConfigError):
        await joiner.serve()
    assert (joiner.state, joiner.too_big) == ("failed", True)
    activity = activity_of(joiner)
    assert activity.message == f"could not join upd: {joiner.error}"
    assert "internet" not in activity.hint
    assert "memory was freed" in activity.hint


def test_a_damaged_expiries_file_is_read_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "manifests.json"
    path.write_text('{"upd": {"a": "soon", "b": 5.0}, "x": [1]}')
    expiries = ManifestExpiries(path)
    assert expiries.expired_at("upd", ["a", "b"], now=10.0) == 5.0
    assert expiries.expired_at("upd", ["b"], now=4.0) is None  # still valid then
    path.write_text("not json")
    assert expiries.expired_at("upd", ["b"], now=10.0) is None
    expiries.remember("upd", "b", 7.0)
    assert expiries.expired_at("upd", ["b"], now=10.0) == 7.0


async def test_a_join_failing_for_the_same_reason_warns_once_not_every_minute(
    autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # an over-budget project logged the same WARNING every 60 s: 1,440 lines a day
    import logging

    from volunteerd.errors import ConfigError

    joiner = joiner_of(MemoryDHT(), Runtime(), ManifestExpiries(tmp_path / "manifests.json"))
    budget, available = "needs 480 MiB, more than the budget", "more than the memory available"
    # each attempt's outcome, a minute apart: it failed for this reason (after joining)
    script = [(budget, False)] * 6 + [(available, False)] * 2 + [(available, True)] * 2

    async def serve() -> None:
        reason, joined_first = script.pop(0)
        if joined_first:
            joiner.joins += 1
        raise ConfigError(reason)

    joiner.serve = serve  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG, logger="volunteerd.swarm.joiner")
    with trio.move_on_after(570):  # ten tries
        await joiner.keep_joining(60.0)
    assert script == []
    levels = [r.levelname for r in caplog.records if "could not join" in r.getMessage()]
    assert levels == (
        ["WARNING"] + ["DEBUG"] * 5  # the same reason: said once
        + ["WARNING", "DEBUG"]  # another reason: said once
        + ["WARNING", "WARNING"]  # it had joined since: news each time
    )  # fmt: skip


@pytest.mark.usefixtures("inline_threads")
async def test_a_wall_clock_jump_does_not_expire_a_manifest_the_swarm_holds_valid(
    autojump_clock: trio.abc.Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expiry is read on the node's swarm clock (``node.dht.clock``, which follows the
    peers where this computer's clock is off), not on ``time.time``: a wall clock set
    48 h ahead dropped the whole project within 2 s (an outside audit)."""
    dht, runtime = MemoryDHT(), Runtime()
    publish(dht, 16, (2,))
    joiner = joiner_of(dht, runtime, ManifestExpiries(tmp_path / "m.json"), clock=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(joiner.serve)
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + 48 * 3600)
        await trio.sleep(120)  # rounds and manifest checks
        assert (joiner.state, joiner.error) == ("joined", None)
        assert set(joiner.hosted) == {"ffn.0", "ffn.1"}
        nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("inline_threads")
async def test_a_project_dropped_while_the_clock_was_ahead_is_hosted_again_once_it_is_right(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """With the swarm's time itself ahead (too few peers to correct it), the manifest
    reads as expired and its experts are dropped; once the clock is set right, the next
    check (``manifest_check_every_s``, on the monotonic clock) takes it up again. On the
    wall clock the next check was 48 h away: the daemon stayed out that long."""
    ahead = [0.0]
    dht, runtime = MemoryDHT(), Runtime()
    manifest = publish(dht, 16, (2,))
    joiner = joiner_of(
        dht,
        runtime,
        ManifestExpiries(tmp_path / "m.json"),
        clock=lambda: trio.current_time() + ahead[0],
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(joiner.serve)
        ahead[0] = 48 * 3600
        await trio.sleep(16)
        assert (joiner.state, joiner.hosted) == ("failed", {})
        assert joiner.expired_at == manifest.expires_at
        ahead[0] = 0.0  # set right
        await trio.sleep(60 + 2 * 12)  # a check, then a round to add the experts
        assert (joiner.state, joiner.error, joiner.expired_at) == ("joined", None, None)
        assert set(joiner.hosted) == {"ffn.0", "ffn.1"}
        nursery.cancel_scope.cancel()


@pytest.mark.usefixtures("inline_threads")
async def test_a_clock_set_back_does_not_freeze_moves(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """How long an expert has been hosted is measured on the monotonic clock: started
    at wall time T and judged at T - 5 h, an expert "stayed" -5 h, and no expert moved
    for 5 h plus ``min_stay_s`` (an outside audit)."""
    back = [0.0]
    dht, runtime = MemoryDHT(), Runtime()
    publish(dht, 16, (4,))
    joiner = joiner_of(
        dht,
        runtime,
        ManifestExpiries(tmp_path / "m.json"),
        clock=lambda: trio.current_time() - back[0],
        min_stay_s=60.0,
    )
    joiner._capacity_of = lambda experts: 2
    async with trio.open_nursery() as nursery:
        await nursery.start(joiner.serve)
        first = set(joiner.hosted)
        assert len(first) == 2
        # another daemon, ranked to stay, hosts the same two; the other two have none
        other = next(
            f"p{i}"
            for i in range(1000)
            if all(tie_break(f"p{i}", uid) < tie_break("me", uid) for uid in first)
        )
        dht.replicas = {uid: [types.SimpleNamespace(peer_id=other, addrs=[])] for uid in first}
        back[0] = 5 * 3600
        await trio.sleep(60 + 2 * 12)  # past min_stay_s, and a round
        assert set(joiner.hosted) == {"ffn.0", "ffn.1", "ffn.2", "ffn.3"} - first
        nursery.cancel_scope.cancel()
