"""What a trainer accepts from experts: checks on the tensors volunteers send back.

A volunteer's machine may be faulty or its owner malicious. Before an expert's answer
(forward outputs, or the input gradients of a backward) is mixed into training:

* it must be finite and no element may exceed ``max_abs``;
* when at least three experts answered in the same round, its root-mean-square may not
  exceed ``max_ratio`` times the median of theirs (one expert answering 1e6 times louder
  than its peers is not an expert);
* a ``spot_check`` fraction of forward calls is also sent to a second replica of the
  same expert; the two answers must point the same way (cosine similarity at least
  ``min_cosine``, norms within ``max_ratio``). On disagreement a third replica, when
  there is one, decides; otherwise the disagreement is remembered, and a peer that has
  disagreed with two different peers is the odd one out.

An answer that fails a check is dropped (as if the expert had not answered) and its peer
is banned for ``ban_s``: none of its experts are chosen and its DHT records are ignored.
Honest replicas drift apart between weight averaging rounds, so the spot check is
deliberately loose: it catches noise and lies, not small differences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["OutputChecks", "Suspicion", "agree", "judge"]


@dataclass(frozen=True, slots=True)
class OutputChecks:
    max_abs: float = 1e4
    max_ratio: float = 1000.0
    spot_check: float = 0.0
    min_cosine: float = 0.5
    ban_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.spot_check <= 1.0:
            raise ValueError("spot_check is a fraction between 0 and 1")
        if self.max_abs <= 0 or self.max_ratio <= 1 or not -1 <= self.min_cosine <= 1:
            raise ValueError("max_abs > 0, max_ratio > 1 and -1 <= min_cosine <= 1")


def _rms(t: torch.Tensor) -> float:
    return float(t.float().square().mean().sqrt()) if t.numel() else 0.0


def judge(tensors: Sequence[torch.Tensor | None], checks: OutputChecks) -> list[str | None]:
    """For each answer (None: no answer), why it is refused, or None if accepted."""
    reasons: list[str | None] = [None] * len(tensors)
    scales: dict[int, float] = {}
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            reasons[i] = "non_finite"
        elif t.numel() and float(t.abs().max()) > checks.max_abs:
            reasons[i] = "out_of_range"
        else:
            scales[i] = _rms(t)
    if len(scales) >= 3:
        median = float(torch.tensor(list(scales.values())).median())
        for i, scale in scales.items():
            if scale > checks.max_ratio * max(median, 1e-12):
                reasons[i] = "out_of_range"
    return reasons


def agree(a: torch.Tensor, b: torch.Tensor, checks: OutputChecks) -> bool:
    """Whether two replicas' answers to the same input are close enough."""
    a, b = a.float().flatten(), b.float().flatten()
    if a.shape != b.shape or not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return na == nb
    if max(na, nb) > checks.max_ratio * min(na, nb):
        return False
    return float(a @ b) / (na * nb) >= checks.min_cosine


class Suspicion:
    """Who disagreed with whom in spot checks without a third replica to decide."""

    def __init__(self) -> None:
        self._against: dict[str, set[str]] = {}
        self.disagreements: Counter[str] = Counter()

    def record(self, a: str, b: str) -> list[str]:
        """Note that ``a`` and ``b`` disagreed; return the peers now judged the odd one
        out (each has disagreed with at least two different peers)."""
        self._against.setdefault(a, set()).add(b)
        self._against.setdefault(b, set()).add(a)
        self.disagreements[a] += 1
        self.disagreements[b] += 1
        return [p for p in (a, b) if len(self._against[p]) >= 2]

    def forget(self, peer: str) -> None:
        self._against.pop(peer, None)
        for others in self._against.values():
            others.discard(peer)
