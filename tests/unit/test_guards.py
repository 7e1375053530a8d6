"""The expert's RequestGuard (on its own and in the runtime: bounds, undone steps, bans)
and the trainer's output checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from volunteerd.config import ExpertsConfig, GuardConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import CheckpointConfig
from volunteerd.errors import Rejected
from volunteerd.experts import to_wire
from volunteerd.moe.checks import OutputChecks, Suspicion, agree, judge
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.runtime.guard import RequestGuard, Sender
from volunteerd.wire import WireTensor

PEER = "12D3KooWpeer"


def warmed(config: GuardConfig, rows: int = 8) -> RequestGuard:
    guard = RequestGuard(config)
    torch.manual_seed(0)
    for _ in range(config.warmup):
        guard.filter_gradients("ffn.0", PEER, [torch.randn(rows, 16)])
    return guard


def test_guard_accepts_everything_finite_while_warming_up() -> None:
    guard = RequestGuard(GuardConfig(warmup=8))
    out, loudest = guard.filter_gradients("ffn.0", PEER, [torch.randn(4, 16) * 1e3])
    assert guard.threshold("ffn.0") is None
    assert loudest == pytest.approx(float(out[0].norm(dim=1).max()))
    assert float(out[0].abs().max()) > 100
    with pytest.raises(Rejected, match="not all finite"):
        guard.filter_gradients("ffn.0", PEER, [torch.tensor([[float("nan")] * 16])])
    with pytest.raises(Rejected):
        guard.check_inputs("ffn.0", PEER, [torch.tensor([[float("inf")]])])
    assert guard.by_peer() == {PEER: {"non_finite_gradient": 1, "non_finite_input": 1}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_guard_bounds_inputs_by_their_largest_magnitude_either_sign(dtype: torch.dtype) -> None:
    guard = RequestGuard(GuardConfig(max_input_abs=100.0))
    x = torch.randn(64, 32).clamp(-3, 3).to(dtype)
    guard.check_inputs("ffn.0", PEER, [x, torch.zeros(0, 32, dtype=dtype)])
    for value, why in [
        (-500.0, "above the bound"),  # the largest magnitude is a negative value
        (500.0, "above the bound"),
        (float("-inf"), "not all finite"),
        (float("inf"), "not all finite"),
        (float("nan"), "not all finite"),
    ]:
        bad = x.clone()
        bad[17, 5] = value  # one value among ordinary ones
        with pytest.raises(Rejected, match=why):
            guard.check_inputs("ffn.0", PEER, [x, bad])


def test_guard_clips_outlier_rows_to_the_threshold_and_keeps_the_rest() -> None:
    guard = warmed(GuardConfig(warmup=16))
    threshold = guard.threshold("ffn.0")
    assert threshold is not None
    grads = torch.randn(4, 16)
    grads[2] *= 20  # an outlier row, but not absurd
    out = guard.filter_gradients("ffn.0", PEER, [grads])[0][0]
    assert float(out[2].norm()) == pytest.approx(threshold, rel=1e-5)
    torch.testing.assert_close(out[[0, 1, 3]], grads[[0, 1, 3]])
    assert guard.counts[(PEER, "clipped")] == 1


def test_guard_refuses_absurd_gradients_and_in_reject_mode_any_outlier() -> None:
    guard = warmed(GuardConfig(warmup=16))
    with pytest.raises(Rejected, match="far above"):
        guard.filter_gradients("ffn.0", PEER, [torch.randn(4, 16) * 1e6])
    strict = warmed(GuardConfig(warmup=16, outliers="reject"))
    grads = torch.randn(4, 16)
    grads[0] *= 20
    with pytest.raises(Rejected):
        strict.filter_gradients("ffn.0", PEER, [grads])
    # Other experts keep their own statistics.
    assert strict.threshold("ffn.1") is None


HONEST = [f"12D3KooWhonest{i}" for i in range(4)]
ATTACKER = "12D3KooWattacker"


def honest_traffic(guard: RequestGuard, requests: int = 8) -> None:
    """Four trainers' ordinary gradients (row norms ~0.4)."""
    for _ in range(requests):
        for peer in HONEST:
            guard.filter_gradients("ffn.0", peer, [torch.randn(8, 16) * 0.1])


def cancelling_rows(rows: int, norms: torch.Tensor) -> torch.Tensor:
    """Rows of the given norms in pairs (g, -g): their updates cancel, so the step
    moves nothing and nobody is blamed, while the guard sees each row's norm."""
    g = torch.nn.functional.normalize(torch.randn(rows // 2, 16), dim=1) * norms[: rows // 2, None]
    return torch.cat([g, -g])


def test_no_peer_can_lower_the_threshold_until_honest_gradients_are_refused() -> None:
    torch.manual_seed(1)
    guard = RequestGuard(GuardConfig())
    honest_traffic(guard)
    before = guard.threshold("ffn.0")
    assert before is not None
    for _ in range(20):  # 5,120 rows of norm 1e-6; one request of 256 used to be enough
        whisper = cancelling_rows(256, torch.full((256,), 1e-6))
        guard.filter_gradients("ffn.0", ATTACKER, [whisper])
    after = guard.threshold("ffn.0")
    assert after is not None
    assert after > before / 2
    for peer in HONEST:  # honest rows are still accepted as they are
        grads = torch.randn(8, 16) * 0.1
        out, _ = guard.filter_gradients("ffn.0", peer, [grads])
        torch.testing.assert_close(out[0], grads)


def test_rows_of_zeros_are_not_remembered() -> None:
    """An early expert, one honest trainer: a stranger's rows of zeros (free to send,
    and answered) made the median 0 and the threshold ~1e-11, after which the honest
    trainer's next backward was refused as far above it."""
    torch.manual_seed(2)
    guard = RequestGuard(GuardConfig())
    for _ in range(2):
        guard.filter_gradients("ffn.0", HONEST[0], [torch.randn(8, 16) * 0.1])
    before = guard.threshold("ffn.0")
    assert before is not None
    for _ in range(20):
        _, loudest = guard.filter_gradients("ffn.0", ATTACKER, [torch.zeros(64, 16)])
        assert loudest == 0.0
    assert guard.threshold("ffn.0") == before
    grads = torch.randn(8, 16) * 0.1
    out, _ = guard.filter_gradients("ffn.0", HONEST[0], [grads])
    torch.testing.assert_close(out[0], grads)


def test_one_stranger_whispering_cannot_shut_out_the_only_honest_trainer() -> None:
    """The same with tiny rows that are not zero (1e-7): the threshold fell to ~4e-7
    and the honest trainer's rows were refused (0.5 is over 100 times that)."""
    torch.manual_seed(2)
    guard = RequestGuard(GuardConfig())
    for _ in range(2):
        guard.filter_gradients("ffn.0", HONEST[0], [torch.randn(8, 16) * 0.1])
    for _ in range(20):
        guard.filter_gradients("ffn.0", ATTACKER, [torch.full((64, 16), 1e-7)])
    for _ in range(5):  # accepted, and at most clipped: never refused
        out, _ = guard.filter_gradients("ffn.0", HONEST[0], [torch.randn(8, 16) * 0.1])
        assert out[0].norm(dim=1).max() > 0.1


def test_no_peer_can_raise_the_threshold_with_loud_rows_that_cancel() -> None:
    torch.manual_seed(2)
    guard = RequestGuard(GuardConfig())
    honest_traffic(guard)
    before = guard.threshold("ffn.0")
    assert before is not None
    for _ in range(20):  # each request up to ~3.5 times the threshold, as it climbs
        threshold = guard.threshold("ffn.0")
        assert threshold is not None
        loud = cancelling_rows(256, torch.linspace(threshold / 256, threshold, 256).flip(0))
        guard.filter_gradients("ffn.0", ATTACKER, [loud])
    after = guard.threshold("ffn.0")
    assert after is not None
    assert after < 2 * before
    with pytest.raises(Rejected, match="far above"):  # still refused, as before the attack
        guard.filter_gradients("ffn.0", ATTACKER, [torch.randn(4, 16) * 1e3])


def test_a_skewed_history_is_forgotten_once_the_attack_stops() -> None:
    now = [0.0]
    torch.manual_seed(3)
    guard = RequestGuard(GuardConfig(), clock=lambda: now[0])
    honest_traffic(guard)
    for i in range(8):  # eight identities, each with its full share of the window
        for _ in range(4):
            whisper = cancelling_rows(256, torch.full((256,), 1e-6))
            guard.filter_gradients("ffn.0", f"{ATTACKER}{i}", [whisper])
    threshold = guard.threshold("ffn.0")
    assert threshold is not None
    assert threshold < 1e-3  # owned: honest rows would be refused now
    now[0] = 601.0  # ten minutes without requests: all of it forgotten
    assert guard.threshold("ffn.0") is None
    assert not guard.warmed_up("ffn.0")
    honest_traffic(guard)
    recovered = guard.threshold("ffn.0")
    assert recovered is not None
    assert recovered > 0.1


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        ("one input of 3e38", "input_out_of_range"),
        ("inputs of 1e20", "input_out_of_range"),
        ("gradients of 3e38", "gradient_out_of_range"),
        ("gradients of 1e30", "gradient_out_of_range"),
    ],
)
def test_absolute_bounds_hold_from_the_very_first_request(attack: str, reason: str) -> None:
    guard = RequestGuard(GuardConfig())  # nothing seen yet: no statistics to judge by
    x, g = torch.randn(1, 16), torch.randn(1, 16)
    if attack == "one input of 3e38":
        x[0, 0] = 3e38  # finite in float32
    elif attack == "inputs of 1e20":
        x.fill_(1e20)
    else:
        g.fill_(3e38 if "3e38" in attack else 1e30)

    def backward() -> None:  # as the runtime checks a stateless backward
        guard.check_inputs("ffn.0", PEER, [x])
        guard.filter_gradients("ffn.0", PEER, [g])

    with pytest.raises(Rejected, match="above the bound"):
        backward()
    assert guard.by_peer() == {PEER: {reason: 1}}
    assert guard.accepted == 0
    # Just under the bounds is accepted: the bounds are far above honest values.
    guard.check_inputs("ffn.0", PEER, [torch.full((1, 16), 9e5)])
    guard.filter_gradients("ffn.0", PEER, [torch.full((1, 16), -9e5)])


def test_the_gradient_bound_applies_to_what_clipping_leaves() -> None:
    # A warmed-up guard that clips an outlier row under the bound accepts it.
    guard = warmed(GuardConfig(warmup=16, max_gradient_abs=10.0, reject_ratio=1e9))
    threshold = guard.threshold("ffn.0")
    assert threshold is not None
    grads = torch.randn(4, 16) * 0.5
    grads[1, 3] = 50.0  # above the bound, but an outlier row clipped to the threshold
    out, loudest = guard.filter_gradients("ffn.0", PEER, [grads])
    assert float(out[0].abs().max()) <= 10.0
    assert guard.counts[(PEER, "clipped")] == 1
    assert loudest == pytest.approx(threshold, rel=1e-5)


def test_a_banned_peer_is_refused_everywhere_until_the_ban_ends() -> None:
    now = [1000.0]
    guard = RequestGuard(GuardConfig(ban_s=600), clock=lambda: now[0])
    guard.ban(PEER, "a step of ffn.0 with its gradients was undone (non_finite_weights)")
    guard.check_peer("ffn.0", "12D3KooWother")  # others are served
    for uid in ("ffn.0", "ffn.1"):
        with pytest.raises(Rejected, match=r"refused for 600 s: a step of ffn.0"):
            guard.check_peer(uid, PEER)
    assert guard.counts[(PEER, "banned")] == 2
    assert guard.banned() == {PEER: 600.0}
    now[0] += 599
    with pytest.raises(Rejected):
        guard.check_peer("ffn.0", PEER)
    now[0] += 1
    guard.check_peer("ffn.0", PEER)
    assert guard.banned() == {}
    # ban_s = 0 bans nobody; "" is a local caller and is never banned.
    never = RequestGuard(GuardConfig(ban_s=0))
    never.ban(PEER, "x")
    never.check_peer("ffn.0", PEER)
    guard.ban("", "x")
    guard.check_peer("ffn.0", "")


def test_the_ban_list_is_bounded_and_forgets_the_oldest_first() -> None:
    guard = RequestGuard(GuardConfig(ban_s=600))
    for i in range(10_001):
        guard.ban(f"peer{i}", "x")
    banned = guard.banned()
    assert len(banned) == 10_000
    assert "peer0" not in banned
    assert "peer10000" in banned


def test_blame_falls_on_the_lone_sender_or_on_the_outliers_only() -> None:
    guard = RequestGuard(GuardConfig(blame_ratio=10))
    assert guard.blame([]) == []
    assert guard.blame([Sender("a", 1.0), Sender("a", 2.0)]) == ["a"]
    assert guard.blame([Sender("", 1e9)]) == []  # a local caller
    honest = [Sender(p, n) for p, n in [("h1", 1.0), ("h2", 0.5), ("h3", 2.0)]]
    assert guard.blame([*honest, Sender("bad", 1e5)]) == ["bad"]
    # Two attackers in one merged step are both blamed (the loud few).
    assert sorted(guard.blame([*honest, Sender("bad", 1e5), Sender("worse", 1e6)])) == [
        "bad",
        "worse",
    ]
    # Nobody stands out: the model is to blame, not a peer.
    assert guard.blame([*honest, Sender("h4", 5.0)]) == []


def test_quiet_extra_identities_do_not_make_an_honest_sender_stand_out() -> None:
    """An outside probe: a loud attacker and three identities of near-zero gradients
    beside one honest trainer in a merged step that was undone. Against the lower
    median of the other identities (1e-7) the honest 1e-2 stood out too and was banned
    with the attacker. One very quiet sender must not make everyone else stand out."""
    guard = RequestGuard(GuardConfig(blame_ratio=10))
    quiet = [Sender(f"q{i}", 1e-7) for i in range(3)]
    assert guard.blame([Sender("honest", 1e-2), Sender("loud", 9e5), *quiet]) == ["loud"]
    honest = [Sender(f"h{i}", 5.0) for i in range(4)]
    assert guard.blame([*honest, Sender("q", 1e-9)]) == []


def test_blame_judges_parties_and_bans_every_identity_of_a_blamed_one() -> None:
    """Identities of one address are one party: many quiet ones are one vote, and a
    loud party is blamed with all the identities it sent through."""
    guard = RequestGuard(GuardConfig(blame_ratio=10))
    sybils = [Sender(f"s{i}", 1e-7, "10.0.0.9") for i in range(5)]
    loud = Sender("loud", 9e5, "10.0.0.9")
    assert guard.blame([Sender("honest", 1e-2, "10.0.0.1"), loud, *sybils]) == sorted(
        ["loud", *(s.peer_id for s in sybils)]
    )
    others = [Sender("a", 1.0, "10.0.0.2"), Sender("b", 2.0, "10.0.0.3")]
    assert guard.blame([*others, *sybils]) == []  # a quiet party blames nobody
    # Most parties loud: the expert is diverging, nobody is blamed.
    assert guard.blame([Sender("x", 100.0), Sender("y", 100.0), Sender("z", 1.0)]) == []


def test_an_undone_step_is_counted_and_bans_whom_it_blames() -> None:
    guard = RequestGuard(GuardConfig(ban_s=600))
    honest = [Sender("h1", 1.0), Sender("h2", 1.5)]
    assert guard.step_undone("ffn.0", "non_finite_weights", [*honest, Sender("bad", 1e5)]) == [
        "bad"
    ]
    assert guard.step_undone("ffn.0", "too_large_step", honest) == []
    assert guard.undone == {("ffn.0", "non_finite_weights"): 1, ("ffn.0", "too_large_step"): 1}
    assert set(guard.banned()) == {"bad"}
    assert guard.by_peer() == {"bad": {"step_undone": 1}}


def test_judge_drops_non_finite_huge_and_lone_loud_answers() -> None:
    checks = OutputChecks(max_abs=100.0, max_ratio=50.0)
    # Scales (RMS) 0.9, 1.0 and 1.1: random ones put the peers' median above 1.2 now
    # and then, and 60 was then under 50 times it (a CI failure).
    signs = torch.tensor([1.0, -1.0]).repeat(6).reshape(3, 4)  # RMS 1
    ok = [scale * signs for scale in (0.9, 1.0, 1.1)]
    loud = torch.full((3, 4), 60.0)  # under max_abs, but 60x its peers
    nan = torch.full((3, 4), float("nan"))
    huge = torch.full((3, 4), 1e3)
    assert judge([*ok, loud, nan, huge, None], checks) == [
        None, None, None, "out_of_range", "non_finite", "out_of_range", None,
    ]  # fmt: skip
    # With fewer than three answers there is no "peers" to compare with.
    assert judge([ok[0], loud], checks) == [None, None]


def test_agree_tells_noise_from_a_drifted_replica() -> None:
    checks = OutputChecks()
    y = torch.randn(8, 32)
    assert agree(y, y + 0.3 * torch.randn_like(y), checks)
    assert not agree(y, torch.randn_like(y), checks)
    assert not agree(y, y * 1e4, checks)
    assert not agree(y, torch.full_like(y, float("nan")), checks)


def test_suspicion_names_the_peer_that_disagrees_with_two_others() -> None:
    s = Suspicion()
    assert s.record("liar", "a") == []
    assert s.record("liar", "b") == ["liar"]
    assert s.disagreements["liar"] == 2
    s.forget("liar")
    assert "liar" not in s.disagreements
    assert s.record("a", "b") == []


def test_suspicion_forgets_disagreements_older_than_its_memory() -> None:
    """Replicas drift between averaging rounds: an honest peer's disagreements of weeks
    added up until its next one banned it. Two within MEMORY_S make the odd one out."""
    now = [0.0]
    s = Suspicion(clock=lambda: now[0])
    assert s.record("honest", "drifted") == []
    now[0] += Suspicion.MEMORY_S
    assert s.record("stale", "honest") == []  # the first is forgotten by now
    now[0] += 60
    assert s.record("stale", "other") == ["stale"]


def test_suspicion_stays_bounded_under_a_flood_of_identities() -> None:
    """Identities are free: disagreeing strangers cannot grow the table for good, and a
    liar met among them is still named."""
    s = Suspicion()
    for n in range(Suspicion.REMEMBERED + 300):
        s.record(f"stranger-{n}", "honest")
    assert len(s) == Suspicion.REMEMBERED
    assert len(s.disagreements) == Suspicion.REMEMBERED
    assert "stranger-0" not in s.disagreements  # the oldest went, with its count
    assert s.disagreements["honest"] == Suspicion.REMEMBERED + 300
    assert s.record("liar", "a") == []
    assert s.record("liar", "b") == ["liar"]


def wire(t: torch.Tensor) -> WireTensor:
    meta, data = to_wire(t)
    return WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))


@pytest.mark.parametrize(
    ("lr", "honest_scale", "bad_value", "banned"),
    [(0.01, 0.01, 9e5, {"bad"}), (10.0, 1.0, 1.0, set())],
    ids=["one-outlier", "nobody-stands-out"],
)
async def test_a_merged_step_that_is_undone_bans_only_a_peer_that_stands_out(
    lr: float, honest_scale: float, bad_value: float, banned: set[str]
) -> None:
    """Two trainers' backwards merged into one batch and one step (SGD): the step is
    undone; only a peer whose gradients stand out is banned. When nobody stands out (here
    a learning rate so high that every step diverges), nobody is."""
    uid, hidden = "ffn.0.0", 16
    runtime = ExpertRuntime(
        [uid],
        ExpertsConfig(hidden_dim=hidden, optimizer={"name": "sgd", "lr": lr}),
        # two samples fill a batch; the wait only matters if the second never came
        RuntimeConfig(device="cpu", max_batch_size=2, max_batch_wait_s=10.0),
        WireLimits(),
        torch.device("cpu"),
        GuardConfig(),
    )
    torch.manual_seed(0)

    async def backward(peer: str, g: torch.Tensor) -> None:
        x = torch.randn(g.shape[0], hidden)
        await runtime.backward(uid, [wire(x), wire(g)], peer_id=peer)

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        backend = runtime.backend(uid)
        before = backend.parameter_copies()
        async with trio.open_nursery() as calls:  # answered "ok": the step comes after
            calls.start_soon(backward, "honest", torch.randn(1, hidden) * honest_scale)
            # 9e5 is just under the gradient bound: accepted by the guard, too much for SGD
            calls.start_soon(backward, "bad", torch.full((1, hidden), bad_value))
        await runtime.settled()
        assert runtime.statistics()[0].backward.batches == 1, "one merged batch"
        assert backend.updates == 0
        after = backend.parameter_copies()
        assert all(torch.equal(before[name], after[name]) for name in before)
        assert runtime.step_check is not None
        assert runtime.step_check.undone == 1
        assert set(runtime.guard.banned()) == banned
        assert sum(runtime.guard.undone.values()) == 1
        if banned:
            with pytest.raises(Rejected, match="refused for 600 s"):
                await runtime.forward(uid, [wire(torch.randn(1, hidden))], peer_id="bad")
            # The honest trainer is still served, and alone it trains the expert (two
            # samples fill a batch: no wait).
            await runtime.forward(uid, [wire(torch.randn(2, hidden))], peer_id="honest")
            await backward("honest", torch.randn(2, hidden) * 0.01)
            await runtime.settled()
            assert backend.updates == 1
        runtime.close()


def adam_runtime(guard: GuardConfig) -> ExpertRuntime:
    return ExpertRuntime(
        ["ffn.0.0"],
        ExpertsConfig(hidden_dim=16, optimizer={"name": "adam", "lr": 1e-3}),
        RuntimeConfig(device="cpu"),
        WireLimits(),
        torch.device("cpu"),
        guard,
    )


async def test_steps_are_fully_checked_until_the_guard_has_warmed_up() -> None:
    runtime = adam_runtime(GuardConfig(warmup=12, full_check_every=0))
    torch.manual_seed(1)
    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        check = runtime.step_check
        assert check is not None
        for _ in range(5):  # 4 rows each: warmed up after the third request
            x, g = torch.randn(4, 16), torch.randn(4, 16) * 0.01
            await runtime.backward("ffn.0.0", [wire(x), wire(g)], peer_id=PEER)
            await runtime.settled()
        assert (check.full, check.predicted, check.undone) == (2, 3, 0)
        assert runtime.backend("ffn.0.0").updates == 5
        runtime.close()


@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpoint", "no-checkpoint"])
async def test_an_expert_broken_behind_its_bounds_is_restored_and_nobody_is_banned(
    tmp_path: Path, checkpointed: bool
) -> None:
    """A step the bounds vouched for leaves a NaN (an optimizer kernel gone wrong: the
    bounds rule it out for Adam and SGD): it cannot be undone, so the expert goes back
    to its newest checkpoint (or, without one, to its seeded weights), loudly, and the
    sender, whose gradients were fine, is not blamed."""
    uid = "ffn.0.0"
    runtime = adam_runtime(GuardConfig(warmup=1))
    errors: list[str] = []
    runtime.on_error = errors.append  # the daemon posts these as error events
    checkpointer = Checkpointer(runtime, tmp_path, CheckpointConfig())
    torch.manual_seed(2)
    probe = torch.randn(3, 16)

    async def train() -> None:
        x, g = torch.randn(4, 16), torch.randn(4, 16) * 0.01
        await runtime.backward(uid, [wire(x), wire(g)], peer_id=PEER)
        await runtime.settled()

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        backend = runtime.backend(uid)
        seeded = backend.parameter_copies()
        await train()
        if checkpointed:
            await checkpointer.save(backend)
        good = backend.parameter_copies()
        kernel = backend.optimizer.step

        def broken_kernel() -> None:
            kernel()
            with torch.no_grad():
                next(backend.module.parameters()).view(-1)[0] = float("nan")

        backend.optimizer.step = broken_kernel  # type: ignore[method-assign]
        await train()
        del backend.optimizer.step  # the class's step again
        # Seen after that step, or (between its passes over the weights an Adam step
        # carries a bound of their norm) in the next one, whose gradients are NaN
        # through the broken weight: refused, and the weights reported broken.
        if not runtime.guard.broken:
            await train()
        assert runtime.guard.broken == {(uid, "non_finite_weights"): 1}
        to = "its newest checkpoint" if checkpointed else "its seeded initial weights"
        assert errors == [f"a step broke the weights of {uid}: back to {to}"]
        restored = backend.parameter_copies()
        expected = good if checkpointed else seeded
        assert all(torch.equal(restored[name], expected[name]) for name in expected)
        assert backend.updates == (1 if checkpointed else 0)
        assert runtime.guard.banned() == {}
        assert runtime.guard.undone == {}
        # It serves and trains again.
        reply, _ = await runtime.forward(uid, [wire(probe)], peer_id=PEER)
        assert len(reply.tensors) == 1
        await train()
        assert backend.updates == (2 if checkpointed else 1)
        assert all(torch.isfinite(p).all() for p in backend.module.parameters())
        runtime.close()


def test_the_counts_of_strangers_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refused identity added an entry for good; identities are free."""
    monkeypatch.setattr("volunteerd.runtime.guard._MAX_COUNTED", 100)
    guard = RequestGuard(GuardConfig())
    for i in range(500):
        with pytest.raises(Rejected):
            guard.check_inputs("ffn.0", f"stranger{i}", [torch.tensor([[float("nan")]])])
    assert len(guard.counts) == 100
    assert ("stranger499", "non_finite_input") in guard.counts
    assert ("stranger0", "non_finite_input") not in guard.counts
