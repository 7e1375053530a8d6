"""Beam search over the expert grid picks the best alive experts, one dimension at a time."""

from __future__ import annotations

import itertools

import torch

from volunteerd.moe.routing import beam_search


def children_of(alive: set[str]):  # type: ignore[no-untyped-def]
    """A directory over a fixed set of alive uids, counting the prefixes asked for."""
    asked: list[list[str]] = []

    def children(prefixes: list[str]) -> dict[str, dict[int, list[str]]]:
        asked.append(prefixes)
        out: dict[str, dict[int, list[str]]] = {}
        for prefix in prefixes:
            out[prefix] = {}
            for uid in alive:
                if uid.startswith(prefix):
                    rest = uid[len(prefix) :].split(".")
                    out[prefix].setdefault(int(rest[0]), []).append(f"peer-of-{uid}")
        return out

    return children, asked


def exhaustive(logits: list[torch.Tensor], alive: set[str], k: int) -> list[list[str]]:
    grid = [range(scores.shape[1]) for scores in logits]
    best = []
    for n in range(logits[0].shape[0]):
        scored = []
        for coords in itertools.product(*grid):
            uid = "ffn." + ".".join(map(str, coords))
            if uid in alive:
                scored.append(
                    (sum(float(s[n, c]) for s, c in zip(logits, coords, strict=True)), uid)
                )
        best.append([uid for _, uid in sorted(scored, reverse=True)[:k]])
    return best


def test_a_wide_beam_finds_exactly_the_best_alive_experts() -> None:
    torch.manual_seed(0)
    logits = [torch.randn(20, 4), torch.randn(20, 5)]
    alive = {f"ffn.{i}.{j}" for i in range(4) for j in range(5) if (i + j) % 3}
    children, asked = children_of(alive)
    route = beam_search(logits, "ffn", children, beam_size=4, k=3)
    got = [[route.uid(n, k) for k in range(3) if route.valid_NK[n, k]] for n in range(20)]
    assert got == exhaustive(logits, alive, 3)
    assert len(asked) == 2, "one batched lookup per grid dimension"
    assert asked[0] == ["ffn."]
    assert all(route.peers[uid] == [f"peer-of-{uid}"] for uid in route.peers)


def test_dead_experts_are_never_chosen_and_missing_slots_are_invalid() -> None:
    logits = [torch.zeros(3, 4), torch.zeros(3, 4)]
    alive = {"ffn.1.2", "ffn.3.0"}
    children, _ = children_of(alive)
    route = beam_search(logits, "ffn", children, beam_size=4, k=4)
    assert route.valid_NK.sum(dim=1).tolist() == [2, 2, 2]
    chosen = {route.uid(n, k) for n, k in route.valid_NK.nonzero().tolist()}
    assert chosen == alive


def test_three_dimensional_grid() -> None:
    torch.manual_seed(1)
    logits = [torch.randn(8, 2), torch.randn(8, 3), torch.randn(8, 2)]
    alive = {f"ffn.{i}.{j}.{k}" for i in range(2) for j in range(3) for k in range(2)}
    children, asked = children_of(alive)
    route = beam_search(logits, "ffn", children, beam_size=12, k=2)
    got = [[route.uid(n, k) for k in range(2)] for n in range(8)]
    assert got == exhaustive(logits, alive, 2)
    assert len(asked) == 3


def test_nothing_alive_means_no_valid_slot() -> None:
    children, _ = children_of(set())
    route = beam_search([torch.zeros(2, 2), torch.zeros(2, 2)], "ffn", children, beam_size=2, k=2)
    assert not route.valid_NK.any()
