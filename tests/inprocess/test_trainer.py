"""The trainer path in one process: RemoteMixtureOfExperts against real expert runtimes
behind the real server pipeline and RpcServer, on memory links (volunteerd/testing/
inprocess.py). Routing, k_min and grace, failover, backtracking, the output checks,
spot checks and bans, without sockets or processes.

The experts compute in worker threads, so these tests run in real time; no assertion
depends on how fast the machine is: slow experts are minutes slow, not milliseconds.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable

import pytest
import torch
import trio
from torch import nn

from volunteerd.errors import Busy, ModelDiverging, NoExpertsAvailable, VolunteerdError
from volunteerd.moe import LocalMixtureOfExperts, OutputChecks, RemoteMixtureOfExperts
from volunteerd.moe.checks import BAD_SHAPE, NON_FINITE, OUT_OF_RANGE
from volunteerd.moe.client import TrainerClient
from volunteerd.moe.layer import LATE_STREAK_BAN, REFUSAL_STREAK_BAN
from volunteerd.testing import local_config
from volunteerd.testing.faulty import (
    Fault,
    empty_but_vast,
    int64_min,
    nan,
    noise,
    one_row_short,
    scaled_by,
    wider,
)
from volunteerd.testing.inprocess import InProcessServer, open_world

HIDDEN = 16
GRID = "ffn.[0:2].[0:2]"
CONFIG = local_config(uids=GRID, experts={"hidden_dim": HIDDEN, "seed": 7})


def layer(client: TrainerClient, **options: object) -> RemoteMixtureOfExperts:
    settings: dict[str, object] = {
        "k_best": 2,
        "k_min": 1,
        "forward_timeout_s": 60.0,
        "backward_timeout_s": 60.0,
        "grace_after_k_min_s": 60.0,  # wait for everyone unless a test says otherwise
        **options,
    }
    return RemoteMixtureOfExperts(HIDDEN, (2, 2), "ffn.", client=client, **settings)  # type: ignore[arg-type]


def steps(moe: RemoteMixtureOfExperts, n: int, rows: int = 32) -> None:
    """``n`` forward and backward passes of a random batch; every output must be finite."""
    for _ in range(n):
        y = moe(torch.randn(rows, HIDDEN))
        assert torch.isfinite(y).all(), "nothing non-finite reaches training"
        y.pow(2).mean().backward()


def served(server: InProcessServer) -> int:
    """Expert calls the server's runtime took."""
    return sum(s.forward.requests + s.backward.requests for s in server.runtime.statistics())


async def in_thread(fn: Callable[[], None]) -> None:
    await trio.to_thread.run_sync(fn)


async def offered(client: TrainerClient, replicas: int) -> None:
    """Until the trainer's directory offers ``replicas`` servers of every expert of the
    grid (each is offered once it answered ``info``)."""
    with trio.fail_after(30):
        while True:
            found = await client.directory.children(["ffn.0.", "ffn.1."])
            counts = [len(peers) for children in found.values() for peers in children.values()]
            if len(counts) == 4 and min(counts) >= replicas:
                return
            await trio.sleep(0.01)


@pytest.mark.parametrize(("k_best", "k_min"), [(4, 4), (2, 1)])
async def test_remote_mixture_matches_the_local_one(k_best: int, k_min: int) -> None:
    async with open_world(CONFIG) as world:
        a = await world.add_server("ffn.0.[0:2]")
        b = await world.add_server("ffn.1.[0:2]")
        modules = {
            uid: copy.deepcopy(s.runtime.backend(uid).module)
            for s in (a, b)
            for uid in s.runtime.uids
        }
        async with world.open_trainer() as client:

            def compare() -> None:
                torch.manual_seed(0)
                remote = layer(client, k_best=k_best, k_min=k_min)
                local = LocalMixtureOfExperts(HIDDEN, (2, 2), "ffn.", k_best, modules)
                local.gate.load_state_dict(remote.gate.state_dict())
                x = torch.randn(24, HIDDEN, requires_grad=True)
                x_local = x.detach().clone().requires_grad_()
                y, y_local = remote(x), local(x_local)
                torch.testing.assert_close(y, y_local, atol=1e-5, rtol=0)
                grad = torch.randn_like(y)
                y.backward(grad)
                y_local.backward(grad)
                torch.testing.assert_close(x.grad, x_local.grad, atol=1e-5, rtol=0)
                assert remote.gate.weight.grad is not None
                torch.testing.assert_close(
                    remote.gate.weight.grad, local.gate.weight.grad, atol=1e-5, rtol=0
                )
                stats = remote.stats
                assert stats.forward_failed == stats.backward_failed == 0
                assert stats.forward_ok <= 4, "one call per expert, not per token"
                assert stats.backward_ok == stats.forward_ok
                assert sum(v[2] for v in stats.by_uid.values()) == 24 * k_best

            await in_thread(compare)


async def test_only_alive_experts_are_chosen_best_first() -> None:
    """The beam search picks, per token, the best-scored experts among those served."""
    async with open_world(CONFIG) as world:
        await world.add_server(["ffn.0.1", "ffn.1.0"])
        async with world.open_trainer() as client:

            def run() -> None:
                torch.manual_seed(0)
                moe = layer(client, k_best=1)
                x = torch.randn(16, HIDDEN)
                with torch.no_grad():
                    logits = moe.gate(x).split([2, 2], dim=1)
                route = moe.route(list(logits))
                for n in range(16):
                    score = {
                        uid: float(logits[0][n, i] + logits[1][n, j])
                        for uid, (i, j) in {"ffn.0.1": (0, 1), "ffn.1.0": (1, 0)}.items()
                    }
                    assert route.uid(n, 0) == max(score, key=score.__getitem__)
                moe(x)
                assert set(moe.stats.by_uid) <= {"ffn.0.1", "ffn.1.0"}
                assert moe.stats.forward_failed == 0

            await in_thread(run)


async def test_a_replica_takes_over_within_the_step_and_the_dead_one_is_banned() -> None:
    async with open_world(CONFIG) as world:
        await world.add_server(GRID)
        b = await world.add_server(GRID)
        async with world.open_trainer() as client:
            await offered(client, 2)

            def run() -> None:
                torch.manual_seed(0)
                moe = layer(client)
                for _ in range(20):  # each call goes to a random replica
                    steps(moe, 1)
                    if served(b):
                        break
                assert served(b) > 0, "both replicas serve"
                client.run(b.stop)
                steps(moe, 4)
                assert moe.stats.failovers >= 1
                assert moe.stats.unanswered_tokens == 0
                assert moe.stats.backtracked == 0
                assert b.peer_id in client.directory.banned

            await in_thread(run)


async def test_tokens_whose_experts_all_failed_backtrack_to_their_next_best() -> None:
    async with open_world(CONFIG) as world:
        a = await world.add_server(["ffn.0.0"])
        await world.add_server(["ffn.0.1", "ffn.1.0", "ffn.1.1"])
        async with world.open_trainer() as client:

            def run() -> None:
                torch.manual_seed(0)
                moe = layer(client, k_best=1)  # and one spare
                steps(moe, 1)
                assert "ffn.0.0" in moe.stats.by_uid
                client.run(a.stop)  # still listed: the layer finds out by calling
                steps(moe, 1)
                assert moe.stats.backtracked >= 1
                assert moe.stats.failovers == 0, "no other replica to fail over to"
                assert moe.stats.unanswered_tokens == 0
                assert a.peer_id in client.directory.banned

            await in_thread(run)


async def with_a_slow_server(test: Callable[[TrainerClient, InProcessServer], None]) -> None:
    """``test(client, slow)`` in a thread: a trainer and two servers, ``slow`` hosting
    one row of the grid (its faults set by the test)."""
    async with open_world(CONFIG) as world:
        await world.add_server("ffn.0.[0:2]")
        slow = await world.add_server("ffn.1.[0:2]")
        async with world.open_trainer() as client:
            await in_thread(lambda: test(client, slow))


async def test_experts_slower_than_k_min_and_grace_are_dropped_as_late_not_banned() -> None:
    def run(client: TrainerClient, slow: InProcessServer) -> None:
        torch.manual_seed(0)
        moe = layer(client, k_best=4, k_min=2)
        steps(moe, 1)  # everyone answers (the grace is long)
        assert moe.stats.forward_ok == 4
        moe.grace_after_k_min_s = 0.0
        slow.faults.fault = Fault(delay_s=600.0)  # far beyond any loaded machine
        steps(moe, 1)
        assert moe.stats.late == 2, "both of the slow server's experts"
        assert moe.stats.forward_ok == 4 + 2
        assert moe.stats.backward_ok == 4 + 2, "backward only to those that answered"
        assert moe.stats.forward_failed == moe.stats.backward_failed == 0
        assert moe.stats.unanswered_tokens == 0
        assert client.directory.banned == {}

    await with_a_slow_server(run)


async def test_a_peer_late_every_time_is_banned_after_a_streak_and_one_that_answers_is_not() -> (
    None
):
    """A server that answers info and stalls every call cost each step that chose it
    the whole grace, for good: late is no fault once, but late in LATE_WINDOW_BAN of
    its last LATE_STREAK_BAN rounds bans its peer; rounds on time in between take the
    late ones out of the count (one alone no longer does: unit test_checks)."""

    def run(client: TrainerClient, slow: InProcessServer) -> None:
        torch.manual_seed(0)
        moe = layer(client, k_best=4, k_min=2)
        moe.grace_after_k_min_s = 0.0
        per_step = 1  # its forward round (no backward: it answered nothing)
        slow.faults.fault = Fault(delay_s=600.0)
        steps(moe, LATE_STREAK_BAN // per_step - 1)
        slow.faults.fault = Fault()  # it answers a while: the count starts again
        moe.grace_after_k_min_s = 30.0
        steps(moe, LATE_STREAK_BAN)
        moe.grace_after_k_min_s = 0.0
        slow.faults.fault = Fault(delay_s=600.0)
        steps(moe, LATE_STREAK_BAN // per_step - 1)
        assert client.directory.banned == {}
        late = moe.stats.late
        steps(moe, 1)
        assert moe.stats.late == late + 2  # both of its experts' calls
        assert slow.peer_id in client.directory.banned
        assert client.rpc.hung_up == 1  # its connection too: the next call dials afresh
        steps(moe, 2)  # no longer chosen: no more grace paid for it
        assert moe.stats.late == late + 2
        assert moe.stats.unanswered_tokens == 0

    await with_a_slow_server(run)


async def test_a_peer_banned_for_a_timeout_is_called_on_a_new_connection_after_the_ban() -> None:
    """A volunteer whose address changed (a new one from the router) left the trainer's
    connection open and dead: its calls timed out, it was banned, and when the ban ended
    the trainer took the same dead connection again, and banned it for twice as long
    (an outside probe with network namespaces: 3 min 15 s without its experts). A
    round's own timeout cuts the calls off, not the RPC client's deadline, so nothing
    closed that connection: the ban does, and the next call dials afresh."""

    def run(client: TrainerClient, slow: InProcessServer) -> None:
        torch.manual_seed(0)
        moe = layer(client, k_best=4, k_min=4, forward_timeout_s=1.0)
        slow.faults.fault = Fault(delay_s=600.0)  # every call of its row stalls
        steps(moe, 1)
        assert moe.stats.failures["timeout"] == 2  # both of its experts' calls
        assert slow.peer_id in client.directory.banned
        assert client.rpc.hung_up == 1

    await with_a_slow_server(run)


async def test_a_far_slower_server_does_not_set_the_pace_of_every_step() -> None:
    """The outside audit's WAN swarm in one process: a server holds a whole grid row,
    so the tokens whose best experts share that row can only be answered by it, and it
    answers DELAY_S late (a volunteer on a slow uplink). Each step used to wait for it
    (every round, forward and backward). Now its rows stop waiting once the others are
    long done, go to their spare experts on the fast servers, and its calls are late:
    counted, never failed, and a ban once it is late LATE_STREAK_BAN rounds in a row."""
    delay_s = 5.0
    async with open_world(CONFIG) as world:
        await world.add_server(["ffn.0.0"])
        await world.add_server(["ffn.0.1"])
        slow = await world.add_server("ffn.1.[0:2]")
        async with world.open_trainer() as client:
            await offered(client, 1)

            def run() -> None:
                torch.manual_seed(0)
                moe = layer(client, grace_after_k_min_s=0.2)
                steps(moe, 1)  # everyone answers at once: measured
                slow.faults.fault = Fault(delay_s=delay_s)
                for step in range(LATE_STREAK_BAN + 1):
                    late = moe.stats.late
                    started = time.monotonic()
                    steps(moe, 1)
                    took_s = time.monotonic() - started
                    assert took_s < delay_s / 2, f"step {step} waited for the slow server"
                    if slow.peer_id in client.directory.banned:
                        break
                    assert moe.stats.late > late, "its calls were cut off late"
                assert step == LATE_STREAK_BAN - 1, "banned after a streak of late rounds"
                assert moe.stats.forward_failed == moe.stats.backward_failed == 0
                assert moe.stats.unanswered_tokens == 0, "its tokens went to their spares"
                assert moe.stats.failures == {"late": 1}

            await in_thread(run)


async def test_a_peer_that_refuses_every_call_is_banned_after_a_streak() -> None:
    """A server that announces experts and answers every call ``busy`` held their grid
    places for nothing (its rows fail over or go unanswered each step) and was never
    banned: one refusal is no fault, but REFUSAL_STREAK_BAN rounds in a row with no
    answer from it in between ban its peer; an answer in between starts the count again."""

    def run(client: TrainerClient, squatter: InProcessServer) -> None:
        torch.manual_seed(0)
        moe = layer(client, k_best=4, k_min=2)
        squatter.faults.fault = Fault(refuse=Busy("always"))
        steps(moe, REFUSAL_STREAK_BAN - 1)  # one forward round a step refuses
        squatter.faults.fault = Fault()  # it answers once: the streak starts again
        steps(moe, 1)
        squatter.faults.fault = Fault(refuse=Busy("always"))
        steps(moe, REFUSAL_STREAK_BAN - 1)
        assert client.directory.banned == {}
        steps(moe, 1)
        assert squatter.peer_id in client.directory.banned
        refused = squatter.faults.faulty_replies
        steps(moe, 2)
        assert squatter.faults.faulty_replies == refused, "banned: not called again"

    await with_a_slow_server(run)


async def test_no_answer_at_all_is_the_typed_error() -> None:
    async with open_world(CONFIG) as world:
        servers = [await world.add_server(GRID) for _ in range(2)]
        async with world.open_trainer() as client:
            await offered(client, 2)

            def run() -> None:
                moe = layer(client)
                steps(moe, 1)
                for server in servers:
                    server.faults.fault = Fault(refuse=Busy("loaded"))
                with pytest.raises(NoExpertsAvailable, match="none of the experts chosen"):
                    moe(torch.randn(4, HIDDEN))
                assert moe.stats.failures["busy"] >= 1
                assert client.directory.banned == {}, "busy is loaded, not broken"

            await in_thread(run)


@pytest.mark.parametrize("lie", ["nan", "over_max_abs"])
async def test_a_liar_left_alone_is_no_diverging_model(lie: str) -> None:
    """The honest replicas answer busy; the one peer left answers NaN (or outputs with
    one element just over max_abs). One peer's word says nothing about the model: the
    step has no answer, as when no expert answered (a training loop skips it and tries
    again); it was "the model is diverging", and the trainer stopped for good."""

    def over_max_abs(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = 1.05e4
        return t

    async with open_world(CONFIG) as world:
        honest = [await world.add_server(GRID) for _ in range(2)]
        liar = await world.add_server(GRID)
        async with world.open_trainer() as client:
            await offered(client, 3)

            def run() -> None:
                torch.manual_seed(0)
                moe = layer(client)
                steps(moe, 1)
                for server in honest:
                    server.faults.fault = Fault(refuse=Busy("loaded"))
                liar.faults.fault = Fault(outputs=nan if lie == "nan" else over_max_abs)
                for _ in range(3):
                    with pytest.raises(NoExpertsAvailable, match="output checks dropped"):
                        moe(torch.randn(32, HIDDEN))
                assert liar.faults.faulty_replies >= 1
                assert moe.stats.diverging == {}, moe.stats
                assert client.directory.ban_reasons[NON_FINITE] == 0
                assert client.directory.ban_reasons[OUT_OF_RANGE] == 0

            await in_thread(run)


LIES: dict[str, tuple[Fault, str]] = {
    "nan": (Fault(outputs=nan), NON_FINITE),
    "scaled": (Fault(outputs=scaled_by(1e6)), OUT_OF_RANGE),
    "noise": (Fault(outputs=noise(seed=1)), "disagreed"),
    # the honest answer scaled: passed the spot check (norms within max_ratio) for good
    "scaled_100": (Fault(outputs=scaled_by(100.0)), "disagreed"),
    "huge_gradients": (Fault(gradients=scaled_by(1e6)), OUT_OF_RANGE),
    "short_outputs": (Fault(outputs=one_row_short), BAD_SHAPE),
    "wider_outputs": (Fault(outputs=wider), BAD_SHAPE),
    "short_gradients": (Fault(gradients=one_row_short), BAD_SHAPE),
    "wider_gradients": (Fault(gradients=wider), BAD_SHAPE),
    # the right shape in int64: passed every check of values with 1 or 2 answers
    "int64_outputs": (Fault(outputs=int64_min), BAD_SHAPE),
    "int64_gradients": (Fault(gradients=int64_min), BAD_SHAPE),
}


@pytest.mark.parametrize("answer", ["outputs", "gradients"])
async def test_an_answer_no_tensor_can_have_is_a_failed_call_never_a_broken_step(
    answer: str,
) -> None:
    """A server answers with a tensor of no bytes whose shape is (0, 2**31, ..., 2**31):
    every size check passed, and torch.empty's RuntimeError (its strides overflow)
    escaped every step of the trainer, the honest replica beside it unused (an outside
    probe). Such a reply header is malformed: one failed call, the liar left alone for a
    while, the step done with the honest replica."""
    async with open_world(CONFIG) as world:
        honest = await world.add_server(GRID)
        liar = await world.add_server(GRID)
        liar.faults.fault = Fault(**{answer: empty_but_vast})
        async with world.open_trainer() as client:
            await offered(client, 2)

            def run() -> None:
                torch.manual_seed(0)
                moe = layer(client)
                steps(moe, 4)
                assert liar.faults.faulty_replies >= 1
                # one failed call each (a batch call fails each of its experts)
                assert moe.stats.forward_failed + moe.stats.backward_failed >= 1, moe.stats
                lied = liar.faults.faulty_replies
                steps(moe, 3)
                assert liar.faults.faulty_replies == lied  # not chosen again meanwhile
                assert served(honest) > 0

            await in_thread(run)


@pytest.mark.parametrize("lie", list(LIES))
async def test_a_lying_expert_is_caught_banned_and_not_called_again(lie: str) -> None:
    fault, reason = LIES[lie]
    async with open_world(CONFIG) as world:
        honest = [await world.add_server(GRID) for _ in range(2)]
        liar = await world.add_server(GRID)
        liar.faults.fault = fault
        async with world.open_trainer() as client:
            await offered(client, 3)

            def run() -> None:
                torch.manual_seed(0)
                checks = OutputChecks(spot_check=1.0 if lie in ("noise", "scaled_100") else 0.0)
                moe = layer(client, checks=checks)
                for _ in range(20):
                    steps(moe, 1)
                    if liar.peer_id in client.directory.banned:
                        break
                assert liar.peer_id in client.directory.banned, moe.stats
                assert moe.stats.rejected[reason] >= 1, moe.stats
                assert client.directory.ban_reasons[reason] == 1
                assert not any(s.peer_id in client.directory.banned for s in honest)
                before = liar.faults.faulty_replies
                calls = moe.stats.calls
                steps(moe, 3)
                assert moe.stats.calls > calls
                assert liar.faults.faulty_replies == before, "banned: not called again"

            await in_thread(run)


@pytest.mark.parametrize("seed", range(3))
async def test_colluding_replicas_of_the_wrong_shape_cannot_replace_an_honest_answer(
    seed: int,
) -> None:
    """Two replicas answer rows of another width, alike, against two honest ones, and
    every forward is spot-checked: a wrong-shaped checker or judge is banned for its
    shape; it never outvotes the honest answer into the step (which broke it)."""
    async with open_world(CONFIG) as world:
        honest = [await world.add_server(GRID) for _ in range(2)]
        for _ in range(2):
            liar = await world.add_server(GRID)
            liar.faults.fault = Fault(outputs=wider)
        async with world.open_trainer() as client:
            await offered(client, 4)

            def run() -> None:
                random.seed(seed)
                torch.manual_seed(seed)
                moe = layer(client, checks=OutputChecks(spot_check=1.0))
                steps(moe, 6)
                assert moe.stats.rejected[BAD_SHAPE] >= 1, moe.stats
                assert not any(s.peer_id in client.directory.banned for s in honest)
                assert client.directory.ban_reasons[BAD_SHAPE] == 2

            await in_thread(run)


@pytest.mark.parametrize("lie", ["nan", "huge"])
async def test_a_checkers_bad_answer_never_replaces_an_honest_one(lie: str) -> None:
    """Every expert has two replicas, the honest server and one of two cheap identities
    that answer every forward with NaN (or the honest answer times -1e12), and every
    forward is spot-checked. Such a checker's answer fails the output checks the main
    answer passed: its peer is banned for it, the honest main answer stays. (Before, it
    counted as a disagreement: two made the honest server "the odd one out", banned,
    and the checker's answer went into the step unchecked.)"""
    fault = Fault(outputs=nan if lie == "nan" else scaled_by(-1e12))
    async with open_world(CONFIG) as world:
        honest = await world.add_server(GRID)
        for column in range(2):
            sybil = await world.add_server(f"ffn.[0:2].{column}")
            sybil.faults.fault = fault
        async with world.open_trainer() as client:
            await offered(client, 2)

            def run() -> None:
                random.seed(0)
                torch.manual_seed(0)
                moe = layer(client, checks=OutputChecks(spot_check=1.0))
                steps(moe, 8)  # each output finite
                assert honest.peer_id not in client.directory.banned, client.directory.ban_reasons
                assert moe.stats.rejected["disagreed"] == 0, moe.stats
                assert len(client.directory.banned) == 2, client.directory.ban_reasons

            await in_thread(run)


async def test_training_through_a_swarm_with_a_liar_still_learns() -> None:
    async with open_world(CONFIG) as world:
        for _ in range(2):
            await world.add_server(GRID)
        liar = await world.add_server(GRID)
        liar.faults.fault = Fault(outputs=nan)
        async with world.open_trainer() as client:
            await offered(client, 3)

            def run() -> None:
                torch.manual_seed(0)
                moe = layer(client, grace_after_k_min_s=1.0)
                head = nn.Linear(HIDDEN, HIDDEN)
                optimizer = torch.optim.Adam([*moe.parameters(), *head.parameters()], lr=1e-2)
                x = torch.randn(32, HIDDEN)
                target = torch.tanh(x @ torch.randn(HIDDEN, HIDDEN))
                losses = []
                for _ in range(25):
                    loss = nn.functional.mse_loss(head(moe(x)), target)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    losses.append(float(loss.detach()))
                assert all(loss == loss for loss in losses), "no NaN reached training"
                assert losses[-1] < 0.7 * losses[0], losses

            await in_thread(run)


async def test_honest_experts_that_grow_past_max_abs_are_not_banned() -> None:
    """A model whose outputs grow (an unbounded loss) is reported as diverging and keeps
    its peers; a model whose every answer is NaN is the typed error, not a ban of all."""
    config = local_config(
        uids=GRID, experts={"hidden_dim": HIDDEN, "seed": 7, "optimizer": {"lr": 0.05}}
    )
    async with open_world(config) as world:
        servers = [await world.add_server(GRID) for _ in range(3)]
        async with world.open_trainer(ban_s=600) as client:
            await offered(client, 3)

            def run() -> None:
                torch.manual_seed(0)
                x = torch.randn(32, HIDDEN)
                moe = layer(client)
                with torch.no_grad():
                    start = float(moe(x).abs().max())
                moe.checks = OutputChecks(max_abs=2 * start)  # just above where it starts
                largest = start
                for _ in range(60):
                    y = moe(x)
                    largest = float(y.detach().abs().max())
                    y.sum().backward()
                    if largest > 5 * moe.checks.max_abs:
                        break
                assert largest > 5 * moe.checks.max_abs, (start, largest)
                assert moe.stats.diverging[OUT_OF_RANGE] >= 1, moe.stats
                assert client.directory.banned == {}, client.directory.ban_reasons
                assert moe.stats.bans_held_back == 0

                for server in servers:  # diverged for good: every answer is NaN
                    server.faults.fault = Fault(outputs=nan)
                with pytest.raises(ModelDiverging, match="diverging"):
                    moe(x)
                assert moe.stats.diverging[NON_FINITE] >= 1
                assert client.directory.banned == {}, client.directory.ban_reasons

            await in_thread(run)


async def test_a_trainer_whose_own_gradients_are_not_finite_is_told_it_diverged() -> None:
    """q8 cannot carry NaN: the trainer's own broken gradients are its own divergence,
    said as such before anything is sent, and no server is blamed."""
    async with open_world(CONFIG) as world:
        server = await world.add_server(GRID)
        async with world.open_trainer() as client:
            await offered(client, 1)

            def run() -> None:
                moe = layer(client, compression="q8")
                x = torch.randn(8, HIDDEN)
                moe(x).pow(2).mean().backward()  # finite: goes through
                y = moe(x)
                before = served(server)
                grads = torch.ones_like(y)
                grads[3] = float("nan")
                with pytest.raises(ModelDiverging, match="not finite"):
                    y.backward(grads)
                assert served(server) == before
                assert client.directory.banned == {}

            await in_thread(run)


async def test_a_trainer_whose_own_weights_are_not_finite_is_told_so_not_sent_to_the_dht() -> None:
    """NaN gate scores read as "no alive experts": with training.lr = inf every step
    said "is the swarm reachable?" after seconds of looking the experts up again, and
    the run ended a minute later while the swarm was healthy."""
    async with open_world(CONFIG) as world:
        server = await world.add_server(GRID)
        async with world.open_trainer() as client:
            await offered(client, 1)

            def run() -> None:
                moe = layer(client)
                steps(moe, 1)
                before = served(server)
                with torch.no_grad():
                    moe.gate.weight.fill_(float("inf"))
                with pytest.raises(ModelDiverging, match="gate's scores are not finite"):
                    moe(torch.randn(4, HIDDEN))
                with pytest.raises(ModelDiverging, match="input is not finite"):
                    moe(torch.full((4, HIDDEN), float("nan")))
                local = LocalMixtureOfExperts(
                    HIDDEN, (2, 2), "ffn.", 2, {uid: nn.Identity() for uid in moe.all_uids()}
                )
                local.gate.load_state_dict(moe.gate.state_dict())
                with pytest.raises(ModelDiverging, match=r"lower training\.lr"):
                    local(torch.randn(4, HIDDEN))
                assert served(server) == before
                assert client.directory.banned == {}

            await in_thread(run)


async def test_a_call_cut_off_by_a_crash_is_broken_and_a_servers_own_failure_internal() -> None:
    """A call whose stream closed under it (its daemon killed mid-call) was counted as
    "internal", the code a server sends for a bug of its own: a trainer churning through
    killed daemons reported dozens of server bugs there were not. It is "broken"; a
    server's own failure stays "internal"."""
    async with open_world(CONFIG) as world:
        a = await world.add_server(GRID)
        b = await world.add_server(GRID)
        async with world.open_trainer() as client:
            await offered(client, 2)
            moe = layer(client, k_best=4, k_min=4)  # every row calls all four experts
            b.faults.fault = Fault(delay_s=60.0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_thread, lambda: steps(moe, 1))
                with trio.fail_after(30):
                    while not b.faults.faulty_replies:  # noqa: ASYNC110 - polling
                        await trio.sleep(0.01)
                await b.stop()  # crashes with calls under way
            assert moe.stats.failures["broken"] >= 1
            assert "internal" not in moe.stats.failures
            a.faults.fault = Fault(refuse=VolunteerdError("a bug on the server"))
            with pytest.raises(NoExpertsAvailable):
                await in_thread(lambda: steps(moe, 1))
            assert moe.stats.failures["internal"] >= 1
