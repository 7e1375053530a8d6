"""The replica averager's view of the swarm (``runtime.averaging.ReplicaAverager``):
who else hosts an expert, from the DHT's full-uid records, and their parameters over
this node's RPC client (the connections already open)."""

from __future__ import annotations

import trio

from volunteerd.net import Node, PeerAddress, Verb
from volunteerd.wire import WireTensor
from volunteerd.wire.messages import ParamsReply, ParamsRequest

__all__ = ["SwarmReplicas"]


class SwarmReplicas:
    def __init__(self, node: Node, lookup_s: float) -> None:
        self._node = node
        self._lookup_s = lookup_s
        self._addresses: dict[str, PeerAddress] = {}

    async def replicas(self, uid: str) -> list[str]:
        """The other peers announcing ``uid`` (none if the lookup takes too long)."""
        with trio.move_on_after(self._lookup_s):
            records = (await self._node.dht.get([uid]))[uid]
            peers = []
            for record in records:
                if record.peer_id != self._node.peer_id:
                    self._addresses[record.peer_id] = PeerAddress(record.peer_id, record.addrs)
                    peers.append(record.peer_id)
            return peers
        return []

    async def fetch(self, peer_id: str, uid: str) -> tuple[ParamsReply, list[WireTensor]]:
        """``uid``'s parameters from ``peer_id`` (found by ``replicas`` before)."""
        reply, tensors = await self._node.rpc.call(
            self._addresses[peer_id], Verb.PARAMS, ParamsRequest(uid=uid)
        )
        return reply, tensors
