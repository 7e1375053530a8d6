"""The trainers' network pieces without libp2p: the rendezvous key, the trainer-info
messages, in-memory shard fetches over a fake transport, the snapshots a TrainerSwarm
serves, and verbs added to a running RPC server (over the in-memory network)."""

from __future__ import annotations

import hashlib
import inspect
import json
import tracemalloc
from typing import Any, cast

import pytest
import torch
import trio
from pydantic import ValidationError

from volunteerd.config import Config
from volunteerd.errors import (
    PeerUnreachable,
    RemoteError,
    ShardError,
    UnknownExpert,
    VolunteerdError,
    wire_code,
)
from volunteerd.experts.checkpoint_file import ExpertState, decode_checkpoint
from volunteerd.identity import Identity
from volunteerd.net import Node, PeerAddress, Verb
from volunteerd.net.peers import peer_id_for
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.net.shard import ShardServer, fetch_shard
from volunteerd.swarm.manifest import ExperimentManifest, parse_manifest, sign_manifest
from volunteerd.swarm.trainers import (
    TRAINER_PARAMS_UID,
    TRAINER_STATE_UID,
    TrainerSwarm,
    rendezvous_key,
)
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.train.experiment import Experiment
from volunteerd.train.published import apply_manifest
from volunteerd.uids import is_valid_uid
from volunteerd.wire import InfoRequest, ShardReply, TrainerInfo, TrainerInfoRequest

PEER = PeerAddress("12D3KooWTestPeer", ())
DATA = bytes(range(256)) * 40  # 10240 bytes


def info(**changes: Any) -> TrainerInfo:
    fields: dict[str, Any] = {
        "experiment": "stdlib-chars",
        "version": 3,
        "tokens": 1000,
        "tokens_per_s": 12.5,
        "rounds": 1,
        "data_shard": 2,
    }
    return TrainerInfo.model_validate({**fields, **changes})


def state() -> ExpertState:
    return ExpertState(
        uid="whatever.0",
        expert_type="lm",
        hidden_dim=8,
        optimizer="adam",
        updates=7,
        params={"embed.weight": torch.randn(4, 8), "head.bias": torch.randn(4)},
        optimizer_state={
            0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 8)},
            1: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4)},
        },
    )


# ------------------------------------------------------------------ rendezvous key


def test_rendezvous_key_is_a_valid_uid_the_same_everywhere_and_per_experiment() -> None:
    key = rendezvous_key("stdlib-chars")
    assert is_valid_uid(key)
    assert key == rendezvous_key("stdlib-chars")
    assert key != rendezvous_key("stdlib-chars2")
    # Any text makes a valid key: long, unicode, empty.
    for name in ["x" * 500, "Modèle ünïcode", "", "a.b.c"]:
        assert is_valid_uid(rendezvous_key(name))


def test_a_manifest_may_name_the_rendezvous_key_as_a_valid_uid() -> None:
    assert ExperimentManifest(name="exp", rendezvous="exp_trainers.0").rendezvous
    with pytest.raises(ValidationError):
        ExperimentManifest(name="exp", rendezvous="Not A Uid")


def test_the_rendezvous_key_travels_signed_and_reaches_the_experiment() -> None:
    owner = Identity.generate()
    signed = {"owner": str(peer_id_for(owner)), "issued_at": 1e9, "expires_at": 1e9 + 3600}
    named = ExperimentManifest(name="exp", rendezvous="exp_trainers.0", **signed)
    assert parse_manifest(sign_manifest(named, owner)) == named
    assert apply_manifest(Experiment(), named).swarm.rendezvous == "exp_trainers.0"
    # Unset, it is left out of the signed body (older daemons refuse unknown keys), and
    # the experiment keeps its own (or the derived) key.
    unnamed = ExperimentManifest(name="exp", **signed)
    assert "rendezvous" not in json.loads(sign_manifest(unnamed, owner).body)
    assert parse_manifest(sign_manifest(unnamed, owner)) == unnamed
    assert apply_manifest(Experiment(), unnamed).swarm.rendezvous == ""


def test_swarm_refuses_a_rendezvous_key_that_is_not_a_uid() -> None:
    with pytest.raises(ValueError):
        TrainerSwarm(cast(Node, None), "exp", "not a key")
    with pytest.raises(ValueError):  # nor an experiment name the wire cannot carry
        TrainerSwarm(cast(Node, None), "x" * 200, rendezvous_key("x"))


# ---------------------------------------------------------------------- messages


def test_trainer_info_round_trips_and_refuses_impossible_values() -> None:
    sent = info()
    assert TrainerInfo.model_validate_json(sent.model_dump_json()) == sent
    for bad in [
        {"version": -1},
        {"tokens": -5},
        {"tokens_per_s": -1.0},
        {"tokens_per_s": float("nan")},
        {"tokens_per_s": float("inf")},
        {"tokens_per_s": 1.7e308},  # finite, but two of them summed to an infinite rate
        {"rounds": 2**70},
        {"data_shard": -1},
        {"experiment": ""},
        {"experiment": "x" * 129},
        {"experiment": "line\nbreak"},
        {"status": "error"},
        {"extra": 1},
    ]:
        with pytest.raises(ValidationError):
            info(**bad)
    with pytest.raises(ValidationError):
        TrainerInfo.model_validate_json(
            '{"experiment":"x","version":0,"tokens":0,"tokens_per_s":"Infinity",'
            '"rounds":0,"data_shard":0}'
        )


def test_trainer_info_request_names_one_experiment() -> None:
    assert TrainerInfoRequest(experiment="stdlib-chars").experiment == "stdlib-chars"
    for bad in ["", "a\x00b", "x" * 200]:
        with pytest.raises(ValidationError):
            TrainerInfoRequest(experiment=bad)
    with pytest.raises(ValidationError):
        TrainerInfoRequest.model_validate({"experiment": "x", "uid": "ffn.0"})


# -------------------------------------------------------------- fetch into memory


class FakeRpc:
    """Calls a ShardServer directly, or a reply function that may lie."""

    def __init__(self, shards: ShardServer, lie: Any = None) -> None:
        self.shards = shards
        self.lie = lie
        self.calls = 0
        self.asked: list[int] = []  # lengths asked for
        self.fail: set[int] = set()

    async def call_raw(
        self, peer: PeerAddress, verb: Verb, header: Any, *, max_body_bytes: int | None = None
    ) -> tuple[Any, memoryview]:
        assert verb is Verb.SHARD
        self.calls += 1
        self.asked.append(header.length)
        if self.calls in self.fail:
            raise PeerUnreachable("connection dropped")
        try:
            reply, body = await self.shards.chunk(header)
        except VolunteerdError as exc:
            raise RemoteError(wire_code(exc), str(exc)) from None
        if self.lie is not None:
            lied = self.lie(reply, body)
            return await lied if inspect.isawaitable(lied) else lied
        return reply, body


def shards_of(data: bytes) -> ShardServer:
    async def snapshot(uid: str) -> bytes:
        if uid != "ffn.0.0":
            raise UnknownExpert(uid)
        return data

    return ShardServer(snapshot)


async def fetch(rpc: FakeRpc, **kwargs: Any) -> bytearray:
    kwargs.setdefault("max_bytes", 1 << 20)
    kwargs.setdefault("chunk_bytes", 1024)
    kwargs.setdefault("backoff_s", 0)
    return await fetch_shard(rpc, PEER, "ffn.0.0", **kwargs)  # type: ignore[arg-type]


async def test_fetch_returns_the_whole_snapshot_in_chunks() -> None:
    rpc = FakeRpc(shards_of(DATA))
    seen: list[tuple[int, int]] = []
    data = await fetch(rpc, on_chunk=lambda got, total: seen.append((got, total)))
    assert data == DATA
    assert rpc.calls == 10
    assert seen[-1] == (len(DATA), len(DATA))


async def test_fetch_retries_a_dropped_call() -> None:
    rpc = FakeRpc(shards_of(DATA))
    rpc.fail = {3}
    assert await fetch(rpc) == DATA


async def test_fetch_refuses_a_snapshot_over_max_bytes_from_its_first_reply() -> None:
    rpc = FakeRpc(shards_of(DATA))
    with pytest.raises(ShardError, match="more than"):
        await fetch(rpc, max_bytes=100)
    # One request, for no more than max_bytes.
    assert rpc.asked == [100]


async def test_fetch_refuses_bytes_that_do_not_match_their_hash() -> None:
    def flip(reply: ShardReply, body: memoryview) -> tuple[ShardReply, memoryview]:
        damaged = bytearray(body)
        damaged[0] ^= 1
        return reply, memoryview(damaged)

    with pytest.raises(ShardError, match="sha256"):
        await fetch(FakeRpc(shards_of(DATA), lie=flip))


class Declares:
    """A peer that answers the first chunk honestly but declares ``total`` bytes in all,
    then never answers again."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.replies = 0

    async def __call__(self, reply: ShardReply, body: memoryview) -> tuple[ShardReply, memoryview]:
        self.replies += 1
        if self.replies > 1:
            await trio.sleep_forever()
        return reply.model_copy(update={"total": self.total}), body


async def test_fetch_holds_the_bytes_received_not_the_size_a_peer_declares() -> None:
    # Once a peer's first chunk declared 512 MiB, the download allocated (and zeroed)
    # all of it: two such trainers cost an honest one +2 GiB a round for 1 MiB each.
    liar = Declares(512 << 20)
    rpc = FakeRpc(shards_of(DATA), lie=liar)
    tracemalloc.start()
    try:
        with trio.move_on_after(0.5):
            await fetch(rpc, max_bytes=1 << 30)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert liar.replies == 2  # the first chunk was taken, the second never came
    assert peak < 16 << 20


async def test_fetch_refuses_chunks_of_two_snapshots() -> None:
    other = hashlib.sha256(b"other").hexdigest()

    def switch(reply: ShardReply, body: memoryview) -> tuple[ShardReply, memoryview]:
        if reply.offset:
            reply = reply.model_copy(update={"sha256": other})
        return reply, body

    with pytest.raises(ShardError, match="snapshot"):
        await fetch(FakeRpc(shards_of(DATA), lie=switch))


async def test_fetch_of_an_unknown_uid_is_a_remote_error_at_once() -> None:
    rpc = FakeRpc(shards_of(DATA))
    with pytest.raises(RemoteError) as caught:
        await fetch_shard(rpc, PEER, "ffn.9.9", max_bytes=1 << 20)  # type: ignore[arg-type]
    assert caught.value.code == "unknown_expert"
    assert rpc.calls == 1


# --------------------------------------------------------- what a trainer serves


async def test_swarm_serves_parameters_and_full_state_of_the_latest_publish() -> None:
    swarm = TrainerSwarm(cast(Node, None), "stdlib-chars", rendezvous_key("stdlib-chars"))
    with pytest.raises(UnknownExpert, match="no state"):
        await swarm._snapshot(TRAINER_PARAMS_UID)
    published = state()
    swarm.publish(published, info())
    params = decode_checkpoint(await swarm._snapshot(TRAINER_PARAMS_UID))
    full = decode_checkpoint(await swarm._snapshot(TRAINER_STATE_UID))
    assert (params.uid, params.expert_type, params.updates) == (TRAINER_PARAMS_UID, "trainer", 7)
    assert not params.optimizer_state
    assert (full.uid, full.expert_type) == (TRAINER_STATE_UID, "trainer")
    for name, tensor in published.params.items():
        assert torch.equal(params.params[name], tensor)
        assert torch.equal(full.params[name], tensor)
    assert torch.equal(full.optimizer_state[0]["exp_avg"], published.optimizer_state[0]["exp_avg"])
    with pytest.raises(UnknownExpert):
        await swarm._snapshot("ffn.0.0")
    # A new publish is served from then on.
    newer = state()
    newer.updates = 8
    swarm.publish(newer, info(version=8))
    assert decode_checkpoint(await swarm._snapshot(TRAINER_PARAMS_UID)).updates == 8


def test_publish_refuses_info_of_another_experiment() -> None:
    swarm = TrainerSwarm(cast(Node, None), "stdlib-chars", rendezvous_key("stdlib-chars"))
    with pytest.raises(ValueError):
        swarm.publish(state(), info(experiment="other"))


# ------------------------------------------------------------------ RpcServer.add


async def test_verbs_added_after_install_are_served_and_never_replaced() -> None:
    config = Config()
    network = MemoryNetwork(seed=1)

    async def answer(request: Request) -> Reply:
        return Reply(info(experiment=request.header.experiment))

    async def other(request: Request) -> Reply:
        raise AssertionError("never called")

    async with network.open_host() as server_host, network.open_host() as client_host:
        server = RpcServer(server_host, {}, config.wire, config.timeouts, config.peer_limits)
        server.install()
        server.add({Verb.TRAINER_INFO: answer})
        with pytest.raises(ValueError, match="trainer-info"):
            server.add({Verb.TRAINER_INFO: other})
        client = RpcClient(client_host, config.wire, config.timeouts)
        with trio.fail_after(10):
            reply, _ = await client.call(
                server_host.address, Verb.TRAINER_INFO, TrainerInfoRequest(experiment="e")
            )
            assert reply == info(experiment="e")
            with pytest.raises(PeerUnreachable):  # a verb never added has no handler
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
