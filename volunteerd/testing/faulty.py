"""Faulty experts for tests: a server's handlers that answer NaN, scaled or noisy
tensors, answer late, or refuse, instead of patching an expert's methods.

``Faults.wrap`` takes the handlers a server serves (``Mapping[Verb, Handler]``, what
``RpcServer`` and ``open_node`` take) and returns handlers that behave as
``faults.fault`` says *now*: a test can let an expert be honest for a while, then turn
it bad (``faults.fault = Fault(outputs=nan)``) and back. ::

    faults = Faults(Fault(outputs=scaled_by(1e6), uids=frozenset({"ffn.0.1"})))
    server = RpcServer(host, faults.wrap(handlers), wire, timeouts, peer_limits)

The fault applies to the expert verbs (forward, backward, and their batches); other
verbs (info, params, shard, the DHT's) pass through. The honest answer is computed
first and then corrupted, as a malicious volunteer would: the expert's state (kept
activations, optimizer steps) is the honest one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import trio

from volunteerd.errors import VolunteerdError
from volunteerd.experts import from_wire, to_wire
from volunteerd.net.protocols import Verb
from volunteerd.net.rpc import Handler, Reply, Request
from volunteerd.wire import (
    FLOAT_DTYPES,
    BatchReply,
    TensorMeta,
    TensorReply,
    WireTensor,
    split_body,
)

__all__ = [
    "HONEST",
    "Described",
    "Fault",
    "Faults",
    "TensorFault",
    "empty_but_vast",
    "int64_min",
    "nan",
    "noise",
    "one_row_short",
    "scaled_by",
    "wider",
]


@dataclass(frozen=True, slots=True)
class Described:
    """An answer's tensor as a hostile server writes it: a descriptor sent as it is,
    unchecked (``TensorMeta.model_construct``), and its bytes."""

    meta: TensorMeta
    data: bytes


TensorFault = Callable[[torch.Tensor], "torch.Tensor | Described"]
"""Turns an honest floating-point tensor (as float32) into the answer sent; the header
describes what it returns (another shape makes a malformed answer), or the fault
describes it itself (``Described``)."""


def nan(tensor: torch.Tensor) -> torch.Tensor:
    """Every value NaN."""
    return torch.full_like(tensor, float("nan"))


def int64_min(tensor: torch.Tensor) -> torch.Tensor:
    """The honest answer's shape in int64, every value -2**63: integers are always
    finite, and abs(-2**63) wraps to itself."""
    return torch.full(tensor.shape, torch.iinfo(torch.int64).min, dtype=torch.int64)


def one_row_short(tensor: torch.Tensor) -> torch.Tensor:
    """The honest answer without its last row (an answer for fewer samples than sent)."""
    return tensor[:-1]


def wider(tensor: torch.Tensor) -> torch.Tensor:
    """The honest answer with its last column repeated once (another hidden size)."""
    return torch.cat([tensor, tensor[..., -1:]], dim=-1)


def empty_but_vast(tensor: torch.Tensor) -> Described:
    """No bytes, described as a shape of (0, 2**31, ..., 2**31): zero values, and a
    shape whose strides overflow torch's int64 (torch.empty raised its own error)."""
    shape = (0, *(2**31,) * 7)
    return Described(TensorMeta.model_construct(dtype="float32", shape=shape), b"")


def scaled_by(factor: float) -> TensorFault:
    """The honest answer times ``factor`` (in float16, large factors become inf)."""

    def scaled(tensor: torch.Tensor) -> torch.Tensor:
        return tensor * factor

    return scaled


def noise(seed: int = 0) -> TensorFault:
    """Random values of the honest answer's own scale (its std, at least 1e-3): finite
    and plausible, but unrelated to the input. Reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)

    def noisy(tensor: torch.Tensor) -> torch.Tensor:
        scale = tensor.std().clamp_min(1e-3) if tensor.numel() > 1 else torch.tensor(1.0)
        return torch.randn(tensor.shape, generator=generator) * scale

    return noisy


@dataclass(frozen=True, slots=True)
class Fault:
    """How an expert misbehaves; the default is honest."""

    outputs: TensorFault | None = None  # applied to forward answers
    gradients: TensorFault | None = None  # applied to backward answers (input gradients)
    delay_s: float = 0.0  # answer this much later (trio's clock: virtual under MockClock)
    refuse: VolunteerdError | None = None  # answer with this typed error instead
    uids: frozenset[str] | None = None  # only these experts misbehave (None: all)

    def affects(self, uids: list[str]) -> bool:
        return self.uids is None or any(uid in self.uids for uid in uids)


HONEST = Fault()

_FORWARD = frozenset({Verb.FORWARD, Verb.FORWARD_BATCH})
_EXPERT_VERBS = _FORWARD | {Verb.BACKWARD, Verb.BACKWARD_BATCH}
_BATCHES = frozenset({Verb.FORWARD_BATCH, Verb.BACKWARD_BATCH})


class Faults:
    """The switch between honest and faulty answers of one server (module docstring).

    ``faulty_replies`` counts the requests answered wrongly (corrupted, late or
    refused) since the start."""

    def __init__(self, fault: Fault = HONEST) -> None:
        self.fault = fault
        self.faulty_replies = 0

    def wrap(self, handlers: Mapping[Verb, Handler]) -> dict[Verb, Handler]:
        """``handlers`` with their expert verbs answering as ``self.fault`` says."""
        return {
            verb: self._wrap(verb, handler) if verb in _EXPERT_VERBS else handler
            for verb, handler in handlers.items()
        }

    def _wrap(self, verb: Verb, handler: Handler) -> Handler:
        async def answer(request: Request) -> Reply:
            fault = self.fault
            uids = _uids(verb, request.header)
            if fault == HONEST or not fault.affects(uids):
                return await handler(request)
            self.faulty_replies += 1
            if fault.delay_s > 0:
                await trio.sleep(fault.delay_s)
            if fault.refuse is not None:
                raise type(fault.refuse)(*fault.refuse.args)
            reply = await handler(request)
            attack = fault.outputs if verb in _FORWARD else fault.gradients
            if attack is None:
                return reply
            return _corrupt(reply, attack, [fault.affects([uid]) for uid in uids])

        return answer


def _uids(verb: Verb, header: Any) -> list[str]:
    if verb in _BATCHES:
        return [str(item.uid) for item in header.items]
    return [str(header.uid)]


def _corrupt(reply: Reply, attack: TensorFault, affected: list[bool]) -> Reply:
    """``reply`` with the tensors of the affected items (one item unless a batch)
    replaced by ``attack`` of them."""
    header = reply.header
    body = memoryview(b"".join(bytes(buffer) for buffer in reply.buffers))
    if isinstance(header, TensorReply):
        metas, buffers = _apply_all(attack, split_body(header.tensors, body))
        return Reply(header.model_copy(update={"tensors": metas}), buffers)
    if not isinstance(header, BatchReply):
        return reply
    tensors = iter(split_body(header.tensors, body))
    items: list[Any] = []
    buffers = []
    for item, hit in zip(header.items, affected, strict=True):
        if isinstance(item, TensorReply):
            wire = [next(tensors) for _ in item.tensors]
            if hit:
                metas, datas = _apply_all(attack, wire)
                item = item.model_copy(update={"tensors": metas})
            else:
                datas = [bytes(tensor.data) for tensor in wire]
            buffers.extend(datas)
        items.append(item)
    return replace(reply, header=header.model_copy(update={"items": items}), buffers=buffers)


def _apply_all(
    attack: TensorFault, tensors: list[WireTensor]
) -> tuple[list[TensorMeta], list[bytes]]:
    metas, datas = [], []
    for tensor in tensors:
        if tensor.dtype in FLOAT_DTYPES:
            honest = from_wire(tensor)
            attacked = attack(honest.float())
            if isinstance(attacked, Described):
                metas.append(attacked.meta)
                datas.append(attacked.data)
                continue
            # a floating-point answer goes back in the honest dtype; another as it is
            meta, data = to_wire(
                attacked.to(honest.dtype) if attacked.is_floating_point() else attacked
            )
        else:
            meta, data = tensor.meta, bytes(tensor.data)
        metas.append(meta)
        datas.append(data)
    return metas, datas
