"""The request pipeline on its own (no network): every expert call passes the pause
gate, then accounting, then the runtime, and is counted exactly once."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio

from volunteerd.config import Config, LimitsConfig
from volunteerd.errors import BadShape, Paused, Rejected
from volunteerd.experts import to_wire
from volunteerd.net import Handler, Request, Throttle, Verb
from volunteerd.runtime import ExpertRuntime
from volunteerd.server.contribution import Accountant
from volunteerd.server.pausing import RequestGate
from volunteerd.server.pipeline import GATED_VERBS, expert_handlers
from volunteerd.stats import StatsStore
from volunteerd.wire import (
    BackwardBatchRequest,
    BackwardRequest,
    ErrorReply,
    ForwardBatchRequest,
    ForwardRequest,
    InfoRequest,
    WireTensor,
)

HIDDEN = 8
PEER = "12D3KooWTrainer"


class World:
    def __init__(
        self,
        handlers: dict[Verb, Handler],
        gate: RequestGate,
        counts: Accountant,
        runtime: ExpertRuntime,
    ):
        self.handlers = handlers
        self.gate = gate
        self.counts = counts
        self.runtime = runtime

    async def call(self, verb: Verb, header: object, tensors: list[WireTensor]) -> object:
        return await self.handlers[verb](Request(PEER, header, tensors))


@asynccontextmanager
async def pipeline(tmp_path: Path, **experts: object) -> AsyncIterator[World]:
    config = Config.model_validate(
        {
            "experts": {"uids": "ffn.0.[0:2]", "hidden_dim": HIDDEN, **experts},
            "runtime": {"device": "cpu"},
        }
    )
    runtime = ExpertRuntime(
        config.experts.uid_list(),
        config.experts,
        config.runtime,
        config.wire,
        torch.device("cpu"),
        guard=config.guard,
    )
    store = StatsStore.open(tmp_path / "stats.sqlite3", keep_hourly_days=7)
    gate = RequestGate()
    counts = Accountant(
        store, runtime, Throttle(LimitsConfig()), config.stats, serving=lambda: not gate.closed
    )
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            handlers = expert_handlers(runtime, gate=gate, accountant=counts)
            yield World(handlers, gate, counts, runtime)
            runtime.close()
    finally:
        store.close()


def tensor(rows: int, value: float = 1.0) -> WireTensor:
    meta, data = to_wire(torch.full((rows, HIDDEN), value))
    return WireTensor(meta.dtype, tuple(meta.shape), memoryview(data))


async def test_a_forward_is_counted_once_when_answered(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as world:
        x = tensor(3)
        await world.call(Verb.FORWARD, ForwardRequest(uid="ffn.0.0", tensors=[x.meta]), [x])
        assert world.counts.requests == 1
        assert world.counts.samples == 3
        assert world.counts.peers[PEER].requests == 1
        assert world.counts.store.current().work.forward == 1


async def test_a_closed_gate_refuses_before_the_runtime_and_counts_each_item_once(
    tmp_path: Path,
) -> None:
    async with pipeline(tmp_path) as world:
        world.gate.closed = True
        x = tensor(2)
        with pytest.raises(Paused):
            await world.call(Verb.FORWARD, ForwardRequest(uid="ffn.0.0", tensors=[x.meta]), [x])
        items = [ForwardRequest(uid=uid, tensors=[x.meta]) for uid in ("ffn.0.0", "ffn.0.1")]
        with pytest.raises(Paused):
            await world.call(Verb.FORWARD_BATCH, ForwardBatchRequest(items=items), [x, x])
        assert world.counts.refusals == {"paused": 3}
        assert world.counts.requests == 0
        # what costs nothing still answers
        info = await world.call(Verb.INFO, InfoRequest(uid="ffn.0.0"), [])
        assert info is not None
        assert Verb.INFO not in GATED_VERBS


async def test_refusals_of_made_up_uids_add_no_rows_to_the_statistics(tmp_path: Path) -> None:
    """uids cost a peer nothing: batches of 64 invented ones (refused as unknown, or
    while paused) wrote a row each into the statistics file, 2.5 MB a second for good.
    Refusals of uids the daemon does not host share one row per hour and reason."""
    async with pipeline(tmp_path) as world:
        x = tensor(1)
        for paused in (False, True):
            world.gate.closed = paused
            for batch in range(5):
                items = [
                    ForwardRequest(uid=f"zz{batch}.{i}.{paused:d}", tensors=[x.meta])
                    for i in range(64)
                ]
                try:
                    reply = await world.call(
                        Verb.FORWARD_BATCH, ForwardBatchRequest(items=items), [x] * 64
                    )
                except Paused:
                    assert paused
                else:
                    assert not paused
                    assert all(isinstance(r, ErrorReply) for r in reply.header.items)  # type: ignore[attr-defined]
        with pytest.raises(Paused):  # a hosted expert's refusal keeps its uid
            await world.call(Verb.FORWARD, ForwardRequest(uid="ffn.0.0", tensors=[x.meta]), [x])
        assert world.counts.refusals == {"unknown_expert": 320, "paused": 321}
        world.counts.store.flush()
        rows = world.counts.store._db.execute(
            "SELECT expert, reason, count FROM rejected ORDER BY reason, expert"
        ).fetchall()
        assert rows == [("", "paused", 320), ("ffn.0.0", "paused", 1), ("", "unknown_expert", 320)]


async def test_the_guard_refusal_is_counted_by_its_wire_code_once(tmp_path: Path) -> None:
    async with pipeline(tmp_path) as world:
        x, g = tensor(2), tensor(2, float("nan"))
        header = BackwardRequest(uid="ffn.0.0", tensors=[x.meta, g.meta])
        with pytest.raises(Rejected):
            await world.call(Verb.BACKWARD, header, [x, g])
        assert world.counts.refusals == {"rejected": 1}
        assert world.counts.peers[PEER].refused == 1


async def test_a_batch_item_that_fails_gets_its_own_error_and_the_rest_are_served(
    tmp_path: Path,
) -> None:
    async with pipeline(tmp_path) as world:
        x = tensor(2)
        items = [ForwardRequest(uid=uid, tensors=[x.meta]) for uid in ("ffn.0.0", "ffn.9.9")]
        reply = await world.call(Verb.FORWARD_BATCH, ForwardBatchRequest(items=items), [x, x])
        answered, refused = reply.header.items  # type: ignore[attr-defined]
        assert not isinstance(answered, ErrorReply)
        assert isinstance(refused, ErrorReply)
        assert refused.code == "unknown_expert"
        assert world.counts.requests == 1
        assert world.counts.refusals == {"unknown_expert": 1}


async def test_a_batch_item_that_meets_a_bug_fails_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error in one item's expert (a bug, not the peer's doing) is that
    item's ``internal`` reply; the message's other items are still answered."""
    async with pipeline(tmp_path) as world:

        def broken(*args: object) -> object:
            raise RuntimeError("a bug in this expert")

        world.runtime._hosted("ffn.0.1").backend.forward = broken  # type: ignore[method-assign]
        x = tensor(2)
        items = [ForwardRequest(uid=uid, tensors=[x.meta]) for uid in ("ffn.0.0", "ffn.0.1")]
        reply = await world.call(Verb.FORWARD_BATCH, ForwardBatchRequest(items=items), [x, x])
        answered, failed = reply.header.items  # type: ignore[attr-defined]
        assert not isinstance(answered, ErrorReply)
        assert answered.tensors[0].shape == (2, HIDDEN)
        assert isinstance(failed, ErrorReply)
        assert failed.code == "internal"
        assert "a bug in this expert" in caplog.text


async def test_uptime_counts_to_the_moment_accounting_stops(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    # Uptime is added once a second; a daemon that stops between two ticks (or runs
    # less than one) must still count the time since the last one. (Paused: time
    # serving is counted only while an expert is hosted, and this hosts none.)
    store = StatsStore.open(tmp_path / "stats.sqlite3", keep_hourly_days=7)
    try:
        counts = Accountant(
            store, None, Throttle(LimitsConfig()), Config().stats, serving=lambda: False
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(counts.serve)
            await trio.sleep(2.5)
            nursery.cancel_scope.cancel()
        assert store.current().paused_s == pytest.approx(2.5)
    finally:
        store.close()


def sequences(batch: int, length: int) -> WireTensor:
    meta, data = to_wire(torch.randn(batch, length, HIDDEN))
    return WireTensor(meta.dtype, tuple(meta.shape), memoryview(data))


async def test_gradients_for_another_sequence_length_are_the_peers_error_not_a_bug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A transformer's schema leaves the sequence open: a stateless backward with inputs
    of length 3 and output gradients of length 5 passed it and failed in autograd, an
    ``internal`` reply and two tracebacks logged per item (a batch of 64: megabytes)."""
    async with pipeline(tmp_path, type="transformer", num_heads=2) as world:
        for inputs, grads in [((2, 3), (2, 5)), ((2, 3), (2, 1)), ((2, 5), (2, 3))]:
            x, g = sequences(*inputs), sequences(*grads)
            header = BackwardRequest(uid="ffn.0.0", tensors=[x.meta, g.meta])
            with pytest.raises(BadShape, match="do not match"):
                await world.call(Verb.BACKWARD, header, [x, g])
        x, g = sequences(2, 3), sequences(2, 5)
        items = [BackwardRequest(uid="ffn.0.1", tensors=[x.meta, g.meta]) for _ in range(16)]
        reply = await world.call(
            Verb.BACKWARD_BATCH, BackwardBatchRequest(items=items), [x, g] * 16
        )
        codes = {item.code for item in reply.header.items}  # type: ignore[attr-defined]
        assert codes == {"bad_shape"}
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        # gradients of the outputs' own shape are served, by both experts
        g = sequences(2, 3)
        for uid in ("ffn.0.0", "ffn.0.1"):
            header = BackwardRequest(uid=uid, tensors=[x.meta, g.meta])
            answer = await world.call(Verb.BACKWARD, header, [x, g])
            assert answer.header.tensors[0].shape == (2, 3, HIDDEN)  # type: ignore[attr-defined]


async def test_backwards_of_zero_gradients_are_not_remembered_for_a_step(tmp_path: Path) -> None:
    """A backward whose gradients are all zero makes no step due, so the step that
    clears the list of senders never came: a stranger grew it by ~1,400 entries a
    second on an expert nobody else trained."""
    async with pipeline(tmp_path) as world:
        hosted = world.runtime._hosted("ffn.0.0")
        x, zero = tensor(4), tensor(4, 0.0)
        header = BackwardRequest(uid="ffn.0.0", tensors=[x.meta, zero.meta])
        for _ in range(200):
            await world.call(Verb.BACKWARD, header, [x, zero])
        await world.runtime.settled()
        assert hosted.senders == []
        assert hosted.backend.updates == 0
        g = tensor(4, 0.5)  # a real gradient: a step, which takes its sender along
        header = BackwardRequest(uid="ffn.0.0", tensors=[x.meta, g.meta])
        await world.call(Verb.BACKWARD, header, [x, g])
        await world.runtime.settled()
        assert hosted.backend.updates == 1
        assert hosted.senders == []
