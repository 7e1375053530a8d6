"""Trainers of one experiment over real libp2p on 127.0.0.1: they find each other under
the rendezvous key, serve their published state and fetch each other's, and every
failure of a peer (gone mid-download, silent, too large, another experiment) is an
error within the caller's timeout, never a hang."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from volunteerd.config import Config
from volunteerd.errors import (
    PeerError,
    RemoteError,
    RequestTimeout,
    ShardError,
    VolunteerdError,
)
from volunteerd.experts.checkpoint_file import ExpertState, read_checkpoint
from volunteerd.identity import Identity
from volunteerd.net import Node
from volunteerd.net.shard import FIRST_CHUNK_BYTES, partial_paths
from volunteerd.swarm.trainers import TrainerPeer, TrainerSwarm, rendezvous_key
from volunteerd.testing import local_config, open_peer
from volunteerd.wire import TrainerInfo

# Real libp2p nodes on loopback, in wall-clock time.
pytestmark = pytest.mark.slow

EXPERIMENT = "stdlib-chars"
KEY = rendezvous_key(EXPERIMENT)
DEADLINE_S = 60  # generous: the tests run beside CPU-heavy processes


def trainer_config(boot: Node) -> Config:
    # Records outlive slow announcement rounds on a busy machine (a round may wait for a
    # peer's DHT timeout); expiry is not what these tests are about.
    return local_config(bootstrap=boot.multiaddrs, dht={"record_ttl_s": 30.0})


def trainer_state(updates: int = 5, hidden: int = 32) -> ExpertState:
    """Trainer-side parameters and their Adam state, named as a model's would be."""
    params = {
        "embed.weight": torch.randn(64, hidden),
        "blocks.0.attn.qkv.weight": torch.randn(3 * hidden, hidden),
        "head.bias": torch.randn(64),
    }
    optim = {
        i: {
            "step": torch.tensor(float(updates)),
            "exp_avg": torch.randn_like(p),
            "exp_avg_sq": torch.rand_like(p),
        }
        for i, p in enumerate(params.values())
    }
    return ExpertState(
        uid="lm.0",
        expert_type="lm",
        hidden_dim=hidden,
        optimizer="adam",
        updates=updates,
        params=params,
        optimizer_state=optim,
    )


def trainer_info(version: int = 5, experiment: str = EXPERIMENT) -> TrainerInfo:
    return TrainerInfo(
        experiment=experiment,
        version=version,
        tokens=version * 1024,
        tokens_per_s=100.0,
        rounds=0,
        data_shard=1,
    )


@dataclass
class Trainer:
    node: Node
    swarm: TrainerSwarm
    scope: trio.CancelScope  # cancel to stop the node (and its swarm) at once
    stop: trio.CancelScope  # cancel to stop the swarm (it withdraws its record), then the node

    @property
    def peer(self) -> TrainerPeer:
        return TrainerPeer(self.node.peer_id, tuple(self.node.addrs))


@asynccontextmanager
async def open_trainer(
    boot: Node, experiment: str = EXPERIMENT, key: str = KEY
) -> AsyncIterator[Trainer]:
    """A trainer's node with its TrainerSwarm serving, in a scope the test may cancel
    to make the trainer vanish; leaving stops the swarm first, as a trainer process
    does, so that its goodbye goes out while the node can still send it."""
    config = trainer_config(boot)
    holder: list[Trainer] = []

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            async with open_peer(config, Identity.generate()) as node:
                swarm = TrainerSwarm(node, experiment, key, config)
                async with trio.open_nursery() as nursery:
                    await nursery.start(swarm.serve)
                    holder.append(Trainer(node, swarm, scope, nursery.cancel_scope))
                    task_status.started()

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        trainer = holder[0]
        try:
            yield trainer
        finally:
            trainer.stop.cancel()


@asynccontextmanager
async def trainers(n: int, *others: str) -> AsyncIterator[tuple[Node, list[Trainer]]]:
    """``n`` trainers of EXPERIMENT, then one trainer of each experiment in ``others``."""
    async with open_peer(local_config()) as boot, AsyncExitStack() as stack:
        out = [await stack.enter_async_context(open_trainer(boot)) for _ in range(n)]
        for name in others:
            out.append(
                await stack.enter_async_context(open_trainer(boot, name, rendezvous_key(name)))
            )
        try:
            yield boot, out
        finally:
            for trainer in out:  # all stop at once, not one grace period after another
                trainer.stop.cancel()


async def wait_for_peers(trainer: Trainer, expected: set[str]) -> set[str]:
    """Poll ``peers()`` until it lists ``expected`` (records may take a round to spread)."""
    with trio.fail_after(DEADLINE_S):
        while True:
            found = {p.peer_id for p in await trainer.swarm.peers()}
            if expected <= found:
                return found
            await trio.sleep(0.2)


def some_peer_id() -> str:
    return ID.from_pubkey(create_new_key_pair().public_key).to_base58()


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name], tensor), name


async def test_trainers_of_one_experiment_find_each_other_and_not_another_experiments() -> None:
    async with trainers(3, "another-experiment") as (_, found):
        ours, stranger = found[:3], found[3]
        ids = {t.node.peer_id for t in ours}
        for trainer in ours:
            seen = await wait_for_peers(trainer, ids - {trainer.node.peer_id})
            assert trainer.node.peer_id not in seen  # never itself
            assert stranger.node.peer_id not in seen
        assert not {p.peer_id for p in await stranger.swarm.peers()} & ids


async def test_fetch_params_is_exactly_the_published_parameters_and_info_is_the_latest() -> None:
    async with trainers(2) as (_, (a, b)):
        published = trainer_state(updates=5)
        a.swarm.publish(published, trainer_info(version=5))
        peer = a.peer

        with trio.fail_after(DEADLINE_S):
            info = await b.swarm.info(peer, timeout_s=30)
            fetched = await b.swarm.fetch_params(peer, timeout_s=30, max_bytes=64 << 20)
        assert info == trainer_info(version=5)
        assert (fetched.uid, fetched.expert_type, fetched.updates) == ("trainer.0", "trainer", 5)
        assert_same_tensors(fetched.params, published.params)
        assert not fetched.optimizer_state  # averaging fetches parameters only

        # A newer publish is what the next fetch gets.
        newer = trainer_state(updates=6)
        a.swarm.publish(newer, trainer_info(version=6))
        with trio.fail_after(DEADLINE_S):
            again = await b.swarm.fetch_params(peer, timeout_s=30, max_bytes=64 << 20)
            assert (await b.swarm.info(peer, timeout_s=30)).version == 6
        assert_same_tensors(again.params, newer.params)

        sent, received = a.swarm.statistics(), b.swarm.statistics()
        assert (sent.snapshots_served, sent.infos_served) == (2, 2)
        assert received.bytes_received >= 2 * sum(t.nbytes for t in published.params.values())
        assert sent.bytes_sent >= received.bytes_received


async def test_download_state_writes_a_checkpoint_with_the_optimizer_state(
    tmp_path: Path,
) -> None:
    async with trainers(2) as (_, (a, b)):
        published = trainer_state(updates=9)
        a.swarm.publish(published, trainer_info(version=9))
        dest = tmp_path / "joined.ckpt"
        with trio.fail_after(DEADLINE_S):
            state = await b.swarm.download_state(a.peer, dest, timeout_s=30, max_bytes=64 << 20)
        on_disk = read_checkpoint(dest)
        for got in (state, on_disk):
            assert (got.uid, got.expert_type, got.updates) == ("trainer.1", "trainer", 9)
            assert_same_tensors(got.params, published.params)
            assert got.optimizer_state.keys() == published.optimizer_state.keys()
            for index, entry in published.optimizer_state.items():
                assert_same_tensors(
                    dict(sorted(got.optimizer_state[index].items())), dict(sorted(entry.items()))
                )
        assert not any(p.exists() for p in partial_paths(dest))


async def test_a_trainer_that_vanishes_mid_download_fails_the_fetch_not_hangs_it() -> None:
    async with trainers(2) as (_, (a, b)):
        # ~48 MiB: many chunks, so the fetch is under way when the trainer goes.
        big = trainer_state()
        big.params["big"] = torch.randn(12 << 20)
        a.swarm.publish(big, trainer_info())
        timeout_s = 45.0
        outcome: list[BaseException | ExpertState] = []

        async def fetch() -> None:
            try:
                outcome.append(await b.swarm.fetch_params(a.peer, timeout_s, max_bytes=1 << 30))
            except VolunteerdError as exc:
                outcome.append(exc)

        with trio.fail_after(timeout_s + DEADLINE_S):  # the fetch ends by its own timeout
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                while not outcome:  # until the first chunk arrived
                    if b.swarm.statistics().bytes_received:
                        break
                    await trio.sleep(0.005)
                a.scope.cancel()  # the node closes: streams and connection go
        (result,) = outcome
        assert isinstance(result, PeerError), result


async def test_a_peer_that_never_answers_fails_the_fetch_within_its_timeout() -> None:
    async with trainers(1) as (_, (b,)):
        # Accepts TCP connections and never says a word (no libp2p handshake).
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            port = silent.getsockname()[1]
            mute = TrainerPeer(some_peer_id(), (f"/ip4/127.0.0.1/tcp/{port}",))
            with trio.fail_after(DEADLINE_S):
                with pytest.raises(PeerError):
                    await b.swarm.fetch_params(mute, timeout_s=2.0, max_bytes=1 << 20)
                with pytest.raises(PeerError):
                    await b.swarm.info(mute, timeout_s=2.0)


async def test_a_peer_that_never_answers_is_cut_at_the_first_reply_deadline() -> None:
    """Without it, the dial alone took connect_s (10 s) and was tried three times: a
    record whose address accepts and never answers held an averaging place for all of
    timeout_s. A peer that answers still sends all of a snapshot larger than the first
    chunk (FIRST_CHUNK_BYTES), within the same deadline."""
    async with trainers(2) as (_, (a, b)):
        published = trainer_state(hidden=256)  # parameters alone: several first chunks
        assert sum(t.nbytes for t in published.params.values()) > 4 * FIRST_CHUNK_BYTES
        a.swarm.publish(published, trainer_info())
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            port = silent.getsockname()[1]
            mute = TrainerPeer(some_peer_id(), (f"/ip4/127.0.0.1/tcp/{port}",))
            started = trio.current_time()
            with trio.fail_after(DEADLINE_S), pytest.raises(RequestTimeout, match="within 1 s"):
                await b.swarm.fetch_params(mute, timeout_s=30, max_bytes=1 << 20, first_reply_s=1)
            assert trio.current_time() - started < 5  # not connect_s, not three tries
        with trio.fail_after(DEADLINE_S):
            fetched = await b.swarm.fetch_params(
                a.peer, timeout_s=30, max_bytes=64 << 20, first_reply_s=20
            )
        assert_same_tensors(fetched.params, published.params)


async def test_info_for_another_experiment_is_refused() -> None:
    async with trainers(1, "another-experiment") as (_, (ours, stranger)):
        ours.swarm.publish(trainer_state(), trainer_info())
        with trio.fail_after(DEADLINE_S):
            with pytest.raises(RemoteError) as caught:
                await stranger.swarm.info(ours.peer, timeout_s=30)
        assert caught.value.code == "unknown_expert"
        assert ours.swarm.statistics().infos_served == 0


async def test_oversized_state_is_refused_before_it_is_downloaded(tmp_path: Path) -> None:
    async with trainers(2) as (_, (a, b)):
        a.swarm.publish(trainer_state(hidden=256), trainer_info())  # ~1 MiB with Adam state
        limit = 4096
        dest = tmp_path / "state.ckpt"
        with trio.fail_after(DEADLINE_S):
            with pytest.raises(ShardError, match="more than"):
                await b.swarm.fetch_params(a.peer, timeout_s=30, max_bytes=limit)
            with pytest.raises(ShardError, match="more than"):
                await b.swarm.download_state(a.peer, dest, timeout_s=30, max_bytes=limit)
        assert b.swarm.statistics().bytes_received == 0
        assert not dest.exists()
        assert not any(p.exists() for p in partial_paths(dest))


async def test_fetch_before_anything_is_published_is_refused_at_once() -> None:
    async with trainers(2) as (_, (a, b)):
        with trio.fail_after(DEADLINE_S):
            with pytest.raises(RemoteError) as caught:
                await b.swarm.fetch_params(a.peer, timeout_s=30, max_bytes=1 << 20)
            assert caught.value.code == "unknown_expert"
            with pytest.raises(RequestTimeout):
                # An impossible deadline is a timeout, not a hang or another error.
                await b.swarm.fetch_params(a.peer, timeout_s=1e-6, max_bytes=1 << 20)


async def test_a_trainer_that_stalls_after_its_first_chunk_fails_a_join_in_seconds(
    tmp_path: Path,
) -> None:
    """It sent a chunk and then nothing: a late joiner waited the whole ``timeout_s``
    x 4 for each attempt (an outside probe: 40 s at a timeout_s of 10, 120 s by
    default). A state must keep coming at 256 kbit/s after 5 s, as a replica's must."""
    async with trainers(2) as (_, (a, b)):
        a.swarm.publish(trainer_state(hidden=256), trainer_info())  # ~1 MiB with Adam state
        served = a.swarm._shards.chunk
        calls = 0

        async def stalling(header: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                await trio.sleep_forever()
            return await served(header, **kwargs)

        a.swarm._shards.chunk = stalling  # type: ignore[method-assign]
        b.swarm._chunk_bytes = 64 << 10  # what the first chunk credits it: 2 s at the rate
        dest = tmp_path / "state.ckpt"
        start = trio.current_time()
        with trio.fail_after(DEADLINE_S):
            with pytest.raises(ShardError, match="slower than"):
                await b.swarm.download_state(a.peer, dest, timeout_s=60, max_bytes=64 << 20)
        assert trio.current_time() - start < 20  # 5 s + 2 s; was 60 s (timeout_s)
