"""The simulated swarm: records lapse as the store says, volunteers choose with the
production assignment, the trainer routes with the production layer, runs repeat."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import trio

from volunteerd.moe import layer as moe_layer
from volunteerd.sim.calibration import Calibration
from volunteerd.sim.clock import SimClock
from volunteerd.sim.scenario import Scenario, SimResult, simulate
from volunteerd.sim.world import Churn, World
from volunteerd.swarm import assignment
from volunteerd.train import Experiment, load_corpus
from volunteerd.train.data import Corpus

EXPERIMENT = Experiment.model_validate(
    {
        "name": "sim-test",
        "data": {"max_bytes": 60_000},
        "model": {"hidden_dim": 16, "num_heads": 2, "seq_len": 8, "grid": [2, 2]},
        "training": {"batch_size": 4, "eval_batches": 1, "data_shard": 0},
    }
)
CALIBRATION = Calibration(
    forward_s=(1e-3, 1e-5),
    backward_s=(2e-3, 2e-5),
    trainer_step_s=0.01,
    server_request_s=5e-4,
    client_request_s=2e-4,
    cores=1,
    machine="test",
)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(EXPERIMENT.data)


def in_world(test: Callable[[World], Any], **kwargs: Any) -> None:
    """Run ``test(world)`` (a coroutine function) with the world's volunteers living."""
    settings: dict[str, Any] = {"volunteers": 4, "capacity": 2, "churn": Churn(warmup_s=1.0)}
    settings.update(kwargs)

    async def main() -> None:
        world = World(EXPERIMENT, CALIBRATION, **settings)
        async with trio.open_nursery() as nursery:
            await nursery.start(world.serve)
            await trio.sleep(settings["churn"].warmup_s + 5.0)  # everyone joined and serves
            await test(world)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=SimClock())


def test_crashed_volunteers_records_lapse_a_ttl_after_their_last_refresh() -> None:
    async def check(world: World) -> None:
        v = world.volunteers[0]
        uid = next(iter(v.hosted))
        period = world.config.dht.announce_period_s
        ttl = world.config.dht.record_ttl_s
        await trio.sleep(period * 2.5 - trio.current_time() + v.announced_at)
        last_refresh = v.announced_at + 2 * period
        world.crash(v)
        assert not v.online
        assert not v.serving
        await trio.sleep_until(last_refresh + ttl - 0.01)
        assert v.peer_id in world.dht.listed(uid)  # still listed: it may be back
        await trio.sleep_until(last_refresh + ttl + 0.01)
        assert v.peer_id not in world.dht.listed(uid)

    in_world(check)


def test_a_volunteer_leaving_withdraws_its_records_at_once() -> None:
    async def check(world: World) -> None:
        v = world.volunteers[1]
        hosted = list(v.hosted)
        assert all(v.peer_id in world.dht.listed(u) for u in hosted)
        world.leave(v)
        assert all(v.peer_id not in world.dht.listed(u) for u in hosted)

    in_world(check)


def test_volunteers_fill_the_least_replicated_experts() -> None:
    async def check(world: World) -> None:
        served = [len(world.dht.listed(u)) for u in world.uids]
        # 8 volunteers x 2 experts over 8 experts (2 layers of 2x2): 2 replicas each
        assert served == [2] * 8

    # joins spread over 60 s: each volunteer sees the ones before it in the DHT
    in_world(check, volunteers=8, churn=Churn(warmup_s=60.0))


def test_the_choice_is_the_production_assignment(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    production = assignment.choose_experts

    def everyone_the_same(uids: Any, *args: Any, **kwargs: Any) -> assignment.Choice:
        calls.append(kwargs["peer_id"])
        production(uids, *args, **kwargs)
        return assignment.Choice(add=(uids[0],), drop=())

    monkeypatch.setattr(assignment, "choose_experts", everyone_the_same)

    async def check(world: World) -> None:
        assert len(set(calls)) == 8
        assert [len(world.dht.listed(u)) for u in world.uids] == [8] + [0] * 7

    in_world(check, volunteers=8)


def small(corpus: Corpus, **kwargs: Any) -> SimResult:
    settings: dict[str, Any] = {"volunteers": 6, "steps": 6, "eval_every": 3, "seed": 3}
    settings.update(kwargs)
    return simulate(EXPERIMENT, CALIBRATION, corpus, Scenario(**settings))


def test_a_run_repeats_exactly_given_its_seed(corpus: Corpus) -> None:
    churn = Churn(failing=0.3, down_mean_s=5.0, warmup_s=2.0)
    a, b = small(corpus, churn=churn), small(corpus, churn=churn)
    assert a.run.curve == b.run.curve
    assert a.run.step_s == b.run.step_s
    assert (a.run.forward_ok, a.run.forward_failed) == (b.run.forward_ok, b.run.forward_failed)
    assert a.swarm.up_bytes_per_min == b.swarm.up_bytes_per_min
    c = small(corpus, churn=churn, seed=4)
    assert c.run.step_s != a.run.step_s


def test_the_trainer_routes_with_the_production_layer(
    corpus: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = small(corpus)
    searches: list[int] = []
    production = moe_layer.beam_search

    def one_expert_per_token(*args: Any, **kwargs: Any) -> Any:
        searches.append(1)
        return production(*args, **{**kwargs, "k": 1})

    monkeypatch.setattr(moe_layer, "beam_search", one_expert_per_token)
    after = small(corpus)
    assert searches  # the simulated trainer called it
    assert after.run.forward_ok != before.run.forward_ok
    assert after.run.curve != before.run.curve


def test_training_goes_on_while_volunteers_fail(corpus: Corpus) -> None:
    result = small(
        corpus, volunteers=8, steps=12, churn=Churn(failing=0.4, down_mean_s=3.0, warmup_s=2.0)
    )
    run = result.run
    assert run.steps + run.skipped == 12
    assert run.steps >= 6
    assert run.forward_failed + sum(run.bans.values()) > 0  # failures happened, were met
    assert math.isfinite(run.final_loss)
    assert run.final_loss < run.curve[0][2]


def test_wrong_answers_are_caught_by_the_checks(corpus: Corpus) -> None:
    result = small(corpus, volunteers=8, steps=8, churn=Churn(wrong=0.25, warmup_s=2.0))
    run = result.run
    assert sum(run.rejected.values()) > 0
    assert math.isfinite(run.final_loss)
    assert run.final_loss < run.curve[0][2]
