"""The control API of a real daemon (real libp2p on loopback, real HTTP on 127.0.0.1,
port 0): every route, its security (token, Host, Origin), body validation, that a
pause through the API really withdraws the daemon's announcements, and that the
contribution counts are exact and survive a restart."""

from __future__ import annotations

import http.client
import json
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd.control.api import ROUTES
from volunteerd.control.client import ControlClient
from volunteerd.daemon import Running
from volunteerd.errors import ControlError, DaemonNotRunning, RemoteError
from volunteerd.experts import to_wire
from volunteerd.net import Node, Verb
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import BackwardRequest, ForwardRequest

HIDDEN = 16
GRID = "ffn.[0:2].[0:1]"


def config_for(boot: Node, **sections: Any) -> Any:
    return local_config(
        bootstrap=boot.multiaddrs, uids=GRID, experts={"hidden_dim": HIDDEN}, **sections
    )


def client_of(daemon: Running, data_dir: Path) -> ControlClient:
    client = ControlClient.for_data_dir(data_dir)
    assert client.endpoint.url == daemon.control_url
    return client


async def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def raw(
    url: str, method: str, path: str, *, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, Any]:
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode()


async def forward(client: Node, daemon: Running, uid: str, rows: int) -> None:
    meta, data = to_wire(torch.randn(rows, HIDDEN))
    await client.rpc.call(
        daemon.node.address, Verb.FORWARD, ForwardRequest(uid=uid, tensors=[meta]), [data]
    )


async def backward(client: Node, daemon: Running, uid: str, rows: int) -> None:
    x_meta, x = to_wire(torch.randn(rows, HIDDEN))
    g_meta, g = to_wire(torch.randn(rows, HIDDEN))
    await client.rpc.call(
        daemon.node.address,
        Verb.BACKWARD,
        BackwardRequest(uid=uid, tensors=[x_meta, g_meta]),
        [x, g],
    )


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float = 8.0) -> None:
    with trio.fail_after(within_s):
        while not await check():  # noqa: ASYNC110 - polling, not an event
            await trio.sleep(0.1)


async def test_every_route_answers_with_the_token(tmp_path: Path) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(config_for(boot), tmp_path / "a") as daemon,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as trainer,
    ):
        client = client_of(daemon, tmp_path / "a")
        token_file = tmp_path / "a" / "api-token"
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        await forward(trainer, daemon, "ffn.0.0", 3)

        health = await call(client.health)
        assert health.ok
        status = await call(client.status)
        assert status.state == "running"
        assert status.serving
        assert status.peer_id == daemon.node.peer_id
        assert status.experts == ["ffn.0.0", "ffn.1.0"]
        assert status.device == "cpu"
        assert status.limits.upload_mbit == 0
        assert status.connected_peers >= 1
        assert status.today.forward == 1
        assert status.today.samples == 3

        experts = {e.uid: e for e in await call(client.experts)}
        assert experts["ffn.0.0"].forward == 1
        assert experts["ffn.0.0"].samples == 3
        assert experts["ffn.0.0"].last_used is not None
        assert experts["ffn.1.0"].forward == 0
        assert experts["ffn.1.0"].last_used is None

        peers = {p.peer_id: p for p in await call(client.peers)}
        assert peers[trainer.peer_id].requests == 1

        stats = await call(client.stats)
        assert stats.all_time.forward == 1
        assert stats.all_time.samples == 3
        assert stats.today.forward == 1
        assert stats.week.forward == 1

        limits = await call(client.set_limits, upload_mbit=12.5)
        assert limits.upload_mbit == 12.5
        assert (await call(client.limits)).upload_mbit == 12.5
        assert daemon.node.throttle.statistics().upload_mbit == 12.5

        paused = await call(client.pause)
        assert paused.state == "paused"
        assert not paused.serving
        snoozed = await call(client.snooze, 3600)
        assert snoozed.state == "snoozed"
        assert snoozed.snoozed_until is not None
        resumed = await call(client.resume)
        assert resumed.state == "running"
        assert resumed.serving

        events = await call(client.events, 0)
        kinds = [e.message for e in events.events]
        assert any("paused" in m for m in kinds), kinds
        assert any("limits changed: upload_mbit = 12.5" in m for m in kinds), kinds
        assert events.next == events.events[-1].id

        metrics = await call(client.metrics)
        assert 'volunteerd_expert_requests_total{uid="ffn.0.0",kind="forward"} 1' in metrics
        assert "volunteerd_serving 1" in metrics

        # Every route of the table was exercised above or is exercised here.
        assert {path.rsplit("/", 1)[-1] for _, path, _, _ in ROUTES} == {
            "health", "status", "experts", "peers", "stats", "limits", "pause", "resume",
            "snooze", "events", "shutdown", "metrics",
        }  # fmt: skip
        await call(client.shutdown)  # the daemon stops by itself
        with trio.fail_after(15):
            while (tmp_path / "a" / "control.json").exists():  # noqa: ASYNC110 - a file
                await trio.sleep(0.05)
    with pytest.raises(DaemonNotRunning):
        ControlClient.for_data_dir(tmp_path / "a")


async def test_security_token_host_origin_and_bodies(tmp_path: Path) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(config_for(boot), tmp_path / "a") as daemon,
    ):
        url = daemon.control_url
        assert url is not None
        assert url.startswith("http://127.0.0.1:")
        port = url.rsplit(":", 1)[1]
        token = (tmp_path / "a" / "api-token").read_text().strip()
        good = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {token}"}

        def ask(method: str, path: str, body: bytes | None = None, **headers: str) -> Any:
            merged = {**good, **headers}
            merged = {k: v for k, v in merged.items() if v != ""}
            return raw(url, method, path, headers=merged, body=body)

        # Token: missing or wrong -> 401 on every route but health.
        for method, path, _, needs_token in ROUTES:
            if path.endswith("/shutdown"):
                continue
            body = b"{}" if method != "GET" else None
            code, _ = await call(ask, method, path, body, Authorization="")
            assert code == (401 if needs_token else 200), (method, path, code)
            code, _ = await call(ask, method, path, body, Authorization="Bearer nope")
            assert code == (401 if needs_token else 200), (method, path, code)
        code, _ = await call(ask, "POST", "/api/v1/shutdown", b"{}", Authorization="")
        assert code == 401

        # Every reply forbids framing (a hidden Pause button) and foreign resources.
        def headers_of(path: str) -> tuple[int, dict[str, str]]:
            conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=10)
            try:
                conn.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
                reply = conn.getresponse()
                reply.read()
                return reply.status, {k.lower(): v for k, v in reply.getheaders()}
            finally:
                conn.close()

        for path in ("/", "/api/v1/health", "/api/v1/status"):
            code, headers = await call(headers_of, path)
            assert code == (401 if path.endswith("status") else 200)
            assert headers["x-frame-options"] == "DENY"
            assert "frame-ancestors 'none'" in headers["content-security-policy"]
            assert "access-control-allow-origin" not in headers

        # Host: a DNS-rebinding name (or any other) -> 403, even for health.
        code, error = await call(ask, "GET", "/api/v1/health", Host=f"evil.example:{port}")
        assert code == 403
        assert "127.0.0.1" in error["error"]
        code, _ = await call(ask, "GET", "/api/v1/status", Host=f"localhost:{port}")
        assert code == 200
        # Origin: another site's page -> 403, and no CORS header is ever sent.
        code, _ = await call(ask, "POST", "/api/v1/pause", b"{}", Origin="http://evil.example")
        assert code == 403
        assert daemon.volunteer is not None
        assert daemon.volunteer.state.mode == "running"

        # Bodies: validated, 422 naming the field.
        code, error = await call(ask, "PATCH", "/api/v1/limits", b'{"upload_mbit": -1}')
        assert code == 422
        assert error["field"] == "upload_mbit"
        code, error = await call(ask, "PATCH", "/api/v1/limits", b'{"uplod_mbit": 5}')
        assert code == 422
        assert error["field"] == "uplod_mbit"
        code, error = await call(ask, "PATCH", "/api/v1/limits", b'{"duty_cycle": "x"}')
        assert code == 422
        assert error["field"] == "duty_cycle"
        code, error = await call(ask, "POST", "/api/v1/snooze", b'{"seconds": 0}')
        assert code == 422
        assert error["field"] == "seconds"
        code, error = await call(ask, "POST", "/api/v1/snooze", b"{}")
        assert code == 422
        assert error["field"] == "seconds"
        code, error = await call(ask, "POST", "/api/v1/snooze", b"not json")
        assert code == 422
        assert error["field"] == "body"
        code, error = await call(ask, "GET", "/api/v1/events?since=abc")
        assert code == 422
        assert error["field"] == "since"
        code, error = await call(ask, "GET", "/api/v1/events?wait_s=1e9")
        assert code == 422
        assert error["field"] == "wait_s"
        code, _ = await call(ask, "GET", "/api/v1/nothing")
        assert code == 404
        code, _ = await call(ask, "DELETE", "/api/v1/status")
        assert code == 405
        # Nothing above changed the daemon, and it still answers.
        assert daemon.volunteer.limits.upload_mbit == 0
        code, status = await call(ask, "GET", "/api/v1/status")
        assert code == 200
        assert status["state"] == "running"

        # The typed client turns refusals into ControlError with the field.
        client = client_of(daemon, tmp_path / "a")
        with pytest.raises(ControlError) as refused:
            await call(client.set_limits, download_mbit=-3)
        assert refused.value.status == 422
        assert refused.value.field == "download_mbit"


async def test_pause_through_the_api_withdraws_the_announcements(tmp_path: Path) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(config_for(boot), tmp_path / "a") as daemon,
        open_peer(local_config(bootstrap=boot.multiaddrs)) as trainer,
    ):
        client = client_of(daemon, tmp_path / "a")

        async def announced() -> bool:
            records = (await trainer.dht.get(["ffn.0.0"]))["ffn.0.0"]
            return any(r.peer_id == daemon.node.peer_id for r in records)

        await eventually(announced)
        waiter = trio.Event()
        seen: list[str] = []

        async def long_poll() -> None:  # a client waiting for the next event
            since = (await call(client.events, 0)).next
            got = await call(client.events, since, wait_s=20)
            seen.extend(e.message for e in got.events)
            waiter.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_poll)
            await trio.sleep(0.3)
            await call(client.pause)
            with trio.fail_after(10):
                await waiter.wait()
        assert any(m.startswith("paused") for m in seen), seen

        async def withdrawn() -> bool:
            return not await announced()

        await eventually(withdrawn)
        with pytest.raises(RemoteError) as refused:
            await forward(trainer, daemon, "ffn.0.0", 2)
        assert refused.value.code == "paused"
        await call(client.resume)
        await eventually(announced)
        await forward(trainer, daemon, "ffn.0.0", 2)
        rejected = (await call(client.stats)).all_time.rejected
        assert rejected == {"paused": 1}


async def test_counts_are_exact_and_survive_a_restart(tmp_path: Path) -> None:
    async with open_peer(local_config()) as boot:
        config = config_for(boot)
        async with (
            open_daemon(config, tmp_path / "a") as daemon,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as trainer,
        ):
            for rows in (1, 2, 3, 4, 5):
                await forward(trainer, daemon, "ffn.0.0", rows)
            for rows in (6, 7):
                await backward(trainer, daemon, "ffn.1.0", rows)
            meta, data = to_wire(torch.randn(2, HIDDEN + 1))
            with pytest.raises(RemoteError):  # wrong width: refused, counted by reason
                await trainer.rpc.call(
                    daemon.node.address,
                    Verb.FORWARD,
                    ForwardRequest(uid="ffn.0.0", tensors=[meta]),
                    [data],
                )
            client = client_of(daemon, tmp_path / "a")
            live = (await call(client.stats)).all_time
            assert (live.forward, live.backward, live.samples) == (5, 2, 15 + 13)
            assert live.rejected == {"bad_shape": 1}
            assert live.bytes_in == (15 + 2 * 13) * HIDDEN * 4
            assert live.bytes_out == (15 + 13) * HIDDEN * 4
        # stopped gracefully; start again on the same data folder
        async with open_daemon(config, tmp_path / "a") as again:
            client = client_of(again, tmp_path / "a")
            kept = await call(client.stats)
            assert (kept.all_time.forward, kept.all_time.backward) == (5, 2)
            assert kept.all_time.samples == 28
            assert kept.all_time.rejected == {"bad_shape": 1}
            assert kept.all_time.compute_s > 0
            assert kept.all_time.running_s > 0
            assert sum(b.samples for b in kept.history) == 28
            status = await call(client.status)
            assert status.today.samples == 28


async def test_a_damaged_stats_file_is_moved_aside(tmp_path: Path) -> None:
    data = tmp_path / "a"
    data.mkdir()
    (data / "stats.sqlite3").write_bytes(b"this is not a database" * 100)
    async with (
        open_peer(local_config()) as boot,
        open_daemon(config_for(boot), data) as daemon,
    ):
        client = client_of(daemon, data)
        assert (await call(client.stats)).all_time.forward == 0
    kept = [p.name for p in data.iterdir() if p.name.startswith("stats.sqlite3.unreadable-")]
    assert kept, os.listdir(data)
