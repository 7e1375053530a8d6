"""The shard protocol's logic without a network: the server's snapshot cache and chunks,
and the client's partial file, sidecar, retries and checks, over a fake transport."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd.errors import (
    Busy,
    MalformedFrame,
    PeerUnreachable,
    RemoteError,
    RequestTimeout,
    ShardError,
    ShardTooSlow,
    SnapshotExpired,
    UnknownExpert,
    VolunteerdError,
    wire_code,
)
from volunteerd.net import PeerAddress, Verb
from volunteerd.net.shard import (
    HELD_PER_REQUESTER,
    STALE_S,
    ShardServer,
    download_shard,
    partial_paths,
    sweep_downloads,
)
from volunteerd.wire import ShardReply, ShardRequest

UID = "ffn.0.0"
PEER = PeerAddress("12D3KooWTestPeer", ())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Experts:
    """A fake runtime: each snapshot of an expert is its current bytes."""

    def __init__(self, **states: bytes) -> None:
        self.states = {uid.replace("_", "."): data for uid, data in states.items()}
        self.taken = 0

    async def snapshot(self, uid: str) -> bytes:
        if uid not in self.states:
            raise UnknownExpert(f"no {uid}")
        self.taken += 1
        return self.states[uid]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


DATA = bytes(range(256)) * 40  # 10240 bytes


def server(experts: Experts, clock: Clock | None = None, **kwargs: Any) -> ShardServer:
    return ShardServer(experts.snapshot, clock=clock or Clock(), **kwargs)


# ---------------------------------------------------------------------------- server


async def test_fresh_request_takes_a_snapshot_and_answers_its_first_chunk() -> None:
    shards = server(Experts(ffn_0_0=DATA))
    reply, body = await shards.chunk(ShardRequest(uid=UID, length=1000))
    assert (reply.sha256, reply.total, reply.offset, reply.length) == (
        sha(DATA),
        len(DATA),
        0,
        1000,
    )
    assert bytes(body) == DATA[:1000]


async def test_resumed_request_reads_the_same_snapshot_after_the_expert_changed() -> None:
    experts = Experts(ffn_0_0=DATA)
    shards = server(experts)
    first, _ = await shards.chunk(ShardRequest(uid=UID, length=1000))
    experts.states[UID] = b"new weights" * 100
    reply, body = await shards.chunk(
        ShardRequest(uid=UID, sha256=first.sha256, offset=5000, length=1000)
    )
    assert reply.sha256 == sha(DATA)
    assert bytes(body) == DATA[5000:6000]


async def test_fresh_requests_close_together_share_one_snapshot() -> None:
    experts, clock = Experts(ffn_0_0=DATA), Clock()
    shards = server(experts, clock, reuse_s=5.0)
    await shards.chunk(ShardRequest(uid=UID))
    clock.now += 4
    await shards.chunk(ShardRequest(uid=UID))
    assert experts.taken == 1
    clock.now += 2  # 6 s after the snapshot: a new one
    await shards.chunk(ShardRequest(uid=UID))
    assert experts.taken == 2
    assert shards.statistics().reused == 1


async def test_snapshot_idle_for_too_long_is_expired() -> None:
    clock = Clock()
    shards = server(Experts(ffn_0_0=DATA), clock, keep_idle_s=60.0)
    first, _ = await shards.chunk(ShardRequest(uid=UID, length=100))
    clock.now += 50
    await shards.chunk(ShardRequest(uid=UID, sha256=first.sha256, offset=100, length=100))
    clock.now += 50  # 100 s after the snapshot, but used 50 s ago: still kept
    await shards.chunk(ShardRequest(uid=UID, sha256=first.sha256, offset=200, length=100))
    clock.now += 61
    with pytest.raises(SnapshotExpired) as caught:
        await shards.chunk(ShardRequest(uid=UID, sha256=first.sha256, offset=300))
    assert wire_code(caught.value) == "expired"
    assert shards.statistics().cached == 0


async def test_serve_frees_idle_snapshots_without_waiting_for_a_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    shards = ShardServer(Experts(ffn_0_0=DATA).snapshot, keep_idle_s=60.0, clock=trio.current_time)
    await shards.chunk(ShardRequest(uid=UID))
    async with trio.open_nursery() as nursery:
        await nursery.start(shards.serve)
        await trio.sleep(50)
        assert shards.statistics().cached == 1
        await trio.sleep(30)
        assert shards.statistics().cached == 0
        nursery.cancel_scope.cancel()


async def test_unknown_sha256_or_one_of_another_uid_is_expired() -> None:
    shards = server(Experts(ffn_0_0=DATA, ffn_0_1=b"other"))
    first, _ = await shards.chunk(ShardRequest(uid=UID))
    with pytest.raises(SnapshotExpired):
        await shards.chunk(ShardRequest(uid=UID, sha256="0" * 64))
    with pytest.raises(SnapshotExpired):
        await shards.chunk(ShardRequest(uid="ffn.0.1", sha256=first.sha256))


async def test_cache_keeps_at_most_its_bytes_least_recently_used_out() -> None:
    experts = Experts(ffn_0_0=b"a" * 400, ffn_0_1=b"b" * 400, ffn_0_2=b"c" * 400)
    clock = Clock()
    shards = server(experts, clock, max_cache_bytes=1000, in_use_s=60.0)
    a, _ = await shards.chunk(ShardRequest(uid="ffn.0.0"))
    b, _ = await shards.chunk(ShardRequest(uid="ffn.0.1"))
    clock.now += 61  # neither is in use any longer
    await shards.chunk(ShardRequest(uid="ffn.0.0", sha256=a.sha256))  # a used last
    await shards.chunk(ShardRequest(uid="ffn.0.2"))
    assert shards.statistics().cached_bytes == 800
    await shards.chunk(ShardRequest(uid="ffn.0.0", sha256=a.sha256))
    with pytest.raises(SnapshotExpired):
        await shards.chunk(ShardRequest(uid="ffn.0.1", sha256=b.sha256))


async def test_snapshots_in_use_are_not_evicted_and_a_full_cache_is_busy() -> None:
    experts = Experts(ffn_0_0=b"a" * 600, ffn_0_1=b"b" * 600, ffn_0_2=b"c" * 600)
    clock = Clock()
    shards = server(experts, clock, max_cache_bytes=1000, in_use_s=60.0)
    a, _ = await shards.chunk(ShardRequest(uid="ffn.0.0"))
    b, _ = await shards.chunk(ShardRequest(uid="ffn.0.1"))  # over the cap by one snapshot
    with pytest.raises(Busy) as caught:
        await shards.chunk(ShardRequest(uid="ffn.0.2"))
    assert wire_code(caught.value) == "busy"
    assert experts.taken == 2
    for reply in (a, b):  # both downloads go on
        await shards.chunk(ShardRequest(uid=reply.uid, sha256=reply.sha256, offset=100))
    clock.now += 30
    await shards.chunk(ShardRequest(uid="ffn.0.1", sha256=b.sha256, offset=200))
    clock.now += 31  # a idle for 61 s: its room goes to a new download
    c, _ = await shards.chunk(ShardRequest(uid="ffn.0.2"))
    assert c.total == 600
    with pytest.raises(SnapshotExpired):
        await shards.chunk(ShardRequest(uid="ffn.0.0", sha256=a.sha256))
    assert shards.statistics().busy == 1


async def test_one_requester_keeps_a_few_snapshots_in_use_and_pins_no_more() -> None:
    # A peer asking for a byte of a fresh snapshot every second held 44 of them (1 GiB)
    # in a trainer's cache, and every other trainer's download was refused busy.
    n = HELD_PER_REQUESTER
    experts = Experts(**{f"ffn_0_{i}": bytes([i]) * 100 for i in range(n + 3)})
    clock = Clock()
    shards = server(experts, clock, max_cache_bytes=100 * n + 50, in_use_s=60.0)
    for i in range(n + 1):  # one requester, one snapshot more than it may hold at once
        await shards.chunk(ShardRequest(uid=f"ffn.0.{i}", length=1), requester="pinner")
    assert shards.statistics().cached_bytes == 100 * n  # its oldest was let go, and evicted

    honest, _ = await shards.chunk(ShardRequest(uid=f"ffn.0.{n + 1}"), requester="honest")
    assert honest.total == 100  # room, though the pinner used all of its own just now
    with pytest.raises(Busy):  # the pinner's next one waits: the cache is full of use
        await shards.chunk(ShardRequest(uid=f"ffn.0.{n + 2}", length=1), requester="pinner")
    reply, _ = await shards.chunk(
        ShardRequest(uid=honest.uid, sha256=honest.sha256, offset=50), requester="honest"
    )
    assert reply.offset == 50


async def test_a_superseded_snapshot_leaves_once_no_download_uses_it() -> None:
    # One peer asking for a byte of each fresh snapshot of a trainer's parameters kept
    # the cache full (1 GiB) of snapshots nobody would download again.
    experts = Experts(ffn_0_0=b"v0" * 50)
    clock = Clock()
    shards = server(experts, clock, reuse_s=0.0, max_cache_bytes=1 << 30, in_use_s=60.0)
    honest, _ = await shards.chunk(ShardRequest(uid=UID, length=10), requester="honest")
    for version in range(1, 3 * HELD_PER_REQUESTER):
        experts.states[UID] = f"v{version}".encode() * 50
        clock.now += 1
        await shards.chunk(ShardRequest(uid=UID, length=1), requester="pinner")
        # the pinner's latest few, and the one the honest peer is downloading
        assert shards.statistics().cached <= HELD_PER_REQUESTER + 1
    _, body = await shards.chunk(
        ShardRequest(uid=UID, sha256=honest.sha256, offset=10), requester="honest"
    )
    assert bytes(body) == (b"v0" * 50)[10:]  # still there for the download in progress
    clock.now += 61  # nobody has asked for the old ones in in_use_s: the next fresh one
    experts.states[UID] = b"last" * 25  # drops them all
    latest, _ = await shards.chunk(ShardRequest(uid=UID, length=1), requester="pinner")
    assert shards.statistics().cached == 1
    assert latest.total == 100


async def test_an_unchanged_snapshot_is_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []

    def counting(data: bytes) -> str:
        hashed.append(len(data))
        return sha(data)

    monkeypatch.setattr("volunteerd.net.shard._sha256_hex", counting)
    experts = Experts(ffn_0_0=DATA)
    clock = Clock()
    shards = server(experts, clock, reuse_s=0.0)  # every fresh request asks for a snapshot
    first, _ = await shards.chunk(ShardRequest(uid=UID, length=1))
    clock.now += 1
    again, _ = await shards.chunk(ShardRequest(uid=UID, length=1))
    assert experts.taken == 2
    assert again.sha256 == first.sha256 == sha(DATA)
    assert hashed == [len(DATA)]
    experts.states[UID] = DATA[::-1]  # new bytes: hashed
    clock.now += 1
    changed, _ = await shards.chunk(ShardRequest(uid=UID, length=1))
    assert changed.sha256 == sha(DATA[::-1])
    assert len(hashed) == 2


async def test_a_snapshot_larger_than_the_cache_is_still_kept() -> None:
    clock = Clock()
    shards = server(Experts(ffn_0_0=DATA, ffn_0_1=b"small"), clock, max_cache_bytes=1024)
    await shards.chunk(ShardRequest(uid="ffn.0.1"))
    clock.now += 61
    big, _ = await shards.chunk(ShardRequest(uid=UID, length=10))
    reply, _ = await shards.chunk(ShardRequest(uid=UID, sha256=big.sha256, offset=10))
    assert reply.sha256 == sha(DATA)
    assert shards.statistics().cached == 1


async def test_chunks_are_capped_by_the_server_and_by_the_end() -> None:
    shards = server(Experts(ffn_0_0=DATA), max_chunk_bytes=4096)
    first, body = await shards.chunk(ShardRequest(uid=UID, length=8192))
    assert first.length == len(body) == 4096
    last, body = await shards.chunk(
        ShardRequest(uid=UID, sha256=first.sha256, offset=10000, length=4096)
    )
    assert last.length == 240
    assert bytes(body) == DATA[10000:]
    end, body = await shards.chunk(ShardRequest(uid=UID, sha256=first.sha256, offset=len(DATA)))
    assert end.length == 0
    assert body.nbytes == 0
    with pytest.raises(MalformedFrame):
        await shards.chunk(ShardRequest(uid=UID, sha256=first.sha256, offset=len(DATA) + 1))


async def test_unknown_expert_is_a_typed_error() -> None:
    with pytest.raises(UnknownExpert):
        await server(Experts(ffn_0_0=DATA)).chunk(ShardRequest(uid="ffn.9.9"))


def test_requests_and_replies_are_validated() -> None:
    with pytest.raises(ValueError):
        ShardRequest(uid=UID, length=(4 << 20) + 1)
    with pytest.raises(ValueError):
        ShardRequest(uid=UID, sha256="not-a-hash")
    with pytest.raises(ValueError):
        ShardReply(uid=UID, sha256="0" * 64, total=10, offset=8, length=4)


# ---------------------------------------------------------------------------- client


class FakeRpc:
    """Calls a ShardServer directly; can drop calls or damage bodies on purpose."""

    def __init__(self, shards: ShardServer) -> None:
        self.shards = shards
        self.calls = 0
        self.fail: set[int] = set()  # call numbers (from 1) that fail as a dropped stream
        self.corrupt: set[int] = set()  # call numbers whose body gets a flipped bit
        self.fail_from: int | None = None  # every call from this one on fails
        self.busy: set[int] = set()  # call numbers answered "busy"
        self.caps: list[int | None] = []  # each call's max_body_bytes

    async def call_raw(
        self, peer: PeerAddress, verb: Verb, header: Any, *, max_body_bytes: int | None = None
    ) -> tuple[Any, memoryview]:
        assert verb is Verb.SHARD
        self.calls += 1
        self.caps.append(max_body_bytes)
        if self.calls in self.fail or (self.fail_from and self.calls >= self.fail_from):
            raise PeerUnreachable("connection dropped")
        if self.calls in self.busy:
            raise RemoteError("busy", "try later")
        try:
            reply, body = await self.shards.chunk(header)
        except VolunteerdError as exc:
            raise RemoteError(wire_code(exc), str(exc)) from None
        if self.calls in self.corrupt:
            damaged = bytearray(body)
            damaged[0] ^= 1
            body = memoryview(damaged)
        return reply, body


async def download(rpc: FakeRpc, dest: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("chunk_bytes", 1024)
    kwargs.setdefault("backoff_s", 0)
    return await download_shard(rpc, PEER, UID, dest, **kwargs)  # type: ignore[arg-type]


async def test_download_writes_the_whole_snapshot_and_cleans_up(tmp_path: Path) -> None:
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    dest = tmp_path / "expert.ckpt"
    result = await download(rpc, dest)
    assert dest.read_bytes() == DATA
    assert (result.sha256, result.size, result.resumed_from, result.fetched) == (
        sha(DATA),
        len(DATA),
        0,
        len(DATA),
    )
    assert rpc.calls == 10
    assert not any(p.exists() for p in partial_paths(dest))


async def test_each_chunk_reply_is_capped_at_the_length_asked_for(tmp_path: Path) -> None:
    """The RPC client refuses a longer reply from its prefix (tests/unit/test_reply_caps.py,
    tests/integration/test_oversized_replies.py): a chunk costs what was asked for."""
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    with pytest.raises(ShardError, match="more than 3000"):
        await download(rpc, tmp_path / "x", chunk_bytes=4096, max_bytes=3000)
    assert rpc.caps == [3000]  # before the size is known: at most max_bytes
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    await download(rpc, tmp_path / "y", chunk_bytes=4096)
    assert rpc.caps == [4096, 4096, len(DATA) - 8192]


async def test_dropped_calls_are_retried_within_one_download(tmp_path: Path) -> None:
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    rpc.fail = {3, 4, 7}
    result = await download(rpc, tmp_path / "x", retries=2)
    assert result.sha256 == sha(DATA)
    assert result.fetched == len(DATA)


async def test_busy_answers_are_retried_then_given_up_resumably(tmp_path: Path) -> None:
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    rpc.busy = {1, 2}
    result = await download(rpc, tmp_path / "x", retries=2)
    assert result.sha256 == sha(DATA)
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    rpc.busy = {3, 4, 5}
    with pytest.raises(ShardError) as caught:
        await download(rpc, tmp_path / "y", retries=2)
    assert caught.value.resumable


async def test_interrupted_download_resumes_from_the_bytes_on_disk(tmp_path: Path) -> None:
    shards = server(Experts(ffn_0_0=DATA))
    rpc = FakeRpc(shards)
    rpc.fail_from = 5  # four chunks arrive, then the peer is gone
    dest = tmp_path / "x"
    with pytest.raises(ShardError) as caught:
        await download(rpc, dest, retries=2)
    assert caught.value.resumable
    partial, sidecar = partial_paths(dest)
    assert partial.read_bytes() == DATA[:4096]
    assert json.loads(sidecar.read_text()) == {"uid": UID, "sha256": sha(DATA), "total": len(DATA)}

    result = await download(FakeRpc(shards), dest)
    assert dest.read_bytes() == DATA
    assert (result.resumed_from, result.fetched, result.restarts) == (4096, len(DATA) - 4096, 0)


async def test_what_downloads_left_long_ago_is_swept_and_recent_partials_resume(
    tmp_path: Path,
) -> None:
    """A daemon killed mid-download (or whose project was left since) left its partial
    files for ever, counted against the disk budget. Those untouched for an hour go;
    a fresh one stays, and still resumes."""
    shards = server(Experts(ffn_0_0=DATA))
    rpc = FakeRpc(shards)
    rpc.fail_from = 5
    dest = tmp_path / "downloads" / "ffn.0.0.ckpt"
    with pytest.raises(ShardError):
        await download(rpc, dest, retries=2)
    old = tmp_path / "downloads" / "ffn.0.9.ckpt.partial"
    old.write_bytes(b"x" * 100)
    os.utime(old, (time.time() - STALE_S - 60,) * 2)
    (tmp_path / "downloads" / "folder").mkdir()  # not ours to judge: left alone

    assert sweep_downloads(tmp_path / "downloads") == [old]
    assert sorted(p.name for p in (tmp_path / "downloads").iterdir()) == [
        "ffn.0.0.ckpt.partial",
        "ffn.0.0.ckpt.partial.json",
        "folder",
    ]
    result = await download(FakeRpc(shards), dest)
    assert result.resumed_from == 4096
    # an hour on, what a download leaves is swept too
    partial, sidecar = partial_paths(tmp_path / "downloads" / "ffn.0.1.ckpt")
    partial.write_bytes(b"y")
    sidecar.write_text("{}")
    later = time.time() + STALE_S + 60
    assert sorted(sweep_downloads(tmp_path / "downloads", now=later)) == sorted(
        [dest, partial, sidecar]
    )
    assert sweep_downloads(tmp_path / "nowhere") == []


async def test_expired_snapshot_starts_the_download_again(tmp_path: Path) -> None:
    experts = Experts(ffn_0_0=DATA)
    shards = server(experts)
    rpc = FakeRpc(shards)
    rpc.fail_from = 3
    dest = tmp_path / "x"
    with pytest.raises(ShardError):
        await download(rpc, dest, retries=0)
    shards.clear()
    experts.states[UID] = newer = DATA[::-1]
    result = await download(FakeRpc(shards), dest)
    assert dest.read_bytes() == newer
    assert (result.sha256, result.resumed_from, result.restarts) == (sha(newer), 0, 1)


async def test_a_replica_restarted_with_the_same_state_resumes_the_download(
    tmp_path: Path,
) -> None:
    """Its snapshot is gone (``expired``), but a fresh one is the same bytes (the same
    state, restored from its checkpoint): the partial file stays, and only the rest is
    fetched (151 MiB were fetched again after such a restart; an outside audit)."""
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    rpc.fail_from = 5  # four chunks arrive, then the replica is gone
    dest = tmp_path / "x"
    with pytest.raises(ShardError):
        await download(rpc, dest, retries=0)
    restarted = FakeRpc(server(Experts(ffn_0_0=DATA)))  # nothing kept: a new process
    result = await download(restarted, dest)
    assert dest.read_bytes() == DATA
    assert (result.resumed_from, result.restarts) == (4096, 0)
    assert result.fetched == len(DATA) - 4096
    assert restarted.calls == 1 + 1 + (len(DATA) - 4096) // 1024  # expired, fresh, the rest


async def test_damaged_partial_file_is_detected_and_downloaded_again(tmp_path: Path) -> None:
    shards = server(Experts(ffn_0_0=DATA))
    rpc = FakeRpc(shards)
    rpc.fail_from = 6
    dest = tmp_path / "x"
    with pytest.raises(ShardError):
        await download(rpc, dest, retries=0)
    partial, _ = partial_paths(dest)
    damaged = bytearray(partial.read_bytes())
    damaged[100] ^= 0xFF
    partial.write_bytes(damaged)
    result = await download(FakeRpc(shards), dest)
    assert dest.read_bytes() == DATA
    # The second half, then everything again.
    assert (result.resumed_from, result.fetched, result.restarts) == (0, 5120 + len(DATA), 1)


async def test_bytes_that_do_not_match_their_hash_are_refused(tmp_path: Path) -> None:
    rpc = FakeRpc(server(Experts(ffn_0_0=DATA)))
    rpc.corrupt = {4}
    dest = tmp_path / "x"
    with pytest.raises(ShardError) as caught:
        await download(rpc, dest)
    assert not caught.value.resumable
    assert not dest.exists()
    assert not any(p.exists() for p in partial_paths(dest))


@pytest.mark.parametrize(
    "sidecar",
    [
        "not json",
        json.dumps({"uid": "ffn.1.1", "sha256": sha(DATA), "total": len(DATA)}),
        json.dumps({"uid": UID, "sha256": sha(DATA), "total": 10}),  # shorter than the file
        json.dumps({"uid": UID, "sha256": sha(DATA), "total": len(DATA), "extra": 1}),
    ],
)
async def test_partial_file_without_a_fitting_sidecar_is_discarded(
    tmp_path: Path, sidecar: str
) -> None:
    dest = tmp_path / "x"
    partial, side = partial_paths(dest)
    partial.write_bytes(b"junk" * 100)
    side.write_text(sidecar)
    result = await download(FakeRpc(server(Experts(ffn_0_0=DATA))), dest)
    assert dest.read_bytes() == DATA
    assert result.resumed_from == 0
    assert result.restarts == 0


async def test_expected_sha256_refuses_another_snapshot(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    with pytest.raises(ShardError):
        await download(FakeRpc(server(Experts(ffn_0_0=DATA))), dest, expected_sha256="0" * 64)
    assert not dest.exists()
    assert not any(p.exists() for p in partial_paths(dest))
    result = await download(FakeRpc(server(Experts(ffn_0_0=DATA))), dest, expected_sha256=sha(DATA))
    assert result.sha256 == sha(DATA)


async def test_reply_that_contradicts_the_download_is_refused(tmp_path: Path) -> None:
    experts = Experts(ffn_0_0=DATA)
    rpc = FakeRpc(server(experts))
    original = rpc.call_raw

    async def lying(
        peer: PeerAddress, verb: Verb, header: Any, *, max_body_bytes: int | None = None
    ) -> tuple[Any, memoryview]:
        reply, body = await original(peer, verb, header, max_body_bytes=max_body_bytes)
        if rpc.calls == 3:
            reply = reply.model_copy(update={"total": reply.total + 1})
        return reply, body

    rpc.call_raw = lying  # type: ignore[method-assign]
    with pytest.raises(ShardError, match="in all"):
        await download(rpc, tmp_path / "x")


async def test_complete_partial_file_is_finished_without_asking_again(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    partial, side = partial_paths(dest)
    partial.write_bytes(DATA)
    side.write_text(json.dumps({"uid": UID, "sha256": sha(DATA), "total": len(DATA)}))
    rpc = FakeRpc(server(Experts(ffn_0_0=b"")))
    result = await download(rpc, dest)
    assert dest.read_bytes() == DATA
    assert (result.resumed_from, result.fetched, rpc.calls) == (len(DATA), 0, 0)


async def test_snapshot_larger_than_max_bytes_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "x"
    with pytest.raises(ShardError, match="more than"):
        await download(FakeRpc(server(Experts(ffn_0_0=DATA))), dest, max_bytes=len(DATA) - 1)
    assert not any(p.exists() for p in partial_paths(dest))


async def test_unknown_expert_is_not_retried(tmp_path: Path) -> None:
    rpc = FakeRpc(server(Experts(ffn_0_1=DATA)))
    with pytest.raises(RemoteError) as caught:
        await download(rpc, tmp_path / "x")
    assert caught.value.code == "unknown_expert"
    assert rpc.calls == 1


async def test_empty_snapshot_downloads_to_an_empty_file(tmp_path: Path) -> None:
    result = await download(FakeRpc(server(Experts(ffn_0_0=b""))), tmp_path / "x")
    assert result.size == 0
    assert (tmp_path / "x").read_bytes() == b""


async def test_a_replica_announcing_more_than_the_expert_can_take_is_refused_at_once(
    tmp_path: Path,
) -> None:
    """A 9 KB expert's replica announced 300 MiB and the joiner fetched and read all of
    it before refusing the bytes: the downloader bounds a state by the expert's size."""
    from volunteerd.config import ExpertsConfig
    from volunteerd.experts import ExpertBackend
    from volunteerd.swarm.download import ShardDownloader

    backend = ExpertBackend("ffn.0.0", ExpertsConfig(hidden_dim=8), torch.device("cpu"), 64)
    bound = backend.largest_state_bytes()
    assert bound < 2 << 20
    rpc = FakeRpc(server(Experts(ffn_0_0=bytes(bound + 1))))
    with pytest.raises(ShardError, match=f"more than {bound}"):
        await ShardDownloader(rpc, tmp_path, 60).download(PEER, backend)  # type: ignore[arg-type]
    assert rpc.calls == 1  # the first reply's total was enough


class Trickling(FakeRpc):
    """Answers every request just before the RPC client's ``request_s`` would give up
    on it (an outside probe's replica: 13 bytes in 600 s); with ``short``, with one
    byte whatever was asked for."""

    short = False

    async def call_raw(
        self, peer: PeerAddress, verb: Verb, header: Any, *, max_body_bytes: int | None = None
    ) -> tuple[Any, memoryview]:
        await trio.sleep(59.0)
        if self.short:
            header = header.model_copy(update={"length": 1})
        return await super().call_raw(peer, verb, header, max_body_bytes=max_body_bytes)


async def test_a_replica_that_falls_behind_the_rate_is_dropped_after_the_grace(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """In virtual time, the file's writes inline (``inline_threads``): exact times."""
    rpc = Trickling(server(Experts(ffn_0_0=DATA)))
    start = trio.current_time()
    with pytest.raises(ShardError, match="slower than 32768 bytes a second") as failed:
        await download(rpc, tmp_path / "x", min_rate=32 << 10, grace_s=5.0)
    assert trio.current_time() - start == pytest.approx(5.0)  # was 600 s: 10 x request_s
    assert failed.value.resumable
    assert not (tmp_path / "x").exists()
    # a replica that keeps up is not cut, however many requests it takes
    honest = FakeRpc(server(Experts(ffn_0_0=DATA)))
    await download(honest, tmp_path / "y", min_rate=32 << 10, grace_s=5.0, chunk_bytes=64)
    assert (tmp_path / "y").read_bytes() == DATA


async def test_a_chunk_shorter_than_asked_before_the_end_is_refused(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """One byte a request: each cost the requester a whole RPC (a trainer fetching from
    such a peer trained at half its speed). A server sends what was asked for, up to
    its cap and the end."""
    rpc = Trickling(server(Experts(ffn_0_0=DATA)))
    rpc.short = True
    with pytest.raises(ShardError, match="1 bytes before the end, asked for 1024"):
        await download(rpc, tmp_path / "x")
    assert rpc.calls == 1
    # the last chunk is shorter than asked: the end
    honest = FakeRpc(server(Experts(ffn_0_0=DATA[:1500])))
    await download(honest, tmp_path / "y")
    assert (tmp_path / "y").read_bytes() == DATA[:1500]


class Queued(FakeRpc):
    """A replica whose bulk slots are taken: the first request waits ``queue_s`` for
    its turn, then every chunk comes at once; with ``stall_after``, requests after that
    many answers wait for ever (a replica that stops sending)."""

    def __init__(self, shards: ShardServer, queue_s: float, stall_after: int = 0) -> None:
        super().__init__(shards)
        self.queue_s = queue_s
        self.stall_after = stall_after

    async def call_raw(
        self, peer: PeerAddress, verb: Verb, header: Any, *, max_body_bytes: int | None = None
    ) -> tuple[Any, memoryview]:
        if self.calls == 0:
            await trio.sleep(self.queue_s)
        elif self.stall_after and self.calls >= self.stall_after:
            await trio.sleep_forever()
        return await super().call_raw(peer, verb, header, max_body_bytes=max_body_bytes)


def _expert_file() -> tuple[Any, bytes]:
    from volunteerd.config import ExpertsConfig
    from volunteerd.experts import ExpertBackend
    from volunteerd.experts.checkpoint_file import encode_checkpoint

    backend = ExpertBackend("ffn.0.0", ExpertsConfig(hidden_dim=8), torch.device("cpu"), 64)
    return backend, b"".join(bytes(piece) for piece in encode_checkpoint(backend.state()))


class Paced(FakeRpc):
    """A replica on a slow uplink: each chunk takes its bytes at ``rate`` (the first
    at once with ``fast_start``)."""

    def __init__(self, shards: ShardServer, rate: float, *, fast_start: bool = False) -> None:
        super().__init__(shards)
        self.rate = rate
        self.fast_start = fast_start

    async def call_raw(
        self, peer: PeerAddress, verb: Verb, header: Any, *, max_body_bytes: int | None = None
    ) -> tuple[Any, memoryview]:
        reply, body = await super().call_raw(peer, verb, header, max_body_bytes=max_body_bytes)
        if not (self.fast_start and self.calls == 1):
            await trio.sleep(body.nbytes / self.rate)
        return reply, body


async def test_a_big_expert_over_a_slow_uplink_has_the_time_its_bytes_take(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """The whole download was bounded by 10 request timeouts (600 s), whatever its size:
    a trained expert of width 2048 was cut at 141 of 384 MiB over a 2 Mbit/s uplink, every
    try (an outside audit). The bound now adds the expert's snapshot at the least rate;
    a replica below that rate is still cut by the pace."""
    from volunteerd.config import ExpertsConfig, TimeoutsConfig
    from volunteerd.experts import ExpertBackend
    from volunteerd.experts.checkpoint_file import encode_checkpoint
    from volunteerd.runtime.averaging import MIN_REPLY_RATE
    from volunteerd.swarm.download import ShardDownloader

    backend = ExpertBackend("ffn.0.0", ExpertsConfig(hidden_dim=256), torch.device("cpu"), 64)
    data = b"".join(bytes(piece) for piece in encode_checkpoint(backend.state()))  # untrained
    timeouts = TimeoutsConfig(request_s=1.0)  # 10 s for the whole, before
    rate = 2 * MIN_REPLY_RATE  # twice the least rate: 2-3x the old bound
    assert 2 * 10 < len(data) / rate < 4 * 10
    slow = Paced(server(Experts(ffn_0_0=data)), rate)
    downloader = ShardDownloader.for_node(slow, tmp_path, timeouts)  # type: ignore[arg-type]
    start = trio.current_time()
    state = await downloader.download(PEER, backend)
    assert state.uid == "ffn.0.0"
    assert trio.current_time() - start == pytest.approx(len(data) / rate, rel=0.01)
    assert downloader.download_bound_s(backend) >= 10 + len(data) / MIN_REPLY_RATE
    # below the least rate: cut by the pace, its bytes kept for the next call
    slower = Paced(server(Experts(ffn_0_0=data)), MIN_REPLY_RATE / 2, fast_start=True)
    downloader = ShardDownloader.for_node(slower, tmp_path, timeouts)  # type: ignore[arg-type]
    with pytest.raises(ShardTooSlow) as cut:
        await downloader.download(PEER, backend)
    assert cut.value.fetched > 0
    assert partial_paths(tmp_path / "ffn.0.0.ckpt")[0].stat().st_size == cut.value.fetched


async def test_a_download_under_way_says_how_far_it_is_and_how_long_it_takes(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """For the joiner's ``waiting``: a big expert over a slow uplink takes up to an
    hour, and the volunteer saw "joining" and a rate."""
    from volunteerd.config import ExpertsConfig, TimeoutsConfig
    from volunteerd.experts import ExpertBackend
    from volunteerd.experts.checkpoint_file import encode_checkpoint
    from volunteerd.swarm.download import ShardDownloader

    backend = ExpertBackend("ffn.0.0", ExpertsConfig(hidden_dim=512), torch.device("cpu"), 64)
    data = b"".join(bytes(piece) for piece in encode_checkpoint(backend.state()))  # 8 MiB
    paced = Paced(server(Experts(ffn_0_0=data)), 1 << 17)  # 1 Mbit/s: a MiB in 8 s
    downloader = ShardDownloader.for_node(paced, tmp_path, TimeoutsConfig())  # type: ignore[arg-type]
    shown: list[str | None] = []

    async def watch() -> None:
        for _ in range(3):
            await trio.sleep(4.0 if not shown else 8.0)
            going = downloader.progress("ffn.0.0")
            shown.append(going.shown() if going is not None else None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await downloader.download(PEER, backend)
    assert shown == [
        None,  # nothing came yet
        "downloading ffn.0.0: 1 of 8 MiB",  # one chunk: no rate yet
        "downloading ffn.0.0: 2 of 8 MiB at 1.0 Mbit/s, ~48 s left",
    ]
    assert downloader.progress("ffn.0.0") is None  # none under way


@pytest.mark.parametrize("queue_s", [8.0, 20.0])
async def test_a_newcomer_waits_its_turn_in_a_replicas_queue(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None, queue_s: float
) -> None:
    """A seed answers 4 shard requests at once and keeps the others waiting up to half
    its request_s (30 s); the download's 5 s grace counted that wait, so every joiner
    beyond the fourth failed at 5 s and seeded its expert (an outside audit: 59 of 72)."""
    from volunteerd.swarm.download import ShardDownloader

    backend, data = _expert_file()
    rpc = Queued(server(Experts(ffn_0_0=data)), queue_s)
    start = trio.current_time()
    state = await ShardDownloader(rpc, tmp_path, 600).download(PEER, backend)  # type: ignore[arg-type]
    assert state.uid == "ffn.0.0"
    assert trio.current_time() - start == pytest.approx(queue_s)


async def test_the_pace_counts_from_the_first_reply_and_a_queue_past_its_bound_fails(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    """The queue's wait is granted once, before the first reply: a replica still silent
    after it plus the grace fails, saying it only kept the request waiting (a
    RequestTimeout as the cause: the joiner tries it again later); one that answered
    and then stopped sending fails at the pace counted from that answer."""
    silent = Queued(server(Experts(ffn_0_0=DATA)), 50.0)
    start = trio.current_time()
    with pytest.raises(ShardError, match=r"0 bytes in 35\.0 s") as failed:
        await download(silent, tmp_path / "x", min_rate=1024, grace_s=5.0, queue_s=30.0)
    assert isinstance(failed.value.__cause__, RequestTimeout)
    assert trio.current_time() - start == pytest.approx(35.0)
    stalling = Queued(server(Experts(ffn_0_0=DATA)), 20.0, stall_after=2)
    start = trio.current_time()
    with pytest.raises(ShardError, match=r"2048 bytes in 27\.0 s") as failed:
        await download(stalling, tmp_path / "y", min_rate=1024, grace_s=5.0, queue_s=30.0)
    # the first reply came at 20 s: 5 s of grace, then 2 KiB at 1 KiB a second
    assert trio.current_time() - start == pytest.approx(27.0)
    assert failed.value.__cause__ is None  # it sent bytes: slow, not queued
