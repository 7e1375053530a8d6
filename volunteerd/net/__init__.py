"""Networking: the only package that imports libp2p (never torch).

host (TCP + Noise + Yamux), request/response verbs over pooled streams, and expert
discovery through signed, expiring records stored on the Kademlia-closest peers.
"""

from __future__ import annotations

from volunteerd.logs import tame_third_party
from volunteerd.net.announce import Announcer, children_by_key
from volunteerd.net.dht import ExpertDHT, StoreOutcome
from volunteerd.net.node import Node, open_node
from volunteerd.net.peers import PeerAddress, parse_peer_multiaddr, peer_id_for, short
from volunteerd.net.protocols import PROTOCOLS, ProtocolSpec, Verb
from volunteerd.net.records import (
    EXPERT_RECORDS,
    MANIFESTS,
    ExpertRecord,
    ManifestRecord,
    sign_record,
)
from volunteerd.net.rpc import Handler, Reply, Request, RpcClient, RpcServer
from volunteerd.net.shard import ShardResult, ShardServer, download_shard, partial_paths
from volunteerd.net.throttle import Throttle, ThrottleStats, TransferLedger

# Importing py-libp2p (above) detached its loggers; route them through volunteerd's
# logging now, so that a program using volunteerd as a library is not flooded either.
tame_third_party()

__all__ = [
    "EXPERT_RECORDS",
    "MANIFESTS",
    "PROTOCOLS",
    "Announcer",
    "ExpertDHT",
    "ExpertRecord",
    "Handler",
    "ManifestRecord",
    "Node",
    "PeerAddress",
    "ProtocolSpec",
    "Reply",
    "Request",
    "RpcClient",
    "RpcServer",
    "ShardResult",
    "ShardServer",
    "StoreOutcome",
    "Throttle",
    "ThrottleStats",
    "TransferLedger",
    "Verb",
    "children_by_key",
    "download_shard",
    "open_node",
    "parse_peer_multiaddr",
    "partial_paths",
    "peer_id_for",
    "short",
    "sign_record",
]
