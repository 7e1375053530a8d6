"""Two trainers on one expert over real libp2p: a forward of each, then their backwards
in turn. The second backward is applied one update (the first trainer's) after its
forward: the daemon shows staleness 1 for it, per expert and daemon-wide, through its
control API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from volunteerd.control.client import ControlClient
from volunteerd.daemon import Running
from volunteerd.experts import to_wire
from volunteerd.net import Node, Verb
from volunteerd.testing import local_config, open_daemon, open_peer
from volunteerd.wire import BackwardRequest, ForwardRequest

# Real libp2p nodes on loopback, in wall-clock time: a swarm, or a node and its clients.
pytestmark = pytest.mark.slow

HIDDEN = 16
UID = "ffn.0.0"
ROWS = 8


async def kept_forward(trainer: Node, daemon: Running) -> str:
    meta, data = to_wire(torch.randn(ROWS, HIDDEN))
    reply, _ = await trainer.rpc.call(
        daemon.node.address,
        Verb.FORWARD,
        ForwardRequest(uid=UID, tensors=[meta], retain=True),
        [data],
    )
    assert reply.handle is not None
    return str(reply.handle)


async def backward(trainer: Node, daemon: Running, handle: str | None = None) -> None:
    tensors = [torch.randn(ROWS, HIDDEN)] if handle is not None else [torch.randn(ROWS, HIDDEN)] * 2
    encoded = [to_wire(t) for t in tensors]
    await trainer.rpc.call(
        daemon.node.address,
        Verb.BACKWARD,
        BackwardRequest(uid=UID, tensors=[m for m, _ in encoded], handle=handle),
        [d for _, d in encoded],
    )
    await daemon.runtime.settled()  # its optimizer step has run


async def test_two_trainers_interleaving_on_one_expert_show_staleness_one(
    tmp_path: Path,
) -> None:
    async with open_peer(local_config()) as boot:
        config = local_config(
            bootstrap=boot.multiaddrs, uids="ffn.0.[0:1]", experts={"hidden_dim": HIDDEN}
        )
        async with (
            open_daemon(config, tmp_path / "daemon") as daemon,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as a,
            open_peer(local_config(bootstrap=boot.multiaddrs)) as b,
        ):
            # interleaved: forward A, forward B, backward A (fresh), backward B (1 late)
            handle_a = await kept_forward(a, daemon)
            handle_b = await kept_forward(b, daemon)
            await backward(a, daemon, handle_a)
            await backward(b, daemon, handle_b)
            # one trainer alone: fresh; and a stateless backward, counted apart
            await backward(a, daemon, await kept_forward(a, daemon))
            await backward(b, daemon)

            client = ControlClient.for_data_dir(tmp_path / "daemon")
            status = await trio.to_thread.run_sync(client.status)
            experts = await trio.to_thread.run_sync(client.experts)

    assert daemon.runtime.backend(UID).updates == 4
    staleness = status.staleness
    assert staleness.backwards == 3
    assert staleness.mean == pytest.approx(1 / 3)
    assert staleness.max == 1
    assert staleness.histogram == {"0": 2, "1": 1, "2-3": 0, "4-7": 0, "8+": 0}
    assert staleness.stateless == 1
    [view] = experts
    assert view.uid == UID
    assert view.staleness_mean == pytest.approx(1 / 3)
    assert view.staleness_max == 1
