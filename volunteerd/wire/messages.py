"""Headers of the expert protocols (forward, backward, info, and their batched forms)
and the error reply.

Every reply carries ``status``: ``"ok"`` for the verb's own reply model, ``"error"``
for ``ErrorReply``. A request for the tensors verbs lists its tensors in order:
forward sends the inputs, backward sends the inputs followed by the gradients of the
outputs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from volunteerd import uids
from volunteerd.errors import RETRY_AFTER_MOST_S
from volunteerd.wire.tensors import Compression, TensorMeta, TensorSchema

__all__ = [
    "BackwardBatchRequest",
    "BackwardRequest",
    "BatchReply",
    "ErrorReply",
    "ExpertInfo",
    "ForwardBatchRequest",
    "ForwardRequest",
    "InfoRequest",
    "ParamsReply",
    "ParamsRequest",
    "ShardReply",
    "ShardRequest",
    "TensorReply",
    "TrainerInfo",
    "TrainerInfoRequest",
    "Uid",
]


def _check_uid(value: str) -> str:
    if not uids.is_valid_uid(value):
        raise ValueError("not a valid expert uid")
    return value


Uid = Annotated[str, Field(max_length=uids.MAX_UID_LENGTH), AfterValidator(_check_uid)]
TensorList = Annotated[list[TensorMeta], Field(max_length=64)]


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Handle = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class ForwardRequest(_Wire):
    uid: Uid
    tensors: TensorList
    # Keep this forward's graph for a backward that will follow (the reply's handle).
    retain: bool = False
    # Floating-point tensors (both ways) travel in this dtype instead of the schema's.
    compression: Compression = "none"


class BackwardRequest(_Wire):
    """With ``handle``, ``tensors`` are only the output gradients; without it, the
    inputs followed by the output gradients (the stateless backward)."""

    uid: Uid
    tensors: TensorList
    handle: Handle | None = None
    compression: Compression = "none"


class InfoRequest(_Wire):
    uid: Uid


class TensorReply(_Wire):
    status: Literal["ok"] = "ok"
    tensors: TensorList
    handle: Handle | None = None


class ExpertInfo(_Wire):
    """What a server says about one expert: enough for a client to call it correctly."""

    status: Literal["ok"] = "ok"
    uid: Uid
    expert_type: Annotated[str, Field(max_length=32)]
    hidden_dim: Annotated[int, Field(ge=1)]
    inputs: Annotated[list[TensorSchema], Field(min_length=1, max_length=16)]
    outputs: Annotated[list[TensorSchema], Field(min_length=1, max_length=16)]
    max_batch_size: Annotated[int, Field(ge=1)]


class ErrorReply(_Wire):
    """A typed refusal. ``retry_after_s``: seconds until asking again is of use (a bulk
    reply refused for a transfer quota's share used up until its day ends); left out
    of the JSON when None, so every other error reply is the same bytes as before it
    existed (older peers, whose model forbids extra fields, parse them unchanged)."""

    status: Literal["error"] = "error"
    code: Annotated[str, Field(max_length=32)]
    message: Annotated[str, Field(max_length=1000)] = ""
    retry_after_s: (
        Annotated[float, Field(ge=0, le=RETRY_AFTER_MOST_S, allow_inf_nan=False)] | None
    ) = None

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.retry_after_s is None:
            data.pop("retry_after_s", None)
        return data


MAX_BATCH_ITEMS = 64


class ForwardBatchRequest(_Wire):
    """Several experts of one server in one message: a trainer sends one request per
    server, not one per expert. The body holds every item's tensors, in item order."""

    items: Annotated[list[ForwardRequest], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]

    @property
    def tensors(self) -> list[TensorMeta]:
        return [meta for item in self.items for meta in item.tensors]


class BackwardBatchRequest(_Wire):
    items: Annotated[list[BackwardRequest], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]

    @property
    def tensors(self) -> list[TensorMeta]:
        return [meta for item in self.items for meta in item.tensors]


ItemReply = Annotated[Union[TensorReply, ErrorReply], Field(discriminator="status")]  # noqa: UP007


class BatchReply(_Wire):
    """One reply per item, in order: its tensors, or why it failed (the other items are
    unaffected). The body holds the tensors of the items that succeeded, in order."""

    status: Literal["ok"] = "ok"
    items: Annotated[list[ItemReply], Field(max_length=MAX_BATCH_ITEMS)]

    @property
    def tensors(self) -> list[TensorMeta]:
        return [m for item in self.items if isinstance(item, TensorReply) for m in item.tensors]


ParamName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.]+$")]


ByteCount = Annotated[int, Field(ge=0, le=1 << 40)]
# A server's opaque name for one version of an expert's weights
# (``ExpertBackend.weights_version``); the empty string names none.
WeightsVersion = Annotated[str, Field(max_length=64, pattern=r"^[0-9A-Za-z._:-]*$")]


class ParamsRequest(_Wire):
    """Ask a server for one expert's current parameters (replicas average with them).

    ``max_bytes``: the most bytes of tensors the requester takes (its own copy's size);
    a server whose parameters are larger refuses ``too_large`` before it builds the
    reply. Left out of the JSON when None, so a request without it is the same bytes as
    before it existed: releases older than the field refuse a request that carries it
    (``malformed``: their model forbids unknown fields), and a requester that hears
    that asks them again without it (``server.replicas.SwarmReplicas``).

    ``unless_version``: the ``version`` of the last reply the requester had from this
    server for ``uid`` (or "" when it has none): a server whose weights are still that
    version answers "unchanged" (``ParamsReply.unchanged``, no tensors), and any
    server that sees the field says its version in its reply. Left out of the JSON when
    None, as ``max_bytes``, and older releases refuse it the same way."""

    uid: Uid
    max_bytes: ByteCount | None = None
    unless_version: WeightsVersion | None = None

    @property
    def tensors(self) -> list[TensorMeta]:
        return []

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in ("max_bytes", "unless_version"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ParamsReply(_Wire):
    """An expert's parameters, one tensor per name in ``names``, in the module's order;
    ``updates`` is how many optimizer steps the server has applied to them.

    ``version`` (only to a request that carried ``unless_version``): the weights'
    version (``ExpertBackend.weights_version``). ``unchanged``: they are still the
    version the request named, and the reply carries no names and no tensors. Both are
    left out of the JSON when absent (None, False), so a reply to a request without
    ``unless_version`` is the same bytes as before they existed: older requesters,
    whose model forbids unknown fields, never see them."""

    status: Literal["ok"] = "ok"
    uid: Uid
    updates: Annotated[int, Field(ge=0)]
    names: Annotated[list[ParamName], Field(max_length=64)]
    tensors: TensorList
    version: WeightsVersion | None = None
    unchanged: bool = False

    @model_validator(mode="after")
    def _one_name_per_tensor(self) -> Self:
        if len(self.names) != len(self.tensors):
            raise ValueError(f"{len(self.names)} names for {len(self.tensors)} tensors")
        if self.unchanged and (not self.version or self.names):
            raise ValueError("an unchanged reply names its version and carries no tensors")
        return self

    @model_serializer(mode="wrap")
    def _without_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.version is None:
            data.pop("version", None)
        if not self.unchanged:
            data.pop("unchanged", None)
        return data


# A shard chunk is at most this many bytes; servers may send less.
MAX_SHARD_CHUNK = 4 << 20
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ShardRequest(_Wire):
    """Ask for ``length`` bytes at ``offset`` of a snapshot of one expert's state (a
    checkpoint file's bytes). Without ``sha256`` the server takes a fresh snapshot; with
    it, the chunk comes from that snapshot, or the reply is ``expired``."""

    uid: Uid
    sha256: Sha256 | None = None
    offset: ByteCount = 0
    length: Annotated[int, Field(ge=0, le=MAX_SHARD_CHUNK)] = 1 << 20


class ShardReply(_Wire):
    """One chunk of the snapshot ``sha256`` (``total`` bytes): the body holds ``length``
    bytes from ``offset``."""

    status: Literal["ok"] = "ok"
    uid: Uid
    sha256: Sha256
    total: ByteCount
    offset: ByteCount
    length: Annotated[int, Field(ge=0, le=MAX_SHARD_CHUNK)]

    @model_validator(mode="after")
    def _inside_the_snapshot(self) -> Self:
        if self.offset + self.length > self.total:
            raise ValueError(f"{self.length} bytes at {self.offset} of {self.total}")
        return self


# An experiment's name as trainers say it: printable, bounded (names of published
# manifests follow records.NAME_PATTERN; a local experiment's name may be any text).
ExperimentName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
Count = Annotated[int, Field(ge=0, le=1 << 62)]


class TrainerInfoRequest(_Wire):
    """Ask a trainer how far it is; ``experiment`` is the asker's: a trainer of
    another experiment answers ``unknown_expert``, not its info."""

    experiment: ExperimentName


class TrainerInfo(_Wire):
    """What a trainer says about itself to the experiment's other trainers: ``version``
    is the updates it applied, ``tokens`` the tokens it trained on, ``rounds`` the
    averaging rounds it completed, ``data_shard`` the shard of the data it draws from."""

    status: Literal["ok"] = "ok"
    experiment: ExperimentName
    version: Count
    tokens: Count
    # A trillion tokens a second is no trainer's; without a bound two reports of 1.7e308
    # summed to an infinite swarm rate (and --summary-json to invalid JSON).
    tokens_per_s: Annotated[float, Field(ge=0.0, le=1e12, allow_inf_nan=False)]
    rounds: Count
    data_shard: Count
