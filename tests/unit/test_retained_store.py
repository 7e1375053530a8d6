"""RetainedStore: kept forwards are bounded in bytes and time and bound to their peer."""

from __future__ import annotations

import torch
import trio
import trio.lowlevel

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
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
