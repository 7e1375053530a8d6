"""Staleness at the expert: for each backward through a kept forward, the optimizer
updates the expert took between the forward and the backward; stateless backwards are
counted apart. Counted by the runtime (``ExpertStats.staleness``), summed per daemon."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch
import trio

from tests.unit.wire_tensors import wire
from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.control.models import Staleness
from volunteerd.experts import Retained, WeightsSnapshot
from volunteerd.runtime import ExpertRuntime, RetainedStore
from volunteerd.runtime.retained import STALENESS_BUCKETS, StalenessMeter, StalenessStats

HIDDEN = 16
UID = "ffn.0.0"


def test_meter_counts_mean_max_and_buckets() -> None:
    meter = StalenessMeter()
    assert meter.statistics() == StalenessStats()
    assert meter.statistics().mean is None
    for staleness in (0, 0, 1, 2, 3, 4, 7, 8, 100, -2):
        meter.record(staleness)
    meter.record_stateless(3)
    stats = meter.statistics()
    assert stats.count == 10
    assert stats.total == 0 + 0 + 1 + 2 + 3 + 4 + 7 + 8 + 100 + 0  # negative counts as 0
    assert stats.mean == stats.total / 10
    assert stats.max == 100
    assert stats.by_bucket == {"0": 3, "1": 1, "2-3": 2, "4-7": 2, "8+": 2}
    assert list(stats.by_bucket) == list(STALENESS_BUCKETS)
    assert stats.stateless == 3


def test_statistics_add_up_across_experts() -> None:
    a, b = StalenessMeter(), StalenessMeter()
    a.record(1)
    a.record(1)
    b.record(4)
    b.record_stateless()
    total = a.statistics() + b.statistics()
    assert (total.count, total.total, total.max, total.stateless) == (3, 6, 4, 1)
    assert total.by_bucket == {"0": 0, "1": 2, "2-3": 0, "4-7": 1, "8+": 0}
    assert sum([a.statistics(), b.statistics()], StalenessStats()) == total


def test_combined_staleness_of_several_daemons() -> None:
    one = Staleness(backwards=2, mean=1.0, max=1, histogram={"1": 2}, stateless=1)
    two = Staleness(backwards=6, mean=3.0, max=5, histogram={"2-3": 4, "4-7": 2})
    idle = Staleness()
    both = Staleness.combined([one, two, idle])
    assert both.backwards == 8
    assert both.mean == (2 * 1.0 + 6 * 3.0) / 8
    assert both.max == 5
    assert both.histogram == {"1": 2, "2-3": 4, "4-7": 2}
    assert both.stateless == 1
    assert Staleness.combined([]).mean is None


def test_the_store_hands_back_the_version_the_forward_ran_at() -> None:
    store = RetainedStore(1 << 20, 60)
    kept = Retained([], torch.zeros(1), WeightsSnapshot({}, 100), 100)
    handle = store.put(UID, "p", kept, version=7)
    assert handle is not None
    taken = store.take(handle, UID, "p")
    assert taken is not None
    assert taken.retained is kept
    assert taken.version == 7


# -- in a running runtime -----------------------------------------------------------------


def _runtime() -> ExpertRuntime:
    config = RuntimeConfig.model_validate({"device": "cpu", "max_batch_wait_s": 0.001})
    return ExpertRuntime(
        [UID], ExpertsConfig(hidden_dim=HIDDEN), config, WireLimits(), torch.device("cpu")
    )


async def _kept_forward(rt: ExpertRuntime, peer: str) -> str:
    reply, _ = await rt.forward(UID, wire(torch.randn(4, HIDDEN)), retain=True, peer_id=peer)
    assert reply.handle is not None
    return reply.handle


async def _backward(rt: ExpertRuntime, peer: str, handle: str) -> None:
    await rt.backward(UID, wire(torch.randn(4, HIDDEN)), handle=handle, peer_id=peer)
    await rt.settled()  # its optimizer step has run


async def test_interleaved_trainers_see_the_updates_between_forward_and_backward() -> None:
    """Trainers A, B and C each forward, then backward in turn: A's gradient is fresh,
    B's comes one update late (A's), C's two (A's and B's). A stateless backward is
    counted apart."""
    rt = _runtime()
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        handles = {peer: await _kept_forward(rt, peer) for peer in "ABC"}
        for peer in "ABC":
            await _backward(rt, peer, handles[peer])
        # then one more round without interleaving: fresh again
        await _backward(rt, "A", await _kept_forward(rt, "A"))
        x, g = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        await rt.backward(UID, wire(x, g), peer_id="D")
        await rt.settled()
        rt.close()
    assert rt.backend(UID).updates == 5
    [stats] = rt.statistics()
    staleness = stats.staleness
    assert staleness.count == 4
    assert staleness.total == 0 + 1 + 2 + 0
    assert staleness.max == 2
    assert staleness.by_bucket == {"0": 2, "1": 1, "2-3": 1, "4-7": 0, "8+": 0}
    assert staleness.stateless == 1
    assert rt.staleness_statistics() == staleness


async def _given_up(rt: ExpertRuntime, call: Callable[[], Awaitable[object]]) -> None:
    """``call``, its caller gone (a deadline, or its stream closed) once its request
    waits in the queue for its batch."""
    lanes = rt._experts[UID].queues

    def waiting() -> int:
        return sum(lane.statistics().waiting for lane in lanes)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        with trio.fail_after(10):
            while not waiting():  # noqa: ASYNC110
                await trio.sleep(0.001)
        nursery.cancel_scope.cancel()


async def _until(done: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not done():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_gradients_of_a_backward_whose_caller_left_make_their_own_step() -> None:
    """A backward's batch runs whether or not its caller still waits (one cut off by its
    deadline, or by its stream closing). Its step was made due only by the handler after
    the answer, so a caller gone left the gradients in .grad, applied unannounced by
    whichever backward came next (or never). The batch that ran now makes it due."""
    config = RuntimeConfig.model_validate({"device": "cpu", "max_batch_wait_s": 0.3})
    rt = ExpertRuntime(
        [UID], ExpertsConfig(hidden_dim=HIDDEN), config, WireLimits(), torch.device("cpu")
    )
    backend = rt.backend(UID)
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        x, g = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        # stateless, then through a kept forward; each caller gone while its batch waits
        await _given_up(rt, lambda: rt.backward(UID, wire(x, g), peer_id="A"))
        await _until(lambda: backend.updates == 1)
        await rt.settled()
        assert all(p.grad is None for p in backend.module.parameters())
        handle = await _kept_forward(rt, "B")
        await _given_up(rt, lambda: rt.backward(UID, wire(g), handle=handle, peer_id="B"))
        await _until(lambda: backend.updates == 2)
        await rt.settled()
        assert all(p.grad is None for p in backend.module.parameters())
        rt.close()
