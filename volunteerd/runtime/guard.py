"""RequestGuard: what an expert accepts from trainers, and whom it stops accepting.

Every trainer's gradients move weights that the whole swarm shares, so one faulty or
malicious trainer must not be able to wreck them. The guard sits between decoding and
the queue, and hears about every optimizer step that had to be undone:

* inputs and gradients with NaN or infinity are refused (``Rejected``), and so is any
  input value above ``max_input_abs`` or gradient value above ``max_gradient_abs``
  (1e6 each by default). These bounds hold from the first request: float32 squares
  overflow above 1.8e19, so one finite 3e38 (or a row of 1e20) used to make a layer
  norm's variance infinite and every weight NaN;
* each expert remembers the norms of the last ``window`` gradient rows it accepted
  (one row per sample), so that no one peer can steer them: a request adds at most
  ``window / 32`` of its rows (evenly spread over its sorted norms, its largest
  included), a peer holds at most ``window / 8`` (or ``warmup``) of them, its oldest
  making way, and every norm is forgotten after ``_HISTORY_S``. A "peer" here is the
  address its connection comes from (``Request.address``: an IPv4 address, an IPv6
  /64) where there is one, so that identities, which cost nothing, do not multiply a
  machine's share or its say in the threshold; the peer id over a relay or loopback.
  One request of 256 rows used to replace the whole window: rows of ±g (whose updates
  cancel, so nothing moved and nobody was banned) lowered the threshold until every
  honest backward was refused, for good, or raised it step by step. Once ``warmup``
  rows are known, a row whose norm is above both
  ``median + max_deviations * 1.4826 * MAD`` and the 99th percentile of those norms
  is an outlier: it is scaled down to that
  threshold ("clip", the default) or the request is refused ("reject"). A request whose
  largest row is ``reject_ratio`` times the threshold is refused either way: it is no
  accident;
* the runtime checks every optimizer step (``experts.stepcheck.StepCheck``) and refuses or
  undoes one that would make a weight or optimizer state non-finite or move the weights
  too far; it then asks ``step_undone`` whom to blame. Until an expert's guard has
  warmed up (``warmed_up``), its steps get the full check; after that the check's cheap
  prediction, with a full check every ``full_check_every`` steps. One step may join
  several trainers' requests (the batcher merges them, and backwards that finish before
  the step runs share it). A trainer that had the step to itself is blamed. Of several
  (judged by party: the address, as above), only the loudest few are: those above the
  first drop of more than ``blame_ratio`` (10) times from one largest gradient row norm
  to the next, going down from the loudest, when they are at most half (``blame``).
  The gradient is what moves the weights (the built-in experts normalise their inputs
  first), and a step that breaks with nobody standing out, or with most standing out,
  says more about the model (e.g. a learning rate too high) than about a peer: it is
  undone and counted, and no one is banned. Honest requests merged into an undone step lose
  their update.
* a blamed trainer is banned for ``ban_s`` (600 s): every later request of that peer,
  for any expert of this daemon, is refused with ``rejected`` before it is decoded
  further or queued.

What was refused, clipped, undone or banned is counted per peer and reason. The guard
runs on the event loop on CPU tensors; its cost is a max and a norm per row and a
median of ``window`` floats.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from volunteerd.config import GuardConfig
from volunteerd.errors import Rejected

__all__ = ["RequestGuard", "Sender"]

logger = logging.getLogger(__name__)

# The MAD of a normal distribution times this is its standard deviation.
_MAD_TO_SIGMA = 1.4826
# Bans remembered at most (each costs the attacker a request whose step was undone);
# beyond it the oldest are forgotten first.
_MAX_BANNED = 10_000
# (peer, reason) counts kept at most, the first counted forgotten first.
_MAX_COUNTED = 40_000
# A gradient norm is forgotten after this long: statistics that an attack skewed
# recover once it stops, and an expert idle for long warms up again.
_HISTORY_S = 600.0


class _History:
    """One expert's recent gradient row norms, each with its time and its peer, with a
    bounded share per request and per peer."""

    def __init__(self, window: int, warmup: int) -> None:
        self.window = window
        self.per_request = max(1, window // 32)
        self.per_peer = max(window // 8, warmup, self.per_request)
        self._entries: deque[tuple[float, str, float]] = deque()
        self._by_peer: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[float]:
        return [norm for _, _, norm in self._entries]

    def by_peer(self) -> dict[str, list[float]]:
        grouped: dict[str, list[float]] = {}
        for _, peer_id, norm in self._entries:
            grouped.setdefault(peer_id, []).append(norm)
        return grouped

    def expire(self, now: float) -> None:
        while self._entries and self._entries[0][0] <= now - _HISTORY_S:
            self._drop(0)

    def add(self, now: float, peer_id: str, norms: torch.Tensor) -> None:
        if not norms.numel():
            return
        ordered = norms.flatten().sort().values
        if ordered.numel() > self.per_request:
            picks = torch.linspace(0, ordered.numel() - 1, self.per_request).round().long()
            ordered = ordered[picks]
        for norm in ordered.tolist():
            self._entries.append((now, peer_id, norm))
            self._by_peer[peer_id] += 1
        while self._by_peer[peer_id] > self.per_peer:
            self._drop(next(i for i, e in enumerate(self._entries) if e[1] == peer_id))
        while len(self._entries) > self.window:
            self._drop(0)

    def _drop(self, index: int) -> None:
        _, peer_id, _ = self._entries[index]
        del self._entries[index]
        self._by_peer[peer_id] -= 1
        if not self._by_peer[peer_id]:
            del self._by_peer[peer_id]


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent gradients that went into an optimizer step, and how loud they were."""

    peer_id: str
    grad_norm: float  # the largest gradient row norm of the request, as applied
    # whom the device charges for the step (batching's party: the peer's address, or
    # its id without one); "" = the peer id
    party: str = ""


class RequestGuard:
    def __init__(self, config: GuardConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._norms: dict[str, _History] = {}
        # (peer id, reason) -> count; reasons: non_finite_input, input_out_of_range,
        # non_finite_gradient, gradient_out_of_range, outlier_gradient (refused),
        # clipped (accepted after scaling down), step_undone (blamed for an undone
        # step), banned (refused while banned)
        self.counts: Counter[tuple[str, str]] = Counter()
        # uid -> steps refused or undone, by reason (non_finite_gradients,
        # non_finite_weights, non_finite_optimizer_state, too_large_step)
        self.undone: Counter[tuple[str, str]] = Counter()
        # uid -> steps that left the weights broken although the check's bounds vouched
        # for them (the expert was restored from its checkpoint), by reason
        self.broken: Counter[tuple[str, str]] = Counter()
        self._banned: dict[str, tuple[float, str]] = {}  # peer -> (until, why)
        # Told (peer id, why) when a peer is banned (the daemon posts it as an event).
        self.on_ban: Callable[[str, str], object] | None = None
        self.accepted = 0

    def check_peer(self, uid: str, peer_id: str) -> None:
        """Refuse every request of a peer while it is banned."""
        entry = self._banned.get(peer_id)
        if entry is None:
            return
        until, why = entry
        left = until - self._clock()
        if left <= 0:
            del self._banned[peer_id]
            return
        self._count(peer_id, "banned")
        raise Rejected(f"{uid}: requests from this peer are refused for {left:.0f} s: {why}")

    def check_inputs(self, uid: str, peer_id: str, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse inputs that are not all finite or hold a value above the bound."""
        top = _largest(tensors)
        if top != top or top == float("inf"):
            self._refuse(uid, peer_id, "non_finite_input", "inputs are not all finite")
        if top > self.config.max_input_abs:
            self._refuse(
                uid,
                peer_id,
                "input_out_of_range",
                f"an input value of {top:.3g} is above the bound of "
                f"{self.config.max_input_abs:.3g}",
            )

    def filter_gradients(
        self,
        uid: str,
        peer_id: str,
        grads: Sequence[torch.Tensor],
        *,
        source: str | None = None,
    ) -> tuple[list[torch.Tensor], float]:
        """The gradients to apply, refused (``Rejected``) or with outlier rows clipped,
        and the largest row norm among them (for ``step_undone``'s blame). Their norms
        are remembered under ``source`` (the peer's address, which all identities of one
        machine share), or under ``peer_id`` when there is none."""
        out, loudest, _ = self.clip_gradients(uid, peer_id, grads, source=source)
        return out, loudest

    def clip_gradients(
        self,
        uid: str,
        peer_id: str,
        grads: Sequence[torch.Tensor],
        *,
        source: str | None = None,
    ) -> tuple[list[torch.Tensor], float, torch.Tensor | None]:
        """``filter_gradients``, and the factor each row was multiplied by (None when no
        row was clipped): the input gradients computed from clipped rows are divided by
        it before they go back (``unclipped``), since clipping guards the expert's
        weights, not the caller's own gradients."""
        top_value = _largest(grads)
        if top_value != top_value or top_value == float("inf"):
            self._refuse(uid, peer_id, "non_finite_gradient", "gradients are not all finite")
        norms = _row_norms(grads)
        history = self._history(uid)
        threshold = self.threshold(uid)
        out = list(grads)
        clipped: torch.Tensor | None = None
        if threshold is not None and norms.numel() and float(norms.max()) > threshold:
            top = float(norms.max())
            if self.config.outliers == "reject" or top > self.config.reject_ratio * threshold:
                self._refuse(
                    uid,
                    peer_id,
                    "outlier_gradient",
                    f"gradient norm {top:.3g} is far above what this expert gets "
                    f"(threshold {threshold:.3g})",
                )
            scale = (threshold / norms.clamp_min(1e-30)).clamp(max=1.0)
            out = [(g.float() * scale.view(-1, *[1] * (g.dim() - 1))).to(g.dtype) for g in grads]
            norms = norms * scale
            clipped = scale
            top_value = _largest(out)
            self._count(peer_id, "clipped")
        # Checked on what would be applied: clipping may have brought a row under it.
        if top_value > self.config.max_gradient_abs:
            self._refuse(
                uid,
                peer_id,
                "gradient_out_of_range",
                f"a gradient value of {top_value:.3g} is above the bound of "
                f"{self.config.max_gradient_abs:.3g}",
            )
        # A row of zeros says nothing about this expert's gradients (a masked sample, or
        # a peer pulling the median down for free): it is not remembered.
        history.add(self._clock(), source or peer_id, norms[norms > 0])
        self.accepted += 1
        return out, float(norms.max()) if norms.numel() else 0.0, clipped

    @staticmethod
    def unclipped(
        input_grads: Sequence[torch.Tensor], scale: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """The input gradients of rows clipped by ``scale`` (``clip_gradients``) as the
        caller's own output gradients make them. Each sample's input gradient is linear
        in that sample's output gradient (the experts treat samples apart), so dividing
        its rows undoes the clipping exactly; a scale is at least 1 / reject_ratio, so
        nothing is blown up. The trainer's gradients were silently those of the clipped
        rows: 17.6 % off for the layer's input in an outside audit."""
        if scale is None:
            return list(input_grads)
        return [
            (g.float() / scale.to(g.device).view(-1, *[1] * (g.dim() - 1))).to(g.dtype)
            for g in input_grads
        ]

    def threshold(self, uid: str) -> float | None:
        """The largest row norm accepted as is, or None while warming up."""
        history = self._history(uid)
        if len(history) < self.config.warmup:
            return None
        values = torch.tensor(history.values(), dtype=torch.float64)
        median = float(values.median())
        mad = float((values - median).abs().median())
        spread = max(mad * _MAD_TO_SIGMA, 1e-3 * median, 1e-12)
        # Honest row norms are heavy-tailed (a token's gradient scales with its gate
        # weight, and many weights are tiny), so the median and MAD alone can sit far
        # below rows that are perfectly normal: never judge below the 99th percentile
        # of what was accepted. Of each peer's, the median: a peer's own rows hold up
        # to an eighth of the window, so the 99th percentile of all of them would be
        # whatever the loudest peer chose. The upper median of an even count: with one
        # honest trainer and one stranger whispering tiny rows, the lower one was the
        # stranger's, and the honest trainer's next rows were refused. (A loud peer
        # gains nothing from it: its rows were clipped to the threshold already.)
        highs = sorted(
            float(torch.quantile(torch.tensor(norms, dtype=torch.float64), 0.99))
            for norms in history.by_peer().values()
        )
        high = highs[len(highs) // 2]
        return max(median + self.config.max_deviations * spread, high)

    def warmed_up(self, uid: str) -> bool:
        """Whether ``uid``'s gradient statistics are judged yet (``warmup`` rows)."""
        return len(self._history(uid)) >= self.config.warmup

    def _history(self, uid: str) -> _History:
        """``uid``'s norms of the last ``_HISTORY_S``."""
        history = self._norms.get(uid)
        if history is None:
            history = self._norms[uid] = _History(self.config.window, self.config.warmup)
        history.expire(self._clock())
        return history

    def step_broken(self, uid: str, reason: str) -> None:
        """Count a step of ``uid`` that broke its weights and could not be undone. Nobody
        is banned: the step's bounds held, so no peer's gradients can be blamed."""
        self.broken[(uid, reason)] += 1

    def blame(self, senders: Sequence[Sender]) -> list[str]:
        """The peers to blame for an undone step that joined ``senders``' requests.

        Parties (``Sender.party``: an address, where a peer has one) are judged, not
        identities, which are free: the only party; else, going down from the loudest
        party's largest row norm, those above the first drop of more than
        ``blame_ratio`` times to the next, when they are at most half of the parties.
        None when nobody stands out or most do (the expert diverging, not a peer). A
        rule against the median of the others let quiet extra senders (near-zero
        gradients from identities made for it) drag that median down until an honest
        trainer beside a loud attacker stood out too. Every peer id of a blamed party
        is returned."""
        loudest: dict[str, float] = {}
        members: dict[str, set[str]] = {}
        for sender in senders:
            if sender.peer_id:  # "" is a local caller, not a peer
                party = sender.party or sender.peer_id
                loudest[party] = max(loudest.get(party, 0.0), sender.grad_norm)
                members.setdefault(party, set()).add(sender.peer_id)
        blamed: list[str] = list(loudest) if len(loudest) <= 1 else []
        if len(loudest) > 1:
            ranked = sorted(loudest, key=loudest.__getitem__, reverse=True)
            ratio = self.config.blame_ratio
            for i in range(len(ranked) - 1):
                if loudest[ranked[i]] > ratio * loudest[ranked[i + 1]]:
                    if 2 * (i + 1) <= len(ranked):
                        blamed = ranked[: i + 1]
                    break
        return sorted({peer for party in blamed for peer in members[party]})

    def step_undone(self, uid: str, reason: str, senders: Sequence[Sender]) -> list[str]:
        """Count an undone step of ``uid`` and ban the peers to blame; returns them."""
        self.undone[(uid, reason)] += 1
        blamed = self.blame(senders)
        for peer in blamed:
            self._count(peer, "step_undone")
            self.ban(peer, f"a step of {uid} with its gradients was undone ({reason})")
        peers = len({s.peer_id for s in senders})
        if blamed:
            logger.warning(
                "undid a step of %s (%s); banned %s for %.0f s",
                uid,
                reason,
                ", ".join(f"…{p[-8:]}" for p in blamed),
                self.config.ban_s,
            )
        else:
            logger.warning(
                "undid a step of %s (%s) from %d peers, none of whom stands out: the "
                "expert may be diverging (learning rate too high?)",
                uid,
                reason,
                peers,
            )
        return blamed

    def ban(self, peer_id: str, why: str) -> None:
        """Refuse ``peer_id``'s requests for ``ban_s``."""
        if self.config.ban_s <= 0 or not peer_id:
            return
        now = self._clock()
        self._banned.pop(peer_id, None)  # re-inserted last: the newest ban
        self._banned[peer_id] = (now + self.config.ban_s, why)
        if len(self._banned) > _MAX_BANNED:
            for peer in [p for p, (until, _) in self._banned.items() if until <= now]:
                del self._banned[peer]
            while len(self._banned) > _MAX_BANNED:
                del self._banned[next(iter(self._banned))]
        if self.on_ban is not None:
            self.on_ban(peer_id, why)

    def banned(self) -> dict[str, float]:
        """Peers banned now, with the seconds left."""
        now = self._clock()
        return {p: until - now for p, (until, _) in self._banned.items() if until > now}

    def by_peer(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (peer, reason), count in self.counts.items():
            out.setdefault(peer, {})[reason] = count
        return out

    def _count(self, peer_id: str, reason: str) -> None:
        """Count ``reason`` for ``peer_id``; the peers first counted longest ago are
        forgotten beyond ``_MAX_COUNTED`` entries (each stranger refused once added
        one, for good)."""
        self.counts[(peer_id, reason)] += 1
        while len(self.counts) > _MAX_COUNTED:
            del self.counts[next(iter(self.counts))]

    def _refuse(self, uid: str, peer_id: str, reason: str, message: str) -> None:
        self._count(peer_id, reason)
        logger.info("refused a request for %s from …%s: %s", uid, peer_id[-8:], message)
        raise Rejected(f"{uid}: {message}")


def _largest(tensors: Sequence[torch.Tensor]) -> float:
    """The largest |value| of the floating-point tensors: NaN if any is NaN, inf if any
    is infinite (one pass over each tensor: ``aminmax``, which keeps a NaN; the infinity
    norm read the same values ~10 times slower on a CPU, 0.9 ms for 2 MiB)."""
    top = 0.0
    for t in tensors:
        if t.is_floating_point() and t.numel():
            low, high = (float(x) for x in torch.aminmax(t))
            if high != high:
                return high
            top = max(top, high, -low)
    return top


def _row_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One norm per sample over all gradient tensors."""
    squares = [g.float().reshape(g.shape[0], -1).square().sum(dim=1) for g in grads if g.dim()]
    if not squares:
        return torch.zeros(0)
    return torch.stack(squares).sum(dim=0).sqrt()
