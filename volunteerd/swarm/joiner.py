"""Joining an experiment: find its trusted manifest, choose experts, fetch their state,
host them, and revisit the choice as volunteers come and go.

The daemon runs one Joiner per project (``swarm.projects``), all hosting in one
runtime: each considers, hosts and drops only its own experiment's experts, within its
share of the room (``capacity``); an experiment whose uids clash with another's
hosted here is refused (ConfigError). ``Joiner.serve`` (the config's
``experiments.join``: a failure ends the daemon) or ``keep_joining`` (a joined
project: a failure is shown in ``state`` and ``error`` and tried again):

1. look the manifest up under ``experiment/<name>`` until ``join_timeout_s``; accept
   only one signed by an owner in ``experiments.trusted_owners`` (``UntrustedManifest``
   when only others' are found: the daemon stops with exit code 3; nothing at all:
   ``ResourceUnavailable``, exit code 5, so a service manager tries again later);
2. store the manifest again on the closest peers (and every ``republish_every_s``), so
   it outlives its publisher's node;
3. choose experts (``swarm.assignment``) from the live replica counts in the DHT and the
   capacity — a listed peer counts once it has answered ``info`` for the uid
   (``swarm.verified``: fake records must not make an expert look well served); for
   each new one, in this order: this node's own newest checkpoint, else a live
   replica's current state (downloaded, from replicas that answered first), else the
   seeded weights of the manifest (when its checkpoints were all damaged, an error
   says which of the two it got: ``Checkpointer.damaged``); then host it and announce
   it. An expert whose replicas were only busy (they answered ``busy``, ``paused`` or
   ``rate_limited``, or kept the download waiting in their queue) is not seeded: it is
   not hosted until a later try downloads it (``waiting`` says so meanwhile); so is one
   whose download was cut for being slow after bytes came (``swarm.download``): the
   next try resumes its partial file from the same replica; one whose
   replicas are all spent (refused until their transfer quota's day ends:
   ``_SPENT_MOST_S``) is left out of the choice until then, and the room goes to others;
4. every ``rebalance_every_s`` (±20 %), choose again; dropped experts are withdrawn from
   the DHT first, finish their queued work, and are saved for a later return. These
   rounds, and the manifest's republishing, wait while network use is not allowed
   (``network``: paused by the volunteer, outside the network hours, a quota used up);
   the first join does not;
5. at those rounds, every ``manifest_check_every_s`` (5 min), look the manifest up
   again (one lookup) and follow it: a newer one from a trusted owner is taken, its
   experts re-seated when they are built differently; once the manifest held has
   expired, its experts are no longer hosted, and ``state`` is "failed" with the
   reason in ``error``, until the owner publishes one again. A lookup that fails or
   finds nothing changes nothing (lookups are lossy): only expiry ends the hosting.
   Expiry is read on the swarm's clock (``net.swarm_clock``); the checks, like the
   rounds and how long an expert has been hosted, run on the monotonic clock.

Each manifest's ``expires_at`` is kept (``swarm.expiries``): when a join finds nothing
after it, the error says the manifest expired, not that the network may be down.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import trio

from volunteerd.bounded import remember
from volunteerd.config import Config, ExperimentsConfig, ExpertsConfig
from volunteerd.errors import (
    ConfigError,
    ResourceUnavailable,
    ShardError,
    ShardTooSlow,
    UnknownExpert,
    UntrustedManifest,
    VolunteerdError,
)
from volunteerd.experts import ExpertBackend
from volunteerd.experts.checkpoint_file import ExpertState
from volunteerd.net import Node, PeerAddress, short
from volunteerd.net.records import ManifestRecord
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.runtime.hardware import capacity, detect
from volunteerd.shown import clock_time, short_id, span
from volunteerd.swarm.assignment import Choice, choose_experts
from volunteerd.swarm.download import DownloadProgress
from volunteerd.swarm.expiries import ManifestExpiries
from volunteerd.swarm.manifest import ExperimentManifest, choose_trusted, lookup_manifests
from volunteerd.swarm.verified import ReplicaChecks

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["JoinState", "Joiner", "ReplicaDownloader", "capacity_for"]

logger = logging.getLogger(__name__)

_RETRY_S = 1.0
# lookups that must all find no replica (that answers for the uid) before an expert
# starts from the seed
_SEED_LOOKUPS = 3
# Replicas a newcomer downloads an expert from before it gives up and seeds it (each
# must keep sending at swarm.download's rate: a stalling one costs seconds). Three,
# sampled among the verified, missed the one honest replica beside six cheap identities
# that answered `info` and sent bad bytes in 3 of 12 experts (an outside probe): seeded,
# their weights forked from the trained ones.
_MAX_DOWNLOADS = 16
# A replica that answers one of these has the expert: it will give it later. Seeding it
# instead forked it from the trained weights: 59 of 72 experts of 12 joiners that
# started together at one seed (an outside audit; in a second wave, the seed's used-up
# quota, ``paused``, seeded every one). Such an expert is tried again after
# _BUSY_FIRST_S, doubling up to _BUSY_MOST_S, each +-50 % (joiners that queued together
# come back apart), for _BUSY_WAIT_S in a round; still not downloaded then, rebalances
# choose other experts in its place for _BUSY_WAIT_S, then it is a candidate again. (A
# seed serves 4 at once: 48 experts of 2.1 MB take ~100 s at 8 Mbit/s; its quota's share
# for bulk transfers, once used, refuses them until midnight.) A replica that kept a
# download waiting past the queue's bound with nothing sent is not queueing it (an
# honest one answers ``busy`` by then): a real failure, as before. And the waiting is
# bounded: an expert whose replicas stayed busy through _BUSY_ROUNDS rounds is seeded
# after all. A stranger that announced every expert and answered ``busy`` (or nothing)
# to each kept a newcomer from hosting any, for good (a re-check of this change on a
# simulated hour). A download cut for being slow, after bytes came, is "later" too: the
# next try resumes its partial file from that replica first. Counted as a failure, it
# seeded every big expert over a slow uplink and deleted what had come (141 of 384 MiB
# at 2 Mbit/s, each try costing the seed ~150 MB of upload; an outside audit).
_LATER_CODES = frozenset({"busy", "paused", "rate_limited"})
_BUSY_FIRST_S = 10.0
_BUSY_MOST_S = 60.0
_BUSY_WAIT_S = 300.0
_BUSY_ROUNDS = 3
# A replica that refuses saying how long for (``retry_after_s``), longer than a round's
# wait, has used its transfer quota's share for bulk replies (or ours of it) until its
# day ends: it is "spent" for us until then (a stranger's claim: at most _SPENT_MOST_S).
# Spent replicas are not tried, and an expert whose known replicas are all spent is
# left out of the choices (not counted as a busy round: it exists, is served, and there
# is nothing to wait for before that time), so the room goes to experts that can be
# downloaded now, from others that hold them. Before, the choice (fewest replicas
# first) kept taking the experts only a spent seed held: 8 joiners at a seed with a
# 0.1 GB daily quota held 2-5 of their 6 experts for ~30 min, then seeded the rest,
# while other joiners held experts they could have given (an outside re-check). A peer
# still refusing after its time passed, _SPENT_CLAIMS times in a row, is only busy from
# then on (the busy rounds bound it): one that claims every expert could otherwise hold
# a newcomer's room for good, a day at a time. And an expert waits on spent replicas
# _SPENT_MOST_S at most, whoever refuses: after that its spent refusals count as busy
# rounds. Counted per peer alone, a stranger announcing every expert under a fresh
# identity every 47 h kept a newcomer's room empty for 10 simulated days (a re-check).
# The peers remembered are bounded (a fresh identity costs an announcement).
_SPENT_MOST_S = 86400.0
_SPENT_CLAIMS = 2
_SPENT_PEERS = 4096

# While a join adds experts, the announcer is woken at most once every
# ``announce_gap_s`` (the daemon's dht.announce_period_s: 15 s by default), the first
# ready expert at once and what is left when the burst ends. Each round signs and
# stores a record for every key of every hosted uid: woken for each added expert (~2 s
# apiece when seeded), a join's rounds grew with the square of its experts. Once a
# period, a join announces about as often as an idle daemon, and a ready expert waits
# at most one period to be served (a record is that old before its refresh anyway).
_ANNOUNCE_GAP_S = 15.0

JoinState = Literal["joining", "joined", "failed"]


def capacity_for(config: Config, device: torch.device) -> Callable[[ExpertsConfig], int]:
    """How many of an experiment's experts this node hosts: as many as fit the memory
    budget (``runtime.hardware``), at most ``experiments.max_experts`` (128 unless the
    volunteer set it; 0: no cap). Refused (ConfigError: the project fails, saying so)
    when not even one expert fits where hosting one anyway would be unsafe: one
    expert needs more than the device's whole memory, or more than a configured
    ``hardware.memory_budget_mb``; ResourceUnavailable when, with the default budget on
    a CPU, it needs more than the memory available now (it may be freed later). One is
    still hosted when it fits that but not beside the kept forward passes' share of the
    budget (they are kept only as they fit).

    Before, "at least one" hosted a 498 MiB expert under a 64 MiB budget the volunteer
    had set, and a 15 GiB expert on a 16 GiB computer with 4 GiB available, with only a
    log line (an outside probe). (``max_experts`` used to replace the memory check:
    with it set to 4, a manifest of 960 GiB experts had a 24 GiB machine allocate four.)"""

    def experts_that_fit(experts: ExpertsConfig) -> int:
        hardware = detect()
        fit = capacity(hardware, device, experts, config.runtime, config.hardware)
        need = fit.per_expert_bytes
        gpu = next((g for g in hardware.gpus if g.index == (device.index or 0)), None)
        whole = gpu.memory_bytes if device.type == "cuda" and gpu else hardware.memory_bytes
        if whole and need > whole:
            # "at least one" would try to allocate it every minute, failing with the
            # allocator's words (an experiment of width 65536: 64 GiB an expert)
            where = "GPU memory" if device.type == "cuda" else "memory"
            raise ConfigError(
                f"one expert of this experiment needs {_size(need)}, more than all of this "
                f"computer's {where} ({_size(whole)}): it cannot host any"
            )
        if fit.experts < 1:
            if fit.budget_source == "configured" and need > fit.budget_bytes:
                raise ConfigError(
                    f"one expert of this experiment needs {_size(need)}, more than the "
                    f"memory budget for experts (hardware.memory_budget_mb = "
                    f"{fit.budget_bytes >> 20}): it hosts none (raise the budget to host one)"
                )
            available = hardware.available_bytes
            automatic = fit.budget_source != "configured" and device.type != "cuda"
            if automatic and available and need > available:  # may be freed: tried again
                raise ResourceUnavailable(
                    f"one expert of this experiment needs {_size(need)}, more than the "
                    f"memory available now ({_size(available)} of {_size(whole)}): it "
                    "hosts none (close programs, or set hardware.memory_budget_mb)"
                )
            logger.warning(
                "not even one expert fits the memory budget (%d MiB, %s) beside the kept "
                "forward passes (runtime.retain_activations_mb); hosting one: it fits %s",
                fit.budget_bytes >> 20,
                fit.budget_source,
                "the budget" if fit.budget_source == "configured" else "the memory",
            )
        most = config.experiments.max_experts
        room = max(fit.experts, 1)
        return min(room, most) if most else room

    return experts_that_fit


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class _Wakes:
    """Calls ``announce`` for a burst of ``request``s: at once for the first, then at
    most once every ``gap_s`` while more come (``serve``), and once more for what is
    still pending (``flush``)."""

    def __init__(self, announce: Callable[[], None], gap_s: float) -> None:
        self._announce = announce
        self._gap_s = gap_s
        self._pending = False
        self._requested = trio.Event()

    def request(self) -> None:
        self._pending = True
        self._requested.set()

    def flush(self) -> None:
        if self._pending:
            self._pending = False
            self._announce()

    async def serve(self) -> None:
        while True:
            await self._requested.wait()
            self._requested = trio.Event()
            self.flush()
            await trio.sleep(self._gap_s)


class ReplicaDownloader(Protocol):
    """How a newcomer gets an expert's current state from a live replica."""

    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> ExpertState:
        """``peer``'s current state of ``backend.uid`` (not loaded yet). Raises
        VolunteerdError (or a PeerError) when it fails."""
        ...

    async def discard(self, uid: str) -> None:
        """Delete what unfinished downloads of ``uid`` left (none will be resumed)."""
        ...


class Joiner:
    """Hosts a share of experiment ``config.join``'s experts in ``runtime``.

    ``announce`` is called whenever ``hosted`` changed (the daemon then announces what
    every joiner hosts; while experts are added, at most once every ``announce_gap_s``);
    ``taken`` says which uids others host in the same runtime.

    Two clocks: whether a manifest is still valid is read on ``clock``, the swarm's
    time (``node.dht.clock.now`` unless given: the time the storing peers judge its
    records on), and schedules and hosting times on trio's monotonic clock. On the
    wall clock, a clock set 48 h ahead for 16 s dropped the whole project, and its next
    lookup was then 48 h away: it stayed out after the clock was set right; a clock set
    back froze the experts' moves for as long (an outside audit)."""

    def __init__(
        self,
        node: Node,
        runtime: ExpertRuntime,
        announce: Callable[[], None],
        checkpointer: Checkpointer | None,
        downloader: ReplicaDownloader,
        config: ExperimentsConfig,
        capacity: Callable[[ExpertsConfig], int],
        *,
        taken: Callable[[], Collection[str]] = frozenset,
        checks: ReplicaChecks | None = None,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
        expiries: ManifestExpiries | None = None,
        announce_gap_s: float = _ANNOUNCE_GAP_S,
        progress: Callable[[str], DownloadProgress | None] | None = None,
        network: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._node = node
        # returns once network use is allowed (``Volunteer.wait_for_network``): the
        # rounds after the join wait for it; None: always allowed
        self._network = network
        self._runtime = runtime
        self._announce = announce
        self._taken = taken
        self._checkpointer = checkpointer
        self._downloader = downloader
        self._checks = checks  # None: every listed peer counts (tests of the choice)
        self._config = config
        self._capacity_of = capacity
        self._clock = clock  # the swarm's time; None: the node's (``_now``)
        self._rng = rng or random.Random()
        self._expiries = expiries
        self._next_check = 0.0  # trio time of the next lookup of the manifest
        self._announce_gap_s = announce_gap_s
        self.manifest: ExperimentManifest | None = None
        self.record: ManifestRecord | None = None
        self.capacity = 0
        self.hosted: dict[str, float] = {}  # uid -> trio time this node started hosting it
        self.sources: dict[str, str] = {}  # uid -> "checkpoint", "replica <peer>" or "seed"
        self.rounds = 0
        self._seen_before: dict[str, set[str]] = {}
        self.moves = 0
        self.state: JoinState = "joining"
        self.error: str | None = None  # why the last attempt failed (state "failed")
        # when the manifest expired, while that is why nothing is hosted
        self.expired_at: float | None = None
        # the last attempt failed for this computer's room (its memory), not the network
        self.too_big = False
        self.joins = 0  # times it reached "joined"
        # (uid, trio time of the next try) while an expert waits for a busy replica
        self._busy_retry: tuple[str, float] | None = None
        self._busy_until: dict[str, float] = {}  # uid -> trio time: left out of choices
        self._busy_rounds: dict[str, int] = {}  # uid -> rounds its replicas stayed busy
        self._spent: OrderedDict[str, float] = OrderedDict()  # peer id -> refuses until
        self._spent_claims: OrderedDict[str, int] = OrderedDict()  # -> spent refusals in a row
        self._spent_since: dict[str, float] = {}  # uid -> when it first waited on spent ones
        self._spent_out: dict[str, float] = {}  # uid -> trio time a replica of it may give it
        # uid -> the peer whose download of it was cut for being slow: its partial file
        # resumes from that peer only, which is tried first
        self._resume_from: dict[str, str] = {}
        self._progress = progress  # how a download under way goes (``ShardDownloader``)
        self._downloading: str | None = None  # the uid of the download under way

    @property
    def name(self) -> str:
        return self._config.join

    @property
    def waiting(self) -> str | None:
        """What the join waits for now, for the volunteer ("waiting for a busy replica
        of ffn.3.1, retrying in 40 s"; "2 experts wait for replicas whose daily
        transfer quota is used up, until Tue 00:00 (in 7 h 12 min)": room left that only
        spent replicas could fill; "downloading ffn.3.1: 141 of 384 MiB at 2.0 Mbit/s, ~16
        min left" while a download is under way, which can take an hour for a big expert
        over a slow uplink); None when it waits for nothing."""
        now = trio.current_time()
        uid = self._downloading
        going = self._progress(uid) if uid is not None and self._progress is not None else None
        if going is not None:
            return going.shown()
        if self._busy_retry is not None:
            uid, at = self._busy_retry
            left = at - now
            when = f"retrying in {left:.0f} s" if left >= 1 else "trying it now"
            return f"waiting for a busy replica of {uid}, {when}"
        ends = [at for at in self._spent_out.values() if at > now]
        room = self.capacity - len(self.hosted)
        if not ends or room <= 0:
            return None
        count, left = min(room, len(ends)), min(ends) - now
        experts = "1 expert waits" if count == 1 else f"{count} experts wait"
        wall = time.time()
        return (
            f"{experts} for replicas whose daily transfer quota is used up, until "
            f"{clock_time(wall + left, wall)} (in {span(left)})"
        )

    def _now(self) -> float:
        """The swarm's time: what records' ``issued_at`` and ``expires_at`` are read on."""
        return self._clock() if self._clock is not None else self._node.dht.clock.now()

    async def keep_joining(self, retry_s: float) -> None:
        """``serve``, tried again ``retry_s`` after each failure until cancelled; a
        failure is logged and kept in ``state`` and ``error`` meanwhile: at WARNING when
        its reason is new, at DEBUG while the same reason repeats (a project whose
        expert did not fit the memory budget logged the same WARNING every minute, 1,440
        lines a day; an outside re-check)."""
        said = ""
        while True:
            joins = self.joins
            try:
                await self.serve()
            except Exception as exc:  # shown in state and error; the next attempt may work
                reason = str(exc)
                if self.joins != joins:  # it had joined: a failure after is news again
                    said = ""
                logger.log(
                    logging.DEBUG if reason == said else logging.WARNING,
                    "could not join experiment %r (trying again every %.0f s): %s",
                    self.name,
                    retry_s,
                    exc,
                )
                said = reason
            await trio.sleep(retry_s)

    async def serve(
        self, *, task_status: TaskStatus[ExperimentManifest] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Join, host the first choice of experts, report the manifest, then keep the
        manifest stored and the choice fresh until cancelled. The hosted experts stay
        in the runtime when this returns (the daemon stops them). Raises
        UntrustedManifest, ResourceUnavailable (not found), or ConfigError (its uids
        clash with experts hosted here for another experiment); ``state`` is "failed"
        then, with the reason in ``error``."""
        self.state, self.error, self.expired_at = "joining", None, None
        self.too_big = False
        try:
            manifest = await self._joined_manifest()
            try:
                self.capacity = self._capacity_of(manifest.experts_config())
            except (ConfigError, ResourceUnavailable):
                self.too_big = True
                raise
            logger.info(
                "joined experiment %r of %s: %d experts, replication %d; room for %d here",
                manifest.name,
                manifest.owner,
                len(manifest.uids()),
                manifest.replication,
                self.capacity,
            )
            await self.republish()
            await self.rebalance()
        except Exception as exc:
            self.state, self.error = "failed", str(exc) or repr(exc)
            raise
        self.state = "joined"
        task_status.started(manifest)
        self._next_check = trio.current_time() + self._config.manifest_check_every_s
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._republish_loop)
            while True:
                await trio.sleep(self._config.rebalance_every_s * self._rng.uniform(0.8, 1.2))
                await self._network_allowed()
                try:
                    await self._follow_manifest()
                except Exception as exc:  # the next round looks again
                    logger.warning("following the manifest of %r failed: %r", self.name, exc)
                if self.manifest is None:  # expired, or a newer one refused: none to host
                    continue
                try:
                    await self.rebalance()
                except Exception as exc:  # a bad round must not end the daemon
                    logger.warning("re-balancing failed: %r", exc)

    async def _follow_manifest(self) -> None:
        """Stop hosting the manifest held once it has expired; when a lookup is due
        (``manifest_check_every_s``; at once after an expiry), look it up again and
        take a newer one (``_take``). A lookup that fails or finds nothing changes
        nothing: DHT reads are lossy, and the network's failures are no reason to stop
        serving. The owner revokes a manifest by expiry or a newer one (decisions/0007)."""
        now, ticks = self._now(), trio.current_time()
        held = self.manifest
        if held is not None and held.expires_at <= now:
            self.expired_at = held.expires_at
            await self._stop_hosting(_expired(held.expires_at))
            held = None
        elif ticks < self._next_check:
            return
        self._next_check = ticks + self._config.manifest_check_every_s
        unusable: list[str] = []
        try:
            found = await self._look_up(unusable)
        except Exception as exc:  # peers failing us: the next check looks again
            logger.info("looking up experiment %r again failed: %r", self.name, exc)
            return
        if found is None and unusable and held is not None:
            # storing peers keep an owner's newest: the one held was replaced by it
            self.expired_at = None
            await self._stop_hosting(f"a newer manifest was found, but {_unusable(unusable)}")
            return
        if found is None or found[0].expires_at <= self._now():
            return
        manifest, record = found
        if held is not None and manifest.issued_at <= held.issued_at:
            return
        await self._take(manifest, record)

    async def _take(self, manifest: ExperimentManifest, record: ManifestRecord) -> None:
        """Host ``manifest``'s experts in place of the manifest held (if any). When
        they are built differently (another type, size, dtype, optimizer or seed) or
        are another owner's, every hosted expert is dropped (withdrawn, drained, saved)
        and the next rebalance chooses afresh: a uid's checkpoint of the old shape is
        not loaded into the new one (``ExpertState`` checks refuse it). Otherwise the
        next rebalance drops the uids the new grid no longer names and adds its new
        ones. Refused as a join would be (experts clashing with another project's,
        none fitting): then nothing is hosted and ``error`` says why."""
        held = self.manifest
        logger.info(
            "experiment %r of %s: manifest issued at %.0f taken (%d experts, %s %d wide)",
            manifest.name,
            manifest.owner,
            manifest.issued_at,
            len(manifest.uids()),
            manifest.expert_type,
            manifest.hidden_dim,
        )
        await self._remember(manifest)
        try:
            self._check_clash(manifest)
            capacity = self._capacity_of(manifest.experts_config())
        except Exception as exc:  # shown as the project's failure; looked up again later
            self.expired_at = None
            await self._stop_hosting(str(exc) or repr(exc))
            return
        if held is None or _built_differently(held, manifest):
            await self._drop(list(self.hosted))
            self.rounds, self._seen_before = 0, {}
        self.manifest, self.record, self.capacity = manifest, record, capacity
        self.state, self.error, self.expired_at = "joined", None, None
        self.joins += 1

    async def _stop_hosting(self, reason: str) -> None:
        """Drop every hosted expert (withdrawn, drained, saved for a later return) and
        show ``reason`` as the project's failure."""
        logger.warning(
            "experiment %r: %s; its %d experts here are no longer hosted",
            self.name,
            reason,
            len(self.hosted),
        )
        await self._drop(list(self.hosted))
        self.manifest, self.record = None, None
        self.capacity, self.rounds, self._seen_before = 0, 0, {}
        self.state, self.error = "failed", reason

    async def _remember(self, manifest: ExperimentManifest) -> None:
        """Keep when ``manifest`` expires, for the error of a later join that finds
        nothing (``swarm.expiries``)."""
        expiries = self._expiries
        if expiries is not None:
            await trio.to_thread.run_sync(
                expiries.remember, manifest.name, manifest.owner, manifest.expires_at
            )

    async def _joined_manifest(self) -> ExperimentManifest:
        """``find_manifest``, refused if its experts clash with ones hosted here."""
        self.manifest = None
        manifest = await self.find_manifest()
        self._check_clash(manifest)
        self.manifest = manifest
        return manifest

    def _check_clash(self, manifest: ExperimentManifest) -> None:
        """Raises ConfigError if ``manifest`` names experts hosted here for another
        experiment."""
        clash = sorted(set(manifest.uids()) & set(self._taken()))
        if clash:
            raise ConfigError(
                f"experiment {manifest.name!r} names experts that this daemon hosts for "
                f"another experiment ({', '.join(clash[:3])}{', ...' * (len(clash) > 3)}); "
                "leave one of them"
            )

    async def find_manifest(self) -> ExperimentManifest:
        """The trusted manifest of ``config.join``, looked up until ``join_timeout_s``.
        Raises UntrustedManifest or ResourceUnavailable (nothing found: when a manifest
        of it taken before has expired since, the error says so)."""
        name = self._config.join
        unusable: list[str] = []
        with trio.move_on_after(self._config.join_timeout_s):
            while True:
                try:
                    found = await self._look_up(unusable)
                except UntrustedManifest:
                    raise
                except Exception as exc:  # peers failing us: look again until the timeout
                    logger.info("looking up experiment %r failed: %r", name, exc)
                    await trio.sleep(_RETRY_S)
                    continue
                if found is not None:
                    manifest, self.record = found
                    await self._remember(manifest)
                    return manifest
                await trio.sleep(_RETRY_S)
        if unusable:
            # found, signed by its owner, but this version cannot read it: saying "not
            # found, check the internet connection" sent volunteers the wrong way
            raise ConfigError(f"experiment {name!r} was found, but {_unusable(unusable)}")
        expired = self._expired_at()
        if expired is not None:
            # storing peers drop an expired manifest: "not found, are the bootstrap
            # peers right?" sent volunteers to their network
            self.expired_at = expired
            raise ResourceUnavailable(_expired(expired))
        whose = (
            " from a trusted owner (experiments.trusted_owners)"
            if self._config.trusted_owners
            else ""
        )
        raise ResourceUnavailable(
            f"experiment {name!r} was not found in the DHT{whose} within "
            f"{self._config.join_timeout_s:.0f}s: is it published, and are the bootstrap "
            "peers right?"
        )

    async def _look_up(
        self, unusable: list[str]
    ) -> tuple[ExperimentManifest, ManifestRecord] | None:
        """One lookup: the newest trusted manifest of ``config.join`` and its envelope,
        None when there is none. Why a trusted owner's manifest could not be used is
        put in ``unusable``. Raises UntrustedManifest (``choose_trusted``), and what
        the DHT raises."""
        name, owners = self._config.join, self._config.trusted_owners
        records = await lookup_manifests(self._node.dht, name, owners)
        unusable.clear()
        manifest = choose_trusted(name, records, owners, unusable)
        if manifest is None:
            return None
        record = next(
            r for r in records if r.owner == manifest.owner and r.issued_at == manifest.issued_at
        )
        return manifest, record

    def _expired_at(self) -> float | None:
        """When the last manifest taken of ``config.join`` expired, if it has."""
        if self._expiries is None:
            return None
        return self._expiries.expired_at(
            self._config.join, self._config.trusted_owners, self._now()
        )

    async def republish(self) -> int:
        """Store the manifest on the closest peers again; returns how many accepted."""
        if self.record is None or self.record.expires_at <= self._now():
            return 0
        return await self._node.dht.put_manifest(self.record)

    async def _republish_loop(self) -> None:
        while True:
            await trio.sleep(self._config.republish_every_s)
            await self._network_allowed()
            try:
                await self.republish()
            except Exception as exc:  # the next round retries
                logger.info("could not store the manifest again: %r", exc)

    async def _network_allowed(self) -> None:
        """Return once network use is allowed: a paused daemon, one outside its network
        hours or with a quota used up, looked every expert of the experiment up at each
        round (an outside audit: with its replica counts and announce rounds, 7 DHT
        reads a minute from a daemon its volunteer had paused)."""
        if self._network is not None:
            await self._network()

    async def live_replicas(self, uids: Sequence[str]) -> dict[str, list[PeerAddress]]:
        """uid -> the other daemons announcing it now."""
        records = await self._node.dht.get(list(uids))
        me = self._node.peer_id
        return {
            uid: [PeerAddress(r.peer_id, r.addrs) for r in rs if r.peer_id != me]
            for uid, rs in records.items()
        }

    async def rebalance(self) -> Choice:
        """Choose again and apply the difference; returns the choice."""
        manifest = self.manifest
        if manifest is None:
            raise RuntimeError("rebalance() before the experiment's manifest was found")
        uids = manifest.uids()
        listed = await self.live_replicas(uids)
        if not self.rounds:
            # Just joined: connections to most peers are new and the first lookup is
            # the least reliable. Look twice.
            await trio.sleep(_RETRY_S / 2)
            for uid, peers in (await self.live_replicas(uids)).items():
                known = {a.peer_id for a in listed[uid]}
                listed[uid] += [a for a in peers if a.peer_id not in known]
        replicas = listed if self._checks is None else await self._checks.real(listed)
        seen = {uid: {a.peer_id for a in peers} for uid, peers in replicas.items()}
        # A replica seen in this lookup or the previous one counts: one lossy lookup
        # (a peer that did not answer in time) must not look like an orphaned expert.
        others = {uid: peers | self._seen_before.get(uid, set()) for uid, peers in seen.items()}
        self._seen_before = seen
        logger.debug("live replicas: %s", {uid: len(peers) for uid, peers in others.items()})
        # Experts whose replicas stayed busy all the last round's wait are left out of
        # this choice (hosted ones aside) for as long again: the room goes to experts
        # that can be downloaded now, not to a seed's refusals until its quota resets.
        # So are those whose replicas are all spent (``_SPENT_MOST_S``), until one may
        # give them; when adding finds more of them, the choice is made again at once.
        now = trio.current_time()
        self._busy_until = {u: at for u, at in self._busy_until.items() if at > now}
        for peer_id in [p for p, at in self._spent.items() if at <= now]:
            del self._spent[peer_id]
        prefer = await self._checkpointed(uids) if not self.rounds else ()
        self.rounds += 1
        added: list[str] = []
        dropped: list[str] = []
        held: set[str] = set()  # found waiting for a spent replica in this round
        for _ in range(len(uids) + 1):  # each pass leaves out one more expert at least
            self._spent_out = self._only_spent(uids, replicas, held)
            out = self._busy_until.keys() | self._spent_out.keys() | held
            choice = choose_experts(
                [uid for uid in uids if uid in self.hosted or uid not in out],
                others,
                self.hosted,
                capacity=self.capacity,
                peer_id=self._node.peer_id,
                replication=manifest.replication,
                now=trio.current_time(),
                min_stay_s=self._config.min_stay_s,
                prefer=prefer,
            )
            if not choice.changed:
                break
            logger.info(
                "hosting %d experts: +%s -%s",
                len(choice.applied_to(self.hosted)),
                ",".join(choice.add) or "none",
                ",".join(choice.drop) or "none",
            )
            if choice.drop:
                if self.hosted and choice.add:
                    self.moves += len(choice.drop)
                await self._drop(choice.drop)
            added += choice.add
            dropped += choice.drop
            # Only replicas that answered for their uid: a record costs nothing, and each
            # fake one tried for a download cost a newcomer ~30 s of timeouts and retries.
            spent = await self._add(choice.add, replicas, manifest.experts_config())
            if not spent:
                break
            held.update(spent)
        self._spent_out = self._only_spent(uids, replicas, held)
        return Choice(tuple(added), tuple(dropped))

    def _only_spent(
        self, uids: Sequence[str], replicas: Mapping[str, list[PeerAddress]], held: set[str]
    ) -> dict[str, float]:
        """uid -> the trio time one of its spent replicas may give it again, for the
        experts not hosted here whose known replicas are all spent, or (``held``) whose
        other replicas failed this round."""
        spent = self._spent
        out = {
            uid: min(spent[p.peer_id] for p in peers if p.peer_id in spent)
            for uid in uids
            if uid not in self.hosted
            and not self._overdue(uid)
            and (peers := replicas.get(uid, []))
            and any(p.peer_id in spent for p in peers)
            and (uid in held or all(p.peer_id in spent for p in peers))
        }
        now = trio.current_time()
        for uid in out:
            self._spent_since.setdefault(uid, now)
        return out

    def _overdue(self, uid: str) -> bool:
        """Whether ``uid`` waited on spent replicas ``_SPENT_MOST_S`` already: their
        refusals are only busy for it from then on."""
        since = self._spent_since.get(uid)
        return since is not None and trio.current_time() - since >= _SPENT_MOST_S

    def _spend(self, peer: PeerAddress, retry_after_s: float) -> bool:
        """Count ``peer`` as spent for ``retry_after_s`` (at most ``_SPENT_MOST_S``);
        False when it has made ``_SPENT_CLAIMS`` such claims in a row already: only
        busy, then."""
        peer_id = peer.peer_id
        now = trio.current_time()
        if peer_id in self._spent and self._spent[peer_id] > now:
            return True  # another expert's download, begun before it was found spent
        claims = self._spent_claims.get(peer_id, 0)
        if claims >= _SPENT_CLAIMS:
            return False
        remember(self._spent_claims, peer_id, claims + 1, _SPENT_PEERS)
        left = min(retry_after_s, _SPENT_MOST_S)
        remember(self._spent, peer_id, now + left, _SPENT_PEERS)
        wall = time.time()
        logger.info(
            "replica %s refuses downloads until %s (in %s): its daily transfer quota's "
            "share for them is used up; experts only it holds wait until then, and others "
            "are chosen in their place",
            short_id(peer_id),
            clock_time(wall + left, wall),
            span(left),
        )
        return True

    async def _checkpointed(self, uids: Sequence[str]) -> set[str]:
        """The uids this node has checkpoint files of (from an earlier run)."""
        checkpointer = self._checkpointer
        if checkpointer is None:
            return set()
        return await trio.to_thread.run_sync(
            lambda: {uid for uid in uids if checkpointer.has_checkpoint(uid)}
        )

    async def _drop(self, uids: Sequence[str]) -> None:
        for uid in uids:
            self.hosted.pop(uid, None)
            self.sources.pop(uid, None)
        # Withdraw first: trainers stop routing to them while their queues drain.
        self._announce()
        for uid in uids:
            try:
                backend = await self._runtime.remove_expert(uid)
            except UnknownExpert:
                continue
            if self._checkpointer is not None:
                await self._checkpointer.save(backend)

    async def _add(
        self, uids: Sequence[str], replicas: Mapping[str, list[PeerAddress]], experts: ExpertsConfig
    ) -> list[str]:
        """Host ``uids`` (``_add_in_turn``); returns those not hosted because their
        replicas are all spent."""
        # One at a time: a newcomer fetching many experts at once from the same
        # replicas would slow down their serving (and its own lookups).
        wakes = _Wakes(self._announce, self._announce_gap_s)
        spent: list[str] = []
        try:
            async with trio.open_nursery() as nursery:  # the wake-ups beside the loop
                nursery.start_soon(wakes.serve)
                await self._add_in_turn(uids, replicas, experts, wakes, spent)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # only the loop raises (the wake-ups do not): its error, as rebalance's
            # callers and ``error`` knew it, not a group of one
            raise group.exceptions[0] from None
        finally:
            self._busy_retry = None
            wakes.flush()
        return spent

    async def _add_in_turn(
        self,
        uids: Sequence[str],
        replicas: Mapping[str, list[PeerAddress]],
        experts: ExpertsConfig,
        wakes: _Wakes,
        spent: list[str],
    ) -> None:
        """Host ``uids`` one after another; those whose replicas were busy are tried
        again after the others, with backoff (``_BUSY_WAIT_S`` in all), and are left
        for the next rebalance if they still are. Those whose replicas are all spent
        are put in ``spent``, not tried again."""
        pending, delay, since = list(uids), _BUSY_FIRST_S, None
        while True:
            busy: list[str] = []
            for uid in pending:
                backend = await trio.to_thread.run_sync(self._runtime.make_backend, uid, experts)
                if self.manifest is not None:  # whose weights its checkpoints will hold
                    backend.experiment = f"{self.manifest.owner}/{self.manifest.name}"
                try:
                    source = await self._initial_state(backend, replicas.get(uid, []))
                except _ReplicasBusy:
                    busy.append(uid)
                    continue
                except _ReplicasSpent:
                    spent.append(uid)
                    continue
                self.sources[uid] = source
                await self._runtime.add_expert(backend)
                self.hosted[uid] = trio.current_time()
                # Served soon after it is ready, not after the others: each may take its
                # replicas' downloads (a newcomer with room for many served none
                # meanwhile).
                wakes.request()
            if not busy:
                return
            since = trio.current_time() if since is None else since  # the first refusal
            wait = delay * self._rng.uniform(0.5, 1.5)
            if trio.current_time() + wait - since > _BUSY_WAIT_S:
                logger.warning(
                    "not hosting %s for now: their replicas stayed busy for %.0f s; "
                    "other experts are chosen in their place for a while",
                    ",".join(busy),
                    trio.current_time() - since,
                )
                for uid in busy:
                    self._busy_until[uid] = trio.current_time() + _BUSY_WAIT_S
                    self._busy_rounds[uid] = self._busy_rounds.get(uid, 0) + 1
                return
            self._busy_retry = (busy[0], trio.current_time() + wait)
            logger.info(
                "%d experts wait for busy replicas (%s); trying again in %.0f s",
                len(busy),
                ",".join(busy),
                wait,
            )
            await trio.sleep(wait)
            pending, delay = busy, min(2 * delay, _BUSY_MOST_S)

    def _download_order(self, uid: str, replicas: Sequence[PeerAddress]) -> list[PeerAddress]:
        """The replicas to try, at most ``_MAX_DOWNLOADS``: only those that answered for
        ``uid`` (``ReplicaChecks``), in a random order (spreading newcomers' downloads
        over them). Listed peers that never answered are not tried: five fake records
        at an address that accepts and never speaks held a newcomer's start for 169 s,
        and a key holds hundreds of records. Nor are spent ones, until their time."""
        checks, spent, now = self._checks, self._spent, trio.current_time()
        overdue = self._overdue(uid)
        real = [
            p
            for p in replicas
            if (checks is None or checks.verified(p.peer_id, uid))
            and (overdue or spent.get(p.peer_id, 0.0) <= now)
        ]
        order = self._rng.sample(real, min(len(real), _MAX_DOWNLOADS))
        # the replica a cut download resumes from first: its partial file is its bytes
        resume = self._resume_from.get(uid)
        order.sort(key=lambda p: p.peer_id != resume)
        return order

    async def _initial_state(self, backend: ExpertBackend, replicas: Sequence[PeerAddress]) -> str:
        """Load ``backend``'s starting state; returns where it came from. When its
        checkpoints here were all damaged, says so at ERROR and in the error events
        (``Checkpointer.damaged``): its trained weights here are lost, and whether a
        replica's took their place matters (a warning in the log was all there was)."""
        checkpointer = self._checkpointer
        if checkpointer is None:
            return await self._fetched_state(backend, replicas)
        damaged: list[Path] = []
        if await checkpointer.restore_into(backend, damaged):
            await self._downloader.discard(backend.uid)  # what an earlier run left: no use now
            return "checkpoint"  # replica averaging catches it up with the others
        source = await self._fetched_state(backend, replicas)
        if damaged:
            instead = (
                f"was downloaded from a replica ({short(source.removeprefix('replica '))})"
                if source.startswith("replica ")
                else "starts from its initial weights (no replica could give it)"
            )
            checkpointer.damaged(backend.uid, damaged, instead)
        return source

    async def _fetched_state(self, backend: ExpertBackend, replicas: Sequence[PeerAddress]) -> str:
        """Load ``backend``'s state from a live replica, else keep its seeded weights;
        returns where it came from. Raises _ReplicasBusy when no replica gave it and
        one of them was only busy (``_later``): the expert exists and is not seeded;
        _ReplicasSpent when none was busy and one is spent (those are not tried)."""
        uid = backend.uid
        for attempt in range(_SEED_LOOKUPS):
            if replicas:
                break
            # Seeding an expert that has a replica would fork its weights: make sure.
            # A lookup can come back short (a storing peer that did not answer in time,
            # on a busy machine), so an orphan is believed only after a few of them.
            if attempt:
                await trio.sleep(_RETRY_S)
            replicas = (await self.live_replicas([uid]))[uid]
            if replicas and self._checks is not None:
                replicas = (await self._checks.real({uid: replicas}))[uid]
        tried = self._download_order(uid, replicas)
        now = trio.current_time()
        overdue = self._overdue(uid)  # waited a day on spent replicas: they are busy
        spent = not overdue and any(self._spent.get(p.peer_id, 0.0) > now for p in replicas)
        busy: list[str] = []
        for peer in tried:
            try:
                self._downloading = uid
                try:
                    state = await self._downloader.download(peer, backend)
                finally:
                    self._downloading = None
                await self._runtime.executor.run(partial(backend.load_state, state, moments=False))
            except (trio.TooSlowError, ShardTooSlow) as exc:
                if isinstance(exc, ShardTooSlow) and not exc.fetched:
                    # sent nothing: not queueing it (``_later``), a real failure
                    logger.warning("could not download %s from %s: %s", uid, peer, exc)
                    continue
                # Slow, not failed: resumed from its partial file on the next try. Seeded
                # instead, a newcomer forked every big expert over a slow uplink and
                # threw away what had come (141 of 384 MiB at 2 Mbit/s; an outside audit).
                why = str(exc) or "past its bound"
                logger.info(
                    "%s: the download from %s was too slow (%s); resumed later", uid, peer, why
                )
                self._resume_from[uid] = peer.peer_id
                busy.append(f"{short(peer.peer_id)} too slow")
                continue
            except (VolunteerdError, OSError) as exc:
                after = _retry_after(exc)
                quota = after is not None and after > _BUSY_WAIT_S and _later(exc)
                if quota and after is not None and not overdue and self._spend(peer, after):
                    spent = True
                    continue
                if _later(exc):
                    logger.info("%s: replica %s is busy: %s", uid, peer, exc)
                    busy.append(str(exc))
                    continue
                logger.warning("could not download %s from %s: %s", uid, peer, exc)
                continue
            except Exception as exc:  # a stranger's bytes met a bug: that replica's failure
                logger.warning(
                    "could not download %s from %s: %s: %s", uid, peer, type(exc).__name__, exc
                )
                continue
            logger.info("downloaded %s from %s (%d updates)", uid, peer, state.updates)
            self._busy_rounds.pop(uid, None)
            self._spent_since.pop(uid, None)
            self._resume_from.pop(uid, None)
            self._spent_claims.pop(peer.peer_id, None)  # it gives again: a new day
            return f"replica {peer.peer_id}"
        if spent and not busy:
            # what its downloads left is resumed once a replica gives it
            raise _ReplicasSpent(f"{uid}: its replicas' transfer quotas are used up")
        if busy and self._busy_rounds.get(uid, 0) < _BUSY_ROUNDS:
            # what its downloads left is resumed on the next try
            raise _ReplicasBusy(f"{uid}: {len(busy)} of its replicas were busy ({busy[0]})")
        if busy:
            logger.warning(
                "seeding %s: its replicas stayed busy through %d rounds (%s); its weights "
                "differ from theirs until replica averaging brings them together",
                uid,
                _BUSY_ROUNDS,
                busy[0],
            )
            tried = []  # said: not "all failed"
        self._busy_rounds.pop(uid, None)
        self._spent_since.pop(uid, None)
        self._resume_from.pop(uid, None)
        await self._downloader.discard(uid)
        if tried:
            logger.warning(
                "seeding %s: its %d replicas tried all failed; its weights differ from "
                "theirs until replica averaging brings them together",
                uid,
                len(tried),
            )
        return "seed"


class _ReplicasBusy(Exception):
    """No replica of an expert gave its state, and one of them was only busy: the
    expert exists, to be downloaded later rather than seeded."""


class _ReplicasSpent(Exception):
    """No replica of an expert gave its state, and one of them is spent (none busy):
    the expert exists, and other experts take its room until a replica may give it."""


def _later(exc: BaseException) -> bool:
    """Whether a download failed only because its replica was busy: it answered
    ``busy``, ``paused`` or ``rate_limited`` (``Busy``, ``Paused``, ``RateLimited`` or
    their ``RemoteError``; a ShardError of retries caused by one of those). One that
    sent nothing within the queue's bound and the grace (a RequestTimeout) was not
    queueing the request: an honest replica answers ``busy`` by then."""
    if isinstance(exc, ShardError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return getattr(exc, "code", None) in _LATER_CODES


def _retry_after(exc: BaseException) -> float | None:
    """How long the refusal behind ``exc`` says to wait (``retry_after_s``), if it
    said (a ShardError's cause's)."""
    if isinstance(exc, ShardError) and exc.__cause__ is not None:
        exc = exc.__cause__
    after = getattr(exc, "retry_after_s", None)
    return after if isinstance(after, int | float) else None


def _expired(expires_at: float) -> str:
    """Why an expired manifest's experts are not hosted, for the volunteer."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires_at))
    return f"the experiment's manifest expired on {when}; its owner must publish it again"


def _built_differently(old: ExperimentManifest, new: ExperimentManifest) -> bool:
    """Whether ``new``'s experts cannot simply go on from ``old``'s: another owner's
    (checkpoints record whose weights they hold), or another type, size, dtype,
    optimizer or seed (the uid grid aside: a rebalance follows that)."""
    if old.owner != new.owner:
        return True
    built = old.experts_config().model_copy(update={"uids": ""})
    return built != new.experts_config().model_copy(update={"uids": ""})


def _unusable(unusable: Sequence[str]) -> str:
    """Why a trusted owner's manifest cannot be used here, for the volunteer."""
    return (
        f"this volunteerd cannot use it: {unusable[0]} (was it published with a newer "
        "volunteerd? upgrade)"
    )
