"""RemoteExpert: an ``nn.Module`` whose forward and backward run on a remote server.

Use it from ordinary synchronous torch code; the calls go through a
``BackgroundNode``. Forward sends the inputs; backward sends the inputs again with the
gradients of the outputs, and the server returns the input gradients after stepping
the expert's optimizer (Learning@home's stateless backward). Backward runs even when
the inputs need no gradient, so the expert still learns. With ``compression``
floating-point tensors travel narrowed or quantized both ways (the server answers in
kind), as ``RemoteMixtureOfExperts`` sends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from volunteerd.errors import BadDtype, BadShape, RemoteError
from volunteerd.experts import TORCH_DTYPES, from_wire, to_wire
from volunteerd.net import PeerAddress, Verb
from volunteerd.net.background import BackgroundNode
from volunteerd.wire import (
    FLOAT_DTYPES,
    BackwardRequest,
    Compression,
    ExpertInfo,
    ForwardRequest,
    InfoRequest,
    TensorMeta,
    check_against_schema,
    on_wire,
)

__all__ = ["RemoteExpert"]


class RemoteExpert(nn.Module):
    """The expert ``uid`` served by ``peer``, reached through ``node``; its tensors
    travel under ``compression``."""

    def __init__(
        self,
        uid: str,
        peer: PeerAddress,
        node: BackgroundNode,
        *,
        compression: Compression = "none",
    ) -> None:
        super().__init__()
        self.uid = uid
        self.compression: Compression = compression
        self.peer = peer
        self._node = node
        self._info: ExpertInfo | None = None
        # Makes autograd call our backward even when no input requires grad.
        self._dummy = torch.empty(0, requires_grad=True)

    @property
    def info(self) -> ExpertInfo:
        """The server's description of the expert (fetched once). Raises BadDtype when
        it says the expert takes or gives anything but floating point: the inputs are
        cast to, and the answers checked against, the dtypes it names, so an ``info``
        that said int64 made the trainer send its inputs as integers and accept an
        answer of -2**63 (integers are always finite)."""
        if self._info is None:
            reply, _ = self._node.run(
                self._node.node.rpc.call, self.peer, Verb.INFO, InfoRequest(uid=self.uid)
            )
            for what, schemas in (("inputs", reply.inputs), ("outputs", reply.outputs)):
                dtypes = [s.dtype for s in schemas]
                if not set(dtypes) <= FLOAT_DTYPES:
                    raise BadDtype(
                        f"{self.uid} at {self.peer.peer_id[-8:]} says its {what} are "
                        f"{dtypes}: an expert takes and gives floating point"
                    )
            self._info = reply
        return self._info

    def forward(self, *inputs: torch.Tensor) -> Any:
        info = self.info
        wire_inputs = [
            x.to(TORCH_DTYPES[s.dtype]) for x, s in zip(inputs, info.inputs, strict=True)
        ]
        check_against_schema(
            [to_meta(x) for x in wire_inputs], info.inputs, max_samples=info.max_batch_size
        )
        # Inside autograd.Function.forward grad mode is always off: decide here.
        retain = torch.is_grad_enabled()
        outputs = _RemoteCall.apply(self._dummy, self, inputs[0].dtype, retain, *wire_inputs)
        return outputs

    def call(
        self,
        verb: Verb,
        tensors: Sequence[torch.Tensor],
        *,
        retain: bool = False,
        handle: str | None = None,
    ) -> tuple[list[torch.Tensor], str | None]:
        """One blocking request with ``tensors``; returns the reply's tensors (CPU) and
        the handle of a kept forward, if any."""
        encoded = [to_wire(t, self.compression) for t in tensors]
        metas = [m for m, _ in encoded]
        header = (
            ForwardRequest(uid=self.uid, tensors=metas, retain=retain, compression=self.compression)
            if verb is Verb.FORWARD
            else BackwardRequest(
                uid=self.uid, tensors=metas, handle=handle, compression=self.compression
            )
        )
        reply, reply_tensors = self._node.run(
            self._node.node.rpc.call, self.peer, verb, header, [b for _, b in encoded]
        )
        # outputs for a forward, input gradients for a backward: in the dtypes asked for
        # (an int64 answer passes every check of values: integers are always finite)
        schemas = self.info.outputs if verb is Verb.FORWARD else self.info.inputs
        got = [t.dtype for t in reply_tensors]
        if got[: len(schemas)] != [on_wire(s.dtype, self.compression) for s in schemas]:
            raise BadDtype(
                f"{self.uid} at {self.peer.peer_id[-8:]} answered a {verb.value} in {got}"
            )
        return [from_wire(t) for t in reply_tensors], reply.handle

    def extra_repr(self) -> str:
        return f"uid={self.uid!r}, peer={self.peer.peer_id[-8:]}"


def _check_answer(
    expert: RemoteExpert,
    verb: Verb,
    answer: Sequence[torch.Tensor],
    expected: Sequence[tuple[int | None, ...]],
) -> None:
    """Raise BadShape unless ``answer`` has the ``expected`` shapes (None: any size)."""
    shapes = [tuple(t.shape) for t in answer]

    def fits(got: tuple[int, ...], want: tuple[int | None, ...]) -> bool:
        return len(got) == len(want) and all(
            w is None or g == w for g, w in zip(got, want, strict=True)
        )

    if len(shapes) != len(expected) or not all(
        fits(got, want) for got, want in zip(shapes, expected, strict=True)
    ):
        raise BadShape(
            f"{expert.uid} at {expert.peer.peer_id[-8:]} answered a {verb.value} with "
            f"shapes {shapes} where {list(expected)} fit what was sent"
        )


def to_meta(tensor: torch.Tensor) -> TensorMeta:
    name = next((k for k, v in TORCH_DTYPES.items() if v == tensor.dtype), None)
    if name is None:
        raise BadShape(f"dtype {tensor.dtype} cannot be sent")
    return TensorMeta(dtype=name, shape=tuple(tensor.shape))  # type: ignore[arg-type]


class _RemoteCall(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        _dummy: torch.Tensor,
        expert: RemoteExpert,
        out_dtype: torch.dtype,
        retain: bool,
        *inputs: torch.Tensor,
    ) -> Any:
        ctx.expert = expert
        ctx.out_dtype = out_dtype
        ctx.devices = [x.device for x in inputs]
        ctx.save_for_backward(*inputs)
        outputs, ctx.handle = expert.call(Verb.FORWARD, inputs, retain=retain)
        samples = inputs[0].shape[0]
        _check_answer(
            expert, Verb.FORWARD, outputs, [(samples, *s.shape[1:]) for s in expert.info.outputs]
        )
        device = inputs[0].device
        result = [o.to(device, out_dtype) for o in outputs]
        return result[0] if len(result) == 1 else tuple(result)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        info = expert.info
        grads = [
            g.to(TORCH_DTYPES[s.dtype]) for g, s in zip(grad_outputs, info.outputs, strict=True)
        ]
        grad_inputs: list[torch.Tensor] | None = None
        if ctx.handle is not None:
            try:
                grad_inputs, _ = expert.call(Verb.BACKWARD, grads, handle=ctx.handle)
            except RemoteError as exc:
                if exc.code != "expired":
                    raise
        if grad_inputs is None:
            grad_inputs, _ = expert.call(Verb.BACKWARD, [*inputs, *grads])
        _check_answer(expert, Verb.BACKWARD, grad_inputs, [tuple(x.shape) for x in inputs])
        return (
            None,
            None,
            None,
            None,
            *(g.to(dev, ctx.out_dtype) for g, dev in zip(grad_inputs, ctx.devices, strict=True)),
        )
