"""What a trainer accepts from experts: checks on the tensors volunteers send back.

A volunteer's machine may be faulty or its owner malicious. Before an expert's answer
(forward outputs, or the input gradients of a backward) is mixed into training, it is
judged together with the other answers of the same round (one forward or backward
fan-out of one layer):

* ``non_finite``: every value must be finite;
* ``out_of_range`` (loud): when at least three answers are finite, an answer's
  root-mean-square, and that of each of its rows, may not exceed ``max_ratio`` times
  the round's typical one (the median over peers of each peer's median RMS: one expert
  answering 1e6 times louder than its peers is not an expert; a few rows blown up
  3000 times in an answer of many passed as a whole, their RMS diluted by the rest);
* ``out_of_range`` (outgrown): no element may exceed ``max_abs``;
* a ``spot_check`` fraction of forward calls is also sent to a second replica of the
  same expert; the two answers must point the same way (cosine similarity at least
  ``min_cosine``) and be about as large (norms within ``max_spot_ratio``: replicas of
  one expert are averaged every few minutes, and ``max_ratio``, meant for different
  experts, let an answer scaled 100 times pass). On disagreement a third replica, when
  there is one, decides; otherwise the disagreement is remembered, and a peer that has
  disagreed with two different peers is the odd one out.

An answer that fails a check is dropped (as if the expert had not answered). Banning
its peer needs evidence that the peer differs from its peers, because a check that
fails everyone is judging the model, not the volunteers (an unbounded loss makes
honest outputs grow past ``max_abs``; a diverged model answers NaN everywhere):

* a peer is *convicted* (banned for ``ban_s``) for a non-finite or loud answer only when
  at least two peers answered the round and no more than half of them failed that
  check; exceeding ``max_abs`` alone never convicts, since honest experts cross it one
  after another as a model grows;
* when at least two peers answered and most answers *and* most answering peers fail a
  check, the round is reported as a diverging model and nobody is banned. Answers that
  merely exceed ``max_abs`` are then accepted, as the model's own scale, if their
  typical RMS is at most ``max_growth`` times that of the layer's last accepted round
  of the same kind (a model grows step by step; an answer a million times louder than
  the last step's is not growth). Non-finite answers are never accepted;
* a peer that answered the round alone is never evidence about the model: its
  non-finite answers, and those above ``max_abs`` but not within ``max_growth`` of the
  last accepted round, are dropped, nobody is banned and the round is not reported as
  diverging.

Honest replicas drift apart between weight averaging rounds, so the spot check is
deliberately loose: it catches noise, lies and answers scaled tenfold or more, not
small differences. Early in training honest replicas differ in scale more than one
would think (in one process, every forward of 150 steps spot-checked, no averaging:
norms up to 3.3 times apart with the default experiment, hidden 128 and expert lr 3e-3;
1.08 with lr 1e-3; 9.7 with lr 1e-2, hidden 64), so ``max_spot_ratio`` is 10.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from volunteerd.bounded import remember

__all__ = [
    "NON_FINITE",
    "OUT_OF_RANGE",
    "OutputChecks",
    "Suspicion",
    "Verdict",
    "agree",
    "judge",
    "judge_round",
]

NON_FINITE = "non_finite"
OUT_OF_RANGE = "out_of_range"
BAD_SHAPE = "bad_shape"

# Below this an RMS counts as zero (all-zero answers must not make every other one loud).
_TINY = 1e-12


@dataclass(frozen=True, slots=True)
class OutputChecks:
    max_abs: float = 1e4
    max_ratio: float = 1000.0
    spot_check: float = 0.0
    min_cosine: float = 0.5
    # how much larger one replica's answer to a spot check may be than the other's
    max_spot_ratio: float = 10.0
    ban_s: float = 600.0
    # how much louder than the layer's last accepted round a round whose answers all
    # exceed max_abs may be and still be taken as the model's own growth
    max_growth: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.spot_check <= 1.0:
            raise ValueError("spot_check is a fraction between 0 and 1")
        if self.max_abs <= 0 or self.max_ratio <= 1 or not -1 <= self.min_cosine <= 1:
            raise ValueError("max_abs > 0, max_ratio > 1 and -1 <= min_cosine <= 1")
        if self.max_growth <= 1:
            raise ValueError("max_growth > 1")
        if self.max_spot_ratio <= 1:
            raise ValueError("max_spot_ratio > 1")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the answers of one round are worth (one entry per answer, None = no answer).

    ``reasons[i]``: why answer i is dropped, None if it is accepted (or missing).
    ``convicted[i]``: answer i is evidence against its peer (ban the peer).
    ``diverging``: the check that most of the round failed — the model's fault, not a
    peer's — or None; ``blamed_on_model`` the answers that failed it.
    ``scale``: the typical RMS of the accepted answers, the next round's ``reference``
    (None when nothing finite was accepted).
    """

    reasons: list[str | None]
    convicted: list[bool]
    diverging: str | None = None
    blamed_on_model: tuple[int, ...] = ()
    scale: float | None = None


def _rms(t: torch.Tensor) -> tuple[float, float]:
    """The RMS of ``t`` and that of its loudest row (a row: the last dimension), from
    one pass over its squares."""
    if not t.numel():
        return 0.0, 0.0
    ms_R = t.float().square().reshape(-1, t.shape[-1] if t.dim() else 1).mean(dim=1)
    return float(ms_R.mean().sqrt()), float(ms_R.max().sqrt())


def _median(values: Iterable[float]) -> float:
    """The lower median; of two values their mean, so that of two peers neither can
    make the other look loud by answering (near) zeros."""
    ordered = sorted(values)
    if len(ordered) == 2:
        return (ordered[0] + ordered[1]) / 2
    return ordered[(len(ordered) - 1) // 2]


def _typical(scales: dict[int, float], owners: Sequence[str]) -> float:
    """The median over peers of each peer's median RMS: a peer answering many of the
    round's calls weighs as much as one answering a single call."""
    by_peer: dict[str, list[float]] = {}
    for i, scale in scales.items():
        by_peer.setdefault(owners[i], []).append(scale)
    return _median(_median(v) for v in by_peer.values())


def _peers(indices: Iterable[int], owners: Sequence[str]) -> set[str]:
    return {owners[i] for i in indices}


def _most(failing: Sequence[int], pool: Sequence[int], owners: Sequence[str]) -> bool:
    """More than half of the answers and more than half of their peers failed."""
    return 2 * len(failing) > len(pool) and 2 * len(_peers(failing, owners)) > len(
        _peers(pool, owners)
    )


def _few(failing: Sequence[int], pool: Sequence[int], owners: Sequence[str]) -> bool:
    """At least two peers answered and no more than half of them failed: the ones
    that failed differ from their peers."""
    pool_peers = _peers(pool, owners)
    return len(pool_peers) >= 2 and 2 * len(_peers(failing, owners)) <= len(pool_peers)


def judge_round(
    tensors: Sequence[torch.Tensor | None],
    checks: OutputChecks,
    *,
    peers: Sequence[str] | None = None,
    reference: float | None = None,
) -> Verdict:
    """Judge one round's answers (None: no answer) by the rules in the module docstring.

    ``peers[i]`` is who sent answer i (default: every answer a different peer);
    ``reference`` the ``scale`` of the layer's last accepted round of the same kind
    (None: no earlier round, so nothing above ``max_abs`` is taken as growth)."""
    owners = [str(i) for i in range(len(tensors))] if peers is None else list(peers)
    if len(owners) != len(tensors):
        raise ValueError(f"{len(owners)} peers for {len(tensors)} answers")
    reasons: list[str | None] = [None] * len(tensors)
    answered = [i for i, t in enumerate(tensors) if t is not None]
    scales: dict[int, float] = {}
    loudest_row: dict[int, float] = {}
    over: list[int] = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not t.is_floating_point():
            t = t.double()  # abs(-2**63) wraps to itself in int64
        if not bool(torch.isfinite(t).all()):
            reasons[i] = NON_FINITE
            continue
        scales[i], loudest_row[i] = _rms(t)
        if t.numel() and float(t.abs().max()) > checks.max_abs:
            over.append(i)
    loud: list[int] = []
    if len(scales) >= 3:
        # The typical scale of the answers within max_abs while they are at least half
        # (the others are suspect), else of all: a model that outgrew max_abs is judged
        # at its own scale.
        within = {i: s for i, s in scales.items() if i not in over}
        basis = within if 2 * len(within) >= len(scales) else scales
        limit = checks.max_ratio * max(_typical(basis, owners), _TINY)
        loud = [i for i in scales if loudest_row[i] > limit]  # never below its RMS
    for i in loud:
        reasons[i] = OUT_OF_RANGE

    non_finite = [i for i in answered if reasons[i] == NON_FINITE]
    outgrown = [i for i in over if i not in loud]
    diverging: str | None = None
    blamed: list[int] = []
    # One peer's answers say nothing about the model: a liar left alone in a round (its
    # honest peers busy) made one NaN answer "the model diverged", which stops training.
    several = len(_peers(answered, owners)) >= 2
    if several and _most(non_finite, answered, owners):
        diverging, blamed = NON_FINITE, non_finite
    if outgrown:
        grown = _most(outgrown, answered, owners)
        if grown and several and diverging is None:
            diverging, blamed = OUT_OF_RANGE, outgrown
        accept = (
            grown
            and reference is not None
            and _typical({i: scales[i] for i in outgrown}, owners)
            <= checks.max_growth * max(reference, _TINY)
        )
        if not accept:
            for i in outgrown:
                reasons[i] = OUT_OF_RANGE

    convicted = [False] * len(tensors)
    for failing, pool in ((non_finite, answered), (loud, list(scales))):
        if failing and _few(failing, pool, owners):
            for i in failing:
                convicted[i] = True
    accepted = {i: s for i, s in scales.items() if reasons[i] is None}
    return Verdict(
        reasons,
        convicted,
        diverging,
        tuple(blamed),
        _typical(accepted, owners) if accepted else None,
    )


def judge(tensors: Sequence[torch.Tensor | None], checks: OutputChecks) -> list[str | None]:
    """For each answer (None: no answer), why it is dropped, or None if accepted; every
    answer from a different peer, no earlier round (see ``judge_round``)."""
    return judge_round(tensors, checks).reasons


def agree(a: torch.Tensor, b: torch.Tensor, checks: OutputChecks) -> bool:
    """Whether two replicas' answers to the same input are close enough: the same
    direction (``min_cosine``) and about the same size (``max_spot_ratio``)."""
    a, b = a.float().flatten(), b.float().flatten()
    if a.shape != b.shape or not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return na == nb
    if max(na, nb) > checks.max_spot_ratio * min(na, nb):
        return False
    return float(a @ b) / (na * nb) >= checks.min_cosine


class Suspicion:
    """Who disagreed with whom in spot checks without a third replica to decide.

    Identities are free and any of them can disagree: the ``REMEMBERED`` peers that
    disagreed most recently are kept, with at most ``_KEPT_PER_PEER`` of the peers each
    disagreed with (two already make it the odd one out), each for ``MEMORY_S``.
    Remembered for good, the disagreements of weeks (replicas drift between averaging
    rounds; a replica back from a laptop's suspend is behind for a round) added up until
    an honest peer disagreed with two and was banned on its next one (an outside probe
    saw the up-to-date replica banned beside a stale one)."""

    REMEMBERED = 4096
    MEMORY_S = 1800.0
    _KEPT_PER_PEER = 8

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        # peer -> the peers it disagreed with, and when (the latest time)
        self._against: OrderedDict[str, dict[str, float]] = OrderedDict()
        self.disagreements: Counter[str] = Counter()
        self._clock = clock

    def __len__(self) -> int:
        return len(self._against)

    def record(self, a: str, b: str) -> list[str]:
        """Note that ``a`` and ``b`` disagreed; return the peers now judged the odd one
        out (each has disagreed with at least two different peers within ``MEMORY_S``)."""
        now = self._clock()
        for peer, other in ((a, b), (b, a)):
            against = {
                p: when
                for p, when in self._against.pop(peer, {}).items()
                if now - when < self.MEMORY_S
            }
            if other in against or len(against) < self._KEPT_PER_PEER:
                against[other] = now
            self.disagreements[peer] += 1
            for gone in remember(self._against, peer, against, self.REMEMBERED):
                self.disagreements.pop(gone, None)  # the oldest go, counts and all
        return [p for p in (a, b) if len(self._against.get(p, ())) >= 2]

    def forget(self, peer: str) -> None:
        self._against.pop(peer, None)
        self.disagreements.pop(peer, None)
        for others in self._against.values():
            others.pop(peer, None)
