"""Sending the chosen experts their work, concurrently, with Learning@home's k_min rule.

Each ``Call`` is one expert's share of the batch (the rows routed to it). Calls for
experts of the same server travel together: one message per server (up to
``MAX_BATCH_ITEMS`` experts), answered with one; the server answers each item on its
own (one expert's failure is its own) and runs them all in one job on its device.

The round is over when every row has answers from at least ``k_min`` of the experts it
was sent to (or from all of them, if fewer were chosen) and a further ``grace_s`` has
passed, when every request has finished, or when ``timeout_s`` runs out — whichever
comes first. Requests still running then are cancelled: their experts were too slow.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from pydantic import BaseModel

from volunteerd.errors import RemoteError, RequestTimeout, VolunteerdError
from volunteerd.net import PeerAddress, RpcClient, Verb, short
from volunteerd.wire import (
    BackwardBatchRequest,
    ErrorReply,
    ForwardBatchRequest,
    WireTensor,
)
from volunteerd.wire.messages import MAX_BATCH_ITEMS

__all__ = ["Call", "Outcome", "call_many"]

logger = logging.getLogger(__name__)

# Experts per request: one message per server. (With one worker job per expert, 4 had
# measured best: a server answered a batch only when every item was done; now the
# items of a message run in one job and one message is cheapest.)
_MAX_PER_REQUEST = MAX_BATCH_ITEMS
_BATCHED = {Verb.FORWARD: Verb.FORWARD_BATCH, Verb.BACKWARD: Verb.BACKWARD_BATCH}
_BATCH_MODEL: dict[Verb, type[BaseModel]] = {
    Verb.FORWARD: ForwardBatchRequest,
    Verb.BACKWARD: BackwardBatchRequest,
}


@dataclass(slots=True)
class Call:
    uid: str
    peer: PeerAddress
    header: Any  # ForwardRequest or BackwardRequest
    buffers: list[bytes]
    rows: list[int]


@dataclass(slots=True)
class Outcome:
    reply: Any = None
    tensors: list[WireTensor] = field(default_factory=list)
    error: BaseException | None = None
    seconds: float = 0.0
    # Cut off by the k_min rule while still running: slow this time, not broken.
    late: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.reply is not None


async def _send(
    rpc: RpcClient, verb: Verb, calls: list[Call]
) -> list[tuple[Any, list[WireTensor]] | BaseException]:
    """One request for ``calls`` (all to one peer): plain for one call, batched for more."""
    peer = calls[0].peer
    if len(calls) == 1:
        call = calls[0]
        try:
            return [await rpc.call(peer, verb, call.header, call.buffers)]
        except VolunteerdError as exc:
            return [exc]
    header = _BATCH_MODEL[verb](items=[c.header for c in calls])
    reply, tensors = await rpc.call(
        peer, _BATCHED[verb], header, [b for c in calls for b in c.buffers]
    )
    out: list[tuple[Any, list[WireTensor]] | BaseException] = []
    offset = 0
    for item in reply.items:
        if isinstance(item, ErrorReply):
            out.append(RemoteError(item.code, item.message))
            continue
        count = len(item.tensors)
        out.append((item, tensors[offset : offset + count]))
        offset += count
    if len(out) != len(calls):
        raise VolunteerdError(f"{verb}: {len(out)} answers for {len(calls)} experts")
    return out


async def call_many(
    rpc: RpcClient,
    verb: Verb,
    calls: Sequence[Call],
    *,
    n_rows: int,
    k_min: int,
    timeout_s: float,
    grace_s: float,
) -> list[Outcome]:
    """One outcome per call, in order. A call cut off by the rule above has a
    RequestTimeout as its error, and ``late`` set if every row already had its
    ``k_min`` answers (the expert was merely slower than the others)."""
    outcomes = [Outcome(error=RequestTimeout(f"{verb}: no answer in time")) for _ in calls]
    need = [0] * n_rows
    for call in calls:
        for row in call.rows:
            need[row] += 1
    need = [min(k_min, n) for n in need]
    unmet = sum(1 for n in need if n > 0)
    got = [0] * n_rows
    grouped: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        grouped.setdefault(call.peer.peer_id, []).append(i)
    requests = [
        indices[start : start + _MAX_PER_REQUEST]
        for indices in grouped.values()
        for start in range(0, len(indices), _MAX_PER_REQUEST)
    ]
    pending = len(requests)
    enough = trio.Event()
    finished = trio.Event()
    if unmet == 0:
        enough.set()
    if pending == 0:
        finished.set()

    async def one(indices: list[int]) -> None:
        nonlocal unmet, pending
        start = trio.current_time()  # the loop's clock: virtual in the simulator
        try:
            try:
                answers = await _send(rpc, verb, [calls[i] for i in indices])
            except (VolunteerdError, OSError) as exc:
                answers = [exc] * len(indices)
            except Exception as exc:
                # Not a failure any layer below names: a bug, or a peer's reply that broke
                # something it should not have. It is this request's failure, never the
                # round's (the round's other experts answered; a trainer's run goes on).
                logger.warning(
                    "%s to %s failed unexpectedly: %r",
                    verb,
                    short(calls[indices[0]].peer.peer_id),
                    exc,
                    exc_info=exc,
                )
                answers = [exc] * len(indices)
            seconds = trio.current_time() - start
            for i, answer in zip(indices, answers, strict=True):
                if isinstance(answer, BaseException):
                    outcomes[i] = Outcome(error=answer, seconds=seconds)
                    continue
                outcomes[i] = Outcome(answer[0], answer[1], None, seconds)
                for row in calls[i].rows:
                    got[row] += 1
                    if got[row] == need[row]:
                        unmet -= 1
            if unmet == 0:
                enough.set()
        finally:
            pending -= 1
            if pending == 0:
                finished.set()

    async with trio.open_nursery() as nursery:
        for indices in requests:
            nursery.start_soon(one, indices)
        with trio.move_on_after(timeout_s) as deadline:

            async def wait(event: trio.Event) -> None:
                await event.wait()
                deadline.cancel()

            async with trio.open_nursery() as waiters:
                waiters.start_soon(wait, enough)
                waiters.start_soon(wait, finished)
        if not finished.is_set() and enough.is_set():
            with trio.move_on_after(grace_s):
                await finished.wait()
        nursery.cancel_scope.cancel()
    if enough.is_set():
        for outcome in outcomes:
            if outcome.reply is None and isinstance(outcome.error, RequestTimeout):
                outcome.late = True
    return outcomes
