"""Sending the chosen experts their work, concurrently, with Learning@home's k_min rule.

Each ``Call`` is one expert's share of the batch (the rows routed to it). Calls for
experts of the same server travel together: one message per server (up to
``MAX_BATCH_ITEMS`` experts), answered with one; the server answers each item on its
own (one expert's failure is its own) and runs them all in one job on its device.

The round is over at the first of:

* every request has finished;
* every row has answers from at least ``k_min`` of the experts it was sent to (or from
  all of them, if fewer were chosen), and a further ``grace_s`` has passed;
* of two requests or more, half have answered (the ``ceil(n / 2)``-th at ``t_half``
  after the start), and ``max(STRAGGLER_FACTOR * t_half, t_half + grace_s)`` has passed
  since the start: a request still running then is far slower than the round's typical
  one, and rows that only it could answer go without (the layer sends them to their
  spare experts). Without this a row whose experts all sat on one slow server (beam
  search often picks a token's experts in one grid row, and a server often hosts whole
  rows) made every round wait for that server: one volunteer on a 1 Mbit/s uplink
  took a 4-daemon swarm from 1.9 to 9.7 s per step. The bound is taken from this
  round's own answers, so a trainer whose own link or machine is slow waits as long
  as its typical peer needs, and one peer answering slowly on purpose cannot move it;
* ``timeout_s`` runs out.

Requests still running then are cancelled: their experts were too slow. Those cut off
by the grace or the straggler bound are ``late`` (slower than the others; the layer bans
a peer only when it is late round after round); those cut off by the timeout failed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from pydantic import BaseModel

from volunteerd.errors import RemoteError, RequestTimeout, VolunteerdError
from volunteerd.moe.timing import STRAGGLER_FACTOR
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
            out.append(RemoteError(item.code, item.message, item.retry_after_s))
            continue
        count = len(item.tensors)
        out.append((item, tensors[offset : offset + count]))
        offset += count
    if len(out) != len(calls):
        raise VolunteerdError(f"{verb}: {len(out)} answers for {len(calls)} experts")
    return out


async def _first_of(*events: trio.Event) -> None:
    """Return once any of ``events`` is set."""
    async with trio.open_nursery() as waiters:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            waiters.cancel_scope.cancel()

        for event in events:
            waiters.start_soon(wait, event)


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
    """One outcome per call, in order. A call cut off by the rules above has a
    RequestTimeout as its error, and ``late`` set unless the round ran out its
    ``timeout_s`` (the expert was slower than the others, not silent past the limit)."""
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
    answered = 0  # requests with at least one answer
    # the median request: of 2, the first to answer; a lone request is its own pace
    half = -(-len(requests) // 2) if len(requests) > 1 else 2
    enough = trio.Event()  # every row has its k_min answers: the grace starts
    finished = trio.Event()
    cut_stragglers = trio.Event()  # the straggler bound has passed
    round_start = trio.current_time()
    if unmet == 0:
        enough.set()
    if pending == 0:
        finished.set()

    async def bound_stragglers(t_half: float) -> None:
        await trio.sleep_until(round_start + max(STRAGGLER_FACTOR * t_half, t_half + grace_s))
        cut_stragglers.set()

    async def one(indices: list[int]) -> None:
        nonlocal unmet, pending, answered
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
            if any(not isinstance(a, BaseException) for a in answers):
                answered += 1
                if answered == half:
                    nursery.start_soon(bound_stragglers, trio.current_time() - round_start)
        finally:
            pending -= 1
            if pending == 0:
                finished.set()

    async with trio.open_nursery() as nursery:
        for indices in requests:
            nursery.start_soon(one, indices)
        with trio.move_on_after(timeout_s):
            await _first_of(enough, finished, cut_stragglers)
        if not finished.is_set() and enough.is_set() and not cut_stragglers.is_set():
            with trio.move_on_after(grace_s):
                await _first_of(finished, cut_stragglers)
        nursery.cancel_scope.cancel()
    if enough.is_set() or cut_stragglers.is_set():
        for outcome in outcomes:
            if outcome.reply is None and isinstance(outcome.error, RequestTimeout):
                outcome.late = True
    return outcomes
