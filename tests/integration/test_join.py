"""Joining a published experiment: daemons with no experts configured choose a share of
the grid between them, a latecomer downloads its experts' current state from replicas,
and an experiment signed by an untrusted owner is refused."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd.config import Config
from volunteerd.control.client import ControlClient
from volunteerd.daemon import Running
from volunteerd.errors import DaemonNotRunning, ResourceUnavailable, UntrustedManifest
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import CheckpointHeader, ExpertState, encode_checkpoint
from volunteerd.identity import Identity
from volunteerd.net import Verb
from volunteerd.net.peers import peer_id_for
from volunteerd.net.records import StoreReply, StoreRequest, sign_record
from volunteerd.swarm.manifest import ExperimentManifest, sign_manifest
from volunteerd.testing import local_config, open_daemon, open_peer

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

NAME = "join-test"
GRID = (4, 4)
REPLICATION = 2
CAPACITY = 6  # 3 daemons x 6 = 18 places for 16 experts


def make_manifest(
    owner: Identity, grid: tuple[int, int] = GRID, replication: int = REPLICATION
) -> ExperimentManifest:
    now = time.time()
    return ExperimentManifest(
        name=NAME,
        hidden_dim=16,
        uid_prefix="ffn",
        grid=grid,
        replication=replication,
        seed=7,
        owner=str(peer_id_for(owner)),
        issued_at=now,
        expires_at=now + 3600,
    )


def joining_config(bootstrap: list[str], trusted: list[str], **experiments: Any) -> Config:
    return local_config(
        bootstrap=bootstrap,
        experiments={
            "join": NAME,
            "trusted_owners": trusted,
            "max_experts": CAPACITY,
            "rebalance_every_s": 2.0,
            "min_stay_s": 0.0,
            "join_timeout_s": 10.0,
            **experiments,
        },
        # No averaging: the weights stay exactly what the test makes them.
        replicas={"enabled": False},
        # Announcements outlive a round or two that fails on a busy machine.
        dht={"record_ttl_s": 10.0},
    )


def hosted(running: Running) -> set[str]:
    (joiner,) = running.joiners  # experiments.join: one project
    return set(joiner.hosted)


def payload_sha256(backend: ExpertBackend) -> str:
    """The checkpoint hash of an expert's state (weights and optimizer state)."""
    return payload_sha256_of(backend.state())


def weights_sha256(backend: ExpertBackend) -> str:
    """The hash of an expert's weights and update count: what a newcomer takes from a
    replica (its optimizer starts afresh)."""
    state = backend.state()
    state.optimizer_state = {}
    return payload_sha256_of(state)


def payload_sha256_of(state: ExpertState) -> str:
    raw = bytes(encode_checkpoint(state, saved_at=0.0)[1])
    return CheckpointHeader.model_validate_json(raw).payload_sha256


def train_once(backend: ExpertBackend) -> None:
    """One optimizer step, so the weights leave the seed and Adam has state."""
    x = torch.randn(4, backend.info.hidden_dim)
    backend.backward([x], [torch.randn(4, backend.info.hidden_dim)])
    backend.step()


async def settled(daemons: list[Running], all_uids: set[str]) -> list[set[str]]:
    """The daemons' choices once they cover every expert and stop changing (the same
    for four re-balancing rounds)."""
    last: list[set[str]] = []
    since = trio.current_time()
    with trio.fail_after(40):
        while True:
            now = [hosted(d) for d in daemons]
            if now != last:
                last, since = now, trio.current_time()
            elif set().union(*now) == all_uids and trio.current_time() - since >= 2.0:
                return now
            await trio.sleep(0.1)


async def test_three_joiners_cover_the_grid_and_a_latecomer_downloads_from_replicas(
    tmp_path: Path,
) -> None:
    owner = Identity.generate()
    manifest = make_manifest(owner)
    all_uids = set(manifest.uids())
    started = time.perf_counter()
    async with open_peer(local_config()) as boot:
        assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
        config = joining_config(boot.multiaddrs, [manifest.owner])
        daemons: list[Running] = []
        stop, all_started = trio.Event(), trio.Event()

        async def serve(index: int) -> None:
            async with open_daemon(config, tmp_path / f"d{index}") as running:
                daemons.append(running)
                if len(daemons) == 3:
                    all_started.set()
                await stop.wait()

        async with trio.open_nursery() as nursery:
            # The three start together: each first sees an empty swarm.
            for i in range(3):
                nursery.start_soon(serve, i)
            with trio.fail_after(30):
                await all_started.wait()
            first_choice = [hosted(d) for d in daemons]
            sets = await settled(daemons, all_uids)
            settled_s = time.perf_counter() - started
            pairs = [(a, b) for i, a in enumerate(first_choice) for b in first_choice[i + 1 :]]
            overlaps = [len(a & b) for a, b in pairs]
            print(f"first choices overlap pairwise: {overlaps}")
            print(f"covered all {len(all_uids)} experts after {settled_s:.1f}s; sets {sets}")
            assert all(len(s) == CAPACITY for s in sets)
            assert len({frozenset(s) for s in first_choice}) == 3
            assert len({frozenset(s) for s in sets}) == 3
            assert all(len(a & b) < CAPACITY for i, a in enumerate(sets) for b in sets[i + 1 :])
            counts = Counter(u for s in sets for u in s)

            # Every replica trains a step: their state is no longer the seed's.
            for d in daemons:
                for uid in hosted(d):
                    await d.runtime.with_expert(uid, train_once)
            # Wait until a third party's lookup finds every replica, before the latecomer.
            with trio.fail_after(30):
                while True:
                    found = await boot.dht.get(sorted(all_uids))
                    hosts = {
                        u: {d.node.peer_id for d in daemons if u in hosted(d)} for u in all_uids
                    }
                    if all(hosts[u] <= {r.peer_id for r in found[u]} for u in all_uids):
                        break
                    await trio.sleep(config.dht.announce_period_s / 2)

            async with open_daemon(config, tmp_path / "late") as late:
                taken = hosted(late)
                print(f"latecomer took {sorted(taken)}; replicas before {dict(counts)}")
                assert len(taken) == CAPACITY
                # The least served, as the latecomer saw them: a replica whose ``info``
                # check failed (a connection that broke under load) counts as none for
                # a while, by design (an expert looks less served, never more). One CI
                # run saw an expert of 3 replicas taken so; allowed only when explained.
                checks = late.joiners[0]._checks
                assert checks is not None
                failed = {uid for _, uid in checks._failed}
                over = {uid for uid in taken if counts[uid] != min(counts.values())}
                assert over <= failed, (over, failed)
                owners = {uid: d for d in daemons for uid in hosted(d)}
                for uid in taken:
                    source = late.joiners[0].sources[uid]
                    assert source.startswith("replica "), (uid, source)
                    peer = source.removeprefix("replica ")
                    replica = next(d for d in daemons if d.node.peer_id == peer)
                    assert uid in hosted(replica), (uid, owners[uid].node.peer_id)
                    theirs = await replica.runtime.with_expert(uid, weights_sha256)
                    mine = await late.runtime.with_expert(uid, weights_sha256)
                    assert mine == theirs, uid
                    seeded = ExpertBackend(uid, manifest.experts_config(), torch.device("cpu"), 16)
                    assert weights_sha256(seeded) != mine  # not merely the same seed
                print(f"whole test {time.perf_counter() - started:.1f}s")
            stop.set()


async def test_fake_replicas_do_not_make_an_expert_look_served(tmp_path: Path) -> None:
    """Two experts, room for one on each daemon. A hosts one of them; three identities
    with no server behind them announce the other. The newcomer B must count only
    replicas that answer for their uid and host the expert nobody serves (counting
    records, it took the one A serves: "3 replicas" against 1)."""
    owner = Identity.generate()
    manifest = make_manifest(owner, grid=(1, 2), replication=1)
    async with (
        open_peer(local_config()) as boot,
        open_peer(local_config(bootstrap=[])) as attacker,
    ):
        assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
        config = joining_config(boot.multiaddrs, [manifest.owner], max_experts=1)
        async with open_daemon(config, tmp_path / "a") as a:
            (served,) = hosted(a)
            (unserved,) = set(manifest.uids()) - {served}
            fakes = [Identity.generate() for _ in range(3)]
            records = [
                sign_record(
                    f, str(peer_id_for(f)), key=unserved, addrs=["/ip4/127.0.0.1/tcp/9"], ttl_s=600
                )
                for f in fakes
            ]
            reply, _ = await attacker.rpc.call(
                boot.address, Verb.DHT_STORE, StoreRequest(records=records)
            )
            assert isinstance(reply, StoreReply)
            assert reply.stored == 3
            with trio.fail_after(30):  # A's own record is found too before B joins
                while True:
                    found = (await boot.dht.get([served]))[served]
                    if {r.peer_id for r in found} == {a.node.peer_id}:
                        break
                    await trio.sleep(0.2)
            async with open_daemon(config, tmp_path / "b") as b:
                assert hosted(b) == {unserved}
                (joiner,) = b.joiners
                assert joiner.sources[unserved] == "seed"  # the fakes had nothing to give
                assert hosted(a) == {served}


async def test_daemon_refuses_a_manifest_signed_by_an_untrusted_key(tmp_path: Path) -> None:
    owner, trusted = Identity.generate(), Identity.generate()
    manifest = make_manifest(owner)
    async with open_peer(local_config()) as boot:
        assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
        # No owner trusted yet: the error names who published, as a hint.
        config = joining_config(boot.multiaddrs, [])
        with pytest.raises(BaseException) as info:
            async with open_daemon(config, tmp_path / "d"):
                pass
        error = _find(info.value, UntrustedManifest)
        assert error is not None, info.value
        message = str(error)
        assert manifest.owner in message
        assert "experiments.trusted_owners" in message

        # An owner is trusted: strangers' manifests (anyone can publish under any name)
        # are neither used nor suggested; the daemon says it found no trusted one.
        config = joining_config(boot.multiaddrs, [str(peer_id_for(trusted))], join_timeout_s=3.0)
        with pytest.raises(BaseException) as info:
            async with open_daemon(config, tmp_path / "e"):
                pass
        unavailable = _find(info.value, ResourceUnavailable)
        assert unavailable is not None, info.value
        assert "trusted owner" in str(unavailable)
        assert manifest.owner not in str(unavailable)


async def test_the_control_api_answers_while_the_configs_experiment_is_joined(
    tmp_path: Path,
) -> None:
    """With ``experiments.join`` in the config the control API started only once the
    join was done: during a long join (the manifest not found yet, up to
    ``join_timeout_s``) `volunteerd status` said the daemon was not running. It answers
    now, the project "joining"; the start completes once the manifest is found."""
    owner = Identity.generate()
    data_dir = tmp_path / "d"
    async with open_peer(local_config()) as boot:
        config = joining_config(boot.multiaddrs, [str(peer_id_for(owner))], join_timeout_s=60.0)
        started = trio.Event()
        hosting: list[set[str]] = []

        async def run_daemon() -> None:
            async with open_daemon(config, data_dir) as running:
                hosting.append(hosted(running))
                started.set()
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_daemon)
            status = None
            with trio.fail_after(60):
                while status is None:
                    await trio.sleep(0.2)
                    try:
                        client = ControlClient.for_data_dir(data_dir)
                        status = await trio.to_thread.run_sync(client.status)
                    except DaemonNotRunning:
                        continue
            assert [(p.name, p.state) for p in status.projects] == [(NAME, "joining")]
            assert not started.is_set()
            assert await boot.dht.put_manifest(sign_manifest(make_manifest(owner), owner)) >= 1
            with trio.fail_after(60):
                await started.wait()
            assert hosting[0]  # it hosts its first experts before it says it started
            status = await trio.to_thread.run_sync(client.status)
            assert [(p.name, p.state) for p in status.projects] == [(NAME, "joined")]
            nursery.cancel_scope.cancel()


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find(inner, kind)
            if found is not None:
                return found
    return None


async def test_restarted_daemon_resumes_its_experts_from_its_checkpoints(tmp_path: Path) -> None:
    owner, me = Identity.generate(), Identity.generate()
    manifest = make_manifest(owner)
    async with open_peer(local_config()) as boot:
        assert await boot.dht.put_manifest(sign_manifest(manifest, owner)) >= 1
        config = joining_config(boot.multiaddrs, [manifest.owner], max_experts=3)
        async with open_daemon(config, tmp_path / "d", identity=me) as first:
            before = hosted(first)
            assert set(first.joiners[0].sources.values()) == {"seed"}
            for uid in before:
                await first.runtime.with_expert(uid, train_once)
            hashes = {uid: await first.runtime.with_expert(uid, payload_sha256) for uid in before}
        # Stopped: the final save wrote every trained expert.
        async with open_daemon(config, tmp_path / "d", identity=me) as again:
            assert hosted(again) == before
            assert set(again.joiners[0].sources.values()) == {"checkpoint"}
            for uid in before:
                assert await again.runtime.with_expert(uid, payload_sha256) == hashes[uid]
