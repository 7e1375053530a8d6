"""Choosing which experts to host: fewest replicas first, newcomers spread out, and
re-balancing that moves only for a clear gain and never flaps."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from volunteerd.swarm.assignment import choose_experts, tie_break
from volunteerd.uids import expand_pattern

UIDS = expand_pattern("ffn.[0:4].[0:4]")
PEERS = [f"peer-{i}" for i in range(8)]


def choose(  # type: ignore[no-untyped-def]
    others, hosted=None, *, capacity=4, peer="me", replication=2, now=1000.0, min_stay_s=0.0, **kw
):
    return choose_experts(
        UIDS,
        others,
        hosted or {},
        capacity=capacity,
        peer_id=peer,
        replication=replication,
        now=now,
        min_stay_s=min_stay_s,
        **kw,
    )


def test_newcomer_takes_the_least_replicated_experts() -> None:
    others = {uid: ["a", "b"] for uid in UIDS}
    lonely = ["ffn.0.3", "ffn.2.1", "ffn.3.3"]
    for uid in lonely:
        others[uid] = ["a"]
    others["ffn.1.1"] = []
    choice = choose(others, capacity=4)
    assert set(choice.add) == {"ffn.1.1", *lonely}
    assert choice.drop == ()


def test_own_peer_id_in_the_records_is_not_counted() -> None:
    others = {uid: ["a"] for uid in UIDS}
    others["ffn.0.0"] = ["me", "a"]
    choice = choose(others, {"ffn.0.0": 0.0}, capacity=1)
    assert not choice.changed


def test_simultaneous_newcomers_pick_different_experts() -> None:
    picks = [set(choose({}, capacity=6, peer=p).add) for p in PEERS[:3]]
    assert all(len(p) == 6 for p in picks)
    assert len({frozenset(p) for p in picks}) == 3
    # The tie-break is a hash: the same peer always makes the same choice.
    assert set(choose({}, capacity=6, peer=PEERS[0]).add) == picks[0]


def test_a_restart_prefers_the_experts_it_has_checkpoints_of() -> None:
    mine = ["ffn.3.3", "ffn.0.1"]
    others = {uid: ["a"] for uid in UIDS}
    others["ffn.2.2"] = []  # an orphan still comes first
    choice = choose(others, capacity=3, prefer=mine)
    assert choice.add == ("ffn.2.2", *sorted(mine, key=lambda u: tie_break("me", u)))


def test_capacity_above_the_grid_hosts_everything() -> None:
    assert set(choose({}, capacity=100).add) == set(UIDS)


def test_shrinking_drops_the_most_replicated_first_even_before_min_stay() -> None:
    hosted = {"ffn.0.0": 999.0, "ffn.0.1": 999.0, "ffn.0.2": 999.0}
    others = {"ffn.0.0": ["a", "b", "c"], "ffn.0.1": [], "ffn.0.2": ["a"]}
    choice = choose(others, hosted, capacity=2, min_stay_s=3600)
    assert choice.drop == ("ffn.0.0",)
    assert choice.add == ()


def test_uids_no_longer_in_the_experiment_are_dropped() -> None:
    choice = choose({}, {"attn.0.0": 0.0}, capacity=1)
    assert "attn.0.0" in choice.drop
    assert len(choice.add) == 1


def test_moves_to_an_orphan_when_the_source_keeps_a_replica() -> None:
    others = {uid: ["a"] for uid in UIDS}
    others["ffn.3.3"] = []
    hosted = {"ffn.0.0": 0.0}
    # Make "me" the first to leave ffn.0.0 among its two hosts.
    peer = next(p for p in PEERS if tie_break(p, "ffn.0.0") > tie_break("a", "ffn.0.0"))
    choice = choose(others, hosted, capacity=1, peer=peer)
    assert choice.add == ("ffn.3.3",)
    assert choice.drop == ("ffn.0.0",)


def test_only_the_first_ranked_host_leaves_an_expert_in_a_round() -> None:
    others = {uid: ["x"] for uid in UIDS}
    others["ffn.3.3"] = []
    hosts = ["p", "q"]
    leaving = []
    for me in hosts:
        other = [h for h in hosts if h != me]
        view = {**others, "ffn.0.0": other}
        if choose(view, {"ffn.0.0": 0.0}, capacity=1, peer=me).drop:
            leaving.append(me)
    assert len(leaving) == 1


def test_no_move_without_a_clear_gain() -> None:
    # Hosted expert has one other replica, the best candidate one too: staying is as good.
    others = {uid: ["a"] for uid in UIDS}
    choice = choose(others, {"ffn.0.0": 0.0}, capacity=1, peer="zzz")
    assert not choice.changed
    # Two more replicas than the candidate but the candidate already meets the target.
    others = {uid: ["a", "b"] for uid in UIDS}
    others["ffn.0.0"] = ["a", "b", "c", "d"]
    assert not choose(others, {"ffn.0.0": 0.0}, capacity=1, replication=2).changed


def test_min_stay_holds_a_move_back() -> None:
    others = {uid: ["a"] for uid in UIDS}
    others["ffn.3.3"] = []
    peer = next(p for p in PEERS if tie_break(p, "ffn.0.0") > tie_break("a", "ffn.0.0"))
    hosted = {"ffn.0.0": 900.0}
    assert not choose(others, hosted, capacity=1, peer=peer, now=1000, min_stay_s=300).changed
    assert choose(others, hosted, capacity=1, peer=peer, now=1300, min_stay_s=300).changed


def test_at_most_max_moves_a_round() -> None:
    others = {uid: ["a", "b", "c"] for uid in UIDS}
    hosted = {uid: 0.0 for uid in UIDS[:8]}
    for uid in UIDS[8:]:
        others[uid] = []
    choice = choose(others, hosted, capacity=8, peer="zzzz", max_moves=2)
    assert len(choice.add) <= 2
    assert len(choice.drop) == len(choice.add)


@settings(max_examples=60, deadline=None)
@given(
    n_peers=st.integers(1, 6),
    capacity=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_swarm_converges_to_full_coverage_and_then_stops_moving(
    n_peers: int, capacity: int, seed: int
) -> None:
    """Peers choose in turn, each seeing the others' current choice, as rounds of the
    daemons do. If the swarm has room for every expert it ends up covering them all;
    and once settled nobody moves again (no flapping)."""
    rng = random.Random(seed)
    peers = [f"peer-{rng.getrandbits(64):x}" for _ in range(n_peers)]
    hosted: dict[str, dict[str, float]] = {p: {} for p in peers}
    now = 0.0

    def step() -> bool:
        nonlocal now
        changed = False
        order = peers[:]
        rng.shuffle(order)
        for p in order:
            now += 1
            others: dict[str, list[str]] = {u: [] for u in UIDS}
            for q in peers:
                if q != p:
                    for u in hosted[q]:
                        others[u].append(q)
            choice = choose_experts(
                UIDS,
                others,
                hosted[p],
                capacity=capacity,
                peer_id=p,
                replication=2,
                now=now,
                min_stay_s=0,
            )
            for u in choice.drop:
                del hosted[p][u]
            for u in choice.add:
                hosted[p][u] = now
            changed |= choice.changed
        return changed

    rounds = 0
    while step():
        rounds += 1
        assert rounds < 60, "no convergence"
    assert all(len(h) == min(capacity, len(UIDS)) for h in hosted.values())
    counts = Counter(u for h in hosted.values() for u in h)
    if n_peers * capacity >= len(UIDS):
        assert set(counts) == set(UIDS)
    # Settled: nothing moves in further rounds.
    assert not step()
    assert not step()
