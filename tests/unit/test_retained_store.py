"""RetainedStore: kept forwards are bounded in bytes and time and bound to their peer."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.lowlevel

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.errors import ActivationsExpired, BadShape, Busy, Rejected
from volunteerd.experts import Retained, WeightsSnapshot, to_wire
from volunteerd.runtime import ExpertRuntime, RetainedStore
from volunteerd.wire import WireTensor


def kept(nbytes: int, weights: WeightsSnapshot | None = None) -> Retained:
    weights = weights or WeightsSnapshot({}, 100)
    return Retained([], torch.zeros(1), weights, nbytes)


def test_take_returns_each_entry_once_and_only_to_its_peer_and_expert() -> None:
    store = RetainedStore(10_000, 60)
    handle = store.put("ffn.0.0", "peerA", kept(10))
    assert handle is not None
    assert len(handle) == 32
    assert store.take(handle, "ffn.0.0", "peerB") is None  # another peer
    handle = store.put("ffn.0.0", "peerA", kept(10))
    assert store.take(handle, "ffn.0.1", "peerA") is None  # another expert
    handle = store.put("ffn.0.0", "peerA", kept(10))
    assert store.take(handle, "ffn.0.0", "peerA") is not None
    assert store.take(handle, "ffn.0.0", "peerA") is None
    stats = store.statistics()
    # The two mismatched entries stay for their owner until they expire.
    assert (stats.hits, stats.misses, stats.entries, stats.nbytes) == (1, 3, 2, 220)


def test_entries_expire() -> None:
    now = [0.0]
    store = RetainedStore(10_000, ttl_s=5, clock=lambda: now[0])
    handle = store.put("e.0", "p", kept(10))
    assert handle is not None
    now[0] = 5.1
    assert store.take(handle, "e.0", "p") is None
    assert store.statistics().nbytes == 0


def test_budget_evicts_oldest_and_charges_shared_weights_once() -> None:
    store = RetainedStore(1000, 60)
    shared = WeightsSnapshot({}, 400)
    first = store.put("e.0", "p", kept(100, shared))
    second = store.put("e.0", "p", kept(100, shared))
    assert store.statistics().nbytes == 600  # 400 of weights, once, + 2 x 100
    third = store.put("e.0", "p", kept(350))  # 350 + 100 of its own weights: evict one
    assert third is not None
    assert store.take(first or "", "e.0", "p") is None
    assert store.take(second or "", "e.0", "p") is not None
    assert store.put("e.0", "p", kept(5000)) is None  # can never fit
    assert RetainedStore(0, 60).enabled is False


# -- the budget in a running runtime ------------------------------------------------------

HIDDEN = 64
ROWS = 256
BUDGET_MB = 2


def _runtime(**runtime: object) -> ExpertRuntime:
    config = RuntimeConfig.model_validate(
        {"device": "cpu", "max_batch_wait_s": 0.001, "retain_activations_mb": BUDGET_MB, **runtime}
    )
    experts = ExpertsConfig(hidden_dim=HIDDEN)
    return ExpertRuntime(["ffn.0.0"], experts, config, WireLimits(), torch.device("cpu"))


def _inputs() -> list[WireTensor]:
    meta, data = to_wire(torch.randn(ROWS, HIDDEN))
    return [WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))]


def graph_bytes(retained: Retained) -> int:
    """What a kept forward really holds, counted apart from the store: the storages of
    its inputs, its output and every tensor its autograd graph saved, weights aside."""
    weights = {p.untyped_storage().data_ptr() for p in retained.weights.params.values()}
    storages = {t.untyped_storage().data_ptr(): t for t in (*retained.leaves, retained.output)}
    seen, todo = set(), [retained.output.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for name in dir(fn):
            if name.startswith("_saved_"):
                value = getattr(fn, name)
                if isinstance(value, torch.Tensor):
                    storages[value.untyped_storage().data_ptr()] = value
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return sum(t.untyped_storage().nbytes() for p, t in storages.items() if p not in weights)


async def test_kept_forwards_in_flight_never_overshoot_the_budget() -> None:
    """Many kept forwards at once: the budget is taken before each graph is computed, so
    what is kept and in flight together stays within it; the rest are served unkept."""
    rt = _runtime()
    budget = BUDGET_MB << 20
    most = 0
    handles: list[str | None] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)

        async def kept_forward() -> None:
            reply, _ = await rt.forward("ffn.0.0", _inputs(), retain=True, peer_id="p")
            assert reply.tensors[0].shape == (ROWS, HIDDEN)
            handles.append(reply.handle)

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, rt.retained.statistics().nbytes)
                await trio.lowlevel.checkpoint()

        nursery.start_soon(watch)
        async with trio.open_nursery() as calls:
            for _ in range(64):
                calls.start_soon(kept_forward)
        nursery.cancel_scope.cancel()
    kept = [h for h in handles if h is not None]
    # The store charges at least what each kept graph really holds.
    for entry in rt.retained._entries.values():
        assert entry.retained.nbytes >= graph_bytes(entry.retained) > 0
    assert len(handles) == 64
    assert 0 < len(kept) < 64
    assert most <= budget
    assert rt.retained.statistics().refused + rt.retained.statistics().evicted > 0


async def test_kept_forwards_give_memory_back_when_they_expire_without_requests() -> None:
    rt = _runtime(retain_s=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        reply, _ = await rt.forward("ffn.0.0", _inputs(), retain=True, peer_id="p")
        assert reply.handle is not None
        assert rt.retained.statistics().nbytes > 0
        with trio.fail_after(20):
            while rt.retained.statistics().entries:  # noqa: ASYNC110 - no request comes
                await trio.sleep(0.05)
        assert rt.retained.statistics().nbytes == 0
        nursery.cancel_scope.cancel()


async def test_kept_forwards_of_different_sequence_lengths_are_batched_apart() -> None:
    """Two trainers' kept forwards of one transformer expert, at sequence lengths 8 and
    9, queued together: each batch holds one length (inputs of different lengths
    cannot be concatenated; merged, every request of the batch failed)."""
    config = RuntimeConfig.model_validate(
        {"device": "cpu", "max_batch_wait_s": 0.01, "retain_activations_mb": 64}
    )
    experts = ExpertsConfig(type="transformer", hidden_dim=HIDDEN, num_heads=4)
    rt = ExpertRuntime(["tf.0.0"], experts, config, WireLimits(), torch.device("cpu"))

    def tokens(rows: int, length: int) -> list[WireTensor]:
        meta, data = to_wire(torch.randn(rows, length, HIDDEN))
        return [WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))]

    shapes: list[tuple[int, ...]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)

        async def kept_forward(peer: str, rows: int, length: int) -> None:
            reply, _ = await rt.forward("tf.0.0", tokens(rows, length), retain=True, peer_id=peer)
            assert reply.handle is not None
            shapes.append(reply.tensors[0].shape)

        async with trio.open_nursery() as calls:
            for _ in range(6):
                calls.start_soon(kept_forward, "trainerA", 2, 8)
                calls.start_soon(kept_forward, "trainerB", 1, 9)
        nursery.cancel_scope.cancel()
    assert sorted(shapes) == [(1, 9, HIDDEN)] * 6 + [(2, 8, HIDDEN)] * 6


# -- the estimate follows what kept graphs of each size really hold ------------------------


def test_estimate_is_per_input_byte_and_per_size_class_and_follows_measurements() -> None:
    """A graph measured for one size of sample (a long sequence) leaves the estimate for
    others (short ones) alone, and each estimate is the latest measurement, not the
    largest ever."""
    store = RetainedStore(64 << 20, 60)
    short = 16 * HIDDEN * 4  # input bytes of one 16-token sample
    long = 4096 * HIDDEN * 4
    assert store.estimate("tr", 128, 128 * short) == 8 * 128 * short  # nothing measured yet
    store.put("tr", "p", kept(17 * 128 * short), samples=128, input_bytes=128 * short)
    assert store.estimate("tr", 128, 128 * short) == 17 * 128 * short
    assert store.estimate("tr", 1, long) == 17 * long  # the nearest size measured
    store.put("tr", "p", kept(40 * long), samples=1, input_bytes=long)  # say it grew
    assert store.estimate("tr", 1, long) == 40 * long
    assert store.estimate("tr", 128, 128 * short) == 17 * 128 * short  # unchanged
    assert store.estimate("tr", 2, 2 * short) == 17 * 2 * short  # per input byte, any rows
    store.put("tr", "p", kept(10 * 128 * short), samples=128, input_bytes=128 * short)
    assert store.estimate("tr", 64, 64 * short) == 10 * 64 * short  # the latest, not the max
    assert store.estimate("other", 4, 4 * short) == 8 * 4 * short  # per expert


def test_refusals_are_counted() -> None:
    store = RetainedStore(1000, 60)
    assert store.reserve("e.0", 1, 200) is None  # 8 x 200 > the whole budget
    assert store.put("e.0", "p", kept(5000)) is None
    assert store.statistics().refused == 2


def test_a_small_forward_evicts_only_room_for_what_it_measures() -> None:
    """After a long-sequence graph was measured, a small forward of short samples
    reserves what graphs of its own size hold, not rows x the long one's size."""
    store = RetainedStore(32 << 20, 60)
    token = HIDDEN * 4
    handles = []
    for _ in range(6):
        reserved = store.reserve("tr", 8, 8 * 16 * token)
        assert reserved is not None
        retained = kept(17 * 8 * 16 * token)
        handles.append(store.put("tr", "p", retained, reserved, 8, input_bytes=8 * 16 * token))
    big = store.reserve("tr", 1, 4096 * token)
    assert big is not None
    store.put("tr", "q", kept(17 * 4096 * token), big, 1, input_bytes=4096 * token)
    small = store.reserve("tr", 118, 118 * token)
    assert small is not None
    assert small <= 17 * 118 * token
    assert store.statistics().evicted == 0
    assert all(store.take(h or "", "tr", "p") is not None for h in handles)


def test_nothing_is_evicted_for_a_forward_that_cannot_fit_beside_those_in_flight() -> None:
    """Forwards in flight hold their reservations: a forward that would not fit beside
    them even in an empty store is refused without evicting the kept ones."""
    store = RetainedStore(1000, 60)
    handle = store.put("e.0", "p", kept(100))
    in_flight = store.reserve("e.0", 1, 80)  # 8 x 80
    assert in_flight == 640
    assert store.reserve("e.0", 1, 50) is None  # 400 beside 640
    assert store.put("e.0", "q", kept(350)) is None  # 350 + 100 of weights beside 640
    stats = store.statistics()
    assert (stats.evicted, stats.refused, stats.entries) == (0, 2, 1)
    store.release(in_flight)
    assert store.take(handle or "", "e.0", "p") is not None
    assert store.statistics().nbytes == 0


def test_an_entry_given_back_is_kept_again_under_its_handle_until_its_expiry() -> None:
    now = [0.0]
    store = RetainedStore(10_000, ttl_s=5, clock=lambda: now[0])
    first = store.put("e.0", "p", kept(10)) or ""
    now[0] = 1.0
    second = store.put("e.0", "p", kept(10)) or ""
    taken = store.take(first, "e.0", "p")
    assert taken is not None
    assert store.statistics().entries == 1
    assert store.give_back(taken)
    assert store.statistics().entries == 2
    assert store.statistics().hits == 0  # taken, not used
    now[0] = 5.5  # the first's expiry (5.0), not the second's (6.0), and not renewed
    store.expire()
    assert store.take(first, "e.0", "p") is None
    again = store.take(second, "e.0", "p")
    assert again is not None
    now[0] = 7.0
    assert not store.give_back(again)  # expired meanwhile
    assert store.statistics().nbytes == 0


def _tokens(rows: int, length: int) -> list[WireTensor]:
    meta, data = to_wire(torch.randn(rows, length, 32))
    return [WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))]


def _transformer(budget_mb: int, uids: list[str]) -> ExpertRuntime:
    config = RuntimeConfig.model_validate(
        {"device": "cpu", "max_batch_wait_s": 0.001, "retain_activations_mb": budget_mb}
    )
    experts = ExpertsConfig(type="transformer", hidden_dim=32, num_heads=4)
    return ExpertRuntime(uids, experts, config, WireLimits(), torch.device("cpu"))


async def test_a_long_kept_sequence_does_not_stop_short_ones_from_being_kept() -> None:
    """One stranger's kept forward of 1 x 4096 tokens made the estimate 4096 tokens per
    row for good: an honest trainer's 128 x 16 kept forwards got no handle ever after
    (and the refusal was not counted)."""
    rt = _transformer(16, ["tr.0.0"])
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        reply, _ = await rt.forward("tr.0.0", _tokens(128, 16), retain=True, peer_id="honest")
        assert reply.handle is not None
        reply, _ = await rt.forward("tr.0.0", _tokens(1, 4096), retain=True, peer_id="stranger")
        for _ in range(3):
            reply, _ = await rt.forward("tr.0.0", _tokens(128, 16), retain=True, peer_id="honest")
            assert reply.handle is not None
        # far more 4096-token rows than the budget holds: not kept, and counted
        reply, _ = await rt.forward("tr.0.0", _tokens(4, 4096), retain=True, peer_id="stranger")
        assert reply.handle is None
        assert rt.retained_statistics().refused >= 1
        nursery.cancel_scope.cancel()


async def test_one_small_kept_forward_does_not_evict_everything() -> None:
    """After a long-sequence kept forward, 118 one-token sequences (15 KB) reserved ~the
    whole budget and evicted every kept forward of every expert."""
    rt = _transformer(1024, ["tr.0.0", "tr.0.1"])
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        handles = []
        for uid in ("tr.0.0", "tr.0.1"):
            for _ in range(3):
                reply, _ = await rt.forward(uid, _tokens(8, 16), retain=True, peer_id="honest")
                assert reply.handle is not None
                handles.append((uid, reply.handle))
        await rt.forward("tr.0.0", _tokens(1, 4096), retain=True, peer_id="stranger")
        before = rt.retained_statistics().nbytes
        reply, _ = await rt.forward("tr.0.0", _tokens(118, 1), retain=True, peer_id="stranger")
        assert reply.handle is not None
        stats = rt.retained_statistics()
        assert stats.evicted == 0
        assert stats.nbytes - before < 1 << 20  # what it holds, ~300 KB
        for uid, handle in handles:
            grads, _ = await rt.backward(uid, _grads(8, 16, 32), handle=handle, peer_id="honest")
            assert grads.tensors[0].shape == (8, 16, 32)
        nursery.cancel_scope.cancel()


def _grads(*shape: int, value: float | None = None) -> list[WireTensor]:
    g = torch.full(shape, value) if value is not None else torch.randn(*shape) * 1e-3
    meta, data = to_wire(g)
    return [WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))]


# -- a backward refused before it ran leaves its kept forward ------------------------------


async def test_a_refused_backward_leaves_the_kept_forward_for_a_corrected_retry() -> None:
    """Gradients of the wrong batch size are ``bad_shape`` (were ``expired``), non-finite
    ones ``rejected``, a full lane ``busy``: none of them uses the kept forward, so a
    retry with correct gradients goes through the handle."""
    rt = _runtime()
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        reply, _ = await rt.forward("ffn.0.0", _inputs(), retain=True, peer_id="p")
        handle = reply.handle
        assert handle is not None
        with pytest.raises(BadShape):
            await rt.backward("ffn.0.0", _grads(ROWS - 1, HIDDEN), handle=handle, peer_id="p")
        with pytest.raises(Rejected):
            await rt.backward(
                "ffn.0.0", _grads(ROWS, HIDDEN, value=float("nan")), handle=handle, peer_id="p"
            )
        lane = rt._experts["ffn.0.0"].backward_retained
        submit = lane.submit

        async def busy(*args: object, **kwargs: object) -> object:
            raise Busy("full")

        lane.submit = busy  # type: ignore[method-assign]
        with pytest.raises(Busy):
            await rt.backward("ffn.0.0", _grads(ROWS, HIDDEN), handle=handle, peer_id="p")
        lane.submit = submit  # type: ignore[method-assign]
        grads, _ = await rt.backward("ffn.0.0", _grads(ROWS, HIDDEN), handle=handle, peer_id="p")
        assert grads.tensors[0].shape == (ROWS, HIDDEN)
        stats = rt.retained_statistics()
        assert (stats.hits, stats.entries, stats.nbytes) == (1, 0, 0)
        with pytest.raises(ActivationsExpired):  # used once
            await rt.backward("ffn.0.0", _grads(ROWS, HIDDEN), handle=handle, peer_id="p")
        nursery.cancel_scope.cancel()


async def test_two_backwards_with_one_handle_use_it_once() -> None:
    rt = _runtime()
    outcomes: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        reply, _ = await rt.forward("ffn.0.0", _inputs(), retain=True, peer_id="p")
        handle = reply.handle

        async def backward() -> None:
            try:
                await rt.backward("ffn.0.0", _grads(ROWS, HIDDEN), handle=handle, peer_id="p")
                outcomes.append("ok")
            except ActivationsExpired:
                outcomes.append("expired")

        async with trio.open_nursery() as calls:
            calls.start_soon(backward)
            calls.start_soon(backward)
        nursery.cancel_scope.cancel()
    assert sorted(outcomes) == ["expired", "ok"]


def test_room_is_made_from_the_party_that_holds_the_most() -> None:
    """One stranger keeping forwards it never takes back (9 requests a second, inside its
    limits) evicted every other trainer's: their backwards came back ``expired`` (an
    outside probe: 10 of 11). Room now comes from the party holding the most bytes."""
    store = RetainedStore(1000, 60)
    shared = WeightsSnapshot({}, 0)
    honest = [store.put("e.0", "trainer", kept(100, shared), party="10.0.0.1") for _ in range(2)]
    flood = [store.put("e.1", "stranger", kept(100, shared), party="10.0.0.9") for _ in range(8)]
    assert None not in honest
    assert None not in flood
    for _ in range(20):  # the stranger goes on: it makes room from its own oldest
        flood.append(store.put("e.1", "stranger", kept(100, shared), party="10.0.0.9"))
    assert store.statistics().entries == 10
    # the trainer's newer forward too takes the stranger's place, not its own older one
    honest.append(store.put("e.0", "trainer", kept(100, shared), party="10.0.0.1"))
    for handle in honest:
        assert store.take(handle or "", "e.0", "trainer") is not None
    # two identities at one address are one party; the peer id is the party by default
    other = store.put("e.1", "sybil", kept(100, shared), party="10.0.0.9")
    lone = store.put("e.0", "loopback", kept(100, shared))
    assert store.take(other or "", "e.1", "sybil") is not None
    assert store.take(lone or "", "e.0", "loopback") is not None
    assert store.statistics().entries == 7  # the stranger's newest, where room was made


def test_a_party_that_holds_the_most_loses_its_oldest_first_even_if_honest() -> None:
    store = RetainedStore(500, 60)
    shared = WeightsSnapshot({}, 0)
    big = [store.put("e.0", "a", kept(100, shared), party="A") for _ in range(4)]
    small = store.put("e.0", "b", kept(100, shared), party="B")
    late = store.put("e.0", "c", kept(200, shared), party="C")  # room: A's oldest two
    assert late is not None
    assert [store.take(h or "", "e.0", "a") is not None for h in big] == [False, False, True, True]
    assert store.take(small or "", "e.0", "b") is not None
