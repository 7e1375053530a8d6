"""Every protocol volunteerd speaks over libp2p, in one table.

One protocol id per verb. A stream carries one verb; a client keeps a stream open and
sends request after request on it (one at a time), the server answers each in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel

from volunteerd.net.dialback import DialBackReply, DialBackRequest
from volunteerd.net.records import (
    FindReply,
    FindRequest,
    ManifestFindReply,
    ManifestFindRequest,
    ManifestStoreRequest,
    StoreReply,
    StoreRequest,
)
from volunteerd.wire import (
    BackwardBatchRequest,
    BackwardRequest,
    BatchReply,
    ExpertInfo,
    ForwardBatchRequest,
    ForwardRequest,
    InfoRequest,
    ShardReply,
    ShardRequest,
    TensorReply,
    TrainerInfo,
    TrainerInfoRequest,
)
from volunteerd.wire.messages import ParamsReply, ParamsRequest

__all__ = ["PROTOCOLS", "ProtocolSpec", "Verb"]


class Verb(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    INFO = "info"
    FORWARD_BATCH = "forward-batch"
    BACKWARD_BATCH = "backward-batch"
    DHT_STORE = "dht-store"
    DHT_FIND = "dht-find"
    PARAMS = "params"
    DIALBACK = "dialback"
    MANIFEST_STORE = "manifest-store"
    MANIFEST_FIND = "manifest-find"
    SHARD = "shard"
    TRAINER_INFO = "trainer-info"


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    verb: Verb
    protocol_id: str
    request: type[BaseModel]
    reply: type[BaseModel]
    carries_tensors: bool
    # A request that may be sent twice without harm (backward steps an optimizer).
    idempotent: bool


# The verbs whose *requests* carry tensors, and so a frame body; every other verb's
# request is its JSON header alone, and a body on it is refused from the prefix.
REQUESTS_WITH_TENSORS = frozenset(
    {Verb.FORWARD, Verb.BACKWARD, Verb.FORWARD_BATCH, Verb.BACKWARD_BATCH}
)

PROTOCOLS: dict[Verb, ProtocolSpec] = {
    spec.verb: spec
    for spec in (
        ProtocolSpec(
            Verb.FORWARD, "/volunteerd/forward/1", ForwardRequest, TensorReply, True, True
        ),
        ProtocolSpec(
            Verb.BACKWARD, "/volunteerd/backward/1", BackwardRequest, TensorReply, True, False
        ),
        ProtocolSpec(Verb.INFO, "/volunteerd/info/1", InfoRequest, ExpertInfo, False, True),
        ProtocolSpec(
            Verb.FORWARD_BATCH,
            "/volunteerd/forward-batch/1",
            ForwardBatchRequest,
            BatchReply,
            True,
            True,
        ),
        ProtocolSpec(
            Verb.BACKWARD_BATCH,
            "/volunteerd/backward-batch/1",
            BackwardBatchRequest,
            BatchReply,
            True,
            False,
        ),
        ProtocolSpec(
            Verb.DHT_STORE, "/volunteerd/dht-store/1", StoreRequest, StoreReply, False, True
        ),
        ProtocolSpec(Verb.DHT_FIND, "/volunteerd/dht-find/1", FindRequest, FindReply, False, True),
        # The request carries no tensors; the reply carries the expert's parameters.
        ProtocolSpec(Verb.PARAMS, "/volunteerd/params/1", ParamsRequest, ParamsReply, True, True),
        # Served by every node: dial the requester back (docs/protocol.md, reachability).
        ProtocolSpec(
            Verb.DIALBACK, "/volunteerd/dialback/1", DialBackRequest, DialBackReply, False, True
        ),
        ProtocolSpec(
            Verb.MANIFEST_STORE,
            "/volunteerd/manifest-store/1",
            ManifestStoreRequest,
            StoreReply,
            False,
            True,
        ),
        ProtocolSpec(
            Verb.MANIFEST_FIND,
            "/volunteerd/manifest-find/1",
            ManifestFindRequest,
            ManifestFindReply,
            False,
            True,
        ),
        # The reply's body is raw bytes (a chunk of a checkpoint), not tensors:
        # read it with RpcClient.call_raw.
        ProtocolSpec(Verb.SHARD, "/volunteerd/shard/1", ShardRequest, ShardReply, False, True),
        # Served by trainers to the experiment's other trainers (swarm/trainers.py).
        ProtocolSpec(
            Verb.TRAINER_INFO,
            "/volunteerd/trainer-info/1",
            TrainerInfoRequest,
            TrainerInfo,
            False,
            True,
        ),
    )
}
