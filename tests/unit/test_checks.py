"""The trainer's output checks judge peers against their peers, not against the model.

A round is the answers of one forward (or backward) fan-out of a layer. Bans need
evidence that a peer differs from the other peers of its round; a check that most of
the round fails reports a diverging model and bans nobody.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pytest
import torch
import trio

from volunteerd.errors import RemoteError, RequestTimeout
from volunteerd.experts import to_wire
from volunteerd.identity import Identity
from volunteerd.moe import RemoteMixtureOfExperts
from volunteerd.moe.checks import (
    BAD_SHAPE,
    NON_FINITE,
    OUT_OF_RANGE,
    OutputChecks,
    agree,
    judge_round,
)
from volunteerd.moe.client import TrainerClient
from volunteerd.moe.directory import (
    EXPERTS_GONE_BAN,
    SLOW_BAN_GROWTH_MAX,
    ExpertDirectory,
    RecordLookup,
)
from volunteerd.moe.dispatch import Call, Outcome
from volunteerd.moe.layer import _LATE_AGE_ROUNDS, LATE_STREAK_BAN, _Group
from volunteerd.moe.routing import Route
from volunteerd.net import ExpertRecord, PeerAddress, RpcClient, Verb, peer_id_for, sign_record
from volunteerd.wire import WireTensor

T = TypeVar("T")

CHECKS = OutputChecks(max_abs=100.0, max_ratio=1000.0, max_growth=10.0)


def answers(scale: float, count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` honest-looking answers whose largest element is about ``scale``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        t = torch.rand(4, 8, generator=g) * 2 - 1
        out.append(t / t.abs().max() * scale)
    return out


def test_a_round_that_all_grew_past_max_abs_is_the_model_not_the_peers() -> None:
    # Three honest peers whose outputs all grew from 90 to 150 (max_abs 100): the last
    # accepted round's scale says this is growth, not an attack.
    last = judge_round(answers(90.0, 6), CHECKS, peers=list("aabbcc"))
    assert last.reasons == [None] * 6
    assert last.scale is not None
    now = judge_round(answers(150.0, 6, seed=1), CHECKS, peers=list("aabbcc"), reference=last.scale)
    assert now.reasons == [None] * 6, "accepted as the model's own scale"
    assert now.convicted == [False] * 6
    assert now.diverging == OUT_OF_RANGE
    assert now.blamed_on_model == tuple(range(6))
    assert now.scale is not None
    assert now.scale > last.scale


def test_a_round_above_max_abs_with_no_history_is_dropped_but_nobody_is_banned() -> None:
    verdict = judge_round(answers(150.0, 6), CHECKS, peers=list("aabbcc"))
    assert verdict.reasons == [OUT_OF_RANGE] * 6
    assert verdict.convicted == [False] * 6
    assert verdict.diverging == OUT_OF_RANGE
    assert verdict.scale is None


def test_a_jump_far_beyond_the_last_round_is_not_growth() -> None:
    last = judge_round(answers(1.0, 4), CHECKS, peers=list("abcd"))
    # Everyone (or one peer answering every call) suddenly 1e6 times louder.
    verdict = judge_round(answers(1e6, 4, seed=1), CHECKS, peers=list("abcd"), reference=last.scale)
    assert verdict.reasons == [OUT_OF_RANGE] * 4
    assert verdict.convicted == [False] * 4
    assert verdict.diverging == OUT_OF_RANGE


def test_one_peer_far_louder_than_the_rest_is_convicted() -> None:
    tensors = answers(1.0, 4)
    tensors[2] = tensors[2] * 1e6
    verdict = judge_round(tensors, CHECKS, peers=list("abcd"), reference=1.0)
    assert verdict.reasons == [None, None, OUT_OF_RANGE, None]
    assert verdict.convicted == [False, False, True, False]
    assert verdict.diverging is None


def test_a_few_rows_far_louder_than_the_round_are_convicted() -> None:
    # Two rows of 64 blown up 3000 times: the answer's RMS is diluted by its other rows
    # (~530 times the round's), so it passed, and poisoned the trainer's Adam state.
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 8, generator=g) for _ in range(4)]
    tensors[2][:2] *= 3000
    verdict = judge_round(tensors, CHECKS, peers=list("abcd"))
    assert verdict.reasons == [None, None, OUT_OF_RANGE, None]
    assert verdict.convicted == [False, False, True, False]


def test_rows_of_honestly_different_sizes_are_not_loud() -> None:
    # A token's gradient scales with its gate weight: rows 100 times apart are honest.
    g = torch.Generator().manual_seed(0)
    weights = torch.logspace(-2, 0, 64)[:, None]
    tensors = [torch.randn(64, 8, generator=g) * weights for _ in range(4)]
    verdict = judge_round(tensors, CHECKS, peers=list("abcd"))
    assert verdict.reasons == [None] * 4


def test_one_peer_over_max_abs_but_not_loud_is_dropped_not_banned() -> None:
    # Honest experts of a growing model cross max_abs one after another: the first to
    # cross is no outlier.
    tensors = answers(80.0, 3) + answers(120.0, 1, seed=1)
    verdict = judge_round(tensors, CHECKS, peers=list("abcd"), reference=50.0)
    assert verdict.reasons == [None, None, None, OUT_OF_RANGE]
    assert verdict.convicted == [False] * 4
    assert verdict.diverging is None


def test_an_all_nan_round_is_a_diverged_model() -> None:
    nan = [torch.full((4, 8), float("nan")) for _ in range(5)]
    verdict = judge_round(nan, CHECKS, peers=list("aabbc"), reference=1.0)
    assert verdict.reasons == [NON_FINITE] * 5
    assert verdict.convicted == [False] * 5
    assert verdict.diverging == NON_FINITE
    assert verdict.scale is None


def test_one_nan_peer_among_finite_ones_is_convicted() -> None:
    tensors = answers(1.0, 4)
    tensors[1] = torch.full_like(tensors[1], float("inf"))
    verdict = judge_round([*tensors, None], CHECKS, peers=list("abcde"))
    assert verdict.reasons == [None, NON_FINITE, None, None, None]
    assert verdict.convicted == [False, True, False, False, False]
    assert verdict.diverging is None


def test_a_peer_answering_most_calls_is_judged_as_one_peer() -> None:
    # Peer "bad" got three of the four calls and answered NaN; "good" answered fine.
    # Most answers failed, but not most peers: the peer is the odd one out.
    tensors = answers(1.0, 4)
    for i in (0, 1, 3):
        tensors[i] = torch.full_like(tensors[i], float("nan"))
    verdict = judge_round(tensors, CHECKS, peers=["bad", "bad", "good", "bad"])
    assert verdict.convicted == [True, True, False, True]
    assert verdict.diverging is None


def test_a_lone_peer_is_never_convicted() -> None:
    # Nobody to compare it with: its bad answers are dropped, it is not banned.
    tensors = answers(1.0, 4)
    tensors[0] = torch.full_like(tensors[0], float("nan"))
    tensors[1] = tensors[1] * 1e6
    verdict = judge_round(tensors, CHECKS, peers=["solo"] * 4, reference=1.0)
    assert verdict.reasons == [NON_FINITE, OUT_OF_RANGE, None, None]
    assert verdict.convicted == [False] * 4
    assert verdict.diverging is None  # one answer in four is no diverging model


@pytest.mark.parametrize("lie", ["nan", "over_max_abs"])
def test_a_lone_peer_whose_every_answer_fails_is_no_diverging_model(lie: str) -> None:
    # Its honest peers busy, one liar answers the whole round: NaN, or one element just
    # over max_abs (far beyond the last round's scale). One peer's word says nothing
    # about the model: the answers are dropped, nobody is banned, no divergence.
    tensors = answers(1.0, 3)
    for t in tensors:
        t.view(-1)[0] = float("nan") if lie == "nan" else 1.05 * CHECKS.max_abs
    verdict = judge_round(tensors, CHECKS, peers=["liar"] * 3, reference=1.0)
    assert verdict.reasons == [NON_FINITE if lie == "nan" else OUT_OF_RANGE] * 3
    assert verdict.convicted == [False] * 3
    assert verdict.diverging is None
    assert verdict.blamed_on_model == ()


def test_a_lone_peer_that_grew_a_little_past_max_abs_is_still_taken_as_growth() -> None:
    # A swarm of one server whose model grows: within max_growth of the last round.
    last = judge_round(answers(90.0, 3), CHECKS, peers=["solo"] * 3)
    verdict = judge_round(
        answers(150.0, 3, seed=1), CHECKS, peers=["solo"] * 3, reference=last.scale
    )
    assert verdict.reasons == [None] * 3
    assert verdict.diverging is None


@pytest.mark.parametrize(
    ("bad", "reason", "convicted"),
    [
        (torch.full((4, 8), float("nan")), NON_FINITE, True),  # NaN is never honest
        (torch.ones(4, 8) * 1e6, OUT_OF_RANGE, False),  # which of two is right? no ban
    ],
)
def test_two_answers_only(bad: torch.Tensor, reason: str, convicted: bool) -> None:
    verdict = judge_round([answers(1.0, 1)[0], bad], CHECKS, peers=["good", "bad"])
    assert verdict.reasons == [None, reason]
    assert verdict.convicted == [False, convicted]
    assert verdict.diverging is None


def test_two_nan_answers_of_two_are_a_diverged_model() -> None:
    nan = torch.full((4, 8), float("nan"))
    verdict = judge_round([nan, nan.clone()], CHECKS, peers=["a", "b"])
    assert verdict.convicted == [False, False]
    assert verdict.diverging == NON_FINITE


def test_a_peer_answering_zeros_cannot_make_an_honest_peer_look_loud() -> None:
    tensors = [torch.zeros(4, 8), torch.zeros(4, 8), *answers(1.0, 2)]
    verdict = judge_round(tensors, CHECKS, peers=["zero", "zero", "honest", "honest"])
    assert verdict.reasons == [None] * 4
    assert verdict.convicted == [False] * 4


@pytest.mark.parametrize("factor", [11.0, 30.0, 100.0, 999.0, 0.05])
def test_a_spot_check_refuses_a_replica_answer_scaled_up_or_down(factor: float) -> None:
    # Two replicas of one expert answer the same input: an answer scaled by 100 points
    # the same way and passed (norms within max_ratio, 1000), for good.
    y = answers(1.0, 1)[0]
    assert not agree(y, y * factor, OutputChecks())
    assert not agree(y * factor, y, OutputChecks())


def test_a_spot_check_accepts_replicas_that_drifted_apart() -> None:
    # Honest replicas early in training, between averaging rounds: in one process, with
    # no averaging at all, norms up to 3.3 times apart with the default experiment.
    y = answers(1.0, 1)[0]
    drifted = y * 3.3 + 0.1 * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    assert agree(y, drifted, OutputChecks())
    assert agree(drifted, y, OutputChecks())


def test_spot_ratio_is_validated() -> None:
    with pytest.raises(ValueError, match="max_spot_ratio"):
        OutputChecks(max_spot_ratio=1.0)


def test_growth_limit_is_validated() -> None:
    with pytest.raises(ValueError, match="max_growth"):
        OutputChecks(max_growth=1.0)


# -- the layer: what it does with a verdict -----------------------------------------------


class _Directory:
    def __init__(self) -> None:
        self.banned: dict[str, str] = {}

    def is_banned(self, peer_id: str) -> bool:
        return peer_id in self.banned


class _Client:
    """What the layer needs of a SwarmClient to judge answers: bans (and the
    connections it closes with a ban for a timeout)."""

    def __init__(self) -> None:
        self.directory = _Directory()
        self.hung_up: list[str] = []

    def ban(
        self,
        peer_id: str,
        reason: str,
        seconds: float | None = None,
        *,
        grow: bool = True,
        most: int = 64,
    ) -> None:
        self.directory.banned[peer_id] = reason

    def hang_up(self, peer_id: str) -> None:
        self.hung_up.append(peer_id)


def _layer() -> tuple[RemoteMixtureOfExperts, _Client]:
    client = _Client()
    layer = RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=client, checks=CHECKS)  # type: ignore[arg-type]
    return layer, client


def _round(tensors: list[torch.Tensor], peers: str) -> tuple[list[Call], list[Outcome]]:
    calls, outcomes = [], []
    for i, (t, peer) in enumerate(zip(tensors, peers, strict=True)):
        rows = list(range(t.shape[0]))  # the rows sent: one per row answered
        calls.append(Call(f"ffn.{i}", PeerAddress(peer, ()), None, [], rows))
        meta, data = to_wire(t)
        wire = WireTensor(meta.dtype, tuple(meta.shape), memoryview(bytearray(data)))
        outcomes.append(Outcome(reply=object(), tensors=[wire]))
    return calls, outcomes


def test_the_layer_reports_a_round_most_peers_fail_and_bans_nobody() -> None:
    layer, client = _layer()
    calls, outcomes = _round([torch.full((2, 8), float("nan"))] * 3, "abc")
    ys, unblamed = layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
    assert ys == [None, None, None]
    assert unblamed == {"a", "b", "c"}
    assert layer.stats.diverging == {NON_FINITE: 1}
    assert layer.stats.rejected == {NON_FINITE: 3}
    assert client.directory.banned == {}


def test_the_layer_drops_a_lone_peers_failing_answers_and_calls_no_model_diverging() -> None:
    layer, client = _layer()
    calls, outcomes = _round([torch.full((2, 8), float("nan"))] * 2, "aa")
    ys, unblamed = layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
    assert ys == [None, None]
    assert unblamed == {"a"}, "one peer: not enough for the forward to call it divergence"
    assert layer.stats.diverging == {}
    assert layer.stats.rejected == {NON_FINITE: 2}
    assert client.directory.banned == {}


def test_the_layer_bans_the_odd_peer_out() -> None:
    layer, client = _layer()
    tensors = answers(1.0, 3)
    tensors[1] = torch.full_like(tensors[1], float("nan"))
    calls, outcomes = _round(tensors, "abc")
    ys, unblamed = layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
    assert [y is None for y in ys] == [False, True, False]
    assert unblamed == set()
    assert list(client.directory.banned) == ["b"]
    assert layer.stats.diverging == {}


def test_the_layer_never_bans_its_last_peer() -> None:
    # Two peers serve the step: "a" answers one call and times out on another (banned
    # for that), then "b" answers NaN. Banning "b" too would leave nothing to train with.
    layer, client = _layer()
    good, nan = answers(1.0, 1)[0], torch.full((4, 8), float("nan"))
    calls, outcomes = _round([good, good, nan], "aab")
    outcomes[1] = Outcome(error=RequestTimeout("no answer in time"))
    ys, _ = layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b"})
    assert [y is None for y in ys] == [False, True, True]
    assert list(client.directory.banned) == ["a"]
    assert client.hung_up == ["a"]  # banned for a timeout: its connection closed too
    assert layer.stats.bans_held_back == 1
    assert layer.stats.rejected == {NON_FINITE: 1}


def test_the_layer_bans_a_peer_whose_answer_does_not_fit_the_rows_sent() -> None:
    # "b" answers 3 rows for the 4 it was sent, "c" rows of width 9 instead of 8: each is
    # dropped and banned before the value checks see it, alone as in company.
    layer, client = _layer()
    good = answers(1.0, 3)
    calls, outcomes = _round([good[0], good[1][:3], torch.cat([good[2], good[2][:, :1]], 1)], "abc")
    calls[1] = Call(calls[1].uid, calls[1].peer, None, [], [0, 1, 2, 3])
    ys, unblamed = layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
    assert [y is None for y in ys] == [False, True, True]
    assert unblamed == set()
    assert sorted(client.directory.banned) == ["b", "c"]
    assert layer.stats.rejected == {BAD_SHAPE: 2}
    alone, alone_client = _layer()
    calls, outcomes = _round([good[0][:3]], "d")
    calls[0] = Call(calls[0].uid, calls[0].peer, None, [], [0, 1, 2, 3])
    ys, _ = alone._accept(Verb.BACKWARD, calls, outcomes, {"d", "e"})
    assert ys == [None]
    assert list(alone_client.directory.banned) == ["d"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _DirectoryClient(TrainerClient):
    """A layer's client whose bans go to a real ``ExpertDirectory`` (nothing is looked
    up: the layer is handed its rounds), on a clock the test moves."""

    def __init__(self, dht: RecordLookup | None = None) -> None:
        self.clock = _Clock()
        self._directory = ExpertDirectory(dht, ban_s=60.0, clock=self.clock)  # type: ignore[arg-type]
        self._rpc = _HangUps()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.run(fn, *args)

    @property
    def rpc(self) -> RpcClient:
        return self._rpc  # type: ignore[return-value]

    @property
    def directory(self) -> ExpertDirectory:
        return self._directory


class _HangUps:
    async def hang_up(self, peer_id: str) -> None:
        pass


def _refused(code: str, retry_after_s: float | None = None) -> Outcome:
    return Outcome(error=RemoteError(code, "not now", retry_after_s))


def _ban_lengths(
    outcome: Callable[[], Outcome],
    times: int,
    streak: int,
    answers_between: int = 0,
    calls_per_round: int = 1,
) -> tuple[list[float], RemoteMixtureOfExperts, _DirectoryClient]:
    """The length of each of ``times`` bans of peer "a", each earned by ``streak``
    rounds in a row of ``outcome`` ("b" and "c" answering), each waited out and followed
    by ``answers_between`` rounds in which "a" answered ``calls_per_round`` calls."""
    client = _DirectoryClient()
    layer = RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=client, checks=CHECKS)
    directory = client.directory
    lengths = []
    for _ in range(times):
        for _ in range(streak):
            assert not directory.is_banned("a")
            calls, outcomes = _round(answers(1.0, 3), "abc")
            outcomes[0] = outcome()
            layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
        assert directory.is_banned("a"), "banned after a streak"
        lengths.append(directory.banned["a"] - client.clock.now)
        client.clock.now = directory.banned["a"]  # waited out
        for _ in range(answers_between):
            layer._answered(["a"] * calls_per_round)
    return lengths, layer, client


@pytest.mark.parametrize(
    "outcome",
    [
        lambda: Outcome(late=True),
        lambda: _refused("paused"),
        lambda: _refused("busy"),
        lambda: _refused("rate_limited"),
        lambda: _refused("rejected", retry_after_s=30.0),
    ],
    ids=["late", "paused", "busy", "rate_limited", "retry_after_s"],
)
def test_a_peer_slow_or_loaded_streak_after_streak_is_banned_for_ban_s_each_time(
    outcome: Callable[[], Outcome],
) -> None:
    """A volunteer slowed by its own upload limit, paused or over its quota is not lying:
    its bans grew 60 s, 120 s, ... 64 min, remembered for a day, and kept it unused
    15-25 min after it had recovered (a 45-minute soak). Each such ban is ``ban_s``,
    however often once it answered again in between; it still is one, so a peer late on
    purpose costs a streak per ban."""
    lengths, _layer, client = _ban_lengths(outcome, times=8, streak=8, answers_between=8)
    assert lengths == [60.0] * 8
    # Nor do they count toward a real offence's growth: a first lie is a first ban.
    calls, outcomes = _round(answers(1.0, 3), "abc")
    outcomes[0] = Outcome(error=RequestTimeout("no answer in time"))
    _layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
    assert client.directory.banned["a"] - client.clock.now == 60.0


def test_a_peer_refusing_what_it_should_take_or_lying_is_still_banned_longer_each_time() -> None:
    # A streak with a refusal that does not say "later" grows as before...
    lengths, _, _ = _ban_lengths(lambda: _refused("rejected"), times=4, streak=8)
    assert lengths == [60.0, 120.0, 240.0, 480.0]
    # ... as does a peer whose answers fail the checks (NaN, the odd one out).
    nan = Outcome(
        reply=object(),
        tensors=[_round([torch.full((4, 8), float("nan"))], "a")[1][0].tensors[0]],
    )
    lengths, _, _ = _ban_lengths(lambda: nan, times=3, streak=1)
    assert lengths == [CHECKS.ban_s, 2 * CHECKS.ban_s, 4 * CHECKS.ban_s]


class _Records:
    """The DHT's answer: each of ``servers`` announces experts 0 and 1 of ``ffn.``."""

    def __init__(self, servers: list[Identity], children: list[int] | None = None) -> None:
        self.servers = servers
        self.children = [0, 1] if children is None else children

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        return {
            key: [
                sign_record(
                    s,
                    str(peer_id_for(s)),
                    key=key,
                    addrs=["/ip4/127.0.0.1/tcp/1"],
                    children=self.children,
                    ttl_s=30,
                )
                for s in self.servers
            ]
            for key in keys
        }


def _offered(client: _DirectoryClient) -> dict[int, list[str]]:
    """The peers the directory offers now for each expert of ``ffn.``."""
    found = client.run(client.directory.children, ["ffn."])["ffn."]
    return {child: [p.peer_id for p in peers] for child, peers in found.items()}


def _called(
    layer: RemoteMixtureOfExperts,
    peer: str,
    uid: int,
    peers: set[str],
    *,
    refused: str | None = None,
) -> None:
    """A round in which ``peer`` was called for expert ``uid`` of ``ffn.`` (beside
    another call): answered, or ``refused`` with that error."""
    calls, outcomes = _round([answers(1.0, 1)[0]] * 2, "xb")
    calls[0] = Call(f"ffn.{uid}", PeerAddress(peer, ()), None, [], calls[0].rows)
    if refused is not None:
        outcomes[0] = _refused(refused)
    layer._accept(Verb.FORWARD, calls, outcomes, peers)


def test_an_unknown_expert_answer_drops_that_expert_of_the_peer_not_the_peer() -> None:
    """A volunteer that re-balanced onto other experts answers ``unknown_expert`` for
    the ones it left until its new records replace the old: the peer was banned for it,
    all its experts unused, and longer each time. Now only that expert of that peer is
    left out (for ``ban_s``, never longer: one announcing an expert it does not serve
    costs a call per ``ban_s``), and its records are looked up again."""
    servers = [Identity.generate() for _ in range(2)]
    a, b = (str(peer_id_for(s)) for s in servers)
    dht = _Records(servers)
    client = _DirectoryClient(dht)
    layer = RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=client, checks=CHECKS)
    directory = client.directory

    assert _offered(client) == {0: [a, b], 1: [a, b]}
    for _ in range(4):
        good = answers(1.0, 1)[0]
        calls, outcomes = _round([good, good], "ab")
        calls[0] = Call("ffn.0", PeerAddress(a, ()), None, [], calls[0].rows)
        outcomes[0] = _refused("unknown_expert")
        layer._accept(Verb.FORWARD, calls, outcomes, {a, b})
        assert not directory.is_banned(a), "its other experts are still chosen"
        assert _offered(client) == {0: [b], 1: [a, b]}
        client.clock.now += 60.0  # held for ban_s each time, never longer
        assert _offered(client) == {0: [a, b], 1: [a, b]}
    assert layer.stats.failures["unknown_expert"] == 4


@pytest.mark.parametrize(
    "outcome",
    [lambda: Outcome(late=True), lambda: _refused("busy"), lambda: _refused("rate_limited", 30.0)],
    ids=["late", "busy", "rate_limited"],
)
def test_a_peer_that_never_answers_on_time_between_its_bans_is_banned_longer_each_time(
    outcome: Callable[[], Outcome],
) -> None:
    """One that answers ``info`` and then stalls or refuses every call "later" has not
    recovered between its bans: banned ``ban_s`` each time, it cost the grace of a
    streak per ban forever (57 bans an hour, 6.3 % of steps' grace). Its bans grow, to
    SLOW_BAN_GROWTH_MAX times (grown to 64 times, one honestly late in half its rounds
    sat out 32-64 min: a re-check)."""
    lengths, _, _ = _ban_lengths(outcome, times=7, streak=8)
    assert lengths == [60.0, 60.0, 120.0, 240.0, 240.0, 240.0, 240.0]
    assert SLOW_BAN_GROWTH_MAX * 60.0 == 240.0
    # A few answers in between are not a recovery...
    lengths, _, _ = _ban_lengths(outcome, times=3, streak=8, answers_between=LATE_STREAK_BAN - 1)
    assert lengths == [60.0, 60.0, 120.0]


def test_recovery_from_a_slow_ban_counts_rounds_on_time_not_calls() -> None:
    """Counted per call answered, a slow peer serving 4 of a step's calls showed it
    recovered after 2 rounds on time, and its next ban was ban_s again: a peer late
    in 6 of every 8 rounds never grew. Each round counts once, however many calls."""
    late = lambda: Outcome(late=True)  # noqa: E731
    lengths, _, _ = _ban_lengths(late, times=3, streak=8, answers_between=2, calls_per_round=4)
    assert lengths == [60.0, 60.0, 120.0], "2 rounds on time are no recovery"
    lengths, _, _ = _ban_lengths(
        late, times=3, streak=8, answers_between=LATE_STREAK_BAN, calls_per_round=4
    )
    assert lengths == [60.0] * 3, "LATE_STREAK_BAN rounds on time are"


def test_a_peer_late_in_most_rounds_but_not_all_in_a_row_is_banned() -> None:
    """On time once in 8 rounds broke the streak: never banned, it made steps ~10x
    slower. Late in LATE_WINDOW_BAN of its last LATE_STREAK_BAN rounds, it is banned;
    not having recovered in between, longer each time. One late in half its rounds is
    not banned."""
    client = _DirectoryClient()
    layer = RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=client, checks=CHECKS)
    directory = client.directory

    def rounds(pattern: str) -> None:
        for r in pattern:
            if r == "L":
                calls, outcomes = _round(answers(1.0, 3), "abc")
                outcomes[0] = Outcome(late=True)
                layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
            else:
                layer._answered(["a"])

    rounds("LOLOLOLO" * 4 + "LLOLOLLO" * 4)  # 4 of 8, 5 of 8
    assert not directory.is_banned("a")
    rounds("O" * 8 + "LLLLLLLO")
    assert not directory.is_banned("a")
    rounds("L")
    assert directory.is_banned("a"), "late 7 of its last 8 rounds"
    assert directory.banned["a"] - client.clock.now == 60.0
    client.clock.now = directory.banned["a"]
    rounds("LLLLLLLO" + "L")
    assert directory.banned["a"] - client.clock.now == 60.0, "grown: 60 s, 60 s, 120 s..."
    client.clock.now = directory.banned["a"]
    rounds("LLOLLOLL")
    assert directory.banned["a"] - client.clock.now == 120.0, "6 of 8"


def test_a_replica_often_late_is_chosen_only_when_no_other_is_left() -> None:
    """Between its bans (6 late rounds of 8 each), a replica late 7 rounds of every 8
    was chosen as often as its honest peers: steps ~3x slower (0.15 s vs 0.05 s, one
    replica of 3). Late in 2 of its last 8 rounds, it is called only when no replica
    less often late is left; one late once still shares the load."""
    client = _DirectoryClient()
    layer = RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=client, checks=CHECKS)
    replicas = [PeerAddress(p, ()) for p in "abc"]
    route = Route(torch.zeros(4, 1, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.bool),
                  {"ffn.0": replicas}, "ffn")  # fmt: skip
    group = {"ffn.0": _Group(rows=[0, 1, 2, 3], slots=[0] * 4, candidates=[0] * 4)}
    x = torch.zeros(4, 8)

    def chosen(failed: dict[str, set[str]] | None = None) -> set[str]:
        picks = set()
        for _ in range(200):
            calls, _ = layer._plan_forward(group, route, failed or {}, x, False)
            picks |= {c.peer.peer_id for c in calls}
        return picks

    def late(peer: str) -> None:
        calls, outcomes = _round(answers(1.0, 3), "abc")
        outcomes["abc".index(peer)] = Outcome(late=True)
        layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})

    late("c")
    assert chosen() == {"a", "b", "c"}, "late once: still shares the load"
    late("a")
    late("a")
    assert not client.directory.is_banned("a")
    assert chosen() == {"b", "c"}
    assert chosen({"ffn.0": {"b", "c"}}) == {"a"}, "never an expert without a replica"
    late("b")
    late("b")
    late("b")
    assert chosen() == {"c"}
    assert chosen({"ffn.0": {"c"}}) == {"a"}, "the least often late of the often late"


class _Announced:
    """The DHT's answer: each server announces the experts of ``ffn.`` it lists now."""

    def __init__(self, children: dict[Identity, list[int]]) -> None:
        self.children = children

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        return {
            key: [
                sign_record(
                    s,
                    str(peer_id_for(s)),
                    key=key,
                    addrs=["/ip4/127.0.0.1/tcp/1"],
                    children=children,
                    ttl_s=30,
                )
                for s, children in self.children.items()
            ]
            for key in keys
        }


class _Announcing(_Announced):
    """``_Announced`` whose servers sign their records on ``clock``, anew when what they
    list changes and every ``period_s`` (``dht.announce_period_s``), except those
    ``loading`` (restarted, not announcing yet: their last records stay listed)."""

    def __init__(
        self,
        children: dict[Identity, list[int]],
        clock: Callable[[], float],
        period_s: float = 15.0,
    ) -> None:
        super().__init__(children)
        self.clock = clock
        self.period_s = period_s
        self.loading: set[Identity] = set()
        self._signed: dict[tuple[Identity, str], tuple[list[int], ExpertRecord]] = {}

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        now = self.clock()
        found: dict[str, list[ExpertRecord]] = {}
        for key in keys:
            for s, children in self.children.items():
                last = self._signed.get((s, key))
                fresh = last is None or (
                    s not in self.loading
                    and (last[0] != children or now - last[1].issued_at >= self.period_s)
                )
                if fresh:
                    record = sign_record(s, str(peer_id_for(s)), key=key, now=now,
                                         addrs=["/ip4/127.0.0.1/tcp/1"], children=children,
                                         ttl_s=30)  # fmt: skip
                    last = self._signed[(s, key)] = (list(children), record)
                assert last is not None
                found.setdefault(key, []).append(last[1])
        return found


def _unknown_expert_world(
    dht: _Announced, peers: set[str]
) -> tuple[_DirectoryClient, Callable[[str, int], None]]:
    """A directory over ``dht`` (under a layer of 8 experts), and a round in which one of
    ``peers`` answers ``unknown_expert`` for one expert."""
    client = _DirectoryClient(dht)
    layer = RemoteMixtureOfExperts(8, (8,), "ffn.", 2, client=client, checks=CHECKS)

    def unknown(peer: str, uid: int) -> None:
        _called(layer, peer, uid, peers, refused="unknown_expert")

    return client, unknown


def test_a_volunteer_that_dropped_many_experts_at_once_is_not_banned_for_it() -> None:
    """More than EXPERTS_GONE_BAN experts held out at once banned the peer whole on
    the count alone: a volunteer that re-balanced, or whose project owner changed the
    build, answers ``unknown_expert`` for all its old experts within a step or two and
    was banned, longer each time. Only records looked up after its first such answer
    that still list those experts ban it; a liar's still do, within one lookup."""
    honest, liar, other = (Identity.generate() for _ in range(3))
    a, c, b = (str(peer_id_for(s)) for s in (honest, liar, other))
    everything = list(range(8))
    dht = _Announced({honest: everything, liar: everything, other: everything})
    client, unknown = _unknown_expert_world(dht, {a, b, c})
    directory = client.directory

    _offered(client)
    dht.children[honest] = [6, 7]  # re-balanced: announced anew
    for uid in range(EXPERTS_GONE_BAN + 2):  # two steps' calls
        unknown(a, uid)
        if uid == EXPERTS_GONE_BAN // 2:
            _offered(client)
    assert not directory.is_banned(a)
    for _ in range(2):
        found = _offered(client)
        assert [child for child, peers in found.items() if a in peers] == [6, 7]
    assert "false_records" not in directory.ban_reasons
    # One that keeps announcing them all: not banned on the count before a lookup...
    lookups = directory.lookups
    for uid in range(EXPERTS_GONE_BAN + 1):
        unknown(c, uid)
    assert not directory.is_banned(c)
    found = _offered(client)  # ... nor by the lookup of its records issued since, which list them
    assert not directory.is_banned(c)
    assert c in found[EXPERTS_GONE_BAN + 1]
    unknown(c, EXPERTS_GONE_BAN + 1)  # banned at its next failure of one of them
    assert directory.is_banned(c)
    assert directory.ban_reasons["false_records"] == 1
    assert directory.lookups == lookups + 1
    assert not directory.is_banned(a)
    assert not directory.is_banned(b)


def test_a_liar_withdrawing_its_records_while_held_out_is_banned_failing_them_again() -> None:
    """A liar withdrew its records right after its ``unknown_expert`` answers (the
    lookup they forced found none listing them) and announced them all again once its
    holds ended: 928 failed calls an hour and never banned. Records issued since that
    list more than EXPERTS_GONE_BAN of them again, and another ``unknown_expert`` for
    more than that many of them, ban it; one that re-balanced and took them back serves
    them."""
    honest, liar, other = (Identity.generate() for _ in range(3))
    a, c, b = (str(peer_id_for(s)) for s in (honest, liar, other))
    everything = list(range(8))
    dht = _Announced({honest: everything, liar: everything, other: everything})
    client, unknown = _unknown_expert_world(dht, {a, b, c})
    directory = client.directory

    _offered(client)
    for uid in range(EXPERTS_GONE_BAN + 2):
        unknown(c, uid)
        unknown(a, uid)
    dht.children[liar] = []  # withdrawn while held out
    dht.children[honest] = [6, 7]  # re-balanced
    _offered(client)
    assert not directory.is_banned(c)
    assert not directory.is_banned(a)
    client.clock.now += 61.0  # the holds ended
    _offered(client)
    dht.children[liar] = everything  # announced again
    dht.children[honest] = everything  # took them back
    client.clock.now += 16.0  # stale: the next step looks it up
    _offered(client)
    assert sorted(_offered(client)) == everything
    assert not directory.is_banned(c)  # not yet: so does the honest one
    for uid in range(EXPERTS_GONE_BAN + 1):
        unknown(c, uid)  # and does not serve them
    assert directory.is_banned(c)
    assert directory.ban_reasons["false_records"] == 1
    assert not directory.is_banned(a)
    assert not directory.is_banned(b)
    client.clock.now += 61.0  # its ban ended; its records still list them
    assert c in _offered(client)[0]
    for uid in range(EXPERTS_GONE_BAN + 1):
        unknown(c, uid)
    assert directory.is_banned(c)  # again, at once, and longer
    assert directory.ban_reasons["false_records"] == 2
    client.clock.now += 61.0
    assert directory.is_banned(c)


@pytest.mark.parametrize("back_s", [60.0, 300.0, 1800.0, 3500.0])
def test_a_volunteer_that_takes_back_experts_it_dropped_is_not_banned(back_s: float) -> None:
    """A volunteer re-balanced (``unknown_expert`` for 6 of its 8 experts, for calls
    already planned) and announced them again minutes later (its capacity back; the
    Fill rule prefers experts it has checkpoints of): it was banned as
    ``false_records`` for announcing again what it said it does not host, whenever
    within the hour. It serves them: it is not banned, and is offered for all of them."""
    honest, other = Identity.generate(), Identity.generate()
    a, b = str(peer_id_for(honest)), str(peer_id_for(other))
    everything = list(range(8))
    dht = _Announced({honest: everything, other: everything})
    client = _DirectoryClient(dht)
    layer = RemoteMixtureOfExperts(8, (8,), "ffn.", 2, client=client, checks=CHECKS)
    directory = client.directory

    _offered(client)
    dht.children[honest] = [6, 7]  # re-balanced
    for uid in range(EXPERTS_GONE_BAN + 2):
        _called(layer, a, uid, {a, b}, refused="unknown_expert")
        if uid == EXPERTS_GONE_BAN // 2:
            _offered(client)  # the lookup that answer forced: its new records
    began = client.clock.now
    while client.clock.now - began < back_s:
        client.clock.now += 5.0
        _offered(client)
    dht.children[honest] = everything  # took them back
    for _ in range(24):  # two minutes of steps; its calls answered
        client.clock.now += 5.0
        found = _offered(client)
        for uid, peers in found.items():
            if a in peers:
                _called(layer, a, uid, {a, b})
    assert not directory.is_banned(a)
    assert directory.ban_reasons["false_records"] == 0
    assert all(a in peers for peers in _offered(client).values())


@pytest.mark.parametrize("first", ["restart", "rebalance"])
@pytest.mark.parametrize("kept", [True, False], ids=["records_kept", "records_withdrawn"])
@pytest.mark.parametrize("gap_s", [60.0, 600.0, 3000.0])
def test_a_volunteer_restarted_within_the_hour_of_an_episode_is_not_banned(
    first: str, kept: bool, gap_s: float
) -> None:
    """A restarted volunteer answers ``unknown_expert`` for all its experts while it
    loads: its records from before still list them (or it withdrew them), and it
    announces them again once loaded. Within the hour of an earlier such episode (a
    restart, a re-balance taken back) it was banned as ``false_records`` (60 s, 120 s
    at a second restart): it "took them back and failed them again"; its old records
    still listing them banned it at the first restart too. Only records issued since
    an episode began count, and one that served them for ``ban_s`` since starts afresh;
    it is never banned and is offered for all of them again."""
    honest, other = Identity.generate(), Identity.generate()
    a, b = str(peer_id_for(honest)), str(peer_id_for(other))
    everything = list(range(8))
    client = _DirectoryClient()
    dht = _Announcing({honest: everything, other: everything}, client.clock)
    directory = ExpertDirectory(dht, ban_s=60.0, clock=client.clock)
    client._directory = directory
    layer = RemoteMixtureOfExperts(8, (8,), "ffn.", 2, client=client, checks=CHECKS)

    def episode(listed: list[int], loading: bool) -> None:
        dht.children[honest] = listed
        if loading:
            dht.loading.add(honest)  # its last records stay listed meanwhile
        for uid in range(EXPERTS_GONE_BAN + 2):  # the calls already planned
            _called(layer, a, uid, {a, b}, refused="unknown_expert")
            if uid == EXPERTS_GONE_BAN // 2:
                _offered(client)  # the lookup that answer forced
        assert not directory.is_banned(a)

    def serve(seconds: float) -> None:  # loaded: announced, its calls answered
        dht.loading.clear()
        dht.children[honest] = everything
        began = client.clock.now
        while client.clock.now - began < seconds:
            client.clock.now += 5.0
            for uid, peers in _offered(client).items():
                if a in peers:
                    _called(layer, a, uid, {a, b})
            assert not directory.is_banned(a)

    _offered(client)
    if first == "restart":
        episode(everything if kept else [], loading=kept)
    else:
        episode([6, 7], loading=False)  # re-balanced ...
        serve(0.0)
        client.clock.now += 300.0  # ... and took them back
    serve(120.0 + gap_s)
    episode(everything if kept else [], loading=kept)  # restarted
    serve(120.0)
    assert directory.ban_reasons["false_records"] == 0
    assert all(a in peers for peers in _offered(client).values())


@pytest.mark.parametrize("period_s", [15.0, math.inf], ids=["announcing", "one_record"])
def test_a_liar_announcing_anew_what_it_does_not_serve_is_still_banned(period_s: float) -> None:
    """Counting only records issued since its ``unknown_expert`` answers, a liar that
    keeps announcing experts it does not serve (every ``announce_period_s``) is banned
    at its first ``unknown_expert`` after records issued since list them; again after
    its ban, at once; one that withdraws and announces them again as its holds end is
    banned failing them again (the test above)."""
    liar, other = Identity.generate(), Identity.generate()
    c, b = str(peer_id_for(liar)), str(peer_id_for(other))
    everything = list(range(8))
    client = _DirectoryClient()
    dht = _Announcing({liar: everything, other: everything}, client.clock, period_s)
    directory = ExpertDirectory(dht, ban_s=60.0, clock=client.clock)
    client._directory = directory
    layer = RemoteMixtureOfExperts(8, (8,), "ffn.", 2, client=client, checks=CHECKS)

    def failing() -> int:
        """One step: each expert of the liar offered is called and fails; how many."""
        mine = [child for child, peers in _offered(client).items() if c in peers]
        for uid in mine:
            _called(layer, c, uid, {b, c}, refused="unknown_expert")
        return len(mine)

    failed = failing()
    while not directory.is_banned(c):
        client.clock.now += 5.0
        assert client.clock.now <= 1000.0 + 60.0, "banned at once when its holds end"
        failed += failing()
    assert failed <= 8 + 8  # each expert once, then once more at most
    assert directory.ban_reasons["false_records"] == 1
    client.clock.now = directory.banned[c] + 1.0
    while not directory.is_banned(c):
        assert failing() > 0
    assert directory.ban_reasons["false_records"] == 2
    assert directory.banned[c] - client.clock.now == 120.0


def test_a_replica_late_twice_shares_the_load_again_after_the_layers_rounds() -> None:
    """Counted in its own rounds, a replica late twice was never called again (those
    rounds moved only when it was called): with rare hiccups the load of 3 replicas
    ended on one. Its late rounds age in the layer's rounds: back to its share
    _LATE_AGE_ROUNDS rounds later; one late again soon after stays last longer (its
    own last rounds often late: 4 times as many rounds for each)."""
    client = _DirectoryClient()
    layer = RemoteMixtureOfExperts(8, (4,), "ffn.", 2, client=client, checks=CHECKS)
    replicas = [PeerAddress(p, ()) for p in "abc"]
    route = Route(torch.zeros(4, 1, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.bool),
                  {"ffn.0": replicas}, "ffn")  # fmt: skip
    group = {"ffn.0": _Group(rows=[0, 1, 2, 3], slots=[0] * 4, candidates=[0] * 4)}
    x = torch.zeros(4, 8)

    def chosen() -> set[str]:
        return {
            c.peer.peer_id
            for _ in range(200)
            for c in layer._plan_forward(group, route, {}, x, False)[0]
        }

    def step() -> None:
        """A round through the layer, the replica it chooses on time."""
        calls, _ = layer._plan_forward(group, route, {}, x, False)
        peers = "".join(c.peer.peer_id for c in calls) + "bc"  # b, c: other experts'
        calls, outcomes = _round(answers(1.0, 3), peers)
        layer._answered(list(peers))
        layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})

    for _ in range(2):  # a home-link hiccup
        calls, outcomes = _round(answers(1.0, 3), "abc")
        outcomes[0] = Outcome(late=True)
        layer._accept(Verb.FORWARD, calls, outcomes, {"a", "b", "c"})
    assert chosen() == {"b", "c"}
    for _ in range(_LATE_AGE_ROUNDS):
        step()
    assert chosen() == {"a", "b", "c"}, "back to its share"
    picks = Counter()
    for _ in range(300):
        step()
        picks.update(c.peer.peer_id for c in layer._plan_forward(group, route, {}, x, False)[0])
    assert min(picks.values()) > 60, picks  # about 100 each, never all on one

    layer._accept(Verb.FORWARD, *_late_round("a"), {"a", "b", "c"})
    layer._accept(Verb.FORWARD, *_late_round("a"), {"a", "b", "c"})
    for _ in range(_LATE_AGE_ROUNDS):
        step()
    layer._accept(Verb.FORWARD, *_late_round("a"), {"a", "b", "c"})
    assert chosen() == {"b", "c"}, "late again soon after its share came back: last again"
    for _ in range(2 * _LATE_AGE_ROUNDS):
        step()
    assert chosen() == {"b", "c"}, "3 late of its own last 8: 4 times as many rounds"
    for _ in range(2 * _LATE_AGE_ROUNDS):
        step()
    assert chosen() == {"a", "b", "c"}


def _late_round(peer: str) -> tuple[list[Call], list[Outcome]]:
    calls, outcomes = _round(answers(1.0, 3), "abc")
    outcomes["abc".index(peer)] = Outcome(late=True)
    return calls, outcomes


def test_a_peer_announcing_experts_it_does_not_host_is_banned_and_looked_up_seldom() -> None:
    """``unknown_expert`` for every expert announced cost a failed call and a DHT lookup
    each (568 calls and 760 lookups in 40 s, ban_s 1 s, where a ban costs 33 and 9):
    its records are looked up again at most once per ``refresh_s``, and more than
    EXPERTS_GONE_BAN experts held out at once ban the peer whole, growing."""
    servers = [Identity.generate() for _ in range(2)]
    a, b = (str(peer_id_for(s)) for s in servers)
    client = _DirectoryClient(_Records(servers, children=list(range(8))))
    layer = RemoteMixtureOfExperts(8, (8,), "ffn.", 2, client=client, checks=CHECKS)
    directory = client.directory
    client.run(directory.children, ["ffn."])
    lookups = directory.lookups
    for uid in range(EXPERTS_GONE_BAN):
        _called(layer, a, uid, {a, b}, refused="unknown_expert")
        client.run(directory.children, ["ffn."])
        assert not directory.is_banned(a)
    assert directory.lookups == lookups + 1, "once per refresh_s"
    calls, outcomes = _round([answers(1.0, 1)[0]] * 2, "xb")
    calls[0] = Call(f"ffn.{EXPERTS_GONE_BAN}", PeerAddress(a, ()), None, [], calls[0].rows)
    outcomes[0] = _refused("unknown_expert")
    layer._accept(Verb.FORWARD, calls, outcomes, {a, b})
    assert directory.is_banned(a), "more than EXPERTS_GONE_BAN at once: whole"
    assert not directory.is_banned(b)
    # Growing to SLOW_BAN_GROWTH_MAX times at most: every volunteer of a project whose
    # owner changed its build drops all its experts at once, and grown to 64 times an
    # honest one was left out up to 64 min (a re-check).
    lengths = [directory.banned[a] - client.clock.now]
    for again in range(5):
        client.clock.now = directory.banned[a] + 1
        for uid in range(EXPERTS_GONE_BAN + 1):
            directory.expert_gone(a, f"ffn.{uid}", "unknown_expert: test")
        # not on the count alone; once records since listed them, again at once
        assert directory.is_banned(a) == (again > 0)
        client.run(directory.children, ["ffn."])  # looked up again: still listed
        directory.expert_gone(a, f"ffn.{EXPERTS_GONE_BAN + 1}", "unknown_expert: test")
        lengths.append(directory.banned[a] - client.clock.now)
    assert lengths == [60.0, 120.0, 240.0, 240.0, 240.0, 240.0]
