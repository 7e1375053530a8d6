"""Experts of one type and size computed as one (``experts.stacked``, ``runtime.stacking``):
the same outputs, input gradients and weight updates as one by one, on the CPU with
``stack_experts = "always"`` (a GPU stacks by default; the arithmetic is the same)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import trio

from tests.unit.wire_tensors import wire
from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.errors import Busy
from volunteerd.experts.layers import FeedForwardExpert
from volunteerd.experts.stacked import StackEntry, Stacker
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.stacking import AUTO_MIN_STACK, stacks_on

HIDDEN = 16
UIDS = [f"ffn.0.{i}" for i in range(4)]
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


def one_by_one(
    expert: FeedForwardExpert, x: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    leaf = x.clone().requires_grad_()
    out = expert(leaf)
    grads = torch.autograd.grad(out, [leaf, *expert.parameters()], g)
    names = [n for n, _ in expert.named_parameters()]
    return out.detach(), grads[0], dict(zip(names, grads[1:], strict=True))


def test_stacked_experts_compute_what_each_computes_alone() -> None:
    torch.manual_seed(0)
    experts = [FeedForwardExpert(HIDDEN) for _ in range(6)]
    # unequal: the smaller ones are padded, and the largest is computed alone
    rows = [3, 8, 1, 8, 5, 200]
    xs = [torch.randn(n, HIDDEN) for n in rows]
    gs = [torch.randn(n, HIDDEN) for n in rows]
    stacker = Stacker(experts[0])
    params = [dict(e.named_parameters()) for e in experts]
    assert stacker.stacks([StackEntry(p, x) for p, x in zip(params, xs, strict=True)]) == [
        [5],
        [1, 3, 4, 0, 2],
    ]
    outs = stacker.forward([StackEntry(p, x) for p, x in zip(params, xs, strict=True)])
    back = stacker.backward([StackEntry(p, x, g) for p, x, g in zip(params, xs, gs, strict=True)])
    for expert, x, g, out, (dx, grads) in zip(experts, xs, gs, outs, back, strict=True):
        want_out, want_dx, want_grads = one_by_one(expert, x, g)
        assert out.shape == want_out.shape
        assert dx.shape == x.shape
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(dx, want_dx)
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name])
    for expert in experts:  # nothing was written into the experts themselves
        assert all(p.grad is None for p in expert.parameters())


def test_stacks_waste_at_most_half_their_rows_and_copy_a_bounded_amount_of_weights() -> None:
    expert = FeedForwardExpert(HIDDEN)
    params = dict(expert.named_parameters())

    def entries(rows: Sequence[int]) -> list[StackEntry]:
        return [StackEntry(params, torch.zeros(n, HIDDEN)) for n in rows]

    # one large batch is not padded with many small ones, nor they up to its size
    assert Stacker(expert).stacks(entries([512, 4, 4, 4, 6])) == [[0], [4, 1, 2, 3]]
    weight_bytes = sum(p.numel() * 4 for p in expert.parameters())
    small = Stacker(expert, max_stack_bytes=3 * weight_bytes)
    assert small.stacks(entries([4] * 7)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert Stacker(expert, max_stack=2).stacks(entries([4] * 3)) == [[0, 1], [2]]


def test_too_few_experts_are_computed_one_by_one() -> None:
    """Under ``min_stack`` a stack costs more than it saves: no batched call is made."""
    torch.manual_seed(0)
    experts = [FeedForwardExpert(HIDDEN) for _ in range(4)]
    stacker = Stacker(experts[0], min_stack=4)

    def no_batched_call(*args: object) -> torch.Tensor:
        raise AssertionError("stacked")

    stacker._mapped = no_batched_call  # type: ignore[method-assign]
    entries = [StackEntry(dict(e.named_parameters()), torch.randn(3, HIDDEN)) for e in experts]
    assert stacker.alone(entries[:3]) == [0, 1, 2]
    assert stacker.alone(entries) == []
    outputs = stacker.forward(entries[:3])
    for out, expert, entry in zip(outputs, experts[:3], entries[:3], strict=True):
        torch.testing.assert_close(out, expert(entry.inputs).detach())
    with pytest.raises(AssertionError, match="stacked"):
        stacker.forward(entries)


def test_experts_stack_where_configured() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    auto = RuntimeConfig()
    assert stacks_on(auto, cpu) == 0
    assert stacks_on(auto, gpu) == AUTO_MIN_STACK == 4
    assert stacks_on(RuntimeConfig(stack_experts="always"), cpu) == 2
    assert stacks_on(RuntimeConfig(stack_experts="never"), gpu) == 0


# -- in a running runtime -----------------------------------------------------------


def runtime(stack: str, device: str = "cpu") -> ExpertRuntime:
    experts = ExpertsConfig.model_validate(
        {"hidden_dim": HIDDEN, "seed": 3, "optimizer": {"name": "sgd", "lr": 0.01}}
    )
    config = RuntimeConfig.model_validate(
        {
            "device": device,
            "stack_experts": stack,
            # long enough for every concurrent request to be in the first job
            "max_batch_wait_s": 0.25,
        }
    )
    return ExpertRuntime(UIDS, experts, config, WireLimits(), torch.device(device))


def tensor_of(rt: ExpertRuntime, reply_bytes: list[bytes], rows: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(reply_bytes[0]), dtype=torch.float32).view(rows, HIDDEN)


async def train_once(
    rt: ExpertRuntime, xs: list[torch.Tensor], gs: list[torch.Tensor], *, kept: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every expert's forward at once, then every backward at once; their steps run."""
    outs: list[torch.Tensor] = [torch.empty(0)] * len(UIDS)
    dxs: list[torch.Tensor] = [torch.empty(0)] * len(UIDS)
    handles: list[str | None] = [None] * len(UIDS)

    async def forward(i: int) -> None:
        reply, data = await rt.forward(UIDS[i], wire(xs[i]), retain=kept, peer_id="A")
        handles[i] = reply.handle
        outs[i] = tensor_of(rt, data, len(xs[i]))

    async def backward(i: int) -> None:
        if kept:
            _, data = await rt.backward(UIDS[i], wire(gs[i]), handle=handles[i], peer_id="A")
        else:
            _, data = await rt.backward(UIDS[i], wire(xs[i], gs[i]), peer_id="A")
        dxs[i] = tensor_of(rt, data, len(xs[i]))

    for call in (forward, backward):
        async with trio.open_nursery() as nursery:
            for i in range(len(UIDS)):
                nursery.start_soon(call, i)
    await rt.settled()
    if kept:
        assert all(h is not None for h in handles)
    return outs, dxs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kept", [True, False], ids=["kept-forwards", "stateless"])
async def test_a_runtime_that_stacks_trains_its_experts_as_one_that_does_not(
    kept: bool, device: str
) -> None:
    torch.manual_seed(1)
    rows = [4, 7, 2, 100]  # the last is computed alone (padding it would cost too much)
    batches = [([torch.randn(n, HIDDEN) for n in rows], [torch.randn(n, HIDDEN) for n in rows])]
    batches.append(([torch.randn(n, HIDDEN) for n in rows], [torch.randn(n, HIDDEN) for n in rows]))
    results = {}
    for stack in ("never", "always"):
        rt = runtime(stack, device)
        got = []
        async with trio.open_nursery() as nursery:
            await nursery.start(rt.serve)
            for xs, gs in batches:
                got.append(await train_once(rt, xs, gs, kept=kept))
            rt.close()
        weights = [
            {n: p.detach().cpu() for n, p in rt.backend(uid).module.named_parameters()}
            for uid in UIDS
        ]
        results[stack] = (rt, got, weights)
    plain, stacked = results["never"], results["always"]
    # a GPU's batched products may sum in another order than its single ones
    tol = {} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-4}
    assert plain[0].stacking is None
    assert stacked[0].stacking is not None
    # forwards and backwards of both rounds, each once for all four experts
    assert stacked[0].stacking.calls == 4
    assert stacked[0].stacking.batches == 16
    for (outs_a, dxs_a), (outs_b, dxs_b) in zip(plain[1], stacked[1], strict=True):
        for a, b in zip([*outs_a, *dxs_a], [*outs_b, *dxs_b], strict=True):
            torch.testing.assert_close(a, b, **tol)
    for uid, wa, wb in zip(UIDS, plain[2], stacked[2], strict=True):
        assert plain[0].backend(uid).updates == stacked[0].backend(uid).updates == 2
        for name in wa:
            torch.testing.assert_close(wa[name], wb[name], **tol)
        assert all(p.grad is None for p in stacked[0].backend(uid).module.parameters())
    if kept:  # the stacked kept forwards' backwards were recomputed, stacked; the
        # large batch computed alone kept its graph, as without stacking
        assert [stacked[0].backend(uid).kept_recomputed for uid in UIDS] == [2, 2, 2, 0]
        assert stacked[0].retained_statistics().entries == 0


async def test_a_broken_expert_is_refused_and_the_others_stacked_are_served() -> None:
    rt = runtime("always")
    xs = [torch.randn(3, HIDDEN) for _ in UIDS]
    answers: dict[str, object] = {}

    async def forward(i: int) -> None:
        try:
            _, data = await rt.forward(UIDS[i], wire(xs[i]), peer_id="A")
            answers[UIDS[i]] = tensor_of(rt, data, 3)
        except Busy as exc:
            answers[UIDS[i]] = exc

    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        async with trio.open_nursery() as inner:
            for i in range(len(UIDS)):
                inner.start_soon(forward, i)
            await trio.sleep(0.05)  # queued; the job waits for company
            rt._hosted(UIDS[1]).broken = True  # a failed step, found on the worker
        rt.close()
    assert isinstance(answers[UIDS[1]], Busy)
    for i in (0, 2, 3):
        want = rt.backend(UIDS[i]).forward([xs[i]])[0]
        torch.testing.assert_close(answers[UIDS[i]], want)
    assert rt.stacking is not None
    assert rt.stacking.calls == 1


async def test_when_the_stacked_call_fails_each_batch_runs_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fails(*args: object) -> object:
        raise RuntimeError("no stacked kernel today")

    monkeypatch.setattr(Stacker, "backward", fails)
    torch.manual_seed(2)
    xs = [torch.randn(3, HIDDEN) for _ in UIDS]
    gs = [torch.randn(3, HIDDEN) for _ in UIDS]
    rt, plain = runtime("always"), runtime("never")
    for r in (rt, plain):
        async with trio.open_nursery() as nursery:
            await nursery.start(r.serve)
            got = await train_once(r, xs, gs, kept=True)
            r.close()
        if r is rt:
            stacked_got = got
    assert "batches together failed; running them one by one" in caplog.text
    for a, b in zip(stacked_got[1], got[1], strict=True):  # the input gradients
        torch.testing.assert_close(a, b)
    for uid in UIDS:
        assert rt.backend(uid).updates == 1
        for pa, pb in zip(
            rt.backend(uid).module.parameters(), plain.backend(uid).module.parameters(), strict=True
        ):
            torch.testing.assert_close(pa, pb)
