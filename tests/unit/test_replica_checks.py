"""The joiner counts a listed replica only once it answered for the uid
(``swarm.verified.ReplicaChecks``): fake records cannot make an expert look served."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import trio
import trio.lowlevel

from volunteerd.errors import PeerUnreachable
from volunteerd.net import PeerAddress
from volunteerd.swarm import verified
from volunteerd.swarm.verified import ReplicaChecks

ADDR = ["/ip4/127.0.0.1/tcp/1"]


class Swarm:
    """Which (peer, uid) pairs are real; counts the checks. A check that raises stands
    for py-libp2p's own errors."""

    def __init__(self, real: set[tuple[str, str]], raising: set[str] = frozenset()) -> None:
        self.real = real
        self.raising = raising
        self.asked: Counter[tuple[str, str]] = Counter()
        self.in_flight = 0
        self.most_in_flight = 0

    async def check(self, peer: PeerAddress, uid: str) -> bool:
        self.asked[peer.peer_id, uid] += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await trio.lowlevel.checkpoint()
        self.in_flight -= 1
        if peer.peer_id in self.raising:
            raise RuntimeError("peer store: no such peer")
        return (peer.peer_id, uid) in self.real


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def peers(*ids: str) -> list[PeerAddress]:
    return [PeerAddress(i, ADDR) for i in ids]


def ids(found: dict[str, list[PeerAddress]]) -> dict[str, list[str]]:
    return {uid: [p.peer_id for p in ps] for uid, ps in found.items()}


async def test_only_peers_that_answered_for_the_uid_count() -> None:
    swarm = Swarm({("a", "e.0"), ("b", "e.1")}, raising={"broken"})
    checks = ReplicaChecks(swarm.check, Clock())
    listed = {"e.0": peers("fake", "a", "b", "broken"), "e.1": peers("b", "a")}
    assert ids(await checks.real(listed)) == {"e.0": ["a"], "e.1": ["b"]}
    assert checks.checks == 6
    assert checks.refused == 4  # fake, b for e.0, broken (it raised), a for e.1


async def test_answers_are_believed_for_a_while_and_refusals_back_off() -> None:
    swarm, clock = Swarm({("a", "e")}), Clock()
    checks = ReplicaChecks(swarm.check, clock, verified_s=100, failed_s=50)
    listed = {"e": peers("a", "fake")}
    for _ in range(3):  # within both: nobody is asked again
        assert ids(await checks.real(listed)) == {"e": ["a"]}
        clock.now += 10
    assert swarm.asked == {("a", "e"): 1, ("fake", "e"): 1}
    clock.now += 30  # 60 s on: the fake is asked again, a is still believed
    await checks.real(listed)
    assert swarm.asked == {("a", "e"): 1, ("fake", "e"): 2}
    clock.now += 50  # 110 s: a's answer is too old; a that left no longer counts
    swarm.real.clear()
    assert ids(await checks.real(listed)) == {"e": []}
    assert swarm.asked[("a", "e")] == 2


async def test_a_flood_of_fake_replicas_costs_a_bounded_number_of_checks_a_round() -> None:
    """A thousand fakes listed ahead of the honest replica of one uid: at most
    max_checks a round, at most at_once at a time, the other uids' replicas checked
    in the first round all the same, and the honest replica found within
    ceil(1001 / max_checks) rounds of checks, once each fake backs off."""
    fakes = [f"fake-{i}" for i in range(1000)]
    real = {("honest", "flooded")} | {(f"r{u}", f"e.{u}") for u in range(20)}
    swarm, clock = Swarm(real), Clock()
    checks = ReplicaChecks(
        swarm.check, clock, failed_s=3600, max_checks=100, at_once=8, rng=random.Random(1)
    )
    listed = {"flooded": peers(*fakes, "honest")} | {f"e.{u}": peers(f"r{u}") for u in range(20)}
    first = ids(await checks.real(listed))
    assert all(first[f"e.{u}"] == [f"r{u}"] for u in range(20))
    assert sum(swarm.asked.values()) == 100
    rounds = 1
    while ids(await checks.real(listed))["flooded"] != ["honest"]:
        rounds += 1
        clock.now += 60
    assert rounds <= 11
    assert max(swarm.asked.values()) == 1  # no fake asked twice within its backoff
    assert swarm.most_in_flight <= 8


async def test_fakes_that_never_answer_hold_a_round_for_round_s_at_most(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Fakes that accept and never answer, listed ahead of the honest replica of one
    uid and beside another uid's: each holds a slot for check_s and is then refused;
    checks start in order and none after round_s - check_s, so the round ends by round_s,
    the next round goes on down the list, and the honest replica is found."""

    async def check(peer: PeerAddress, uid: str) -> bool:
        if peer.peer_id.startswith("fake"):
            await trio.sleep(3600)
        return True

    clock = Clock()
    checks = ReplicaChecks(check, clock, check_s=10.0, round_s=30.0, at_once=4)
    listed = {"e": peers(*(f"fake-{i}" for i in range(20)), "honest"), "f": peers("other")}
    start = trio.current_time()
    found = ids(await checks.real(listed))
    assert trio.current_time() - start == pytest.approx(30.0)
    assert found == {"e": [], "f": ["other"]}  # the other uid's replica went first
    assert checks.checks == 13  # the other replica, then 4 fakes at 0, 10 and 20 s
    assert checks.refused == 12
    clock.now += 60
    start = trio.current_time()
    found = ids(await checks.real(listed))  # 8 fakes left (0 and 10 s), then the honest
    assert found == {"e": ["honest"], "f": ["other"]}
    assert trio.current_time() - start == pytest.approx(20.0)


async def test_what_is_remembered_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verified, "_MAX_REMEMBERED", 32)
    swarm = Swarm({(f"p{i}", "e") for i in range(0, 500, 2)})
    checks = ReplicaChecks(swarm.check, Clock(), max_checks=500)
    found = await checks.real({"e": peers(*(f"p{i}" for i in range(500)))})
    assert len(found["e"]) == 32  # the newest 32 answers are kept
    assert len(checks._verified) == 32
    assert len(checks._failed) == 32


async def test_a_real_replica_that_is_busy_counts_and_one_without_the_expert_does_not() -> None:
    """``hosts_uid``: a typed error other than unknown_expert is a replica too."""
    from volunteerd.errors import RemoteError
    from volunteerd.wire import ExpertInfo, TensorSchema

    class Rpc:
        def __init__(self, answer: object) -> None:
            self.answer = answer

        async def call(self, peer: PeerAddress, verb: object, request: object) -> object:
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer, []

    schema = TensorSchema(dtype="float32", shape=[None, 8])
    info = ExpertInfo(
        uid="e.1", expert_type="ffn", hidden_dim=8, inputs=[schema], outputs=[schema],
        max_batch_size=64,
    )  # fmt: skip
    cases = [
        (info, "e.1", True),
        (info, "e.2", False),  # answered about another uid
        (RemoteError("busy", "queue full"), "e.1", True),
        (RemoteError("unknown_expert", "not here"), "e.1", False),
        (PeerUnreachable("refused"), "e.1", False),
    ]
    for answer, uid, expected in cases:
        check = verified.hosts_uid(Rpc(answer))  # type: ignore[arg-type]
        assert await check(peers("p")[0], uid) is expected, (answer, uid)


async def test_a_newcomer_downloads_only_from_replicas_that_answered() -> None:
    """Fake records cost nothing; each fake tried for a download held a newcomer's start
    ~30 s (five of them at an address that accepts and never speaks: 169 s). Only
    replicas that answered for the uid are tried (all of them, up to 16, before it
    seeds: three sampled missed the honest one among cheap identities), and a
    replica's state brings its weights, never its optimizer's moments."""
    import types

    import torch

    from volunteerd.config import ExperimentsConfig, ExpertsConfig
    from volunteerd.errors import ShardError
    from volunteerd.experts import ExpertBackend
    from volunteerd.swarm.joiner import Joiner

    uid = "ffn.0.0"
    real = [f"real{i}" for i in range(5)]
    fakes = [f"fake{i}" for i in range(20)]
    swarm = Swarm({(r, uid) for r in real})
    checks = ReplicaChecks(swarm.check, Clock(), max_checks=len(real) + 2)
    listed = peers(*real, *fakes)
    await checks.real({uid: listed})  # the round's checks: some fakes stay unchecked

    def make() -> ExpertBackend:
        config = ExpertsConfig(hidden_dim=8, optimizer={"name": "adam", "lr": 0.01})
        return ExpertBackend(uid, config, torch.device("cpu"), 1024)

    replica = make()
    replica.backward([torch.randn(2, 8)], [torch.randn(2, 8)])
    replica.step()
    asked: list[str] = []
    discarded: list[str] = []

    class Downloads:
        answering = False

        async def download(self, peer: PeerAddress, backend: ExpertBackend) -> object:
            asked.append(peer.peer_id)
            if not self.answering:  # bad bytes: a busy replica would be asked again
                raise ShardError("the bytes received do not match their sha256", resumable=False)
            return replica.state()

        async def discard(self, uid: str) -> None:
            discarded.append(uid)

    async def run(fn: object) -> object:
        return fn()  # type: ignore[operator]

    downloads = Downloads()
    joiner = Joiner(
        None,  # type: ignore[arg-type]  # not looked up: the replicas are given
        types.SimpleNamespace(executor=types.SimpleNamespace(run=run)),  # type: ignore[arg-type]
        lambda: None,
        None,
        downloads,
        ExperimentsConfig(),
        lambda experts: 1,
        checks=checks,
        rng=random.Random(3),
    )
    assert await joiner._initial_state(make(), listed) == "seed"
    # every replica that answered for the uid is tried before it seeds; no fake is
    assert sorted(asked) == sorted(p.peer_id for p in listed if checks.verified(p.peer_id, uid))
    assert set(asked) <= set(real), asked
    assert discarded == [uid]  # what those downloads left is deleted
    asked.clear()
    downloads.answering = True
    newcomer = make()
    source = await joiner._initial_state(newcomer, listed)
    assert source.startswith("replica real")
    assert len(asked) == 1
    assert newcomer.updates == 1
    assert all(
        torch.equal(p, replica.parameter_copies()[n])
        for n, p in newcomer.parameter_copies().items()
    )
    assert newcomer.state().optimizer_state == {}  # Adam starts afresh


async def test_a_join_announces_each_expert_soon_and_a_burst_in_few_rounds(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A newcomer adds its experts one after another, each after its replicas'
    downloads: it announced them only once the last was ready, so with room for many
    it served none for as long as they all took (an outside probe: ~30 min an expert
    under replicas that trickle). Then it woke the announcer for each one, and every
    round signs a record for every key hosted: 4,096 seeded experts (~2 s each) made
    ~4,096 rounds of up to 4,161 keys (an outside probe). Now the first is announced
    at once, each within ``announce_gap_s`` (the announce period; 10 s here) of being
    ready, and a burst in a round per gap."""
    import types

    import torch

    from volunteerd.config import ExperimentsConfig, ExpertsConfig
    from volunteerd.experts import ExpertBackend
    from volunteerd.swarm.joiner import Joiner

    config = ExpertsConfig(hidden_dim=8)
    announced: list[tuple[float, set[str]]] = []
    added: list[str] = []
    broken = ""

    async def add_expert(backend: ExpertBackend) -> None:
        if backend.uid == broken:
            raise RuntimeError("out of memory")
        added.append(backend.uid)

    runtime = types.SimpleNamespace(
        make_backend=lambda uid, experts: ExpertBackend(uid, experts, torch.device("cpu"), 1024),
        add_expert=add_expert,
    )
    joiner: Joiner

    def announce() -> None:
        announced.append((trio.current_time(), set(joiner.hosted)))

    class NoDownloads:
        async def download(self, peer: PeerAddress, backend: ExpertBackend) -> object:
            raise AssertionError("no replica to download from")

        async def discard(self, uid: str) -> None:
            pass

    joiner = Joiner(
        None,  # type: ignore[arg-type]
        runtime,  # type: ignore[arg-type]
        announce,
        None,
        NoDownloads(),
        ExperimentsConfig(),
        lambda experts: 20,
        clock=trio.current_time,
        announce_gap_s=10.0,
    )

    async def no_replicas(uids: list[str]) -> dict[str, list[PeerAddress]]:
        return {uid: [] for uid in uids}

    joiner.live_replicas = no_replicas  # type: ignore[method-assign]
    uids = [f"ffn.0.{i}" for i in range(20)]  # seeded: ~2 s each (three lookups)
    await joiner._add(uids, {}, config)
    assert added == uids
    assert announced[0][1] == {uids[0]}  # the first at once
    for uid, ready_at in joiner.hosted.items():
        told = next(at for at, hosted in announced if uid in hosted)
        assert told - ready_at <= 10.0, (uid, told - ready_at)
    assert announced[-1][1] == set(uids)
    took = announced[-1][0] - announced[0][0]
    assert took > 35
    assert len(announced) <= took / 10 + 2, len(announced)  # one round per expert: 20

    # an expert that fails ends the burst with its own error, the others announced
    announced.clear()
    broken = "ffn.1.2"
    with pytest.raises(RuntimeError, match="out of memory"):
        await joiner._add(["ffn.1.0", "ffn.1.1", broken], {}, config)
    assert {"ffn.1.0", "ffn.1.1"} <= announced[-1][1]
