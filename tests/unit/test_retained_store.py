"""RetainedStore: kept forwards are bounded in bytes and time and bound to their peer."""

from __future__ import annotations

import torch

from volunteerd.experts import Retained, WeightsSnapshot
from volunteerd.runtime import RetainedStore


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
