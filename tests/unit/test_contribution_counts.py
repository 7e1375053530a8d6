"""What the volunteer is shown about its contribution: every refused expert call is in
"Refused", and time serving is time hosting something. Over the in-memory network, in
virtual time."""

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
from volunteerd.stats import StatsStore
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.wire import ForwardRequest, InfoRequest, TensorMeta

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
