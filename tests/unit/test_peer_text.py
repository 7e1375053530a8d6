"""Text a peer or an owner chooses (an error reply's message, a manifest's key) reaches
a volunteer's log, tray and dashboard: it arrives cut to a sane length."""

from __future__ import annotations

import pytest
import trio

from volunteerd.config import Config
from volunteerd.errors import RemoteError, UnknownExpert
from volunteerd.net import Verb
from volunteerd.net.rpc import Reply, Request, RpcClient, RpcServer
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.wire import InfoRequest

CONFIG = Config()


@pytest.mark.parametrize("length", [40, 990])
async def test_a_peers_error_message_is_cut_where_its_remote_error_is_built(
    autojump_clock: trio.abc.Clock, length: int
) -> None:
    said = "\x1b[2J" + "A" * (length - 4)

    async def info(request: Request) -> Reply:
        raise UnknownExpert(said)  # the wire allows 1,000 characters of any text

    network = MemoryNetwork()
    async with network.open_host() as server_host, network.open_host() as client_host:
        RpcServer(
            server_host, {Verb.INFO: info}, CONFIG.wire, CONFIG.timeouts, CONFIG.peer_limits
        ).install()
        client = RpcClient(client_host, CONFIG.wire, CONFIG.timeouts)
        try:
            with pytest.raises(RemoteError) as refused:
                await client.call(server_host.address, Verb.INFO, InfoRequest(uid="ffn.0.0"))
        finally:
            await client.aclose()
    assert refused.value.code == "unknown_expert"
    if length == 40:
        assert refused.value.message == said
    else:  # its start, and how long it was
        assert refused.value.message == f"{said[:300]}... ({length} characters)"
