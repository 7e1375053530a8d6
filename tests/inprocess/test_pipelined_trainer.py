"""The trainer with several batches in flight (docs/decisions/0012): concurrency,
the staleness bound, synchronous micro-batching as one batch, timeouts that follow the
measured round trip, and pooled streams under concurrency.

Swarm runs use the in-process world (memory links, real runtimes) in real time; no
assertion depends on how fast the machine is.
"""

from __future__ import annotations

import copy
import io
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from tests.words import write_words
from volunteerd.experts import make_optimizer
from volunteerd.moe.client import TrainerClient
from volunteerd.net import Verb
from volunteerd.testing import local_config
from volunteerd.testing.inprocess import InProcessClient, InProcessServer, World, open_world
from volunteerd.testing.memnet import Link, MemoryNetwork
from volunteerd.train import (
    Experiment,
    Progress,
    Trainer,
    TrainSummary,
    build_model,
    load_corpus,
)
from volunteerd.train.data import Corpus

HIDDEN = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return load_corpus(experiment(write_words(tmp_path_factory.mktemp("text"))).data)


def experiment(source: Path | None = None, **training: object) -> Experiment:
    """A tiny model: one block whose mixture is one expert (``mlp0.0``), so every round
    of a batch is exactly one call."""
    return Experiment.model_validate(
        {
            "data": {
                "source": str(source or "python-stdlib"),
                "max_bytes": 100_000,
                "val_every": 2,
            },
            "model": {
                "hidden_dim": HIDDEN,
                "num_blocks": 1,
                "num_heads": 2,
                "seq_len": 8,
                "grid": (1,),
                "k_best": 1,
                "k_min": 1,
                "spot_check": 0.0,
                "forward_timeout_s": 60.0,
                "backward_timeout_s": 60.0,
            },
            "training": {"batch_size": 8, "eval_batches": 1, "eval_every": 10**6, **training},
        }
    )


def train(
    exp: Experiment, corpus: Corpus, client: TrainerClient | None, steps: int
) -> tuple[Trainer, TrainSummary]:
    torch.manual_seed(0)
    trainer = Trainer(exp, build_model(exp, client), corpus)
    return trainer, trainer.run(steps)


async def add_expert(world: World) -> InProcessServer:
    return await world.add_server(
        "mlp0.0",
        config=local_config(uids="mlp0.0", experts={"hidden_dim": HIDDEN, "seed": 3}),
    )


def intercept(
    client: InProcessClient,
    before: Callable[[Verb, Any], Awaitable[None]],
    after: Callable[[Verb, Any], None],
) -> None:
    """Run ``before`` and ``after`` around every RPC call of ``client``."""
    rpc = client.rpc
    original = rpc.call

    async def call(peer: Any, verb: Verb, header: Any, buffers: Any = ()) -> Any:
        await before(verb, header)
        try:
            return await original(peer, verb, header, buffers)
        finally:
            after(verb, header)

    rpc.call = call  # type: ignore[method-assign]


@pytest.mark.parametrize("max_staleness", [4, 0])
async def test_several_batches_wait_for_their_experts_at_once(
    corpus: Corpus, max_staleness: int
) -> None:
    """in_flight 4: a training forward is held until a second one is under way, which
    happens only if batches (or micro-batches) overlap; one at a time it never does."""
    exp = experiment(in_flight=4, max_staleness=max_staleness)
    async with open_world(local_config(uids="mlp0.0")) as world:
        await add_expert(world)
        async with world.open_trainer() as client:
            running = 0
            peak = 0
            overlapped = trio.Event()

            async def before(verb: Verb, header: Any) -> None:
                nonlocal running, peak
                if verb != Verb.FORWARD or not header.retain:
                    return  # evaluation, verification
                running += 1
                peak = max(peak, running)
                if running >= 2:
                    overlapped.set()
                with trio.move_on_after(30):
                    await overlapped.wait()

            def after(verb: Verb, header: Any) -> None:
                nonlocal running
                if verb == Verb.FORWARD and header.retain:
                    running -= 1

            intercept(client, before, after)
            _, s = await trio.to_thread.run_sync(train, exp, corpus, client, 6)
            assert peak >= 2, "more than one batch in flight"
            assert s.steps == 6
            assert s.skipped_steps == s.failed_calls == 0
            assert (s.in_flight, s.max_staleness) == (4, max_staleness)
            if max_staleness == 0:
                assert s.max_staleness_seen == 0
                # 6 steps x 4 micro-batches, a forward and a backward each, and the two
                # evaluations' forwards
                assert s.expert_calls == 6 * 4 * 2 + 2


def test_gradients_staler_than_the_bound_are_dropped_and_counted(corpus: Corpus) -> None:
    """Four batches start from the same weights; after two updates the other two are
    two updates old: over a bound of one, so dropped."""
    _, s = train(experiment(in_flight=4, max_staleness=1), corpus, None, 12)
    assert s.stale_dropped >= 2
    assert s.max_staleness_seen <= 1
    assert 0 < s.mean_staleness <= 1
    assert s.steps == 12
    assert s.skipped_steps == 0


def test_a_generous_bound_applies_every_gradient_however_old(corpus: Corpus) -> None:
    _, s = train(experiment(in_flight=4, max_staleness=64), corpus, None, 12)
    assert s.stale_dropped == 0
    assert s.max_staleness_seen >= 1, "batches in flight see each other's updates"


def test_synchronous_micro_batches_make_exactly_the_update_of_one_batch(corpus: Corpus) -> None:
    """max_staleness 0, in_flight 4: every parameter (trainer and local experts) ends
    where plain sequential full-batch training puts it."""
    exp = experiment(in_flight=4, max_staleness=0)
    steps = 3
    trained = train(exp, corpus, None, steps)[0].model

    torch.manual_seed(0)
    reference = build_model(exp, None)
    initial = copy.deepcopy(reference.state_dict())
    experts = [p for n, p in reference.named_parameters() if ".experts." in n]
    assert experts
    optimizers = [
        torch.optim.Adam(reference.trainer_parameters(), lr=exp.training.lr),
        make_optimizer(experts, exp.experts),
    ]
    generator = torch.Generator().manual_seed(exp.training.seed)
    for _ in range(steps):
        x, y = corpus.batch("train", exp.training.batch_size, exp.model.seq_len, generator)
        for optimizer in optimizers:
            optimizer.zero_grad()
        reference.loss(x, y).backward()
        for optimizer in optimizers:
            optimizer.step()

    ours, theirs = dict(trained.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in theirs.items():
        mine = ours[name]
        if name.endswith("attn.qkv.bias"):
            # The key bias's gradient is zero in exact arithmetic (softmax ignores a
            # constant added to every score of a query); Adam turns the float noise
            # there into steps of about lr, whatever order the sums took.
            key = torch.zeros(3 * HIDDEN, dtype=torch.bool)
            key[HIDDEN : 2 * HIDDEN] = True
            torch.testing.assert_close(mine[key], p[key], atol=2 * steps * exp.training.lr, rtol=0)
            mine, p = mine[~key], p[~key]
        torch.testing.assert_close(mine, p, atol=1e-6, rtol=1e-5)
    assert not all(torch.equal(p, initial[name]) for name, p in theirs.items()), "it trained"


async def test_timeouts_and_grace_follow_the_measured_round_trip(corpus: Corpus) -> None:
    """On a link of 100 ms each way a call takes at least 200 ms. Three calls (two
    evaluations, one step) leave srtt >= 0.2 s and rttvar >= (3/4)^2 x 0.1 s, so
    srtt + 4 rttvar >= 0.42 s: the 1 s forward floor stretches to 3 x that > 1 s, within
    the cap of 4 x 1 s; the grace (4 rttvar >= 0.22 s) is capped at 4 x its 10 ms floor."""
    exp = experiment()
    model = exp.model.model_copy(
        update={"forward_timeout_s": 1.0, "backward_timeout_s": 20.0, "grace_after_k_min_s": 0.01}
    )
    exp = exp.model_copy(update={"model": model})
    network = MemoryNetwork(default=Link(latency_s=0.1))
    async with open_world(local_config(uids="mlp0.0"), network) as world:
        server = await add_expert(world)
        async with world.open_trainer() as client:
            trainer, s = await trio.to_thread.run_sync(train, exp, corpus, client, 1)
            assert s.failed_calls == 0
            layer = trainer.remote_layers()[0]
            srtt = layer.round_trips.srtt(server.peer_id, Verb.FORWARD.value)
            assert srtt is not None
            assert srtt >= 0.2
            limits = layer.limits(Verb.FORWARD, [server.peer_id])
            assert 1.0 < limits.timeout_s <= 4.0
            assert limits.grace_s == pytest.approx(0.04)
            assert layer.limits(Verb.FORWARD, ["never-called"]).timeout_s == 1.0


async def test_batches_in_flight_reuse_pooled_streams(corpus: Corpus) -> None:
    """Many calls from four concurrent batches travel on a few pooled streams."""
    exp = experiment(in_flight=4)
    async with open_world(local_config(uids="mlp0.0")) as world:
        for _ in range(2):
            await add_expert(world)
        async with world.open_trainer() as client:
            host = client.host
            opened = 0
            original = host.open_stream

            async def open_stream(peer: Any, protocol: str) -> Any:
                nonlocal opened
                opened += 1
                return await original(peer, protocol)

            host.open_stream = open_stream  # type: ignore[method-assign]
            _, s = await trio.to_thread.run_sync(train, exp, corpus, client, 24)
            assert s.expert_calls >= 24 * 2
            # per server: at most 4 forward and 4 backward streams (the steps in flight;
            # the evaluations run while none is), and the verification's info
            assert opened <= 2 * (4 + 4 + 1)


class StopAt(Progress):
    """Sets ``stop`` when step ``at`` is reported, as Ctrl-C would."""

    def __init__(self, at: int, stop: threading.Event) -> None:
        super().__init__(1, stream=io.StringIO())
        self.at = at
        self.stop = stop

    def update(self, step: int, fields: dict[str, str]) -> None:
        if step >= self.at:
            self.stop.set()


def test_validation_runs_on_schedule_and_stop_ends_after_the_steps_in_flight(
    corpus: Corpus,
) -> None:
    exp = experiment(in_flight=4, eval_every=4)
    _, s = train(exp, corpus, None, 12)
    assert [step for step, _ in s.val_curve] == [0, 4, 8, 12]
    assert not s.interrupted

    stop = threading.Event()
    torch.manual_seed(0)
    trainer = Trainer(exp, build_model(exp, None), corpus, StopAt(5, stop), stop=stop)
    s = trainer.run(100)
    assert s.interrupted
    # step 5 set it: no step starts after, the (at most 3) others in flight finish
    assert 5 <= s.steps <= 8
    assert s.val_curve[-1][0] == 4
