"""The expert's RequestGuard and the trainer's output checks, on their own."""

from __future__ import annotations

import pytest
import torch

from volunteerd.config import GuardConfig
from volunteerd.errors import Rejected
from volunteerd.moe.checks import OutputChecks, Suspicion, agree, judge
from volunteerd.runtime.guard import RequestGuard

PEER = "12D3KooWpeer"


def warmed(config: GuardConfig, rows: int = 8) -> RequestGuard:
    guard = RequestGuard(config)
    torch.manual_seed(0)
    for _ in range(config.warmup):
        guard.filter_gradients("ffn.0", PEER, [torch.randn(rows, 16)])
    return guard


def test_guard_accepts_everything_finite_while_warming_up() -> None:
    guard = RequestGuard(GuardConfig(warmup=8))
    out = guard.filter_gradients("ffn.0", PEER, [torch.randn(4, 16) * 1e3])
    assert guard.threshold("ffn.0") is None
    assert float(out[0].abs().max()) > 100
    with pytest.raises(Rejected, match="not all finite"):
        guard.filter_gradients("ffn.0", PEER, [torch.tensor([[float("nan")] * 16])])
    with pytest.raises(Rejected):
        guard.check_inputs("ffn.0", PEER, [torch.tensor([[float("inf")]])])
    assert guard.by_peer() == {PEER: {"non_finite_gradient": 1, "non_finite_input": 1}}


def test_guard_clips_outlier_rows_to_the_threshold_and_keeps_the_rest() -> None:
    guard = warmed(GuardConfig(warmup=16))
    threshold = guard.threshold("ffn.0")
    assert threshold is not None
    grads = torch.randn(4, 16)
    grads[2] *= 20  # an outlier row, but not absurd
    out = guard.filter_gradients("ffn.0", PEER, [grads])[0]
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


def test_judge_drops_non_finite_huge_and_lone_loud_answers() -> None:
    checks = OutputChecks(max_abs=100.0, max_ratio=50.0)
    ok = [torch.randn(3, 4) for _ in range(3)]
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
    s.forget("liar")
    assert s.record("a", "b") == []
