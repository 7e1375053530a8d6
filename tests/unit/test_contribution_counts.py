"""What the volunteer is shown about its contribution: every refused expert call is in
"Refused", time serving is time hosting something, and data sent and received is all
the node's traffic. Over the in-memory network, in virtual time."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from volunteerd.config import Config, LimitsConfig, StatsConfig
from volunteerd.errors import RemoteError, UnknownExpert
from volunteerd.net import Verb
from volunteerd.net.protocols import PROTOCOLS
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.net.throttle import Throttle
from volunteerd.server.contribution import Accountant
from volunteerd.stats import HOUR, StatsStore
from volunteerd.stats.store import DAY
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.wire import ForwardRequest, InfoRequest, TensorMeta
from volunteerd.wire.messages import ParamsReply, ParamsRequest

CONFIG = Config()


def _accountant() -> Accountant:
    store = StatsStore.open(Path(":memory:"))
    return Accountant(store, None, Throttle(LimitsConfig()), StatsConfig(), serving=lambda: True)


async def test_calls_refused_before_the_pipeline_are_counted_as_refused(
    autojump_clock: trio.abc.Clock,
) -> None:
    async def forward(request: Request) -> Reply:
        raise UnknownExpert("no such expert")  # the pipeline counts what it refuses

    async def info(request: Request) -> Reply:
        raise UnknownExpert("no such expert")

    accountant = _accountant()
    limits = CONFIG.peer_limits.model_copy(update={"requests_per_s": 0.001, "request_burst": 2})
    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        server = RpcServer(
            server_host,
            {Verb.FORWARD: forward, Verb.INFO: info},
            CONFIG.wire,
            CONFIG.timeouts,
            limits,
        )
        server.refused_early = accountant.refused_early
        server.install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            meta = TensorMeta(dtype="float32", shape=(1, 4))
            request = ForwardRequest(uid="ffn.0.0", tensors=[meta])
            codes = []
            for _ in range(5):
                with pytest.raises(RemoteError) as refused:
                    await client.call(server_host.address, Verb.FORWARD, request, [bytes(16)])
                codes.append(refused.value.code)
            assert codes == ["unknown_expert"] * 2 + ["rate_limited"] * 3
            # Not an expert call: not the volunteer's contribution, refused or not.
            with pytest.raises(RemoteError, match="rate_limited"):
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
            # A frame that is not one: refused from its prefix.
            stream = await client_host.open_stream(
                server_host.address, PROTOCOLS[Verb.FORWARD].protocol_id
            )
            await stream.write(b"\x00" * 64)
            assert b"malformed" in await stream.read(1024)
            await stream.close()
        finally:
            await client.aclose()
    # The handler's own refusals are the pipeline's to count (it was not wired here).
    assert accountant.store.current().rejected == {"rate_limited": 3, "malformed": 1}
    assert accountant.refusals == {"rate_limited": 3, "malformed": 1}
    assert accountant.peers == {}  # per peer, the server's own counts have them


class _Runtime:
    """What the accountant asks of an ``ExpertRuntime``: its experts, their counters."""

    def __init__(self) -> None:
        self.uids: list[str] = []

    def hosts(self, uid: str) -> bool:
        return uid in self.uids

    def statistics(self) -> list[object]:
        return []


async def test_time_serving_counts_only_while_an_expert_is_hosted(
    autojump_clock: trio.abc.Clock,
) -> None:
    runtime = _Runtime()
    serving = True
    accountant = Accountant(
        StatsStore.open(Path(":memory:")),
        runtime,  # type: ignore[arg-type]
        Throttle(LimitsConfig()),
        # No flush within the test: a flush runs in a thread, and the virtual clock
        # jumps on while the accountant waits for it.
        StatsConfig(flush_s=300),
        serving=lambda: serving,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(accountant.serve)
        await trio.sleep(10.5)  # serving, hosting nothing
        assert accountant.store.current().running_s == 0.0
        runtime.uids.append("ffn.0.0")
        await trio.sleep(10.0)
        serving = False
        await trio.sleep(5.0)
        runtime.uids.clear()  # paused is paused, whatever is hosted
        await trio.sleep(5.0)
        nursery.cancel_scope.cancel()
    totals = accountant.store.current()
    assert totals.running_s == pytest.approx(10.0, abs=1.0)
    assert totals.paused_s == pytest.approx(10.0, abs=1.0)


def test_the_dashboard_says_compute_time_is_wall_clock_time() -> None:
    # The worker's time per batch, by the wall clock: on a busy computer it was 1.3 to
    # 1.7 times the daemon's CPU time, so the card must not let it pass for CPU time.
    import re

    import volunteerd.dashboard

    page = (Path(volunteerd.dashboard.__file__).parent / "static" / "index.html").read_text()
    header = re.search(r'<th scope="row"[^>]*>Compute time</th>', page)
    assert header is not None
    assert "wall clock" in header.group(0)
    assert "not CPU time" in header.group(0)


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_data_sent_and_received_count_all_traffic_not_only_expert_calls(
    tmp_path: Path, autojump_clock: trio.abc.Clock, inline_threads: None
) -> None:
    # 5 ``params`` replies sent 10.5 MB, which the daily quota counted and "Uploaded
    # today" did not: it counted only the tensors of expert calls (an outside audit).
    start = 1_780_000_000 - 1_780_000_000 % DAY + 5 * HOUR
    wall = _Clock(start)
    path = tmp_path / "stats.sqlite3"
    throttle = Throttle(LimitsConfig())
    accountant = Accountant(
        StatsStore.open(path, clock=wall),
        None,
        throttle,
        StatsConfig(flush_s=1),
        serving=lambda: True,
    )
    weights = bytes(256 * 256 * 4)  # a hidden-256 expert's weight matrix, float32

    async def params(request: Request) -> Reply:
        meta = TensorMeta(dtype="float32", shape=(256, 256))
        header = ParamsReply(uid=request.header.uid, updates=0, names=["w"], tensors=[meta])
        return Reply(header, [weights])

    network = MemoryNetwork()
    async with (
        network.open_host() as server_host,
        network.open_host() as client_host,
        trio.open_nursery() as nursery,
    ):
        server = RpcServer(
            server_host,
            {Verb.PARAMS: params},
            CONFIG.wire,
            CONFIG.timeouts,
            CONFIG.peer_limits,
            throttle,
        )
        server.install()
        await nursery.start(accountant.serve)
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            for _ in range(5):
                _, buffers = await client.call(
                    server_host.address, Verb.PARAMS, ParamsRequest(uid="ffn.0.0")
                )
                assert bytes(buffers[0].data) == weights
        finally:
            await client.aclose()
        await trio.sleep(2.5)  # two ticks: counted, and flushed
        flushed = accountant.store.totals(since=start - start % DAY)
        nursery.cancel_scope.cancel()
    sent, received = throttle.bytes_up, throttle.bytes_down
    # The weights and the frames around them (prefix and header: 123 bytes a reply here);
    # the requests are what the node received.
    assert 5 * len(weights) <= sent < 5 * len(weights) + 5 * 1024
    assert 0 < received < 5 * 1024
    assert (flushed.traffic.bytes_up, flushed.traffic.bytes_down) == (sent, received)
    assert throttle.ledger.today == sent + received  # what the daily quota counts
    assert flushed.work.bytes_out == 0  # no expert call: the tensors of those are apart
    accountant.store.close()

    # Kept across a restart, and when the hours are rolled up into a day.
    wall.now += 30 * DAY
    reopened = StatsStore.open(path, clock=wall)
    # quarter hours, summed per hour; then the hours rolled up into the day
    assert [size for _, size in reopened.traffic_history()] == [HOUR]
    reopened.roll_up()
    assert [size for _, size in reopened.traffic_history()] == [DAY]
    assert (reopened.totals().traffic.bytes_up, reopened.totals().traffic.bytes_down) == (
        sent,
        received,
    )
    reopened.close()


def test_a_throttle_that_starts_counting_again_loses_nothing() -> None:
    accountant = _accountant()
    accountant._count_traffic(1000, 10)
    accountant._count_traffic(1500, 10)
    accountant._count_traffic(300, 40)  # a new node's throttle: all of its counts are new
    traffic = accountant.store.current().traffic
    assert (traffic.bytes_up, traffic.bytes_down) == (1800, 50)
