"""Sending one request per chosen expert, concurrently, with Learning@home's k_min rule.

A call covers some rows (samples) of the batch. The round is over when every sample
has answers from at least ``k_min`` of the experts it was sent to (or from all of them,
if fewer were chosen) and a further ``grace_s`` has passed, when every call has
finished, or when ``timeout_s`` runs out — whichever comes first. Calls still running
then are cancelled: their experts did not answer in time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio
from pydantic import BaseModel

from volunteerd.errors import RequestTimeout, VolunteerdError
from volunteerd.net import PeerAddress, RpcClient, Verb
from volunteerd.wire import WireTensor

__all__ = ["Call", "Outcome", "call_many"]


@dataclass(slots=True)
class Call:
    uid: str
    peer: PeerAddress
    header: BaseModel
    buffers: list[bytes]
    rows: list[int]


@dataclass(slots=True)
class Outcome:
    reply: Any = None
    tensors: list[WireTensor] = field(default_factory=list)
    error: BaseException | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.reply is not None


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
    RequestTimeout as its error."""
    outcomes = [Outcome(error=RequestTimeout(f"{verb}: no answer in time")) for _ in calls]
    need = [0] * n_rows
    for call in calls:
        for row in call.rows:
            need[row] += 1
    need = [min(k_min, n) for n in need]
    unmet = sum(1 for n in need if n > 0)
    got = [0] * n_rows
    pending = len(calls)
    enough = trio.Event()
    finished = trio.Event()
    if unmet == 0:
        enough.set()
    if pending == 0:
        finished.set()

    async def one(i: int, call: Call) -> None:
        nonlocal unmet, pending
        start = time.perf_counter()
        try:
            reply, tensors = await rpc.call(call.peer, verb, call.header, call.buffers)
        except (VolunteerdError, OSError) as exc:
            outcomes[i] = Outcome(error=exc, seconds=time.perf_counter() - start)
        else:
            outcomes[i] = Outcome(reply, tensors, None, time.perf_counter() - start)
            for row in call.rows:
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
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call)
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
    return outcomes
