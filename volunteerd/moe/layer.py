"""Decentralized Mixture-of-Experts: a layer whose experts are found in the DHT.

Shape legend: N tokens (the input's leading dimensions flattened), H features, K slots
(the ``k_best`` experts a token is sent to), D grid dimensions.

``MixtureOfExperts`` holds what both variants share: the gating layer (one linear map
scoring every grid dimension; an expert's score is the sum of its per-dimension scores),
the beam search over alive experts, and the mixing (a softmax over the experts that
answered, renormalised). ``RemoteMixtureOfExperts`` calls the experts over libp2p;
``LocalMixtureOfExperts`` runs the same experts as ordinary local modules (a baseline,
and the reference the remote layer is tested against).
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from volunteerd import uids
from volunteerd.errors import (
    ModelDiverging,
    NoExpertsAvailable,
    PeerError,
    PeerUnreachable,
    Rejected,
    RemoteError,
    RequestTimeout,
    VolunteerdError,
)
from volunteerd.experts import TORCH_DTYPES, from_wire, to_wire
from volunteerd.moe.checks import (
    BAD_SHAPE,
    NON_FINITE,
    OUT_OF_RANGE,
    OutputChecks,
    Suspicion,
    Verdict,
    agree,
    judge_round,
)
from volunteerd.moe.client import TrainerClient
from volunteerd.moe.directory import BAN_GROWTH_MAX, SLOW_BAN_GROWTH_MAX
from volunteerd.moe.dispatch import Call, Outcome, call_many
from volunteerd.moe.routing import Route, beam_search
from volunteerd.moe.timing import REPLY_WINDOW_S, Limits, RoundTrips
from volunteerd.net import PeerAddress, Verb, short
from volunteerd.wire import BackwardRequest, Compression, ForwardRequest, on_wire

__all__ = [
    "LocalMixtureOfExperts",
    "MixtureOfExperts",
    "MoEStats",
    "RemoteMixtureOfExperts",
    "grid_uids",
]

logger = logging.getLogger(__name__)

# Masked-out scores: finite, so a token no expert answered mixes zeros without NaNs.
_MASKED = -1e9
# A diverging model fails every round: say so at most this often per layer and check.
_WARN_EVERY_S = 60.0
# A layer that finds no expert alive looks the DHT up this many times, this far apart,
# before NoExpertsAvailable: one lookup on a loaded machine may reach too few nodes.
_LOOKUPS_AGAIN = 3
_LOOK_AGAIN_AFTER_S = 1.0
# A peer cut off late in LATE_WINDOW_BAN of its last LATE_STREAK_BAN rounds is banned:
# an honest peer slower than its round-mates still answers on time now and then (and a
# ban ends); one that answers info and stalls every call does not, nor does one on time
# once in 8 rounds to break a streak (never banned, it made steps ~10x slower: 0.48 s vs
# 0.05 s, one replica of 3). A peer banned so (or for "later" refusals) that answered
# on time in fewer than LATE_STREAK_BAN rounds since its last such ban has not shown it
# recovered: its bans grow (a black hole was banned ban_s each time: 57 bans an hour).
LATE_STREAK_BAN = 8
LATE_WINDOW_BAN = 6
# A replica late in this many of the layer's last _LATE_AGE_ROUNDS rounds or more is
# called only when no replica of the expert less often late is left this round (fewest
# first): one late 7 rounds of every 8 made steps ~3x slower between its bans (0.15 s vs
# 0.05 s, one replica of 3), chosen as often as the others. Counted in the layer's
# rounds, not the replica's own: those move only when it is called, and an honest
# replica late twice (a hiccup) was never called again, the load all on one replica.
# Each more late round among its own last LATE_STREAK_BAN quadruples the rounds looked
# back, to _LATE_AGE_ROUNDS << _LATE_AGE_SHIFT_MAX: one late 7 of 8, late again each time
# it is called, stays last longer each time (back after 32 rounds each time, it made
# steps 0.060 s against 0.048 s).
_OFTEN_LATE = 2
_LATE_AGE_ROUNDS = 32
_LATE_AGE_SHIFT_MAX = 8
_MAX_LATE_PEERS = 4096
# Rounds in a row in which one peer refused every call it got (busy, paused, rejected,
# ...: ``_REFUSALS``), no answer from it in between, before it is banned: a loaded server
# answers now and then; one that announces experts and refuses every call holds their
# places in the grid for nothing (and each refusal costs the rows a round).
REFUSAL_STREAK_BAN = 8
# Typed refusals from a live server: loaded, forgetful, or refusing what we sent (too
# big, too often, values it will not train on) — the request's fault, not the peer's.
_NOT_BANNED = frozenset(
    {"busy", "expired", "shutting_down", "paused", "rejected", "too_large", "rate_limited"}
)
# ... of which these refuse the call itself (``expired`` only sends a backward stateless).
_REFUSALS = _NOT_BANNED - {"expired"}
# ... of which these say "not now" (as does any refusal with a ``retry_after_s``): a
# streak of them only, like a streak of late rounds, bans for ``ban_s`` every time,
# never growing (a volunteer paused, over its quota or loaded is back later; grown,
# its bans kept it unused 15-25 min after it was, in a 45-minute soak).
_LATER = frozenset({"busy", "paused", "rate_limited", "shutting_down"})


def grid_uids(name: str, grid_size: Sequence[int]) -> list[str]:
    """Every uid of the grid ``name.[0:g0].[0:g1]...``."""
    return uids.expand_pattern(name + "".join(f".[0:{g}]" for g in grid_size))


@dataclass(slots=True)
class MoEStats:
    """What a layer's calls did, cumulatively. ``by_uid[uid] = [ok, failed, samples]``."""

    forward_ok: int = 0
    forward_failed: int = 0
    backward_ok: int = 0
    backward_failed: int = 0
    late: int = 0  # cut off by the k_min rule: slower than the others, not failed
    backtracked: int = 0
    failovers: int = 0  # calls resent to another replica of the same expert
    spot_checks: int = 0
    disagreements: int = 0
    # answers dropped by the output checks, by reason (non_finite, out_of_range, ...)
    rejected: Counter[str] = field(default_factory=Counter)
    # rounds in which most answers (from most peers) failed a check, by check: the
    # model diverging, not its peers; nobody was banned for them
    diverging: Counter[str] = field(default_factory=Counter)
    # bans not made because the peer was the last one the step could still use
    bans_held_back: int = 0
    # routes that found no expert alive in the cache and looked the DHT up again
    lookups_again: int = 0
    # calls that got no answer, by error code: the peer's (busy, rejected, internal, ...)
    # or this side's (unreachable, timeout, broken: its stream closed mid-call, ...)
    failures: Counter[str] = field(default_factory=Counter)
    unanswered_tokens: int = 0
    by_uid: dict[str, list[int]] = field(default_factory=dict)

    def count(self, uid: str, ok: bool, samples: int) -> None:
        entry = self.by_uid.setdefault(uid, [0, 0, 0])
        entry[0 if ok else 1] += 1
        if ok:
            entry[2] += samples

    @property
    def calls(self) -> int:
        return self.forward_ok + self.forward_failed + self.backward_ok + self.backward_failed

    @property
    def failed(self) -> int:
        return self.forward_failed + self.backward_failed


class MixtureOfExperts(nn.Module):
    """Gating, routing and mixing. Subclasses say which experts are alive and apply them."""

    def __init__(
        self,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        k_best: int,
        *,
        beam_size: int | None = None,
        spare: int = 0,
    ) -> None:
        super().__init__()
        name = uid_prefix.rstrip(".")
        if not uids.is_valid_key(name + ".") or not grid_size or len(grid_size) > uids.MAX_DIMS:
            raise ValueError(f"bad expert grid {uid_prefix!r} {tuple(grid_size)}")
        if k_best < 1:
            raise ValueError("k_best must be at least 1")
        self.name = name
        self.grid_size = tuple(grid_size)
        self.k_best = k_best
        self.beam_size = beam_size or k_best
        self.spare = spare
        self.in_features = in_features
        self.gate = nn.Linear(in_features, sum(self.grid_size))

    def all_uids(self) -> list[str]:
        return grid_uids(self.name, self.grid_size)

    def alive_children(self, prefixes: list[str]) -> dict[str, dict[int, list[Any]]]:
        raise NotImplementedError

    def apply_experts(
        self, x_NH: torch.Tensor, route: Route
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Outputs [N, K, H], which slots answered [N, K], and the experts' coordinates
        [N, K, D] (they may differ from the route's first choices after backtracking)."""
        raise NotImplementedError

    def route(self, logits: Sequence[torch.Tensor]) -> Route:
        return self._search(logits, self.alive_children)

    def _search(
        self,
        logits: Sequence[torch.Tensor],
        children: Callable[[list[str]], dict[str, dict[int, list[Any]]]],
    ) -> Route:
        route = beam_search(
            logits,
            self.name,
            children,
            beam_size=max(self.beam_size, self.k_best + self.spare),
            k=self.k_best + self.spare,
        )
        if not bool(route.valid_NK.any()):
            raise NoExpertsAvailable(
                f"no alive experts under {self.name}. (grid {self.grid_size}): is the swarm "
                "reachable, and does it host this layer?"
            )
        return route

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_NH = x.reshape(-1, shape[-1])
        logits_NG = self.gate(x_NH).float()
        self._check_finite(x_NH, logits_NG)
        logits = list(logits_NG.split(self.grid_size, dim=1))
        route = self.route(logits)
        out_NKH, answered_NK, coords_NKD = self.apply_experts(x_NH, route)
        scores_NK = torch.stack(
            [logits[d].gather(1, coords_NKD[:, :, d]) for d in range(len(self.grid_size))]
        ).sum(dim=0)
        weights_NK = torch.softmax(scores_NK.masked_fill(~answered_NK, _MASKED), dim=1)
        y_NH = (weights_NK.to(out_NKH.dtype)[..., None] * out_NKH).sum(dim=1)
        return y_NH.reshape(*shape[:-1], y_NH.shape[-1])

    def _check_finite(self, x_NH: torch.Tensor, logits_NG: torch.Tensor) -> None:
        """Raises ModelDiverging when the layer's input or its gate's scores are not
        finite: they come from the trainer's own weights (experts' answers that are not
        finite never get through the output checks). The beam search took NaN scores for
        experts not alive, so such a trainer blamed the swarm ("no alive experts ... is
        the swarm reachable?"), looking the experts up again for seconds each step."""
        for what, tensor in (("its input is", x_NH), ("its gate's scores are", logits_NG)):
            if not bool(torch.isfinite(tensor).all()):
                raise ModelDiverging(
                    f"{self.name}: {what} not finite: the trainer's own weights are not "
                    "finite: it diverged; lower training.lr (or your optimizer's learning "
                    "rate) and start again"
                )


class LocalMixtureOfExperts(MixtureOfExperts):
    """The same mixture with its experts as local modules: all alive, called directly."""

    def __init__(
        self,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        k_best: int,
        experts: dict[str, nn.Module],
        *,
        beam_size: int | None = None,
    ) -> None:
        super().__init__(in_features, grid_size, uid_prefix, k_best, beam_size=beam_size)
        missing = set(self.all_uids()) - set(experts)
        if missing:
            raise ValueError(f"no module for experts {sorted(missing)[:5]}")
        # ModuleDict keys may not contain dots.
        self.experts = nn.ModuleDict({uid.replace(".", "_"): m for uid, m in experts.items()})

    def expert(self, uid: str) -> nn.Module:
        return self.experts[uid.replace(".", "_")]

    def alive_children(self, prefixes: list[str]) -> dict[str, dict[int, list[Any]]]:
        out: dict[str, dict[int, list[Any]]] = {}
        for prefix in prefixes:
            depth = prefix.count(".") - 1
            out[prefix] = {c: ["local"] for c in range(self.grid_size[depth])}
        return out

    def apply_experts(
        self, x_NH: torch.Tensor, route: Route
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        N, K = x_NH.shape[0], self.k_best
        pieces = [
            (rows, ks, self.expert(uid)(x_NH[rows])) for uid, (rows, ks) in _group(route, K).items()
        ]
        out_NKH = x_NH.new_zeros(N, K, pieces[0][2].shape[-1])
        for rows, ks, y_RH in pieces:
            out_NKH = out_NKH.index_put((rows, ks), y_RH)
        return out_NKH, route.valid_NK[:, :K], route.coords_NKD[:, :K]


def _group(route: Route, K: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """uid -> (rows, slots) of the first K choices, all samples routed to it together."""
    rows_by_uid: dict[str, tuple[list[int], list[int]]] = {}
    for n, k in route.valid_NK[:, :K].nonzero().tolist():
        rows, ks = rows_by_uid.setdefault(route.uid(n, k), ([], []))
        rows.append(n)
        ks.append(k)
    return {
        uid: (torch.tensor(rows, dtype=torch.long), torch.tensor(ks, dtype=torch.long))
        for uid, (rows, ks) in rows_by_uid.items()
    }


class RemoteMixtureOfExperts(MixtureOfExperts):
    """A mixture of experts hosted by volunteers, found through the DHT.

    Every token goes to its ``k_best`` best alive experts; all tokens routed to one
    expert travel in one request, and the requests go out concurrently. The forward
    waits until every token has ``k_min`` answers, then ``grace_after_k_min_s`` more, and
    at most ``forward_timeout_s``; the softmax is renormalised over the experts that
    answered. Tokens whose chosen experts all failed are sent to their next best ones
    (up to ``spare`` further candidates); a token nobody answers contributes zeros, and
    if no token at all gets an answer the layer raises ``NoExpertsAvailable`` (or
    ``ModelDiverging`` when answers came but the output checks refused them without
    blaming any peer, from at least two peers: one peer's answers say nothing about the
    model). Backward sends gradients only to experts that answered, under the
    same rule (``backward_timeout_s``); missing gradients count as zero.

    Peers that fail a call are not chosen again for the client's ``ban_s``; peers that
    fail the output checks (``checks``) while their peers pass, for ``checks.ban_s``.
    A round that most peers fail is the model's fault: it is counted in
    ``stats.diverging`` and logged as a warning, and nobody is banned. The layer never
    bans the last peer a step could still use (``stats.bans_held_back``).
    """

    def __init__(
        self,
        in_features: int,
        grid_size: Sequence[int],
        uid_prefix: str,
        k_best: int,
        k_min: int = 1,
        forward_timeout_s: float = 10.0,
        backward_timeout_s: float = 20.0,
        grace_after_k_min_s: float = 0.5,
        *,
        client: TrainerClient,
        compression: Compression = "none",
        beam_size: int | None = None,
        spare: int | None = None,
        checks: OutputChecks | None = None,
    ) -> None:
        super().__init__(
            in_features,
            grid_size,
            uid_prefix,
            k_best,
            beam_size=beam_size,
            spare=k_best if spare is None else spare,
        )
        if not 1 <= k_min <= k_best:
            raise ValueError("k_min must be between 1 and k_best")
        for name, seconds in (
            ("forward_timeout_s", forward_timeout_s),
            ("backward_timeout_s", backward_timeout_s),
        ):
            if not 0 < seconds <= REPLY_WINDOW_S:
                raise ValueError(
                    f"{name} must be over 0 and at most {REPLY_WINDOW_S:g} s (servers send "
                    f"no reply later than that after a request), not {seconds}"
                )
        self.k_min = k_min
        self.forward_timeout_s = forward_timeout_s
        self.backward_timeout_s = backward_timeout_s
        self.grace_after_k_min_s = grace_after_k_min_s
        self.compression: Compression = compression
        # what an answer decodes to: the wire dtype of float32 under the compression
        # (q8 is dequantized to float32)
        wire = on_wire("float32", compression)
        self._answer_dtype = torch.float32 if wire == "q8" else TORCH_DTYPES[wire]
        self.client = client
        self.checks = checks or OutputChecks()
        self.suspicion = Suspicion()
        self.stats = MoEStats()
        # typical RMS of the last accepted round, per verb (see checks.judge_round)
        self._scale: dict[Verb, float] = {}
        self._warned_at: dict[str, float] = {}
        # measured call durations per peer: the rounds' timeouts and grace follow them
        self.round_trips = RoundTrips()
        # peer -> its last rounds, late (1) or on time (0), as bits behind a leading 1;
        # only peers with a late round among them (``_late_window``)
        self._late_rounds: dict[str, int] = {}
        # rounds this layer judged (``_accept``), and peer -> the numbers of its last
        # LATE_STREAK_BAN late rounds among them (``_lateness``)
        self._round = 0
        self._late_at: dict[str, list[int]] = {}
        # peer -> rounds in which it answered since its last ban for being late or
        # "later", while fewer than LATE_STREAK_BAN (then forgotten: it recovered)
        self._answers_since_ban: dict[str, int] = {}
        # peer -> rounds in a row it refused, with no answer from it in between
        self._refusal_streak: dict[str, int] = {}
        # peers whose refusal streak holds a refusal that is not "later" (``_LATER``)
        self._firm_refusals: set[str] = set()
        # Makes autograd call our backward even when the inputs need no gradient.
        self._dummy = torch.empty(0, requires_grad=True)

    def replica(self) -> RemoteMixtureOfExperts:
        """The same layer for another thread of the same trainer: its own gate (a copy
        of this one's weights) and its own ``stats``, the same client, checks,
        suspicions and round-trip estimates. Several batches in flight each run through
        a replica, so no two threads share a parameter or a counter."""
        twin = RemoteMixtureOfExperts(
            self.in_features,
            self.grid_size,
            self.name,
            self.k_best,
            self.k_min,
            self.forward_timeout_s,
            self.backward_timeout_s,
            self.grace_after_k_min_s,
            client=self.client,
            compression=self.compression,
            beam_size=self.beam_size,
            spare=self.spare,
            checks=self.checks,
        )
        twin.load_state_dict(self.state_dict())
        twin.suspicion = self.suspicion
        twin.round_trips = self.round_trips
        twin._scale = self._scale
        twin._warned_at = self._warned_at
        return twin

    def alive_children(self, prefixes: list[str]) -> dict[str, dict[int, list[Any]]]:
        return dict(self.client.children(prefixes))  # type: ignore[arg-type]

    def route(self, logits: Sequence[torch.Tensor]) -> Route:
        """The beam search over what the directory knows; when it finds no expert alive,
        once more over a fresh DHT lookup of every prefix it asked for. A lookup that
        reached too few storing nodes can list only a banned peer for a prefix, and a
        layer must not give up on a swarm that is there."""
        asked: list[str] = []

        def remember(prefixes: list[str]) -> dict[str, dict[int, list[Any]]]:
            asked.extend(prefixes)
            return self.alive_children(prefixes)

        try:
            return self._search(logits, remember)
        except NoExpertsAvailable:
            pass
        for _ in range(_LOOKUPS_AGAIN - 1):
            self.stats.lookups_again += 1
            self.client.look_again(asked)
            try:
                return super().route(logits)
            except NoExpertsAvailable:
                time.sleep(_LOOK_AGAIN_AFTER_S)  # a loaded machine's lookups catch up
        self.stats.lookups_again += 1
        self.client.look_again(asked)
        return super().route(logits)

    def apply_experts(
        self, x_NH: torch.Tensor, route: Route
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out_NKH, answered_NK, coords_NKD = _RemoteExperts.apply(
            self._dummy, self, route, torch.is_grad_enabled(), x_NH
        )
        return out_NKH, answered_NK, coords_NKD

    # -- calls (run in the torch thread; the network part runs on the client's loop) ---

    def _encode(self, tensors: Sequence[torch.Tensor]) -> tuple[list[Any], list[bytes]]:
        try:
            encoded = [to_wire(t.float(), self.compression) for t in tensors]
        except Rejected as exc:
            # q8 cannot carry NaN or infinity; the other encodings would send them to be
            # refused by every server. Either way the trainer's own model has diverged.
            raise ModelDiverging(
                f"{self.name}: the trainer's own activations or gradients are not "
                f"finite ({exc}); lower the learning rate or restart from a checkpoint"
            ) from exc
        return [m for m, _ in encoded], [b for _, b in encoded]

    def limits(self, verb: Verb, peer_ids: Iterable[str]) -> Limits:
        """The timeout and k_min grace of a round calling ``peer_ids`` now: the
        configured ones, stretched to the measured round trips (moe/timing.py)."""
        floor = self.forward_timeout_s if verb == Verb.FORWARD else self.backward_timeout_s
        return self.round_trips.limits(peer_ids, verb.value, floor, self.grace_after_k_min_s)

    def _run_calls(self, verb: Verb, calls: list[Call], n_rows: int) -> list[Outcome]:
        """``call_many`` on the client's loop under ``limits``; the answers then update
        the round-trip estimates (on the loop too: one thread touches them)."""

        async def run() -> list[Outcome]:
            limits = self.limits(verb, (c.peer.peer_id for c in calls))
            outcomes = await call_many(
                self.client.rpc,
                verb,
                calls,
                n_rows=n_rows,
                k_min=self.k_min,
                timeout_s=limits.timeout_s,
                grace_s=limits.grace_s,
            )
            for call, outcome in zip(calls, outcomes, strict=True):
                if outcome.ok:
                    self.round_trips.observe(call.peer.peer_id, verb.value, outcome.seconds)
            self._answered([c.peer.peer_id for c, o in zip(calls, outcomes, strict=True) if o.ok])
            return outcomes

        return self.client.run(run)

    def _answered(self, peer_ids: Sequence[str]) -> None:
        """A round's answers (one per call answered): each peer that answered, once a
        round however many of its calls answered, ends its refusal streak, has a round
        on time and one more toward showing it recovered from a ban for being slow or
        loaded (counted per call, a slow peer serving 4 of a step's calls recovered
        after 2 rounds on time, not LATE_STREAK_BAN)."""
        for peer_id in dict.fromkeys(peer_ids):
            count = self._answers_since_ban.pop(peer_id, None)
            if count is not None and count + 1 < LATE_STREAK_BAN:
                self._answers_since_ban[peer_id] = count + 1  # re-inserted last: newest
            self._refusal_streak.pop(peer_id, None)
            self._firm_refusals.discard(peer_id)
            _late_window(self._late_rounds, peer_id, late=False)

    def _slow_ban(self, peer_id: str, why: str, usable: set[str], *, firm: bool = False) -> bool:
        """Ban ``peer_id`` for being late or refusing "later" round after round: for
        ``ban_s`` when it showed it recovered since its last such ban (answers in
        LATE_STREAK_BAN rounds), else growing to SLOW_BAN_GROWTH_MAX times, and as any
        offence's when ``firm`` (a refusal that was not "later")."""
        recovered = peer_id not in self._answers_since_ban
        most = BAN_GROWTH_MAX if firm else SLOW_BAN_GROWTH_MAX
        if not self._ban(peer_id, why, None, usable, grow=firm or not recovered, most=most):
            return False
        self._answers_since_ban.pop(peer_id, None)
        self._answers_since_ban[peer_id] = 0
        if len(self._answers_since_ban) > _MAX_LATE_PEERS:  # forgotten: taken as recovered
            del self._answers_since_ban[next(iter(self._answers_since_ban))]
        return True

    def _ban(
        self,
        peer_id: str,
        reason: str,
        seconds: float | None,
        usable: set[str],
        *,
        grow: bool = True,
        most: int = BAN_GROWTH_MAX,
    ) -> bool:
        """Ban ``peer_id`` unless no other peer in ``usable`` (those the step could use)
        is left unbanned: a layer that bans its last peer cannot train at all, and
        whatever fails every peer is more likely the trainer's side. Returns whether
        the peer is banned. Not ``grow``: never longer than ``seconds`` (slow or loaded,
        not lying: ExpertDirectory.ban)."""
        directory = self.client.directory
        if not any(p != peer_id and not directory.is_banned(p) for p in usable):
            self.stats.bans_held_back += 1
            logger.warning(
                "%s: not banning %s (%s): no other peer of this step is left",
                self.name, short(peer_id), reason,
            )  # fmt: skip
            return False
        self.client.ban(peer_id, reason, seconds, grow=grow, most=most)
        return True

    def _note_failure(self, call: Call, outcome: Outcome, usable: set[str]) -> None:
        """Count a call that did not answer; ban its peer unless it was merely slow or
        loaded."""
        if outcome.late:
            self.stats.late += 1
            return
        error = outcome.error
        code = error.code if isinstance(error, VolunteerdError) else type(error).__name__
        self.stats.failures[code] += 1
        if isinstance(error, RemoteError):
            if error.code in _NOT_BANNED:
                # alive, just loaded (or forgetful, or refusing what we sent): choose it
                # again later
                return
            if error.code == "unknown_expert":
                # It does not host that expert (any more: a volunteer that re-balanced
                # onto others, its new records on the way): not chosen for it for a
                # while, its other experts still are (ExpertDirectory.expert_gone).
                self._expert_gone(call.peer.peer_id, call.uid, f"{error}")
                return
            reason = error.code
        elif isinstance(error, RequestTimeout):
            reason = "timeout"
        elif isinstance(error, PeerUnreachable):
            reason = "unreachable"
        else:
            reason = "failed"
        why = f"{reason}: {call.uid}: {error}"
        through_relay = isinstance(error, PeerUnreachable) or type(error) is PeerError
        # no circuit opened: every one was tried (a stalled dial or a broken stream was
        # one relay's, and the next call tries the peer's other relay first)
        every_circuit = type(error) is PeerUnreachable
        if through_relay and self._relay_failed(call.peer, why, every_circuit):
            # No way through its relays, or a connection through one that broke: the
            # relay's failure, not the peer's. Banned for it, an honest volunteer lost
            # a minute of steps each time its relay restarted, then twice that...
            return
        fresh = not self.client.directory.is_banned(call.peer.peer_id)  # not this round's
        if self._ban(call.peer.peer_id, why, None, usable) and reason == "timeout" and fresh:
            # The round's own timeout cut the call off, not the RPC client's deadline,
            # whose rule for silent connections then never saw it: a connection whose
            # other end was gone (the volunteer got a new address) was taken again when
            # the ban ended, and the peer banned for twice as long (an outside probe:
            # 3 min 15 s without its experts). The next call dials afresh.
            self.client.hang_up(call.peer.peer_id)

    def _expert_gone(self, peer_id: str, uid: str, reason: str) -> None:
        async def gone() -> None:
            self.client.directory.expert_gone(peer_id, uid, reason)

        self.client.run(gone)

    def _relay_failed(self, peer: PeerAddress, reason: str, every_circuit: bool) -> bool:
        async def hold() -> bool:
            return self.client.directory.relay_failed(peer, reason, every_circuit=every_circuit)

        return self.client.run(hold)

    def _late_again(self, call: Call, usable: set[str]) -> None:
        """A round that cut ``call``'s peer off late (its rows' other experts answered):
        no fault once, but a peer whose every call is late (one that answers ``info``
        and stalls every forward) cost each step that chose it the whole grace, for
        good, and was never banned. Late in ``LATE_WINDOW_BAN`` of its last
        ``LATE_STREAK_BAN`` rounds: banned for the client's ``ban_s`` if it recovered
        since its last such ban (a volunteer slowed for a while by its own upload limit
        is not lying), growing if not (``_slow_ban``)."""
        peer_id = call.peer.peer_id
        rounds = self._late_at.pop(peer_id, [])  # re-inserted last: newest
        self._late_at[peer_id] = [*rounds[1 - LATE_STREAK_BAN :], self._round]
        if len(self._late_at) > _MAX_LATE_PEERS:
            del self._late_at[next(iter(self._late_at))]
        late = _late_window(self._late_rounds, peer_id, late=True)
        if late is None:
            return
        self.stats.failures["late"] += 1
        why = f"late {late} of its last {LATE_STREAK_BAN} rounds: {call.uid}"
        if self._slow_ban(peer_id, why, usable):
            # Calls cut off late never time out on their own, so the RPC client's rule
            # for silent connections never saw them: a connection whose other end is
            # gone (a new address, a network that dropped) would be taken again when
            # the ban ends. The next call dials afresh.
            self.client.hang_up(peer_id)

    def _refused_again(self, call: Call, usable: set[str], *, later: bool) -> None:
        """A round in which ``call``'s peer refused (each refusal alone is no fault):
        ``REFUSAL_STREAK_BAN`` such rounds in a row with no answer from it in between,
        and it is banned for the client's ``ban_s``; never longer when every refusal of
        the streak said "later" (``later``: paused, busy, a ``retry_after_s``...) and it
        recovered since its last such ban (``_slow_ban``)."""
        peer_id = call.peer.peer_id
        if not later:
            self._firm_refusals.add(peer_id)
        streak = _one_more(self._refusal_streak, peer_id, REFUSAL_STREAK_BAN)
        if streak is None:
            if len(self._firm_refusals) > _MAX_LATE_PEERS:  # those still counted
                self._firm_refusals &= self._refusal_streak.keys()
            return
        firm = peer_id in self._firm_refusals
        self._firm_refusals.discard(peer_id)
        self.stats.failures["refused"] += 1
        why = f"refused {streak} rounds in a row: {call.uid}"
        self._slow_ban(peer_id, why, usable, firm=firm)

    def _misbehaved(self, peer: PeerAddress, uid: str, reason: str, usable: set[str]) -> None:
        """A peer sent what its peers did not: drop it for ``checks.ban_s``."""
        logger.warning("dropping %s's answer from %s: %s", uid, short(peer.peer_id), reason)
        if self._ban(peer.peer_id, f"{reason}: {uid}", self.checks.ban_s, usable):
            self.suspicion.forget(peer.peer_id)

    def _decode(self, outcome: Outcome) -> torch.Tensor | None:
        if not outcome.ok or not outcome.tensors:
            return None
        return from_wire(outcome.tensors[0])

    def _accept(
        self, verb: Verb, calls: Sequence[Call], outcomes: Sequence[Outcome], usable: set[str]
    ) -> tuple[list[Any], set[str]]:
        """The first tensor of each answer that passes the output checks, else None, and
        the peers whose answers the checks dropped without blaming them. Failures are
        noted, convicted peers banned, a diverging model reported."""
        self._round += 1
        tensors = [self._decode(o) for o in outcomes]
        # An answer of another shape than the rows sent, or of another dtype than the
        # one asked for, is no honest mistake: it is refused and its peer banned before
        # it can reach (or break) the step.
        malformed = [
            t is not None and not self._well_formed(t, call)
            for t, call in zip(tensors, calls, strict=True)
        ]
        tensors = [None if bad else t for t, bad in zip(tensors, malformed, strict=True)]
        verdict = judge_round(
            tensors,
            self.checks,
            peers=[c.peer.peer_id for c in calls],
            reference=self._scale.get(verb),
        )
        if verdict.scale is not None:
            self._scale[verb] = verdict.scale
        if verdict.diverging is not None:
            answered = [i for i, t in enumerate(tensors) if t is not None]
            self._report_diverging(verb, verdict, calls, answered)
        unblamed: set[str] = set()
        late = {c.peer.peer_id: c for c, o in zip(calls, outcomes, strict=True) if o.late}
        for call in late.values():  # once a round, however many of its calls it had
            self._late_again(call, usable)
        refused: dict[str, tuple[Call, bool]] = {}  # peer -> a call, all said "later"
        for c, o in zip(calls, outcomes, strict=True):
            if isinstance(o.error, RemoteError) and o.error.code in _REFUSALS:
                later = o.error.code in _LATER or o.error.retry_after_s is not None
                before = refused.get(c.peer.peer_id, (c, True))[1]
                refused[c.peer.peer_id] = (c, before and later)
        for call, later in refused.values():
            self._refused_again(call, usable, later=later)
        for i, (call, outcome) in enumerate(zip(calls, outcomes, strict=True)):
            reason = verdict.reasons[i]
            if malformed[i]:
                self.stats.rejected[BAD_SHAPE] += 1
                self._misbehaved(call.peer, call.uid, BAD_SHAPE, usable)
            elif tensors[i] is None:
                self._note_failure(call, outcome, usable)
            elif reason is not None:
                self.stats.rejected[reason] += 1
                if verdict.convicted[i]:
                    self._misbehaved(call.peer, call.uid, reason, usable)
                else:
                    unblamed.add(call.peer.peer_id)
                tensors[i] = None
        return tensors, unblamed

    def _answer_shape(self, call: Call) -> tuple[int, ...]:
        """What a forward or backward answer to ``call`` must be: a row of
        ``in_features`` for each row sent (the experts map [B, H] to [B, H])."""
        return (len(call.rows), self.in_features)

    def _well_formed(self, answer: torch.Tensor, call: Call) -> bool:
        """The answer has ``_answer_shape`` and the dtype its request asked for (float32
        sent, float32 back, or what the compression makes of it): an int64 answer of
        -2**63 passed every check (``abs`` wraps, integers are always finite) and made
        the trainer's Adam state infinite."""
        return tuple(answer.shape) == self._answer_shape(call) and answer.dtype == (
            self._answer_dtype
        )

    def _fits(
        self,
        y: torch.Tensor | None,
        call: Call,
        peer: PeerAddress,
        route: Route,
        y_main: torch.Tensor,
    ) -> torch.Tensor | None:
        """A spot check's answer (a checker's or a judge's) if it passes what the main
        answer ``y_main`` passed: the shape and dtype ``call``'s answer must have, every
        value finite, none above ``max_abs`` unless the main answer's are too (a model
        outgrowing it), and no louder than ``max_ratio`` times the layer's last accepted
        forward round. Else None, and ``peer`` is banned for it: such an answer would
        otherwise outvote the main one, or replace it in the step unchecked."""
        if y is None:
            return None
        reason = None
        if not self._well_formed(y, call):
            reason = BAD_SHAPE
        elif not bool(torch.isfinite(y).all()):
            reason = NON_FINITE
        else:
            top = float(y.abs().max()) if y.numel() else 0.0
            main_top = float(y_main.abs().max()) if y_main.numel() else 0.0
            reference = self._scale.get(Verb.FORWARD)
            if (top > self.checks.max_abs and top > main_top) or (
                reference is not None
                and float(y.float().pow(2).mean().sqrt()) > self.checks.max_ratio * reference
            ):
                reason = OUT_OF_RANGE
        if reason is None:
            return y
        self.stats.rejected[reason] += 1
        self._misbehaved(peer, call.uid, reason, _usable(route))
        return None

    def _report_diverging(
        self, verb: Verb, verdict: Verdict, calls: Sequence[Call], answered: list[int]
    ) -> None:
        """Count a round that most peers failed, and warn (at most every _WARN_EVERY_S)."""
        check = str(verdict.diverging)
        self.stats.diverging[check] += 1
        now = time.monotonic()
        if now - self._warned_at.get(check, -_WARN_EVERY_S) < _WARN_EVERY_S:
            return
        self._warned_at[check] = now
        blamed = verdict.blamed_on_model
        what = "non-finite" if check == "non_finite" else f"above max_abs={self.checks.max_abs:g}"
        kept = (
            "accepted as the model's own scale" if verdict.reasons[blamed[0]] is None else "dropped"
        )
        hint = "" if check == "non_finite" else ", or raise max_abs if such values are expected"
        logger.warning(
            "%s: the model is diverging: %d of %d %s answers, from %d of %d peers, were %s "
            "(%s; no peer banned; %d such rounds so far). Bound the loss or lower the "
            "learning rate%s.",
            self.name, len(blamed), len(answered), verb.value,
            len({calls[i].peer.peer_id for i in blamed}),
            len({calls[i].peer.peer_id for i in answered}),
            what, kept, self.stats.diverging[check], hint,
        )  # fmt: skip

    def _replicas(
        self,
        uid: str,
        route: Route,
        failed: dict[str, set[str]],
        exclude: str = "",
        late: Collection[str] = (),
    ) -> list[PeerAddress]:
        """Servers of ``uid`` that have not failed it this step, were not cut off
        ``late`` this step (a server too slow for one round is for the next) and are
        not banned; those often late last (``_lateness``), in the directory's order
        (verified earliest first) among equals."""
        gone = failed.get(uid, set())
        directory = self.client.directory
        peers = [
            p
            for p in route.peers.get(uid, ())
            if isinstance(p, PeerAddress)
            and p.peer_id not in gone
            and p.peer_id != exclude
            and p.peer_id not in late
            and not directory.is_banned(p.peer_id)
        ]
        if self._late_at:
            peers.sort(key=lambda p: self._lateness(p.peer_id))  # stable
        return peers

    def _lateness(self, peer_id: str) -> int:
        """How often ``peer_id`` was late lately: its late rounds among the layer's last
        ``_LATE_AGE_ROUNDS`` (4 times as many for each late round past ``_OFTEN_LATE``
        among its own last ``LATE_STREAK_BAN``), or 0 when fewer than ``_OFTEN_LATE`` (an honest
        replica cut off now and then still shares the load, and one late twice is back
        to its share ``_LATE_AGE_ROUNDS`` rounds later)."""
        rounds = self._late_at.get(peer_id)
        if not rounds:
            return 0
        bits = self._late_rounds.get(peer_id, 0)
        own = bits.bit_count() - 1 if bits else 0
        shift = min(2 * max(own - _OFTEN_LATE, 0), _LATE_AGE_SHIFT_MAX)
        since = self._round - (_LATE_AGE_ROUNDS << shift)
        late = sum(1 for r in rounds if r > since)
        return late if late >= _OFTEN_LATE else 0

    def _plan_forward(
        self,
        groups: dict[str, _Group],
        route: Route,
        failed: dict[str, set[str]],
        x_cpu: torch.Tensor,
        retain: bool,
        late: Collection[str] = (),
    ) -> tuple[list[Call], list[_Check]]:
        """One call per expert, to a random live replica among the least often late
        (spreading load; ``_replicas``), and spot checks of a ``checks.spot_check``
        fraction of them on a second replica."""
        calls: list[Call] = []
        checks: list[_Check] = []
        for uid, group in groups.items():
            peers = self._replicas(uid, route, failed, late=late)
            if not peers:
                continue
            least = self._lateness(peers[0].peer_id)
            peer = random.choice([p for p in peers if self._lateness(p.peer_id) == least])
            metas, buffers = self._encode([x_cpu[group.rows]])
            header = ForwardRequest(
                uid=uid, tensors=metas, retain=retain, compression=self.compression
            )
            calls.append(Call(uid, peer, header, buffers, group.rows))
            others = [p for p in peers if p.peer_id != peer.peer_id]
            if others and random.random() < self.checks.spot_check:
                # The very request the main call sends (``retain`` included): a server
                # must not be able to tell a spot check from a call that trains, or it
                # answers checks honestly and lies to the step (or the reverse).
                checks.append(
                    _Check(len(calls) - 1, Call(uid, random.choice(others), header, buffers, []))
                )
        return calls, checks

    def _spot_check(
        self,
        check: _Check,
        calls: list[Call],
        outcomes: list[Outcome],
        ys: list[Any],
        outcome: Outcome,
        route: Route,
    ) -> None:
        """Compare a call's answer with a second replica's; on disagreement let a third
        replica decide, or remember it. A main answer found wrong is replaced by the
        checker's (its backward is then stateless)."""
        call = calls[check.index]
        y_main = ys[check.index]
        if y_main is None:
            return
        y_check = self._fits(self._decode(outcome), call, check.call.peer, route, y_main)
        if y_check is None:
            return
        self.stats.spot_checks += 1
        if agree(y_main, y_check, self.checks):
            return
        self.stats.disagreements += 1
        main_peer, checker = call.peer, check.call.peer
        judges = [
            p
            for p in self._replicas(call.uid, route, {}, exclude=main_peer.peer_id)
            if p.peer_id != checker.peer_id
        ]
        y_third = None
        if judges:
            third = Call(call.uid, random.choice(judges), check.call.header, call.buffers, [])
            [answer] = self._run_calls(Verb.FORWARD, [third], 1)
            y_third = self._fits(self._decode(answer), call, third.peer, route, y_main)
        if y_third is not None:
            liars = [
                peer
                for peer, y in ((main_peer, y_main), (checker, y_check))
                if not agree(y, y_third, self.checks)
            ]
            if len(liars) == 2:
                return  # nobody agrees with anybody: inconclusive
        else:
            odd = set(self.suspicion.record(main_peer.peer_id, checker.peer_id))
            liars = [p for p in (main_peer, checker) if p.peer_id in odd]
        for peer in liars:
            self.stats.rejected["disagreed"] += 1
            self._misbehaved(peer, call.uid, "disagreed", _usable(route))
        if any(p.peer_id == main_peer.peer_id for p in liars):
            calls[check.index] = Call(call.uid, checker, check.call.header, call.buffers, call.rows)
            outcomes[check.index] = outcome
            ys[check.index] = y_check


def _one_more(streaks: dict[str, int], peer_id: str, ban_at: int) -> int | None:
    """Count one more round in ``peer_id``'s streak: its length once it reaches
    ``ban_at`` (and it is forgotten), else None. The ``_MAX_LATE_PEERS`` peers counted
    most recently are kept."""
    streak = streaks.pop(peer_id, 0) + 1  # re-inserted last: newest
    if streak >= ban_at:
        return streak
    streaks[peer_id] = streak
    if len(streaks) > _MAX_LATE_PEERS:
        del streaks[next(iter(streaks))]
    return None


def _late_window(windows: dict[str, int], peer_id: str, *, late: bool) -> int | None:
    """Count a round of ``peer_id``'s, ``late`` or on time, in its window of the last
    ``LATE_STREAK_BAN``: for a late round that fills it with ``LATE_WINDOW_BAN`` or more
    late, their number (and it is forgotten), else None. A peer with no late round in its window
    is not kept; the ``_MAX_LATE_PEERS`` peers counted most recently are."""
    bits = windows.pop(peer_id, 1 if late else 0)  # re-inserted last: newest
    if not bits:
        return None
    bits = (bits << 1) | late
    if bits >> (LATE_STREAK_BAN + 1):  # full: the oldest round out
        bits = (bits & ((1 << LATE_STREAK_BAN) - 1)) | (1 << LATE_STREAK_BAN)
    count = bits.bit_count() - 1
    if late and bits >> LATE_STREAK_BAN and count >= LATE_WINDOW_BAN:
        return count
    if count:
        windows[peer_id] = bits
        if len(windows) > _MAX_LATE_PEERS:
            del windows[next(iter(windows))]
    return None


def _usable(route: Route) -> set[str]:
    """The peers a step's route may call (the directory left banned ones out)."""
    return {
        p.peer_id for peers in route.peers.values() for p in peers if isinstance(p, PeerAddress)
    }


@dataclass(slots=True)
class _Answered:
    """One expert call that answered the forward: what its backward needs."""

    uid: str
    peer: PeerAddress
    rows: torch.Tensor
    slots: torch.Tensor
    handle: str | None


@dataclass(slots=True)
class _Group:
    """The (row, slot) pairs sent to one expert in a round, with their candidate index."""

    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    candidates: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Check:
    """A spot check: the same input sent to a second replica of ``calls[index]``."""

    index: int
    call: Call


class _RemoteExperts(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        _dummy: torch.Tensor,
        layer: RemoteMixtureOfExperts,
        route: Route,
        retain: bool,
        x_NH: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        N, K = x_NH.shape[0], layer.k_best
        x_cpu = x_NH.detach().to("cpu")
        candidates = route.valid_NK.shape[1]
        coords_NKD = route.coords_NKD[:, :K].clone()
        answered_NK = torch.zeros(N, K, dtype=torch.bool)
        # next candidate index per row, for backtracking
        next_candidate = torch.full((N,), min(K, candidates), dtype=torch.long)
        tried: set[tuple[int, str]] = set()
        failed_peers: dict[str, set[str]] = {}  # uid -> peers that failed it this step
        late_peers: set[str] = set()  # peers cut off late this step
        assignment = {  # (row, slot) -> candidate index
            (n, k): k for n, k in route.valid_NK[:, :K].nonzero().tolist()
        }
        answered: list[_Answered] = []
        answers: list[torch.Tensor] = []  # each answered call's output, [its rows, H]
        usable = _usable(route)
        # peers whose answers the checks dropped without blaming them: at least two
        # whose answers all failed is a diverging model; one is a peer nobody can judge
        unblamed: set[str] = set()
        for round_ in range(2):
            groups: dict[str, _Group] = {}
            for (n, k), c in assignment.items():
                uid = route.uid(n, c)
                tried.add((n, uid))
                group = groups.setdefault(uid, _Group())
                group.rows.append(n)
                group.slots.append(k)
                group.candidates.append(c)
            calls, checks = layer._plan_forward(
                groups, route, failed_peers, x_cpu, retain, late_peers
            )
            outcomes = layer._run_calls(Verb.FORWARD, calls + [c.call for c in checks], N)
            main = outcomes[: len(calls)]
            ys, dropped = layer._accept(Verb.FORWARD, calls, main, usable)
            unblamed |= dropped
            for check, outcome in zip(checks, outcomes[len(calls) :], strict=True):
                layer._spot_check(check, calls, main, ys, outcome, route)
            next_assignment: dict[tuple[int, int], int] = {}
            for call, outcome, y in zip(calls, main, ys, strict=True):
                group = groups[call.uid]
                if not outcome.late:
                    layer.stats.count(call.uid, y is not None, len(group.rows))
                if y is None:
                    if outcome.late:
                        late_peers.add(call.peer.peer_id)
                        continue
                    layer.stats.forward_failed += 1
                    failed_peers.setdefault(call.uid, set()).add(call.peer.peer_id)
                    if layer._replicas(call.uid, route, failed_peers, late=late_peers):
                        # Another replica of the same expert takes its place next round.
                        layer.stats.failovers += 1
                        for n, k, c in zip(group.rows, group.slots, group.candidates, strict=True):
                            next_assignment[(n, k)] = c
                    continue
                layer.stats.forward_ok += 1
                rows, slots = torch.tensor(group.rows), torch.tensor(group.slots)
                answered_NK[rows, slots] = True
                handle = getattr(outcome.reply, "handle", None)
                answered.append(_Answered(call.uid, call.peer, rows, slots, handle))
                answers.append(y)
            # Backtrack: tokens no expert answered (and no replica will) try their next
            # best candidates, skipping those only a server cut off late this step (or
            # one that failed them) hosts: a token whose experts all sit on one slow
            # server would otherwise wait for it again, with nobody faster to answer.
            covered = {n for n, _ in next_assignment}
            waiting = (~answered_NK.any(dim=1) & route.valid_NK[:, :K].any(dim=1)).tolist()
            silent = [n for n in range(N) if waiting[n] and n not in covered]
            for n in silent:
                for k in range(K):
                    while next_candidate[n] < candidates:
                        c = int(next_candidate[n])
                        next_candidate[n] += 1
                        uid = route.uid(n, c) if bool(route.valid_NK[n, c]) else ""
                        if (
                            uid
                            and (n, uid) not in tried
                            and layer._replicas(uid, route, failed_peers, late=late_peers)
                        ):
                            next_assignment[(n, k)] = c
                            coords_NKD[n, k] = route.coords_NKD[n, c]
                            break
            assignment = next_assignment
            if not assignment or round_ == 1:
                break
            layer.stats.backtracked += len(silent)
        unanswered = int((~answered_NK.any(dim=1)).sum())
        layer.stats.unanswered_tokens += unanswered
        if unanswered == N and len(unblamed) >= 2:
            raise ModelDiverging(
                f"no answer under {layer.name}. passed the output checks (those of "
                f"{len(unblamed)} peers dropped without blaming them; rounds that most peers "
                f"failed so far: {dict(layer.stats.diverging)}): the model is diverging. "
                "Bound the loss or lower the learning rate, or raise max_abs "
                f"({layer.checks.max_abs:g}) if such values are expected."
            )
        if unanswered == N:
            # Answers of a lone peer that failed the checks land here too: a liar left
            # alone (its honest peers busy) made one NaN answer "the model diverged",
            # which stopped training for good. The step is tried again later.
            rejected = dict(layer.stats.rejected)
            raise NoExpertsAvailable(
                f"none of the experts chosen under {layer.name}. answered "
                f"({layer.stats.forward_failed} failed calls so far"
                + (f"; answers the output checks dropped: {rejected}" if rejected else "")
                + ")"
            )
        out_NKH = torch.zeros(N, K, answers[0].shape[-1], dtype=x_NH.dtype)
        for item, y in zip(answered, answers, strict=True):
            out_NKH[item.rows, item.slots] = y.to(x_NH.dtype)
        ctx.layer = layer
        ctx.answered = answered
        ctx.x_cpu = x_cpu
        ctx.device = x_NH.device
        ctx.mark_non_differentiable(answered_NK, coords_NKD)
        return out_NKH.to(x_NH.device), answered_NK.to(x_NH.device), coords_NKD.to(x_NH.device)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_NKH: torch.Tensor, *_: Any) -> Any:
        layer: RemoteMixtureOfExperts = ctx.layer
        x_cpu: torch.Tensor = ctx.x_cpu
        grad_cpu = grad_NKH.to("cpu")
        grad_x_NH = torch.zeros(x_cpu.shape, dtype=torch.float32)
        pending: list[_Answered] = list(ctx.answered)
        for stateless in (False, True):
            calls = []
            for item in pending:
                grads = grad_cpu[item.rows, item.slots]
                if not stateless and item.handle is not None:
                    metas, buffers = layer._encode([grads])
                    header = BackwardRequest(
                        uid=item.uid,
                        tensors=metas,
                        handle=item.handle,
                        compression=layer.compression,
                    )
                else:
                    metas, buffers = layer._encode([x_cpu[item.rows], grads])
                    header = BackwardRequest(
                        uid=item.uid, tensors=metas, compression=layer.compression
                    )
                calls.append(Call(item.uid, item.peer, header, buffers, item.rows.tolist()))
            outcomes = layer._run_calls(Verb.BACKWARD, calls, x_cpu.shape[0])
            grads_in, _unblamed = layer._accept(
                Verb.BACKWARD, calls, outcomes, {a.peer.peer_id for a in ctx.answered}
            )
            retry = []
            for item, outcome, g in zip(pending, outcomes, grads_in, strict=True):
                if g is not None:
                    layer.stats.backward_ok += 1
                    grad_x_NH.index_add_(0, item.rows, g.float())
                elif (
                    not stateless
                    and isinstance(outcome.error, RemoteError)
                    and outcome.error.code == "expired"
                ):
                    retry.append(item)  # the server let the forward go: resend the inputs
                elif not outcome.late:
                    layer.stats.backward_failed += 1
            pending = retry
            if not pending:
                break
        return None, None, None, None, grad_x_NH.to(ctx.device, x_cpu.dtype)
