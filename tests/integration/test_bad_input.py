"""Bad input from the network gets a typed error reply; the daemon keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from volunteerd.daemon import Running
from volunteerd.errors import RemoteError
from volunteerd.experts import to_wire
from volunteerd.net import PROTOCOLS, Node, Verb
from volunteerd.net.framing import read_frame_rest, read_prefix
from volunteerd.net.host import Libp2pStream
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import PREFIX, ForwardRequest, TensorMeta, encode_frame

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

HIDDEN = 32


@asynccontextmanager
async def daemon_and_client(
    tmp_path: Path, **sections: dict
) -> AsyncIterator[tuple[Running, Node]]:  # type: ignore[type-arg]
    async with open_peer(local_config()) as boot:
        config = local_config(bootstrap=boot.multiaddrs, uids="ffn.0.[0:2]", **sections)
        async with (
            open_daemon(config, tmp_path / "d") as server,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as client,
        ):
            yield server, client


async def forward(
    client: Node, server: Running, x: torch.Tensor, uid: str = "ffn.0.0"
) -> torch.Tensor:
    meta, data = to_wire(x)
    header, tensors = await client.rpc.call(
        server.node.address, Verb.FORWARD, ForwardRequest(uid=uid, tensors=[meta]), [data]
    )
    assert header.tensors[0].shape == tuple(x.shape)
    return torch.frombuffer(bytearray(tensors[0].data), dtype=torch.float32).view(x.shape)


async def raw_exchange(
    client: Node, server: Running, payload: bytes, *, close: bool = False, verb: Verb = Verb.FORWARD
) -> dict | None:  # type: ignore[type-arg]
    """Write raw bytes on a fresh stream of ``verb``; return the reply header (or None if
    the server closed the stream without a reply)."""
    stream = await client.host.new_stream(
        ID.from_base58(server.node.peer_id), [TProtocol(PROTOCOLS[verb].protocol_id)]
    )
    await stream.write(payload)
    if close:
        await stream.close_write()
    reader = Libp2pStream(stream)
    with trio.fail_after(10):
        prefix = await read_prefix(reader)
        if prefix is None:
            return None
        frame = await read_frame_rest(reader, bytes(prefix), local_config().wire)
    await stream.close()
    return json.loads(frame.header)


def raw_frame(header: object, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return PREFIX.pack(b"VD", 1, 0, len(raw), len(body)) + raw + body


async def test_each_kind_of_bad_frame_gets_its_typed_error(tmp_path: Path) -> None:
    async with daemon_and_client(tmp_path) as (server, client):
        good = torch.randn(3, HIDDEN)
        expected = await forward(client, server, good)

        cases = {
            "malformed": raw_frame({"uid": "ffn.0.0", "tensors": "nope"}),
            "too_large": PREFIX.pack(b"VD", 1, 0, 10, 1 << 40),
            "unsupported_version": PREFIX.pack(b"VD", 7, 0, 10, 0),
        }
        for code, payload in cases.items():
            reply = await raw_exchange(client, server, payload)
            assert reply == {"status": "error", "code": code, "message": reply["message"]}, code
        garbage = await raw_exchange(client, server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
        assert garbage is not None
        assert garbage["code"] == "malformed"
        meta, data = to_wire(good)
        full = encode_frame(ForwardRequest(uid="ffn.0.0", tensors=[meta]), [data])
        truncated = full[:-100]
        reply = await raw_exchange(client, server, truncated, close=True)
        assert reply is not None
        assert reply["code"] == "malformed"
        assert "ended inside a frame" in reply["message"]

        # Still serving, with the same weights.
        torch.testing.assert_close(await forward(client, server, good), expected)
        errors = server.node.server.stats.errors
        assert errors["malformed"] >= 3
        assert errors["too_large"] == 1


@pytest.mark.parametrize(
    ("meta", "code"),
    [
        (TensorMeta(dtype="float16", shape=(3, HIDDEN)), "bad_dtype"),
        (TensorMeta(dtype="float32", shape=(3, HIDDEN + 1)), "bad_shape"),
        (TensorMeta(dtype="float32", shape=(3, 2, HIDDEN)), "bad_shape"),
        (TensorMeta(dtype="float32", shape=(100_000, HIDDEN)), "too_large"),
    ],
)
async def test_wrong_dtype_or_shape_is_refused_and_the_stream_stays_usable(
    tmp_path: Path, meta: TensorMeta, code: str
) -> None:
    async with daemon_and_client(tmp_path) as (server, client):
        body = b"\0" * meta.nbytes
        with pytest.raises(RemoteError) as info:
            await client.rpc.call(
                server.node.address,
                Verb.FORWARD,
                ForwardRequest(uid="ffn.0.0", tensors=[meta]),
                [body],
            )
        assert info.value.code == code
        out = await forward(client, server, torch.randn(2, HIDDEN))
        assert out.shape == (2, HIDDEN)


async def test_unknown_expert_is_a_typed_error(tmp_path: Path) -> None:
    async with daemon_and_client(tmp_path) as (server, client):
        with pytest.raises(RemoteError) as info:
            await forward(client, server, torch.randn(2, HIDDEN), uid="ffn.9.9")
        assert info.value.code == "unknown_expert"


async def test_a_sender_that_stalls_inside_a_frame_is_dropped(tmp_path: Path) -> None:
    async with daemon_and_client(tmp_path, timeouts={"frame_read_s": 0.5}) as (server, client):
        stream = await client.host.new_stream(
            ID.from_base58(server.node.peer_id), [TProtocol(PROTOCOLS[Verb.FORWARD].protocol_id)]
        )
        meta, data = to_wire(torch.randn(2, HIDDEN))
        frame = encode_frame(ForwardRequest(uid="ffn.0.0", tensors=[meta]), [data])
        await stream.write(frame[:40])  # then nothing
        with trio.fail_after(5):
            dropped = False
            try:
                dropped = await stream.read(1) == b""
            except Exception:  # reset or EOF: either way the server dropped the stream
                dropped = True
        assert dropped
        assert server.node.server.stats.errors.get("slow_sender") == 1
        assert (await forward(client, server, torch.randn(2, HIDDEN))).shape == (2, HIDDEN)


async def test_a_verb_without_tensors_refuses_a_body_from_its_prefix(tmp_path: Path) -> None:
    """255 MiB declared on `info` (which carries no tensors) is refused before a byte of
    it is read; it used to be read in full, four such frames costing a gigabyte."""
    async with daemon_and_client(tmp_path) as (server, client):
        declared = 255 << 20
        raw = json.dumps({"uid": "ffn.0.0"}).encode()
        payload = PREFIX.pack(b"VD", 1, 0, len(raw), declared) + raw + bytes(64 << 10)
        reply = await raw_exchange(client, server, payload, verb=Verb.INFO)
        assert reply is not None
        assert reply["code"] == "too_large"
        assert "carry no tensors" in reply["message"]
        assert server.node.server.stats.bytes_in < 1 << 20
        await forward(client, server, torch.randn(2, HIDDEN))  # still serving


async def test_requests_in_flight_share_one_byte_budget(tmp_path: Path) -> None:
    """Frames being read count against max_inflight_mib, all peers together: while one
    peer's 900 KiB frame is in flight, another's 500 KiB is refused busy, then served."""
    async with (
        daemon_and_client(
            tmp_path, wire={"max_inflight_mib": 1}, runtime={"max_batch_size": 8192}
        ) as (server, client),
        open_peer(local_config()) as other,
    ):
        meta, data = to_wire(torch.randn(900 * 1024 // (4 * HIDDEN), HIDDEN))
        frame = encode_frame(ForwardRequest(uid="ffn.0.0", tensors=[meta]), [data])
        stream = await client.host.new_stream(
            ID.from_base58(server.node.peer_id), [TProtocol(PROTOCOLS[Verb.FORWARD].protocol_id)]
        )
        await stream.write(frame[: len(frame) // 2])  # and stalls, inside its frame
        with trio.fail_after(10):
            while server.node.server.inflight_bytes < len(frame):  # noqa: ASYNC110 - polling
                await trio.sleep(0.01)
        small = torch.randn(500 * 1024 // (4 * HIDDEN), HIDDEN)
        with pytest.raises(RemoteError) as refused:
            await forward(other, server, small)
        assert refused.value.code == "busy"
        await stream.write(frame[len(frame) // 2 :])
        with trio.fail_after(10):
            prefix = await read_prefix(Libp2pStream(stream))
            assert prefix is not None
            reply = await read_frame_rest(Libp2pStream(stream), bytes(prefix), local_config().wire)
        assert json.loads(reply.header)["status"] == "ok"
        await stream.close()
        await forward(other, server, small)
        assert server.node.server.inflight_bytes == 0


async def test_a_batch_over_the_cap_is_refused_before_its_tensors_are_read(
    tmp_path: Path,
) -> None:
    """610 forwards of 8192 rows against a cap of 2048 were each read whole (~640 MB
    counted against the quotas) to be refused: refused from the header now."""
    async with daemon_and_client(tmp_path, runtime={"max_batch_size": 64}) as (server, client):
        meta = TensorMeta(dtype="float32", shape=(8192, HIDDEN))
        read_before = server.node.server.stats.bytes_in
        with pytest.raises(RemoteError, match="8192 samples exceeds the cap of 64") as info:
            await client.rpc.call(
                server.node.address,
                Verb.FORWARD,
                ForwardRequest(uid="ffn.0.0", tensors=[meta]),
                [b"\0" * meta.nbytes],
            )
        assert info.value.code == "too_large"
        assert server.node.server.stats.bytes_in == read_before  # its body was never read
        out = await forward(client, server, torch.randn(2, HIDDEN))  # and it goes on
        assert out.shape == (2, HIDDEN)
        # an expert this node does not host is answered as one, whatever the size:
        # trainers' directories count unknown_expert answers, not too_large ones
        with pytest.raises(RemoteError) as info:
            await client.rpc.call(
                server.node.address,
                Verb.FORWARD,
                ForwardRequest(uid="ffn.9.9", tensors=[meta]),
                [b"\0" * meta.nbytes],
            )
        assert info.value.code == "unknown_expert"
