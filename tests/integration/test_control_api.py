"""The control API of a real daemon (real libp2p on loopback, real HTTP on 127.0.0.1,
port 0): every route, its security (token, Host, Origin), body validation, that a
pause through the API really withdraws the daemon's announcements, and that the
contribution counts are exact and survive a restart."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd import localtime
from volunteerd.control.api import ROUTES
from volunteerd.control.client import ControlClient
from volunteerd.daemon import Running
from volunteerd.errors import ControlError, DaemonNotRunning, RemoteError
from volunteerd.experts import to_wire
from volunteerd.net import Node, Verb
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import BackwardRequest, ForwardRequest

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

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
    status, _, data = raw_reply(url, method, path, headers=headers, body=body)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode()


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
        assert not peers[trainer.peer_id].banned
        # A peer the guard banned is listed as such (the dashboard's Standing column),
        # even one this daemon never counted a request of.
        assert daemon.runtime is not None
        daemon.runtime.guard.ban("12D3KooWbanned", "its gradients wrecked a step")
        peers = {p.peer_id: p for p in await call(client.peers)}
        assert peers["12D3KooWbanned"].banned
        assert 0 < peers["12D3KooWbanned"].banned_s <= daemon.runtime.guard.config.ban_s

        stats = await call(client.stats)
        assert stats.all_time.forward == 1
        assert stats.all_time.samples == 3
        assert stats.today.forward == 1
        assert stats.week.forward == 1

        # The live charts' recent past: sampled from the start, a point every few seconds.
        history = await call(client.history)
        assert history.window_s == 600
        assert history.samples, "the first sample is taken as the daemon starts"
        assert history.samples[0].t >= status.started_at
        assert [s.t for s in history.samples] == sorted(s.t for s in history.samples)

        limits = await call(client.set_limits, upload_mbit=12.5)
        assert limits.upload_mbit == 12.5
        assert (await call(client.limits)).upload_mbit == 12.5
        assert daemon.node.throttle.statistics().upload_mbit == 12.5
        limits = await call(client.set_limits, daily_quota_gb=50, disk_budget_gb=20, cpu_threads=1)
        assert (limits.daily_quota_gb, limits.disk_budget_gb, limits.cpu_threads) == (50, 20, 1)

        # The schedule: its rules, a change applied at once, and what it allows now.
        schedule = await call(client.schedule)
        assert (schedule.run, schedule.compute_hours) == ("always", [])
        changed = await call(client.set_schedule, compute_hours=["22:00-07:00"], on_battery=True)
        assert changed.compute_hours == ["22:00-07:00"]
        assert (await call(client.schedule)).on_battery
        assert (tmp_path / "a" / "schedule.toml").exists()
        await call(client.set_schedule, compute_hours=[])
        now = (await call(client.status)).schedule
        assert now.computing
        # the zone its hours go by, and its offset now
        assert (now.zone, now.utc_offset_s) == (localtime.zone_name(), localtime.utc_offset_s())

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
        assert any("upload limit set to 12.5 Mbit/s" in m for m in kinds), kinds
        assert events.next == events.events[-1].id

        metrics = await call(client.metrics)
        assert 'volunteerd_expert_requests_total{uid="ffn.0.0",kind="forward"} 1' in metrics
        assert "volunteerd_serving 1" in metrics
        # What a node spends on strangers is on the dashboard of any monitoring tool.
        budget = 64 << 20
        assert (
            f'volunteerd_dht_store_bytes{{store="records",kind="budget"}} {budget * 3 // 4:g}'
            in (metrics)
        )
        assert 'volunteerd_inbound_slots{state="total"} 900' in metrics
        assert "volunteerd_inflight_request_bytes 0" in metrics
        assert "volunteerd_guard_banned_peers 1" in metrics  # the one banned above

        # Projects (joined and left for real in test_projects.py): an invitation that
        # is none is refused saying why, a dry run records nothing, and leaving a
        # project this daemon is not in is a 404.
        with pytest.raises(ControlError) as refused:
            await call(client.join_project, "volunteerd://join/x?owner=nobody")
        assert refused.value.status == 400
        assert "not a valid invitation" in str(refused.value)
        invitation = f"volunteerd://join/x?owner={trainer.peer_id}&peer={boot.multiaddrs[0]}"
        checked = await call(client.join_project, invitation, dry_run=True)
        assert (checked.project.name, checked.project.owner) == ("x", trainer.peer_id)
        assert not checked.restarting
        assert not (tmp_path / "a" / "projects.toml").exists()
        with pytest.raises(ControlError) as missing:
            await call(client.leave_project, "x")
        assert missing.value.status == 404
        # bytes of the command line that are not UTF-8 (surrogates): no such project
        for name in ("a\udcff", "\udced\udca0\udc80"):
            with pytest.raises(ControlError, match="not in a project named") as missing:
                await call(client.leave_project, name)
            assert missing.value.status == 404

        # Every route of the table was exercised above or is exercised here.
        assert {path.rsplit("/", 1)[-1] for _, path, _, _ in ROUTES} == {
            "health", "status", "experts", "peers", "stats", "history", "limits", "schedule",
            "pause", "resume", "snooze", "events", "shutdown", "metrics", "projects", "{name}",
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
        polling, waiter = trio.Event(), trio.Event()
        seen: list[str] = []

        async def long_poll() -> None:  # a client waiting for the next events
            since = (await call(client.events, 0)).next
            polling.set()
            # until the pause: another event (a reachability check that ends late on a
            # loaded machine) may come first, and returns the request before it
            while not any(m.startswith("paused") for m in seen):
                got = await call(client.events, since, wait_s=20)
                seen.extend(e.message for e in got.events)
                since = got.next
            waiter.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_poll)
            # Paused only once the client holds the events from before: a pause that a
            # fixed 0.3 s let through first (a loaded machine) was among those, and the
            # wait for the next event found none. The 0.3 s after that makes it likely
            # that the pause wakes a waiting request; either way one returns it.
            with trio.fail_after(30):
                await polling.wait()
            await trio.sleep(0.3)
            await call(client.pause)
            with trio.move_on_after(10):
                await waiter.wait()
            nursery.cancel_scope.cancel()
        assert any(m.startswith("paused") for m in seen), seen

        async def withdrawn() -> bool:
            return not await announced()

        await eventually(withdrawn)
        read_before = daemon.node.server.stats.bytes_in
        with pytest.raises(RemoteError) as refused:
            await forward(trainer, daemon, "ffn.0.0", 2)
        assert refused.value.code == "paused"
        # refused from its prefix: a peer that keeps sending costs a paused daemon nothing
        assert daemon.node.server.stats.bytes_in == read_before
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


async def test_status_answers_while_the_stats_file_cannot_be_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A query of the stats file failing (here a disk error) made every status a 500:
    ``volunteerd status``, the dashboard and the tray got nothing for the whole run."""
    import sqlite3

    def disk_error(*args: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    async with (
        open_peer(local_config()) as boot,
        # No flush while the test runs: one (each second at the tests' flush_s) that
        # came between the count below and a status wrote the count to the file, where
        # a status that cannot read the file does not see it (with 1.2 s there, as a
        # loaded machine may take, 3 samples read as 0).
        open_daemon(config_for(boot, stats={"flush_s": 300}), tmp_path / "a") as daemon,
    ):
        assert daemon.controls is not None
        store = daemon.controls._accountant.store
        store.record("ffn.0.0", forward=1, samples=3)  # counted, not written yet
        store._sums = disk_error  # type: ignore[method-assign]
        client = client_of(daemon, tmp_path / "a")
        for _ in range(2):
            assert (await call(client.status)).today.samples == 3
        del store._sums
    failed = [r for r in caplog.records if "could not read the statistics" in r.getMessage()]
    assert [r.exc_info for r in failed] == [None, None]
    assert "GET /api/v1/status failed" not in caplog.text


def strict_json(text: str | bytes) -> Any:
    """Parse as a browser would: Infinity and NaN are not JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def raw_reply(
    url: str, method: str, path: str, *, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def hang_up_mid_body(url: str, headers: dict[str, str]) -> None:
    """PATCH /limits announcing 100 bytes of body, then closing after 5 of them."""
    port = int(url.rsplit(":", 1)[1])
    lines = ["PATCH /api/v1/limits HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    lines += ["Content-Type: application/json", "Content-Length: 100", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode() + b'{"upl')


def announce_huge_body(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    """PATCH /limits announcing 1 GiB of body; the reply, after only its first bytes."""
    port = int(url.rsplit(":", 1)[1])
    lines = ["PATCH /api/v1/limits HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    lines += ["Content-Type: application/json", f"Content-Length: {1 << 30}", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall("\r\n".join(lines).encode())
        sock.sendall(b'{"upload_mbit": 5')
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        return reply.status, strict_json(reply.read())


_ID = "12D3KooWN2cK7Wt448ipDy2ZHnA1dhJcHcwcL4T48AvWZFauku7K"
_UNIX_INVITATION = json.dumps(
    {"invitation": f"volunteerd://join/abc?owner={_ID}&peer=%2Funix%2Fa%2Fp2p%2F{_ID}"}
).encode()

# The attack of issue 12: each body once answered 500 (and Infinity made every later
# status and limits reply a 500), 1e300 applied half of its change, the deep body
# overflowed the parser's recursion. Each is now refused whole, naming the field.
BAD_BODIES: list[tuple[str, bytes, int, str]] = [
    ("/limits", b'{"upload_mbit": Infinity}', 422, "upload_mbit"),
    ("/limits", b'{"upload_mbit": 1e999}', 422, "upload_mbit"),
    ("/limits", b'{"download_mbit": -Infinity}', 422, "download_mbit"),
    ("/limits", b'{"download_mbit": NaN}', 422, "download_mbit"),
    ("/limits", b'{"upload_mbit": "inf"}', 422, "upload_mbit"),
    ("/limits", b'{"upload_mbit": 5, "monthly_quota_gb": 1e300}', 422, "monthly_quota_gb"),
    ("/limits", b'{"monthly_quota_gb": 1000001}', 422, "monthly_quota_gb"),
    ("/limits", b'{"upload_mbit": 100001, "download_mbit": 3}', 422, "upload_mbit"),
    ("/limits", b'{"upload_mbit": -1}', 422, "upload_mbit"),
    ("/limits", b'{"duty_cycle": NaN}', 422, "duty_cycle"),
    ("/limits", b'{"max_batch_size": 1e999}', 422, "max_batch_size"),
    ("/limits", b'{"daily_quota_gb": Infinity}', 422, "daily_quota_gb"),
    ("/limits", b'{"cpu_threads": -1}', 422, "cpu_threads"),
    ("/limits", b'{"disk_budget_gb": NaN}', 422, "disk_budget_gb"),
    ("/schedule", b'{"compute_hours": ["7:00-8:00"]}', 422, "compute_hours.0"),
    ("/schedule", b'{"idle_minutes": NaN}', 422, "idle_minutes"),
    ("/schedule", b'{"run": "sometimes"}', 422, "run"),
    ("/snooze", b'{"seconds": Infinity}', 422, "seconds"),
    ("/snooze", b'{"seconds": NaN}', 422, "seconds"),
    # a value of the wrong JSON type is refused, not converted (true was 1 Mbit/s)
    ("/limits", b'{"upload_mbit": true}', 422, "upload_mbit"),
    ("/limits", b'{"cpu_threads": true}', 422, "cpu_threads"),
    ("/limits", b'{"download_mbit": "7"}', 422, "download_mbit"),
    ("/snooze", b'{"seconds": true}', 422, "seconds"),
    ("/schedule", b'{"on_battery": "yes"}', 422, "on_battery"),
    # a socket path takes in the /p2p/ part: multiaddr's own error was a bare 500
    ("/projects", _UNIX_INVITATION, 400, "invitation"),
    ("/limits", b"[" * 30_000 + b"]" * 30_000, 422, "body"),
    ("/limits", b'{"upload_mbit": ' + b"[" * 40 + b"]" * 40 + b"}", 422, "body"),
    ("/limits", b'{"x": "' + b"[{" * 100 + b'\\""}', 422, "x"),  # brackets in a string
    ("/limits", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, 422, "body"),
    ("/limits", b'{"upload_mbit": 5' + b" " * (64 << 10) + b"}", 413, "body"),
]


async def test_bad_values_change_nothing_and_the_api_stays_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(config_for(boot), tmp_path / "a") as daemon,
    ):
        url = daemon.control_url
        assert url is not None
        assert daemon.volunteer is not None
        port = url.rsplit(":", 1)[1]
        token = (tmp_path / "a" / "api-token").read_text().strip()
        good = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {token}"}

        def ask(method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
            code, headers, data = raw_reply(url, method, path, headers=good, body=body)
            assert headers["content-type"] == "application/json", (path, code, data[:200])
            return code, strict_json(data)

        def settings(limits: dict[str, Any]) -> dict[str, Any]:
            # DHT traffic
            return {k: v for k, v in limits.items() if k not in ("month_bytes", "day_bytes")}

        code, before = await call(ask, "GET", "/api/v1/limits")
        assert code == 200
        before = settings(before)
        throttle_before = daemon.node.throttle.statistics()

        async def unchanged_and_answering(what: str) -> None:
            code, status = await call(ask, "GET", "/api/v1/status")
            assert code == 200, what
            assert status["state"] == "running", what
            assert settings(status["limits"]) == before, what
            code, limits = await call(ask, "GET", "/api/v1/limits")
            assert (code, settings(limits)) == (200, before), what
            now = daemon.node.throttle.statistics()
            assert (now.upload_mbit, now.download_mbit, now.quota_bytes) == (
                throttle_before.upload_mbit,
                throttle_before.download_mbit,
                throttle_before.quota_bytes,
            ), what

        for path, body, expected, field in BAD_BODIES:
            what = f"{path} {body[:60]!r}"
            method = "PATCH" if path in ("/limits", "/schedule") else "POST"
            code, error = await call(ask, method, "/api/v1" + path, body)
            assert code == expected, (what, code, error)
            assert error["field"] == field, (what, error)
            if (expected, field) == (422, "body"):
                assert error["error"] == "body: nested deeper than 32 levels", what
            await unchanged_and_answering(what)
        # A body announced far over the cap is refused before it is sent at all.
        code, error = await call(announce_huge_body, url, good)
        assert (code, error["field"]) == (413, "body")
        await unchanged_and_answering("a huge body")
        # A client that hangs up mid-body is gone, not the daemon's error (each one
        # logged an ERROR with a 40-line traceback).
        for _ in range(5):
            await call(hang_up_mid_body, url, good)
        await unchanged_and_answering("hung up mid-body")
        failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not failed, [r.getMessage() for r in failed]
        assert not (tmp_path / "a" / "limits.toml").exists()  # nothing was saved either
        assert daemon.volunteer.state.mode == "running"  # the snoozes did not happen

        # Query values: finite and in range, or 422 naming the parameter.
        for query in ("since=inf", "since=nan", "since=1e999", "since=-1"):
            code, error = await call(ask, "GET", f"/api/v1/stats?{query}")
            assert (code, error["field"]) == (422, "since"), query
        for query in ("wait_s=nan", "wait_s=inf", "since=-inf"):
            code, error = await call(ask, "GET", f"/api/v1/events?{query}")
            assert code == 422, query

        # A wrong method is 405 with the methods that are allowed, on every route.
        allowed: dict[str, set[str]] = {}
        for method, path, _, _ in ROUTES:
            allowed.setdefault(path, set()).add(method)
        for path, methods in allowed.items():
            for wrong in {"GET", "POST", "PATCH", "PUT", "DELETE"} - methods - {"HEAD"}:
                body = None if wrong == "GET" else b"{}"
                code, headers, data = await call(
                    raw_reply, url, wrong, path, headers=good, body=body
                )
                assert code == 405, (wrong, path, code, data)
                allow = {m.strip() for m in headers["allow"].split(",")}
                assert allow == methods | ({"HEAD"} if "GET" in methods else set()), path
                assert "not allowed" in strict_json(data)["error"]
        code, error = await call(ask, "GET", "/api/v1/shutdown")
        assert code == 405
        code, _ = await call(ask, "GET", "/api/v1/nothing")
        assert code == 404
        await unchanged_and_answering("after the wrong methods")  # GET /shutdown stopped nothing

        # The typed client refuses to send what JSON cannot carry.
        client = client_of(daemon, tmp_path / "a")
        with pytest.raises(ControlError) as refused:
            await call(client.set_limits, upload_mbit=float("inf"))
        assert refused.value.status == 422
        # And a good change still works afterwards, all of it.
        code, limits = await call(
            ask, "PATCH", "/api/v1/limits", b'{"upload_mbit": 5, "monthly_quota_gb": 1000000}'
        )
        assert code == 200
        assert (limits["upload_mbit"], limits["monthly_quota_gb"]) == (5, 1e6)
        assert daemon.node.throttle.statistics().quota_bytes == 10**15


async def test_a_change_that_fails_half_way_is_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        open_peer(local_config()) as boot,
        open_daemon(config_for(boot), tmp_path / "a") as daemon,
    ):
        client = client_of(daemon, tmp_path / "a")
        throttle = daemon.node.throttle
        real_apply = throttle.apply

        def fails_after_the_rates(limits: Any) -> None:  # as the quota of 1e300 GB did
            throttle.set_rates(limits.upload_mbit, limits.download_mbit)
            if limits.monthly_quota_gb == 5:
                raise OverflowError("cannot convert float infinity to integer")
            real_apply(limits)

        monkeypatch.setattr(throttle, "apply", fails_after_the_rates)
        with pytest.raises(ControlError) as refused:
            await call(client.set_limits, upload_mbit=7, monthly_quota_gb=5)
        assert refused.value.status == 409
        assert "nothing changed" in str(refused.value)
        assert throttle.statistics().upload_mbit == 0
        limits = await call(client.limits)
        assert (limits.upload_mbit, limits.monthly_quota_gb) == (0, 0)
        assert not (tmp_path / "a" / "limits.toml").exists()
        assert (await call(client.status)).limits.upload_mbit == 0


async def test_a_non_finite_value_in_a_snapshot_is_sent_as_null(tmp_path: Path) -> None:
    """The last line of defence: should a non-finite number get into what the daemon
    reports, the replies stay valid JSON (the value is null) instead of failing."""
    async with (
        open_peer(local_config()) as boot,
        open_daemon(config_for(boot), tmp_path / "a") as daemon,
    ):
        assert daemon.volunteer is not None
        url = daemon.control_url
        assert url is not None
        port = url.rsplit(":", 1)[1]
        token = (tmp_path / "a" / "api-token").read_text().strip()
        good = {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {token}"}
        valid = daemon.volunteer.limits
        # bypasses validation, as a bug elsewhere might
        daemon.volunteer.limits = type(valid).model_construct(
            **{**valid.model_dump(), "upload_mbit": float("inf"), "duty_cycle": float("nan")}
        )
        for path in ("/api/v1/status", "/api/v1/limits"):
            code, _, data = await call(raw_reply, url, "GET", path, headers=good)
            assert code == 200, (path, data)
            reply = strict_json(data)
            limits = reply["limits"] if path.endswith("status") else reply
            assert limits["upload_mbit"] is None
            assert limits["duty_cycle"] is None
            assert limits["download_mbit"] == 0
        code, _, data = await call(raw_reply, url, "GET", "/metrics", headers=good)
        assert code == 200
        assert b"volunteerd_serving 1" in data


async def test_uptime_counts_on_the_monotonic_clock_not_the_wall_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uptime read -17,960 s after the wall clock was set back 5 h, and days after it
    jumped ahead (an outside audit); ``started_at`` stays the wall-clock start."""
    import time

    import volunteerd.server.control_view as control_view

    class Wall:
        """The time module, with its wall clock off by ``off_s``."""

        off_s = 0.0

        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def time(self) -> float:
            return time.time() + self.off_s

    wall = Wall()
    monkeypatch.setattr(control_view, "time", wall)
    async with open_daemon(local_config(uids="ffn.0.0"), tmp_path / "a") as daemon:
        assert daemon.controls is not None
        started_at = (await daemon.controls.status()).started_at
        for off_s in (-5 * 3600.0, 3 * 86400.0):
            wall.off_s = off_s
            status = await daemon.controls.status()
            assert 0 <= status.uptime_s < 60
            assert status.started_at == started_at
