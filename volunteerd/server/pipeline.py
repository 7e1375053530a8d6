"""The request pipeline: what happens to every expert verb between the RPC layer and
its reply. Each request passes these stages once, in this order:

1. **limits** (``net.rpc.RpcServer``, the transport, before this module): frame sizes,
   the per-peer request rate and concurrency, the bytes in flight, the whole frame
   read within ``frame_read_s``, the header validated;
2. **pause gate** (``server.pausing.RequestGate``): while the volunteer is not serving,
   the verbs that cost compute or bandwidth (``GATED_VERBS``) are refused at once with
   ``paused`` (their expert calls are counted as refused); the ones let through are
   counted in flight, so that pausing can wait for them;
3. **accounting** (``server.contribution.Accountant.counted``): each expert call (every
   item of a batch on its own) is counted once, answered or refused with its wire code;
4. **runtime** (``runtime.service.ExpertRuntime``): the schema check, then the
   **request guard** (``runtime.guard``: banned peers, non-finite or out-of-range
   values, outlier gradients) -- a stage of the runtime because it judges decoded
   tensors and hears of every optimizer step that had to be undone -- then the
   expert's bounded queue, the batcher and the device;
5. **reply**: the result (a batch: one reply per item, a failed item its own error
   reply) goes back to the RPC layer, which writes it; an error raised on the way
   becomes its wire code there.

``info`` skips the gate and the accounting (it costs nothing); ``params`` and ``shard``
pass the gate, then, while a transfer quota is set, the **bulk budget**
(``server.transfers.TransferBudget``): a reply a party or all of them together have no
share of the quota left for is refused (``rate_limited``, ``busy``) rather than sent, so
that a stranger's tiny requests cannot use up the quota that serving needs.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Literal

import trio

from volunteerd.errors import FrameTooLarge, Paused, VolunteerdError, retry_after, wire_code
from volunteerd.experts import ExpertBackend, to_wire
from volunteerd.experts.checkpoint_file import encode_checkpoint
from volunteerd.net import Handler, Reply, Request, ShardServer, Verb, short
from volunteerd.net.shard import Snapshot
from volunteerd.runtime import ExpertRuntime
from volunteerd.server.contribution import Accountant, Result
from volunteerd.server.pausing import GATED_VERBS, RequestGate
from volunteerd.server.transfers import TransferBudget
from volunteerd.wire import BatchReply, ErrorReply, TensorReply, WireTensor
from volunteerd.wire.messages import ParamsReply

__all__ = ["GATED_VERBS", "expert_handlers", "shard_snapshot"]

logger = logging.getLogger(__name__)


Kind = Literal["forward", "backward"]


def expert_handlers(
    runtime: ExpertRuntime,
    *,
    gate: RequestGate | None = None,
    accountant: Accountant | None = None,
    shards: ShardServer | None = None,
    budget: TransferBudget | None = None,
) -> dict[Verb, Handler]:
    """The expert verbs of ``runtime`` through the pipeline: ``gate`` (default: one that
    stays open), ``accountant`` (default: none, nothing counted), ``shards`` for the
    ``shard`` verb (default: one of ``shard_snapshot(runtime)``; start its ``serve`` so
    idle snapshots are freed), ``budget`` for the bulk replies (default: none, no
    budget; the daemon gives one of its throttle)."""
    pipeline = _Pipeline(runtime, gate or RequestGate(), accountant)
    shard: Handler = (shards or ShardServer(shard_snapshot(runtime))).handle
    params: Handler = pipeline.params
    if budget is not None:
        params, shard = _budgeted(params, budget), _budgeted(shard, budget)
    return {
        Verb.FORWARD: pipeline.gated(partial(pipeline.one, "forward"), counted=True),
        Verb.BACKWARD: pipeline.gated(partial(pipeline.one, "backward"), counted=True),
        Verb.FORWARD_BATCH: pipeline.gated(partial(pipeline.batch, "forward"), counted=True),
        Verb.BACKWARD_BATCH: pipeline.gated(partial(pipeline.batch, "backward"), counted=True),
        Verb.PARAMS: pipeline.gated(params, counted=False, bulk=True),
        Verb.SHARD: pipeline.gated(shard, counted=False, bulk=True),
        Verb.INFO: pipeline.info,
    }


def _budgeted(handler: Handler, budget: TransferBudget) -> Handler:
    """``handler`` (``params``, ``shard``) within ``budget``: its reply counted at its size
    (a shard chunk as part of its snapshot's ``total``), or refused; the part of it the
    RPC layer could not write (``Reply.unsent``) is given back."""

    async def within_the_budget(request: Request) -> Reply:
        party = request.address or request.peer_id
        budget.check(party)  # already over: not worth building the reply
        reply = await handler(request)
        size = sum(memoryview(buffer).nbytes for buffer in reply.buffers)
        budget.take(party, size, max(size, getattr(reply.header, "total", 0)))
        # What does not go out is given back (the frame's tail is the body's).
        reply.unsent = lambda n: budget.give_back(party, min(n, size))
        return reply

    return within_the_budget


class _Pipeline:
    def __init__(
        self, runtime: ExpertRuntime, gate: RequestGate, accountant: Accountant | None
    ) -> None:
        self._runtime = runtime
        self._gate = gate
        self._accountant = accountant

    # -- stage 2: the pause gate ---------------------------------------------------------

    def gated(self, handler: Handler, *, counted: bool, bulk: bool = False) -> Handler:
        """``handler`` behind the gate; ``counted``: its refusals are refused expert
        calls; ``bulk``: they say until when, where known (``RequestGate.refusal``)."""

        async def through_the_gate(request: Request) -> Reply:
            refusal = self._gate.refusal(bulk=bulk)
            if refusal is not None:
                if counted:
                    self._refused(request, refusal)
                raise refusal
            async with self._gate.admitted():
                return await handler(request)

        return through_the_gate

    def _refused(self, request: Request, exc: Paused) -> None:
        if self._accountant is None:
            return
        header = request.header
        for item in getattr(header, "items", None) or [header]:
            self._accountant.refused(str(getattr(item, "uid", "")), request.peer_id, exc)

    # -- stages 3 and 4: accounting, runtime ---------------------------------------------

    async def call(
        self,
        kind: Kind,
        item: Any,
        tensors: list[WireTensor],
        peer: str,
        address: str | None = None,
    ) -> Result:
        """One expert call (a request, or an item of a batch) from ``peer`` at
        ``address`` (``Request.address``)."""
        runtime = self._runtime
        if kind == "forward":
            call = runtime.forward(
                item.uid,
                tensors,
                retain=item.retain,
                peer_id=peer,
                source=address,
                compression=item.compression,
            )
        else:
            call = runtime.backward(
                item.uid,
                tensors,
                handle=item.handle,
                peer_id=peer,
                source=address,
                compression=item.compression,
            )
        if self._accountant is None:
            return await call
        return await self._accountant.counted(kind, item.uid, peer, tensors, call)

    async def one(self, kind: Kind, request: Request) -> Reply:
        return Reply(
            *await self.call(
                kind, request.header, request.tensors, request.peer_id, request.address
            )
        )

    async def batch(self, kind: Kind, request: Request) -> Reply:
        """A batch's items run concurrently; an item that fails gets its own error reply."""
        items = request.header.items
        results: list[tuple[TensorReply | ErrorReply, list[bytes]]] = [
            (ErrorReply(code="internal"), []) for _ in items
        ]

        async def one(i: int, item: Any, tensors: list[WireTensor]) -> None:
            try:
                results[i] = await self.call(kind, item, tensors, request.peer_id, request.address)
            except VolunteerdError as exc:
                error = ErrorReply(
                    code=wire_code(exc), message=str(exc)[:1000], retry_after_s=retry_after(exc)
                )
                results[i] = (error, [])
            except Exception:  # a bug, not the peer's error: this item's, not the batch's
                logger.exception("%s of %s failed for %s", kind, item.uid, short(request.peer_id))
                results[i] = (ErrorReply(code="internal"), [])

        offset = 0
        async with trio.open_nursery() as nursery:
            for i, item in enumerate(items):
                count = len(item.tensors)
                nursery.start_soon(one, i, item, request.tensors[offset : offset + count])
                offset += count
        return Reply(
            BatchReply(items=[header for header, _ in results]),
            [buffer for _, buffers in results for buffer in buffers],
        )

    async def params(self, request: Request) -> Reply:
        uid = request.header.uid
        cap = request.header.max_bytes
        if cap is not None:
            # Refused before the copy and its encoding: a replica whose expert is
            # smaller (another width under the same uid) refused every reply from its
            # prefix, after this node had built it whole, every round.
            size = sum(
                p.numel() * p.element_size() for p in self._runtime.backend(uid).module.parameters()
            )
            if size > cap:
                raise FrameTooLarge(
                    f"the parameters of {uid} are {size} bytes, over the {cap} asked for"
                )

        unless = request.header.unless_version

        def read(backend: ExpertBackend) -> Reply:
            # Encoded in the worker's turn: one consistent copy, between optimizer steps.
            # The version only to requesters that know the field (``unless_version``):
            # older ones refuse a reply with a field they do not know.
            version = None if unless is None else backend.weights_version()
            if version is not None and version == unless:
                # Still the weights the requester has: idle replicas sent each other
                # every expert whole every round (33.5 MB each at hidden 1024).
                unchanged = ParamsReply(
                    uid=uid,
                    updates=backend.updates,
                    names=[],
                    tensors=[],
                    version=version,
                    unchanged=True,
                )
                return Reply(unchanged, [])
            named = [(name, *to_wire(p)) for name, p in backend.live_parameters().items()]
            header = ParamsReply(
                uid=uid,
                updates=backend.updates,
                names=[name for name, _, _ in named],
                tensors=[meta for _, meta, _ in named],
                version=version,
            )
            return Reply(header, [data for _, _, data in named])

        return await self._runtime.with_expert(uid, read)

    async def info(self, request: Request) -> Reply:
        return Reply(self._runtime.info(request.header.uid))


def shard_snapshot(runtime: ExpertRuntime) -> Snapshot:
    """The ``shard`` verb's snapshots: an expert's weights and update count encoded as
    a checkpoint file, without its optimizer state, and with ``saved_at`` 0.

    A newcomer is the only one that downloads them, and it starts its optimizer afresh
    (``ExpertBackend.load_state(moments=False)``: a stranger's moments cannot be
    checked), so Adam's two moments were two thirds of every byte sent for nothing: a
    trained expert of width 2048 was 403 MB where its weights are 134 MB, and did not
    arrive over a 2 Mbit/s uplink (an outside audit). The same state gives the same
    bytes, so a download resumes across a replica's restart from its checkpoint
    (``net.shard``); with the time of encoding in the header, each snapshot had a
    SHA-256 of its own and 151 MiB were fetched again."""

    async def snapshot(uid: str) -> bytes:
        # Copied in the worker's turn (consistent, between optimizer steps), encoded in
        # another thread so the worker goes back to batches at once.
        state = await runtime.with_expert(uid, lambda backend: backend.state(moments=False))
        return await trio.to_thread.run_sync(
            lambda: b"".join(encode_checkpoint(state, saved_at=0.0))
        )

    return snapshot
