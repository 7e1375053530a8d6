"""Decentralized averaging of the trainer-side weights among an experiment's trainers.

Several ``volunteerd train`` processes of one experiment train the same model, each on
its own shard of the data; the experts take everyone's gradients, but the trainer-side
weights (embeddings, attention, gates, head) live in each trainer. ``TrainerAverager``
pulls them together with no coordinator (docs/decisions/0014):

* every ``averaging.every_s`` (jittered ±20 %) it picks up to ``group_size - 1`` of the
  other trainers at random (found under the experiment's rendezvous key), downloads the
  parameters they *published* (a CPU snapshot at most a few seconds old), checks them
  (names, shapes, dtype, finite) and combines them with its own by centered clipping
  (``experts.clipping``): weights within tau are averaged exactly, a trainer far off
  (a bug, or a lie) moves each tensor by at most tau/n per round;
* a peer that fails or does not answer within ``timeout_s`` is left out and counted:
  its place in the group goes to another peer while the round's ``timeout_s`` lasts
  (up to ``TRIES_PER_PLACE`` peers a place), and the round completes with those that
  answered, or with nobody (then nothing changes). A peer left out is tried after all
  the others for the next 1, 2, 4 … ``AVOID_ROUNDS_MAX`` rounds (doubling while it keeps
  failing): a trainer that died stays in the DHT until its record expires, and one not
  yet ready, lying, or of another model would otherwise keep taking places from the
  live ones;
* Adam's moments stay local; a trainer joining late downloads a peer's whole state
  (parameters, Adam state, update count) instead of starting from the seed (``join``).

Threads: rounds run on the network's trio loop (``serve``); the training loop's thread
calls ``publish``, ``apply_pending`` and ``join``. Fetched weights cross over through a
locked slot and are written by the training thread between two updates, so no
optimizer step ever sees its weights change under it. The network is behind
``TrainerNetwork`` (``swarm.trainers.TrainerSwarm``; a fake in the unit tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import tempfile
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import trio

from volunteerd.bounded import remember
from volunteerd.errors import (
    PeerUnreachable,
    RemoteError,
    RequestTimeout,
    ShardError,
    TrainerStateError,
    VolunteerdError,
)
from volunteerd.experts.checkpoint_file import ExpertState
from volunteerd.experts.clipping import Params, centered_clip
from volunteerd.moe import SwarmClient
from volunteerd.swarm.trainers import (
    TRAINER_STATE_UID,
    TrainerInfo,
    TrainerNetStats,
    TrainerPeer,
    TrainerSwarm,
    rendezvous_key,
)
from volunteerd.train.experiment import AveragingConfig, Experiment

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = [
    "AveragingStatistics",
    "Run",
    "TrainerAverager",
    "TrainerNetwork",
    "data_shard_of",
    "params_bytes_bound",
    "start_averaging",
    "state_bytes_bound",
]

logger = logging.getLogger(__name__)

# ``await fn(*args)`` on the network's loop, called from the training thread
# (``TrainerClient.run``; ``trio.from_thread.run`` in tests)
Run = Callable[..., Any]

# peers asked for their info each round (trainers count, swarm throughput)
INFO_PEERS = 16
# a late joiner tries this many downloads (a peer may be tried again: downloads resume)
JOIN_ATTEMPTS = 3
# a whole state (weights and Adam's moments) takes longer than a round's weights
JOIN_TIMEOUT_FACTOR = 4
# Other trainers asked whether a state to join from agrees with their weights; more
# than half of those that answer must (``_witnessed``).
WITNESSES = 3
# publish a fresh snapshot at most this often (or 10x as long as a copy takes)
PUBLISH_EVERY_S = 2.0
# A late joiner takes a state only if a witness's weights agree with it: all the tensors
# together within JOIN_DISTANCE of the smaller norm and at a cosine of JOIN_COSINE or
# more, and each tensor within JOIN_TENSOR_DISTANCE of its smaller norm (at least
# 0.01*sqrt(numel), as clip_bound). Measured between two honest trainers averaging
# (tests/inprocess/test_trainer_averaging_inprocess.py; lr 1e-2, snapshots up to 72
# updates apart): all tensors within 0.035 (cosine >= 0.9994), each within 0.31 after
# the first 3 updates and 1.0 before (a bias near zero, at the floor); trained apart for
# 150 updates from one seed, never averaged: 0.19 (cosine 0.983), each within 0.94. A
# liar's noise of 1.9x the norm, or negated weights, passed the old bound of 2x.
JOIN_DISTANCE = 0.5
JOIN_COSINE = 0.9
JOIN_TENSOR_DISTANCE = 1.5
# More updates than any trainer makes (a thousand a second for 8,900 years): a peer that
# claims more is lying (its info is not ranked, its state refused), and a trainer never
# publishes more, so its count stays within the wire's (2**62) and the checkpoint
# format's bounds whatever it adopted.
MAX_VERSION = 2**48
# rounds kept in the summary's log
ROUNDS_LOGGED = 100
# a round gives a place whose peer failed to another, up to this many peers per place
TRIES_PER_PLACE = 3
# a peer left out is tried last for 1, 2, 4 ... rounds, at most this many
AVOID_ROUNDS_MAX = 16
# once a round's places are settled, its info requests get at most this much longer
INFO_GRACE_S = 2.0
# peers remembered as having sent parameters that fit
_MAX_GOOD = 4096
# with one place a round, how often it goes to a peer not averaged with before
EXPLORE_ONE_PLACE = 0.25
# a peer must begin to answer a fetch within this (a quarter of timeout_s if less):
# a record whose address accepts and never answers held its place for all of timeout_s
FIRST_REPLY_S = 5.0
# and then send all of its parameters within this much more than they take at
# SLOW_LINK_BYTES_PER_S (1 Mbit/s): one that answered its first chunk and then stalled
# held its place, and the round, for all of timeout_s
STALL_S = 2.0
SLOW_LINK_BYTES_PER_S = 125_000
# TrainerInfo's counts (wire.messages.Count)
_MAX_COUNT = 1 << 62
_ADAM_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})


class TrainerNetwork(Protocol):
    """What the averager needs of the network (``swarm.trainers.TrainerSwarm``)."""

    def publish(self, state: ExpertState, info: TrainerInfo) -> None:
        """Serve ``state`` (CPU copies) and ``info`` to other trainers from now on.
        Thread-safe: called from the training thread."""
        ...

    async def peers(self) -> list[TrainerPeer]:
        """The experiment's other active trainers (not this one)."""
        ...

    async def info(self, peer: TrainerPeer, timeout_s: float) -> TrainerInfo:
        """``peer``'s info; raises VolunteerdError."""
        ...

    async def fetch_params(
        self,
        peer: TrainerPeer,
        timeout_s: float,
        max_bytes: int,
        *,
        first_reply_s: float | None = None,
    ) -> ExpertState:
        """``peer``'s published parameters (no optimizer state); raises VolunteerdError,
        RequestTimeout when the peer has not begun to answer within ``first_reply_s``."""
        ...

    async def download_state(
        self, peer: TrainerPeer, dest: Path, timeout_s: float, max_bytes: int
    ) -> ExpertState:
        """``peer``'s whole published state, downloaded (resumably) to ``dest``; raises
        VolunteerdError."""
        ...

    def statistics(self) -> TrainerNetStats: ...


@dataclass(frozen=True, slots=True)
class AveragingStatistics:
    """What the averager did; times are the averager's clock (``time.monotonic``)."""

    trainers: int  # most trainers of the experiment seen active at once, self included
    trainers_now: int  # active at the last round, self included
    rounds: int  # rounds completed with at least one peer
    averaged_with: int  # peers summed over those rounds
    last_round_at: float | None
    last_round_peers: tuple[str, ...]
    rounds_log: tuple[tuple[float, tuple[str, ...]], ...]  # (when, peers), the last 100
    rejected: dict[str, int]  # peers left out of a round (or a join), by reason
    clipped: int  # tensors clipped, over all rounds
    last_shift: float  # |new - own| / |own| over all tensors, last round
    bytes_sent: int
    bytes_received: int
    swarm_tokens_per_s: float  # this trainer's rate + the others' last reported
    peers_tokens_per_s: float  # the others' last reported rates
    started_from: str  # "seed", or the peer id whose state it started from
    started_from_version: int


@dataclass(frozen=True, slots=True)
class _Pending:
    """A round's replies, waiting for the training thread."""

    peers: tuple[str, ...]
    params: list[Params]


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def params_bytes_bound(layout: Layout) -> int:
    """The most bytes a snapshot of parameters with ``layout`` can hold: their raw bytes,
    plus the checkpoint format's prefix and a JSON header entry per tensor (its name,
    dtype, shape and size), with room to spare. A peer's parameters come in this format;
    a snapshot declared larger cannot be ``layout``'s and is refused before it is read."""
    payload = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())
    header = sum(len(name.encode()) + 32 * len(shape) + 256 for name, (shape, _) in layout.items())
    return payload + header + 64 * 1024


def state_bytes_bound(layout: Layout) -> int:
    """The most bytes a trainer's whole state (``trainer.1``) with ``layout`` can hold:
    its parameters (``params_bytes_bound``) and Adam's moments, two tensors of each
    parameter's shape and dtype and a step count, each with its header entry. A late
    joiner refuses a state declared larger before it is read (not ``max_state_mb``: a
    liar's 48 MiB state for a 0.07 MiB model was downloaded and decoded 3 times)."""
    moments = sum(
        2 * math.prod(shape) * dtype.itemsize + 8 + 3 * (32 * len(shape) + 320)
        for shape, dtype in layout.values()
    )
    return params_bytes_bound(layout) + moments


def data_shard_of(peer_id: str) -> int:
    """A trainer's default data shard: a number derived from its peer id, so trainers
    started with the same experiment file draw different batches."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") >> 1


class TrainerAverager:
    """Averages the trainer-side weights with the experiment's other trainers.

    ``run`` takes the training thread onto the network's loop (``TrainerClient.run``);
    ``clock`` is only read on the training thread (and in ``statistics``)."""

    def __init__(
        self,
        network: TrainerNetwork,
        config: AveragingConfig,
        experiment_name: str,
        *,
        run: Run,
        peer_id: str = "",
        data_shard: int = 0,
        hidden_dim: int = 1,
        rendezvous: str = "",
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.network = network
        self.rendezvous = rendezvous  # the DHT key the trainers meet under (for display)
        self.config = config
        self.experiment_name = experiment_name
        self.peer_id = peer_id
        self.data_shard = data_shard
        self._run = run
        self._hidden_dim = max(1, hidden_dim)
        self._rng = rng or random.Random()
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: _Pending | None = None
        # names, shapes and dtypes of the trainer's parameters (set by the first publish)
        self._layout: Layout | None = None
        self._published_at = -math.inf
        self._publish_every_s = PUBLISH_EVERY_S
        self._tokens_per_s = 0.0
        # peer id -> its last reported tokens/s (peers active at the last round)
        self._peer_rates: dict[str, float] = {}
        self._trainers = 1
        self._trainers_now = 1
        self._rounds = 0
        self._averaged_with = 0
        self._rounds_log: deque[tuple[float, tuple[str, ...]]] = deque(maxlen=ROUNDS_LOGGED)
        self._rejected: Counter[str] = Counter()
        # peer id -> (the round until which it is tried last, its failures in a row)
        self._avoid: dict[str, tuple[int, int]] = {}
        # peers whose parameters fit, most recent last: tried first (records are free)
        self._good: OrderedDict[str, None] = OrderedDict()
        self._round_no = 0
        self._clipped = 0
        self._last_shift = 0.0
        self.started_from = "seed"
        self.started_from_version = 0

    # --- the network's loop ---------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run a round every ``every_s`` (jittered ±20 %) until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self.config.every_s * self._rng.uniform(0.8, 1.2))
            try:
                await self.run_round()
            except VolunteerdError as exc:
                logger.info("averaging round failed: %s", exc)
            except Exception as exc:
                # py-libp2p raises its own errors for peers that come and go under a
                # lookup: never a reason to stop averaging.
                logger.warning("averaging round failed: %r", exc)

    async def run_round(self) -> tuple[str, ...]:
        """One round: fetch the parameters of up to ``group_size - 1`` peers, picked at
        random among those not left out lately, check them and leave them for
        ``apply_pending``; ask up to 16 peers for their info meanwhile. A place whose
        peer fails (or does not fit) goes to the next peer in line; fetching ends after
        ``timeout_s`` in all. Returns the peers whose parameters are waiting (empty when
        none answered fit, or nothing is published yet).

        Skipped while the last round's parameters wait for the training thread (a step
        slower than ``every_s``): fetching again would only replace them."""
        layout = self._layout
        if layout is None or self._pending is not None:
            return ()
        self._round_no += 1
        peers = await self._peers()
        places = min(len(peers), self.config.group_size - 1)
        line = self._in_line(peers, places)
        rest = line[places:]
        asked = line[:places] + self._rng.sample(rest, min(len(rest), max(0, INFO_PEERS - places)))
        waiting = deque(line)
        tries = TRIES_PER_PLACE * places
        tried: list[TrainerPeer] = []
        replies: dict[str, Params] = {}
        answered: set[str] = set()
        rates: dict[str, float] = {}
        timeout_s = self.config.timeout_s
        deadline = trio.current_time() + timeout_s

        async def place() -> None:
            nonlocal tries
            # a place is given again only while half the round's time is left: a peer
            # cut short by the end of the round would be counted as too slow
            while waiting and tries > 0 and deadline - trio.current_time() >= timeout_s / 2:
                peer = waiting.popleft()
                tries -= 1
                tried.append(peer)
                params = await self._fetch(peer, layout, deadline - trio.current_time())
                if params is not None:
                    replies[peer.peer_id] = params
                    answered.add(peer.peer_id)
                    with self._lock:
                        remember(self._good, peer.peer_id, None, _MAX_GOOD)
                    return

        async def ask(peer: TrainerPeer) -> None:
            info = await self._info(peer)
            if info is not None:
                rates[peer.peer_id] = info.tokens_per_s
                answered.add(peer.peer_id)

        async with trio.open_nursery() as asking:
            for peer in asked:
                asking.start_soon(ask, peer)
            async with trio.open_nursery() as placing:
                for _ in range(places):
                    placing.start_soon(place)
            # A peer that accepts and never answers would hold the round (and the next
            # one) for all of timeout_s: the info is worth a short wait, not that.
            scope = asking.cancel_scope
            scope.deadline = min(scope.deadline, trio.current_time() + INFO_GRACE_S)
        # the active: those that answered, and those not asked this round
        not_asked = len(peers) - len({p.peer_id for p in (*asked, *tried)})
        chosen = tuple(p.peer_id for p in tried if p.peer_id in replies)
        with self._lock:
            self._trainers_now = 1 + len(answered) + not_asked
            self._trainers = max(self._trainers, self._trainers_now)
            self._peer_rates = rates
            if replies:
                # a round not applied yet (training paused between steps) is replaced
                self._pending = _Pending(chosen, [replies[p] for p in chosen])
        return chosen

    def _in_line(self, peers: list[TrainerPeer], places: int) -> list[TrainerPeer]:
        """``peers`` in the order a round with ``places`` places tries them: of those not
        left out lately, peers whose parameters fit before (all places but one while
        there is a new peer), then one new peer, then the other known ones, each group in
        random order (one place: the new peer first in a quarter of the rounds); with no
        new peer, one left out lately after the known ones. While no peer is known: the
        new ones, then those left out lately, in random order. Forgets the failures of
        peers no longer listed. Known peers first: records are free, and fresh identities
        whose address accepts and never answers once took every place of most rounds
        (two honest trainers averaged 3 and 2 times in 300 s beside 8)."""
        listed = {p.peer_id for p in peers}
        with self._lock:
            if listed:  # a lookup that found nobody (or timed out) forgets nothing
                self._avoid = {k: v for k, v in self._avoid.items() if k in listed}
            avoid = dict(self._avoid)
            good = set(self._good)
        known: list[TrainerPeer] = []
        new: list[TrainerPeer] = []
        avoided: list[TrainerPeer] = []
        for p in peers:
            if avoid.get(p.peer_id, (0, 0))[0] >= self._round_no:
                avoided.append(p)
            else:
                (known if p.peer_id in good else new).append(p)
        for group in (known, new, avoided):
            self._rng.shuffle(group)
        if not new:
            first = places
        elif places > 1:
            first = places - 1
        else:  # one place: a new peer's turn now and then, or the pairs never mix
            first = 0 if self._rng.random() < EXPLORE_ONE_PLACE else 1
        if not known:
            return new + avoided
        # One peer not known to answer a round: records are free, and a place that went
        # to a silent one went on to the next (tries of 5 s each), so rounds beside 8
        # records took ~17 s where they take ~1 s.
        if not new:
            return known + avoided[:1]
        return known[:first] + new[:1] + known[first:]

    async def _peers(self) -> list[TrainerPeer]:
        """The other trainers now (none when the lookup takes over ``timeout_s``)."""
        with trio.move_on_after(self.config.timeout_s):
            return [p for p in await self.network.peers() if p.peer_id != self.peer_id]
        logger.info("looking up the other trainers took over %g s", self.config.timeout_s)
        return []

    async def _fetch(
        self, peer: TrainerPeer, layout: Layout, timeout_s: float | None = None
    ) -> Params | None:
        """``peer``'s parameters if they fit ``layout``, fetched within ``timeout_s``
        (the config's when None) and within the peer's own deadline (``_peer_s``);
        else None (counted, and the peer tried last for a few rounds)."""
        timeout_s = self.config.timeout_s if timeout_s is None else max(0.0, timeout_s)
        timeout_s = min(timeout_s, self._peer_s(layout))
        state: ExpertState | None = None
        with trio.move_on_after(timeout_s):
            try:
                state = await self.network.fetch_params(
                    peer,
                    timeout_s,
                    min(self.config.max_state_bytes, params_bytes_bound(layout)),
                    first_reply_s=min(FIRST_REPLY_S, self.config.timeout_s / 4),
                )
            except VolunteerdError as exc:
                self._reject(peer.peer_id, _reason(exc), str(exc))
                return None
            except Exception as exc:
                self._reject(peer.peer_id, "unreachable", repr(exc))
                return None
        if state is None:
            self._reject(peer.peer_id, "timeout", f"no answer in {timeout_s:g} s")
            return None
        checked = await trio.to_thread.run_sync(_check_params, state, layout)
        if isinstance(checked, str):
            self._reject(peer.peer_id, checked, "parameters refused")
            return None
        with self._lock:
            self._avoid.pop(peer.peer_id, None)
        return checked

    def _peer_s(self, layout: Layout) -> float:
        """How long one peer may take to send its parameters: to begin, as long as
        ``fetch_params``'s ``first_reply_s`` allows, then their bytes at 1 Mbit/s and
        ``STALL_S`` more (quarters of ``timeout_s`` where it is shorter). A peer that
        answers its first chunk and then stalls (or trickles) costs a round that long,
        not all of ``timeout_s``: an identity is free, and one a round held every
        round for 30 s."""
        quarter = self.config.timeout_s / 4
        transfer = params_bytes_bound(layout) / SLOW_LINK_BYTES_PER_S
        return min(FIRST_REPLY_S, quarter) + min(STALL_S, quarter) + transfer

    async def _info(self, peer: TrainerPeer) -> TrainerInfo | None:
        timeout_s = self.config.timeout_s
        with trio.move_on_after(timeout_s):
            try:
                info = await self.network.info(peer, timeout_s)
            except Exception as exc:
                logger.debug("trainer %s: no info: %r", peer.peer_id[-8:], exc)
                return None
            return info if info.experiment == self.experiment_name else None
        return None

    def _reject(self, peer_id: str, reason: str, detail: str) -> None:
        with self._lock:
            self._rejected[reason] += 1
            failures = self._avoid.get(peer_id, (0, 0))[1] + 1
            rounds = min(AVOID_ROUNDS_MAX, 2 ** min(failures - 1, 16))
            self._avoid[peer_id] = (self._round_no + rounds, failures)
            self._good.pop(peer_id, None)
        logger.info("trainer %s left out (%s): %s", peer_id[-8:], reason, detail[:200])

    # --- the training thread --------------------------------------------------------

    def publish(
        self,
        named_params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        version: int,
        tokens: int,
        tokens_per_s: float,
        *,
        force: bool = False,
    ) -> bool:
        """Offer the trainer's state to the others: CPU copies of ``named_params`` (the
        trainer-side parameters, in the optimizer's order) and of ``optimizer``'s state.
        Copies at most every ~2 s (longer if copying is slow) unless ``force``; returns
        whether it published."""
        now = self._clock()
        self._tokens_per_s = tokens_per_s if math.isfinite(tokens_per_s) else 0.0
        # whatever count the trainer holds, what it publishes fits the wire and the file
        version = min(max(0, version), MAX_VERSION)
        if not force and now - self._published_at < self._publish_every_s:
            return False
        started = time.perf_counter()
        with torch.no_grad():
            params = {n: p.detach().to("cpu", copy=True) for n, p in named_params.items()}
        optimizer_state = {
            int(index): {
                key: (t.detach().to("cpu", copy=True) if torch.is_tensor(t) else torch.tensor(t))
                for key, t in values.items()
            }
            for index, values in optimizer.state_dict()["state"].items()
        }
        self._layout = {n: (tuple(p.shape), p.dtype) for n, p in params.items()}
        state = ExpertState(
            uid=TRAINER_STATE_UID,
            expert_type="trainer",
            hidden_dim=self._hidden_dim,
            optimizer="adam",
            updates=version,
            params=params,
            optimizer_state=optimizer_state,
        )
        info = TrainerInfo(
            experiment=self.experiment_name,
            version=version,
            tokens=min(max(0, tokens), _MAX_COUNT),
            tokens_per_s=min(max(0.0, self._tokens_per_s), 1e12),
            rounds=min(self._rounds, _MAX_COUNT),
            data_shard=min(max(0, self.data_shard), _MAX_COUNT),
        )
        self.network.publish(state, info)
        self._published_at = now
        self._publish_every_s = max(PUBLISH_EVERY_S, 10 * (time.perf_counter() - started))
        return True

    def apply_pending(self, named_params: Mapping[str, torch.Tensor]) -> bool:
        """If a round's parameters are waiting, combine them with ``named_params`` by
        centered clipping and write the result into them in place; returns whether a
        round was applied. Call between two optimizer steps, on the training thread."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        with torch.no_grad():
            own = {name: p.detach() for name, p in named_params.items()}
            if any(set(params) != set(own) for params in pending.params):
                logger.warning("averaging round dropped: the trainer's parameters changed")
                return False
            new, clipped = centered_clip(own, pending.params, self.config.clip_ratio)
            moved = math.sqrt(sum(float((new[k] - own[k]).norm()) ** 2 for k in own))
            size = math.sqrt(sum(float(own[k].norm()) ** 2 for k in own))
            for name, p in named_params.items():
                p.copy_(new[name])
        now = self._clock()
        with self._lock:
            self._rounds += 1
            self._averaged_with += len(pending.peers)
            self._clipped += sum(clipped)
            self._last_shift = moved / max(size, 1e-12)
            self._rounds_log.append((now, pending.peers))
        logger.info(
            "averaged with %d trainers (%s); %d tensors clipped, moved %.2e of the norm",
            len(pending.peers),
            ", ".join(p[-8:] for p in pending.peers),
            sum(clipped),
            self._last_shift,
        )
        return True

    def join(
        self,
        named_params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        dest_dir: Path | None = None,
    ) -> tuple[str, int]:
        """Start from another trainer's state instead of the seed: the state of the
        peer with the most updates (by its info) is downloaded to ``dest_dir`` (a
        temporary folder when None; downloads resume), each attempt within 4 x
        ``timeout_s`` and no larger than a state of ``named_params``' layout can be
        (``state_bytes_bound``), checked against ``named_params`` and ``optimizer`` and
        loaded into them. Tries up to 3 downloads; returns ``(peer id, update count)``,
        or ``("seed", 0)`` when no peer has trained yet or none could give a usable
        state (then nothing is changed).

        The update count is the smaller of the peer's info and its state's: a liar
        advertising 2**62 was chosen first and then handed the joiner a count it could
        not publish. A count over ``MAX_VERSION`` marks a liar (``_join_candidates``
        does not rank it, a state claiming it is refused)."""
        if not self.config.join_from_peers:
            return "seed", 0
        layout = {n: (tuple(p.shape), p.dtype) for n, p in named_params.items()}
        max_bytes = min(self.config.max_state_bytes, state_bytes_bound(layout))
        with contextlib.ExitStack() as stack:
            if dest_dir is None:
                dest_dir = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="volunteerd-join-"))
                )
            dest_dir.mkdir(parents=True, exist_ok=True)
            candidates, trained = self._join_candidates()
            for peer, version in candidates:
                dest = dest_dir / f"{_safe(peer.peer_id)}.trainer-state"
                try:
                    state = self._run(
                        self.network.download_state,
                        peer,
                        dest,
                        JOIN_TIMEOUT_FACTOR * self.config.timeout_s,
                        max_bytes,
                    )
                except VolunteerdError as exc:
                    self._reject(peer.peer_id, f"join_{_reason(exc)}", str(exc))
                    continue
                except Exception as exc:
                    self._reject(peer.peer_id, "join_unreachable", repr(exc))
                    continue
                if not 0 <= state.updates <= MAX_VERSION:
                    self._reject(peer.peer_id, "join_version", f"{state.updates} updates")
                    continue
                problem = self._witnessed(state, peer, trained, named_params)
                problem = problem or _load_state(state, named_params, optimizer)
                if problem is not None:
                    self._reject(peer.peer_id, f"join_{problem}", "state refused")
                    continue
                with contextlib.suppress(OSError):
                    dest.unlink()
                updates = min(state.updates, version)
                self.started_from = peer.peer_id
                self.started_from_version = updates
                logger.info(
                    "started from trainer %s's state (update %d; it said %d, its state %d)",
                    peer.peer_id[-8:],
                    updates,
                    version,
                    state.updates,
                )
                return peer.peer_id, updates
        return "seed", 0

    def _witnessed(
        self,
        state: ExpertState,
        source: TrainerPeer,
        trained: list[tuple[TrainerPeer, int]],
        named_params: Mapping[str, torch.Tensor],
    ) -> str | None:
        """A downloaded state is taken only if other trainers' parameters agree with it
        (``_agrees``): at least one of those asked that answer, and no fewer than
        disagree. Up to ``WITNESSES`` other trained peers, drawn from all that answered
        (not only the best ranked: identities that claim the most updates would be
        each other's witnesses), are asked; with none to ask (or none answering) the
        state is taken as it is. So a peer that lies about its progress to be chosen
        and then serves far-off weights (x1e3, noise of the weights' size, negated
        weights) is refused ("disagrees"), an honest trainer is vouched for by an
        honest other whatever one liar says, and a liar vouched for by a second
        identity of its own is refused where honest witnesses outnumber it: one
        agreeing witness of two was enough, and such a pair gave a joiner weights worse
        than the seed's (an outside probe: its loss 8.5 where the seed's was 5.8)."""
        others = {p.peer_id: p for p, _ in trained if p.peer_id != source.peer_id}
        witnesses = self._rng.sample(list(others.values()), min(WITNESSES, len(others)))
        if not witnesses:
            return None
        layout = {n: (tuple(p.shape), p.dtype) for n, p in named_params.items()}

        async def fetch_all() -> list[Params | None]:
            out: list[Params | None] = [None] * len(witnesses)

            async def one(i: int) -> None:
                out[i] = await self._fetch(witnesses[i], layout)

            async with trio.open_nursery() as nursery:
                for i in range(len(witnesses)):
                    nursery.start_soon(one, i)
            return out

        answers: list[Params | None] = self._run(fetch_all)
        heard = [theirs for theirs in answers if theirs is not None]
        agreeing = sum(_agrees(state.params, theirs) for theirs in heard)
        if not heard or (agreeing and 2 * agreeing >= len(heard)):
            return None
        logger.info(
            "trainer %s's state disagrees with %d of %d other trainers' weights",
            source.peer_id[-8:],
            len(heard) - agreeing,
            len(heard),
        )
        return "disagrees"

    def _join_candidates(
        self,
    ) -> tuple[list[tuple[TrainerPeer, int]], list[tuple[TrainerPeer, int]]]:
        """(peers to download from, most updates first, cycled up to 3 attempts; all
        peers that answered with a count of updates, the witnesses' pool). A count over
        ``MAX_VERSION`` is a lie, not ranked (it would be chosen first by every joiner)."""
        peers: list[TrainerPeer] = self._run(self._peers)
        if not peers:
            return [], []
        asked = self._rng.sample(peers, min(len(peers), INFO_PEERS))

        async def infos() -> list[TrainerInfo | None]:
            out: list[TrainerInfo | None] = [None] * len(asked)

            async def one(i: int, scope: trio.CancelScope) -> None:
                out[i] = await self._info(asked[i])
                if out[i] is not None:
                    # the others get a short while more, as in a round: one record
                    # that accepted and never answered held every join for all of
                    # timeout_s (30 s by default) after the others had answered
                    scope.deadline = min(scope.deadline, trio.current_time() + INFO_GRACE_S)

            async with trio.open_nursery() as nursery:
                for i in range(len(asked)):
                    nursery.start_soon(one, i, nursery.cancel_scope)
            return out

        answers: list[TrainerInfo | None] = self._run(infos)
        trained: list[tuple[TrainerPeer, int]] = []
        for peer, info in zip(asked, answers, strict=True):
            if info is None or info.version <= 0:
                continue
            if info.version > MAX_VERSION:
                self._reject(peer.peer_id, "join_version", f"it says {info.version} updates")
                continue
            trained.append((peer, info.version))
        ranked = sorted(trained, key=lambda pair: -pair[1])
        if not ranked:
            return [], []
        return [ranked[attempt % len(ranked)] for attempt in range(JOIN_ATTEMPTS)], trained

    # --- the researcher's view ------------------------------------------------------

    def statistics(self) -> AveragingStatistics:
        net = self.network.statistics()
        with self._lock:
            last = self._rounds_log[-1] if self._rounds_log else None
            return AveragingStatistics(
                trainers=self._trainers,
                trainers_now=self._trainers_now,
                rounds=self._rounds,
                averaged_with=self._averaged_with,
                last_round_at=last[0] if last else None,
                last_round_peers=last[1] if last else (),
                rounds_log=tuple(self._rounds_log),
                rejected=dict(self._rejected),
                clipped=self._clipped,
                last_shift=self._last_shift,
                bytes_sent=net.bytes_sent,
                bytes_received=net.bytes_received,
                swarm_tokens_per_s=self._tokens_per_s + sum(self._peer_rates.values()),
                peers_tokens_per_s=sum(self._peer_rates.values()),
                started_from=self.started_from,
                started_from_version=self.started_from_version,
            )


def start_averaging(client: SwarmClient, experiment: Experiment) -> TrainerAverager:
    """Average with ``experiment``'s other trainers on ``client``'s node: serve this
    trainer's state under the experiment's rendezvous key (``swarm.rendezvous``, or one
    derived from its name) and run rounds, both until the client closes. Hand the
    returned averager to ``Trainer``."""
    node = client.node.node
    key = experiment.swarm.rendezvous or rendezvous_key(experiment.name)
    swarm = TrainerSwarm(node, experiment.name, key)
    averager = TrainerAverager(
        swarm,
        experiment.averaging,
        experiment.name,
        run=client.run,
        peer_id=node.peer_id,
        hidden_dim=experiment.model.hidden_dim,
        rendezvous=key,
    )
    client.node.start_service(swarm.serve)
    client.node.start_service(averager.serve)
    return averager


def _reason(exc: VolunteerdError) -> str:
    if isinstance(exc, RequestTimeout):
        return "timeout"
    if isinstance(exc, PeerUnreachable):
        return "unreachable"
    if isinstance(exc, TrainerStateError):
        return "not_usable"
    if isinstance(exc, ShardError):
        # a download that kept failing names what failed it (a peer gone, a timeout);
        # only one that got bytes and found them wrong is "bad_bytes"
        cause = exc.__cause__
        if isinstance(cause, VolunteerdError):
            return _reason(cause)
        return "unreachable" if cause is not None else "bad_bytes"
    if isinstance(exc, RemoteError):
        return "refused"
    return "failed"


def _safe(peer_id: str) -> str:
    return "".join(c for c in peer_id if c.isalnum())[-32:] or "peer"


def _agrees(params: Mapping[str, torch.Tensor], theirs: Params) -> bool:
    """Whether a witness's parameters ``theirs`` vouch for a state's ``params``: all the
    tensors together within ``JOIN_DISTANCE`` of the smaller of the two norms and at a
    cosine of at least ``JOIN_COSINE``, and each tensor within ``JOIN_TENSOR_DISTANCE``
    of its smaller norm (at least 0.01*sqrt(numel), as ``clip_bound``). Measured on the
    smaller norm: a liar's x1000 weights must not widen the bound that judges an honest
    state. Tensors whose names or shapes differ are not a question of distance
    (``_load_state`` says what is wrong)."""
    dot = mine_sq = theirs_sq = diff_sq = 0.0
    for name, tensor in theirs.items():
        mine = params.get(name)
        if mine is None or mine.shape != tensor.shape:
            continue
        a, b = mine.double(), tensor.double()
        a_norm, b_norm, diff = float(a.norm()), float(b.norm()), float((a - b).norm())
        floor = 0.01 * math.sqrt(max(1, a.numel()))
        if not diff <= JOIN_TENSOR_DISTANCE * max(min(a_norm, b_norm), floor):
            return False
        dot += float(a.flatten() @ b.flatten())
        mine_sq, theirs_sq, diff_sq = mine_sq + a_norm**2, theirs_sq + b_norm**2, diff_sq + diff**2
    if mine_sq == 0.0 and theirs_sq == 0.0:
        return True
    smaller = math.sqrt(min(mine_sq, theirs_sq))
    if not math.sqrt(diff_sq) <= JOIN_DISTANCE * smaller:
        return False
    return dot >= JOIN_COSINE * math.sqrt(mine_sq) * math.sqrt(theirs_sq)


def _check_params(state: ExpertState, layout: Layout) -> Params | str:
    """``state``'s parameters if they have ``layout``'s names, shapes and dtypes and
    are finite; else why not: "not_trainer", "names", "shape", "dtype", "non_finite"."""
    if state.expert_type != "trainer":
        return "not_trainer"
    if set(state.params) != set(layout):
        return "names"
    for name, (shape, dtype) in layout.items():
        tensor = state.params[name]
        if tuple(tensor.shape) != shape:
            return "shape"
        if tensor.dtype != dtype:
            return "dtype"
        if not bool(torch.isfinite(tensor).all()):
            return "non_finite"
    return dict(state.params)


def _adam_ratio_bound(group: Mapping[str, Any]) -> tuple[float, float] | None:
    """(C, eps): Adam's moments always satisfy |m| <= C * sqrt(v) for betas (b1, b2)
    with b1**2 < b2, C = (1 - b1) / sqrt((1 - b2) * (1 - b1**2 / b2)) (Cauchy-Schwarz
    over the sums of past gradients they are; 7.3 for the defaults). None: no bound."""
    betas = group.get("betas")
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        return None
    b1, b2 = float(betas[0]), float(betas[1])
    if not (0 <= b1 < 1 and 0 < b2 < 1 and b1 * b1 < b2):
        return None
    bound = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
    return bound, float(group.get("eps", 1e-8))


def _adam_moments_possible(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, ratio: tuple[float, float] | None
) -> bool:
    """Whether Adam could have made these moments: a running mean of squares is never
    negative (one is the square root of a negative: NaN weights at the first step),
    and the first moment is bounded by the second (a peer's 1e30 over 0 moved the
    weights to 1e34 at the first step). A joiner's witnesses compare weights only."""
    if bool((exp_avg_sq < 0).any()):
        return False
    if ratio is None:
        return True
    bound, eps = ratio
    # 1 % and Adam's eps for float rounding: within them the step stays below ~bound
    limit = (exp_avg_sq.double().sqrt() + eps) * (bound * 1.01)
    return not bool((exp_avg.double().abs() > limit).any())


def _load_state(
    state: ExpertState, named_params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> str | None:
    """Load a downloaded state's parameters into ``named_params`` after checking it all
    (moments Adam could not have made mark a liar: its state is refused); returns why
    it was refused, or None. ``optimizer`` starts afresh: a stranger's moments that Adam
    could have made can still be chosen to harm, and nothing vouches for them (the
    witnesses compare weights): a second moment of 1e30 froze a joiner's weights for
    tens of thousands of steps."""
    layout = {n: (tuple(p.shape), p.dtype) for n, p in named_params.items()}
    checked = _check_params(state, layout)
    if isinstance(checked, str):
        return checked
    shapes = [tuple(p.shape) for p in named_params.values()]
    current = optimizer.state_dict()
    ratio = _adam_ratio_bound(current["param_groups"][0] if current["param_groups"] else {})
    for index, values in state.optimizer_state.items():
        if not 0 <= index < len(shapes) or set(values) != _ADAM_KEYS:
            return "optimizer_state"
        step = values["step"]
        if step.numel() != 1 or not bool(torch.isfinite(step).all()) or float(step) < 0:
            return "optimizer_state"
        for key in ("exp_avg", "exp_avg_sq"):
            moment = values[key]
            if tuple(moment.shape) != shapes[index] or not moment.is_floating_point():
                return "optimizer_state"
            if not bool(torch.isfinite(moment).all()):
                return "non_finite"
        if not _adam_moments_possible(values["exp_avg"], values["exp_avg_sq"], ratio):
            return "optimizer_state"
    if sum(len(g["params"]) for g in current["param_groups"]) != len(shapes):
        return "optimizer_state"
    with torch.no_grad():
        for name, p in named_params.items():
            p.copy_(checked[name])
    optimizer.load_state_dict({"state": {}, "param_groups": current["param_groups"]})
    return None
