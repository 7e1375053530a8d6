"""Every protocol volunteerd speaks over libp2p, in one table.

One protocol id per verb. A stream carries one verb; a client keeps a stream open and
sends request after request on it (one at a time), the server answers each in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel

from volunteerd.net.records import FindReply, FindRequest, StoreReply, StoreRequest
from volunteerd.wire import (
    BackwardBatchRequest,
    BackwardRequest,
    BatchReply,
    ExpertInfo,
    ForwardBatchRequest,
    ForwardRequest,
    InfoRequest,
    TensorReply,
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


@dataclass(frozen=True, slots=True)
class ProtocolSpec:
    verb: Verb
    protocol_id: str
    request: type[BaseModel]
    reply: type[BaseModel]
    carries_tensors: bool
    # A request that may be sent twice without harm (backward steps an optimizer).
    idempotent: bool


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
    )
}
