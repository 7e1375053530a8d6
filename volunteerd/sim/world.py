"""The simulated swarm: volunteers that join, choose experts, announce, serve, fail and
return, with the production decision code where the swarm decides something.

What runs as in production (imported, not re-implemented):

* **choosing experts**: ``swarm.assignment.choose_experts`` on joining (fill, ties to
  checkpoints held) and every ``experiments.rebalance_every_s`` (shrink, moves with
  hysteresis, ``min_stay_s``), from what the DHT lists now;
* **records, expiry and refresh**: the DHT's records live in one production
  ``net.store.SignedRecordStore`` standing for the storing nodes of every key (they hold
  the same records): its per-key cap (``max_records_per_key``: writers seen longest
  first keep their place, a newcomer waits for room), its per-writer cap and its expiry
  on read. Records are the announcer's (``net.announce.children_by_key``: a record per
  prefix and per uid). A volunteer re-announces every ``announce_period_s`` while it
  runs; rather than one event per refresh (millions at 10,000 volunteers) the refresh is
  applied in closed form: a running volunteer's records do not lapse, a crashed one's
  lapse ``record_ttl_s`` after its last refresh (exactly when the store would drop
  them), and a volunteer leaving gracefully withdraws them (inactive records, as
  ``Announcer.records(withdraw=...)`` writes). A record the store refused is offered
  again at the next refresh instant;
* **serving**: every call runs the real expert math (``experts.ExpertBackend``: forward,
  kept forward, backward through it, optimizer step) and the real staleness meter
  (``runtime.retained.StalenessMeter``). Replicas of one expert share one backend: the
  simulator assumes replica averaging keeps them equal (see docs/scale.md);
* the **trainer's side** (sim.trainer): RemoteMixtureOfExperts, ExpertDirectory,
  call_many, bans, checks, all unchanged, through ``SimRpc``.

What is modelled: link delays and rates (sim.network, sim.links), compute time
(sim.calibration), DHT lookups' hops and messages (sim.kademlia), when volunteers come
and go (``Churn``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import trio

from volunteerd.config import Config, DHTConfig
from volunteerd.errors import InvalidRecord, PeerUnreachable, RemoteError
from volunteerd.experts import ExpertBackend, from_wire, to_wire
from volunteerd.experts.backend import Retained
from volunteerd.moe.layer import grid_uids
from volunteerd.net import ExpertRecord, PeerAddress, Verb, children_by_key
from volunteerd.net.envelope import RecordKind
from volunteerd.net.records import EXPERT_RECORDS
from volunteerd.net.store import SignedRecordStore
from volunteerd.runtime.retained import StalenessMeter, StalenessStats
from volunteerd.sim.calibration import Calibration
from volunteerd.sim.kademlia import (
    FIND_NODE_REPLY_BYTES,
    FIND_NODE_REQUEST_BYTES,
    LookupCost,
    lookup_cost,
    store_messages,
)
from volunteerd.sim.links import LAN, Link, home_links, one_way_s
from volunteerd.sim.network import Cpu, Host, Network
from volunteerd.swarm import assignment
from volunteerd.train.experiment import Experiment
from volunteerd.train.loop import expert_config
from volunteerd.wire import (
    BackwardRequest,
    BatchReply,
    ErrorReply,
    ForwardRequest,
    TensorReply,
    WireTensor,
)

if TYPE_CHECKING:
    from trio_typing import TaskStatus

__all__ = [
    "FIND_NODE_REPLY_BYTES",
    "FIND_NODE_REQUEST_BYTES",
    "STORE_REPLY_BYTES",
    "STORE_REQUEST_BYTES",
    "Churn",
    "SimDHT",
    "SimRpc",
    "Volunteer",
    "World",
]

# A message's header and framing, besides its tensors (a JSON header of a few hundred
# bytes, the frame, Yamux and Noise overheads).
HEADER_BYTES = 400
# A STORE request carries one record (measured: ~1.4 KiB in memory, ~600 B as JSON);
# its answer is an acknowledgement.
STORE_REQUEST_BYTES = 700
STORE_REPLY_BYTES = 100
# The share of a prefix key's record per child (measured: ~40 bytes more per child).
_RECORD_BYTES = 600
# How fresh the DHT's listing is when a volunteer chooses its experts.
_VIEW_S = 0.1
_FAR = 1e12  # "does not lapse while its writer runs" (finite: the store checks it)
# The researcher's machine: the paper's 100 Mbit/s, on a university or cloud network.
TRAINER_LINK = Link(up_mbps=100.0, down_mbps=100.0, rtt_ms=10.0)


@dataclass(frozen=True, slots=True)
class Churn:
    """When volunteers are there.

    ``failing``: the share of the time a volunteer is down, crash-style (its records
    stay listed until they lapse): each volunteer alternates up ~Exp(mean
    ``down_mean_s * (1 - failing) / failing``) and down ~Exp(``down_mean_s``).
    ``session_mean_s``: graceful sessions (the daemon stops and withdraws its records),
    ~Exp, each followed by an absence of the same mean; inf = none.
    ``wrong``: the share of volunteers answering wrongly (outputs and gradients scaled
    by ``wrong_scale``). ``warmup_s``: volunteers first join spread over this long."""

    failing: float = 0.0
    down_mean_s: float = 60.0
    session_mean_s: float = math.inf
    wrong: float = 0.0
    wrong_scale: float = 1000.0
    warmup_s: float = 30.0


class _UnsignedExperts(RecordKind[ExpertRecord]):
    """The expert record kind without the signature check: every simulated record is
    written by the volunteer it names (the store's other checks and caps all apply)."""

    def validate(self, record: ExpertRecord, config: DHTConfig, *, now: float) -> None:
        if not record.expires_at > now:
            raise InvalidRecord("expired")
        self.rules(record, config)


_KIND = _UnsignedExperts(
    **{f: getattr(EXPERT_RECORDS, f) for f in EXPERT_RECORDS.__dataclass_fields__}
)


@dataclass(slots=True, eq=False)
class Volunteer:
    index: int
    peer_id: str
    host: Host
    capacity: int
    honest: bool = True
    online: bool = False
    epoch: int = 0  # bumped when it goes away: work of an earlier presence is void
    hosted: dict[str, float] = field(default_factory=dict)  # uid -> hosted since
    serving: set[str] = field(default_factory=set)  # downloaded, answering
    checkpoints: set[str] = field(default_factory=set)  # uids it has hosted before
    announced_at: float = 0.0  # the phase of its announcements
    # handle -> (uid, the kept forward, the expert's updates then, when): in order
    kept: dict[str, tuple[str, Retained, int, float]] = field(default_factory=dict)
    online_s: float = 0.0
    last_up: float = 0.0
    answered: int = 0

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self.peer_id, ())


class SimDHT:
    """The DHT as the trainer's ``ExpertDirectory`` sees it (``RecordLookup``): the
    store's records, after a lookup's modelled hops."""

    def __init__(self, world: World, lookups: LookupCost) -> None:
        self.world = world
        self.cost = lookups
        self.store: SignedRecordStore[ExpertRecord] = SignedRecordStore(
            _KIND, _store_config(world.config.dht), clock=trio.current_time
        )
        self.lookups = 0
        self.lookup_s: list[float] = []

    async def get(self, keys: Sequence[str]) -> dict[str, list[ExpertRecord]]:
        """One lookup per key, in parallel: the slowest one's hops of round trips."""
        world = self.world
        trainer = world.trainer_host
        rtt = 2 * one_way_s(trainer.link, world.typical_link)
        seconds = self.cost.hops_mean * rtt if keys else 0.0
        requests = len(keys) * (self.cost.messages_mean + world.config.dht.replication)
        trainer.traffic.sent("dht", requests * FIND_NODE_REQUEST_BYTES, requests)
        trainer.traffic.received("dht", requests * FIND_NODE_REPLY_BYTES, requests)
        world.dht_answered_messages += requests
        self.lookups += len(keys)
        self.lookup_s.append(seconds)
        await trio.sleep(seconds)
        # In a large swarm a lookup can end at nodes that do not hold a writer's record
        # (sim.kademlia: found_record): each listed record is missed with that chance.
        miss = 1.0 - self.cost.found_record
        return {
            key: [
                r
                for r in self.store.get(key)
                if r.active and (miss <= 0 or world.rng.random() >= miss)
            ]
            for key in keys
        }

    def listed(self, uid: str) -> list[str]:
        """Peer ids the DHT lists as hosting ``uid`` now."""
        return [r.peer_id for r in self.store.get(uid) if r.active]


def _store_config(config: DHTConfig) -> DHTConfig:
    """One store stands for the storing nodes of *every* key: their per-key and
    per-writer caps apply as configured; the per-node totals (which bound one node's
    share of the keys) are lifted."""
    return config.model_copy(update={"max_keys": 10**9, "store_budget_mb": 1e6})


class World:
    """Volunteers, the DHT, the network and the experts' weights."""

    def __init__(
        self,
        experiment: Experiment,
        calibration: Calibration,
        *,
        volunteers: int,
        capacity: int,
        churn: Churn,
        links: str = "home",
        shared_cores: int = 0,
        seed: int = 0,
        config: Config | None = None,
        placement: Sequence[Sequence[str]] | None = None,
        background_cpu: float = 0.0,
    ) -> None:
        """``placement``: the uids each volunteer hosts, fixed (daemons started with
        ``experts.uids``, as the demo's local swarm); None: they choose, as daemons
        that joined an experiment do. ``background_cpu``: the share of a core each
        volunteer's daemon spends on its own upkeep (DHT, connections, statistics),
        booked on its device every second: it matters where hosts share cores."""
        self.background_cpu = background_cpu
        self.requests = 0  # requests the trainer sent to volunteers
        self.served_s = 0.0  # device seconds they cost
        self.experiment = experiment
        self.calibration = calibration
        self.config = config or Config()
        self.churn = churn
        self.rng = random.Random(seed)
        self.network = Network()
        self.experts_config = expert_config(experiment)
        m = experiment.model
        self.uids = [u for b in range(m.num_blocks) for u in grid_uids(m.layer_name(b), m.grid)]
        self.backends: dict[str, ExpertBackend] = {}
        self.staleness: dict[str, StalenessMeter] = {}
        shared = Cpu(shared_cores) if shared_cores else None
        count = volunteers + 1
        sampled = [LAN] * count if links == "lan" else home_links(count, seed)
        self.typical_link = LAN if links == "lan" else home_links(1, seed + 1)[0]
        trainer_link = LAN if links == "lan" else TRAINER_LINK
        self.trainer_host = Host("trainer", trainer_link, Cpu(1, shared))
        self.placement = [list(p) for p in placement] if placement is not None else None
        self.volunteers = [
            Volunteer(
                i,
                f"sim{i:06d}",
                Host(f"sim{i:06d}", sampled[i + 1], Cpu(1, shared)),
                capacity,
            )
            for i in range(volunteers)
        ]
        self.by_peer = {v.peer_id: v for v in self.volunteers}
        liars = self.rng.sample(self.volunteers, round(churn.wrong * volunteers))
        for v in liars:
            v.honest = False
        self.dht = SimDHT(self, lookup_cost(max(volunteers, 2), seed=seed))
        self.dht_answered_messages = 0.0
        self.announces = 0
        self.store_messages = store_messages(max(volunteers, 2), self.config.dht.replication)
        self._events: list[tuple[float, int, str, int, int]] = []
        self._seq = itertools.count()
        self._handles = itertools.count()
        self._seen: tuple[float, dict[str, list[str]]] | None = None
        self.moves = 0
        self.downloads = 0
        self.refused_records = 0
        self.started_at = 0.0

    # -- experts ------------------------------------------------------------------------

    def backend(self, uid: str) -> ExpertBackend:
        backend = self.backends.get(uid)
        if backend is None:
            backend = ExpertBackend(
                uid, self.experts_config, torch.device("cpu"), self.config.runtime.max_batch_size
            )
            self.backends[uid] = backend
            self.staleness[uid] = StalenessMeter()
        return backend

    def expert_state_bytes(self) -> int:
        """What a volunteer downloads to join an expert: parameters and Adam's moments."""
        backend = self.backend(self.uids[0])
        return 3 * sum(p.numel() * 4 for p in backend.module.parameters())

    def expert_param_bytes(self) -> int:
        backend = self.backend(self.uids[0])
        return sum(p.numel() * 4 for p in backend.module.parameters())

    def staleness_stats(self) -> StalenessStats:
        total = StalenessStats()
        for meter in self.staleness.values():
            total = total + meter.statistics()
        return total

    # -- the swarm's own events ----------------------------------------------------------

    def _at(self, when: float, kind: str, v: Volunteer) -> None:
        heapq.heappush(self._events, (when, next(self._seq), kind, v.index, v.epoch))

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the volunteers' lives until cancelled."""
        self.started_at = trio.current_time()
        churn = self.churn
        for v in self.volunteers:
            start = self.rng.uniform(0, churn.warmup_s)
            if churn.failing > 0 and self.rng.random() < churn.failing:
                # down when the trainer comes: its first presence starts later
                start += self.rng.expovariate(1 / churn.down_mean_s)
            self._at(self.started_at + start, "join", v)
        if self.background_cpu > 0:
            for v in self.volunteers:
                self._at(self.started_at + 1.0, "upkeep", v)
        task_status.started()
        while True:
            if not self._events:
                await trio.sleep_forever()
            when, _, kind, index, epoch = self._events[0]
            await trio.sleep_until(when)
            heapq.heappop(self._events)
            v = self.volunteers[index]
            if epoch != v.epoch:
                continue  # planned for an earlier presence
            self._handle(kind, v)

    def _handle(self, kind: str, v: Volunteer) -> None:
        now = trio.current_time()
        churn = self.churn
        if kind == "join":
            self._join(v)
            if churn.failing > 0:
                up_mean = churn.down_mean_s * (1 - churn.failing) / churn.failing
                self._at(now + self.rng.expovariate(1 / up_mean), "crash", v)
            if math.isfinite(churn.session_mean_s):
                self._at(now + self.rng.expovariate(1 / churn.session_mean_s), "leave", v)
            self._at(now + self._jitter(self.config.experiments.rebalance_every_s), "rebalance", v)
        elif kind in ("crash", "leave"):
            self._away(v, crashed=kind == "crash")
            mean = churn.down_mean_s if kind == "crash" else churn.session_mean_s
            self._at(now + self.rng.expovariate(1 / mean), "join", v)
        elif kind == "rebalance":
            self._rebalance(v)
            self._at(now + self._jitter(self.config.experiments.rebalance_every_s), "rebalance", v)
        elif kind == "serve":
            # a download finished: the experts it brought are answered (and announced,
            # as the joiner does) from now on
            v.serving = set(v.hosted)
            self._announce(v, v.serving)
        elif kind == "announce":
            self._announce(v, v.serving)
        elif kind == "upkeep":
            if v.online:
                v.host.cpu.reserve(self.background_cpu)
            self._at(now + 1.0, "upkeep", v)

    def _jitter(self, seconds: float) -> float:
        return seconds * self.rng.uniform(0.8, 1.2)

    def seen(self) -> dict[str, list[str]]:
        """uid -> peer ids the DHT lists for it: a volunteer's view when it chooses (one
        snapshot per ``_VIEW_S`` of virtual time: a daemon's own lookups of the
        experiment's uids take about that long)."""
        now = trio.current_time()
        if self._seen is None or now - self._seen[0] >= _VIEW_S:
            self._seen = (now, {uid: self.dht.listed(uid) for uid in self.uids})
        return self._seen[1]

    def _join(self, v: Volunteer) -> None:
        now = trio.current_time()
        v.online = True
        v.last_up = now
        v.announced_at = now
        if self.placement is not None:
            v.hosted = {uid: now for uid in self.placement[v.index % len(self.placement)]}
            v.serving = set(v.hosted)
            self._announce(v, v.hosted)
            return
        choice = self._choose(v, {})
        v.hosted = {uid: now for uid in choice.add}
        self._download(v, [u for u in choice.add if u not in v.checkpoints])
        self._announce(v, v.serving)

    def _choose(self, v: Volunteer, hosted: dict[str, float]) -> assignment.Choice:
        """What a daemon of ``v``'s capacity decides, from what the DHT lists now."""
        return assignment.choose_experts(
            self.uids,
            self.seen(),
            hosted,
            capacity=v.capacity,
            peer_id=v.peer_id,
            replication=self.config.dht.replication,
            now=trio.current_time(),
            min_stay_s=self.config.experiments.min_stay_s,
            prefer=v.checkpoints,
        )

    def _download(self, v: Volunteer, uids: Iterable[str]) -> None:
        """Fetch the state of ``uids`` from a replica the DHT lists (or start from the
        seed when none is): the volunteer answers for them once all arrived."""
        now = trio.current_time()
        done = now
        nbytes = self.expert_state_bytes()
        uids = list(uids)
        for uid in uids:
            sources = [self.by_peer[p] for p in self.seen().get(uid, []) if p in self.by_peer]
            sources = [s for s in sources if s.online and s is not v]
            if not sources:
                continue
            src = self.rng.choice(sources)
            done = max(done, self.network.arrival(src.host, v.host, nbytes, "download"))
            self.downloads += 1
        v.checkpoints.update(v.hosted)
        if done > now:
            v.serving = {u for u in v.hosted if u not in uids}
            self._at(done, "serve", v)
        else:
            v.serving = set(v.hosted)

    def _records(self, v: Volunteer, uids: Iterable[str], *, active: bool) -> list[ExpertRecord]:
        now = trio.current_time()
        return [
            ExpertRecord.model_construct(
                key=key,
                peer_id=v.peer_id,
                addrs=(),
                children=tuple(sorted(children)),
                active=active,
                issued_at=now,
                expires_at=_FAR if active else now + self.config.dht.record_ttl_s,
                signature="",
            )
            for key, children in children_by_key(uids).items()
        ]

    def _announce(self, v: Volunteer, uids: Iterable[str], *, active: bool = True) -> None:
        """Store ``v``'s records; one refused is offered again at the next refresh."""
        refused = False
        for record in self._records(v, uids, active=active):
            if not self.dht.store.put(record):
                refused = True
                self.refused_records += 1
        self.announces += 1
        if refused and active:
            self._at(self._next_refresh(v), "announce", v)

    def crash(self, v: Volunteer) -> None:
        """``v`` stops answering at once; its records stay until they lapse."""
        if v.online:
            self._away(v, crashed=True)

    def leave(self, v: Volunteer) -> None:
        """``v`` stops as a daemon does on a signal: its records are withdrawn."""
        if v.online:
            self._away(v, crashed=False)

    def _next_refresh(self, v: Volunteer) -> float:
        """The first of ``v``'s announcement instants strictly after now."""
        period = self.config.dht.announce_period_s
        done = math.floor((trio.current_time() - v.announced_at) / period + 1e-9)
        return v.announced_at + (done + 1) * period

    def _away(self, v: Volunteer, *, crashed: bool) -> None:
        now = trio.current_time()
        v.online = False
        v.epoch += 1
        v.online_s += now - v.last_up
        v.kept.clear()
        announced, v.serving = v.serving, set()
        if crashed:
            # its records lapse record_ttl_s after its last refresh
            last = self._next_refresh(v) - self.config.dht.announce_period_s
            ttl = self.config.dht.record_ttl_s
            for record in self._records(v, announced, active=True):
                lapsing = record.model_copy(
                    update={"issued_at": last + 1e-6, "expires_at": last + ttl}
                )
                if lapsing.expires_at > now:
                    self.dht.store.put(lapsing)
                else:
                    self.dht.store.put(record.model_copy(update={"active": False}))
        else:
            self._announce(v, v.hosted, active=False)

    def _rebalance(self, v: Volunteer) -> None:
        if not v.online or self.placement is not None:
            return
        now = trio.current_time()
        choice = self._choose(v, v.hosted)
        if not choice.changed:
            return
        self.moves += len(choice.add)
        before = set(children_by_key(v.hosted))
        v.hosted = {u: t for u, t in v.hosted.items() if u not in choice.drop}
        v.hosted.update({u: now for u in choice.add})
        gone = before - set(children_by_key(v.hosted))
        for record in self._records(v, choice.drop, active=False):
            if record.key in gone:  # withdrawn: listed no more
                self.dht.store.put(record)
        v.serving -= set(choice.drop)
        self._download(v, [u for u in choice.add if u not in v.checkpoints])
        self._announce(v, v.serving)

    # -- serving --------------------------------------------------------------------------

    def handle(self, v: Volunteer, verb: Verb, header: Any, buffers: Sequence[bytearray]) -> Any:
        """What ``v`` answers (after its compute is charged): a reply header and its
        tensors' bytes; raises RemoteError for a typed refusal of a plain request."""
        if verb == Verb.INFO:
            if header.uid not in v.hosted:
                raise RemoteError("unknown_expert", header.uid)
            return self.backend(header.uid).info, []
        if verb in (Verb.FORWARD_BATCH, Verb.BACKWARD_BATCH):
            items: list[Any] = []
            out: list[bytes] = []
            offset = 0
            for item in header.items:
                count = len(item.tensors)
                try:
                    reply, data = self._one(v, item, buffers[offset : offset + count])
                except RemoteError as exc:
                    items.append(ErrorReply(code=exc.code, message=str(exc)[:200]))
                else:
                    items.append(reply)
                    out.extend(data)
                offset += count
            return BatchReply(items=items), out
        return self._one(v, header, buffers)

    def _one(
        self, v: Volunteer, header: Any, buffers: Sequence[bytearray]
    ) -> tuple[Any, list[bytes]]:
        uid = header.uid
        if uid not in v.serving:
            raise RemoteError("unknown_expert", f"{uid} is not hosted here")
        backend = self.backend(uid)
        tensors = [
            from_wire(WireTensor(m.dtype, tuple(m.shape), memoryview(b)))  # type: ignore[arg-type]
            for m, b in zip(header.tensors, buffers, strict=True)
        ]
        scale = 1.0 if v.honest else self.churn.wrong_scale
        handle = None
        if isinstance(header, ForwardRequest):
            if header.retain:
                now = trio.current_time()
                self._forget_kept(v, now)
                outs, retained = backend.forward_retained(tensors)
                handle = f"{next(self._handles):032x}"
                v.kept[handle] = (uid, retained, backend.updates, now)
            else:
                outs = backend.forward(tensors)
        elif isinstance(header, BackwardRequest):
            if header.handle is not None:
                kept = v.kept.pop(header.handle, None)
                if kept is None or kept[0] != uid:
                    raise RemoteError("expired", "no kept forward under this handle")
                _, retained, updates, _ = kept
                [outs] = backend.backward_retained([(retained, tensors)])
                self.staleness[uid].record(backend.updates - updates)
            else:
                outs = backend.backward(tensors[:1], tensors[1:])
                self.staleness[uid].record_stateless()
            if v.honest:
                backend.step()
            else:  # a liar's gradients never reach the weights it shares with replicas
                backend.optimizer.zero_grad(set_to_none=False)
        else:  # pragma: no cover - the verbs above are all the trainer sends
            raise RemoteError("bad_request", type(header).__name__)
        v.answered += 1
        encoded = [to_wire(o.float() * scale, header.compression) for o in outs]
        return TensorReply(tensors=[m for m, _ in encoded], handle=handle), [b for _, b in encoded]

    def _forget_kept(self, v: Volunteer, now: float) -> None:
        """Kept forwards older than ``runtime.retain_s`` are let go, as a daemon does
        (their backward, if it ever comes, is answered ``expired``)."""
        limit = now - self.config.runtime.retain_s
        while v.kept:
            handle, kept = next(iter(v.kept.items()))
            if kept[3] > limit:
                return
            del v.kept[handle]

    def compute_s(self, verb: Verb, header: Any) -> float:
        """Device seconds ``header`` costs its server (sim.calibration)."""
        cal = self.calibration
        if verb == Verb.INFO:
            return cal.server_request_s
        items = header.items if verb in (Verb.FORWARD_BATCH, Verb.BACKWARD_BATCH) else [header]
        seconds = cal.server_request_s
        for item in items:
            rows = item.tensors[0].shape[0] if item.tensors else 0
            if isinstance(item, BackwardRequest):
                a, b = cal.backward_s
                seconds += cal.optimizer_step_s  # a step after every backward
            elif item.retain or cal.inference_s == (0.0, 0.0):
                a, b = cal.forward_s
            else:
                a, b = cal.inference_s
            seconds += a + b * rows
        return seconds

    # -- what it amounts to ----------------------------------------------------------------

    def availability(self) -> dict[str, int]:
        """How many uids have a volunteer answering for them now, and how many the DHT
        lists."""
        serving = {u for v in self.volunteers if v.online for u in v.serving}
        listed = {u for u in self.uids if self.dht.listed(u)}
        return {"uids": len(self.uids), "serving": len(serving), "listed": len(listed)}


class SimRpc:
    """The trainer's ``RpcClient`` in the simulation: ``call`` delivers the request
    over the modelled links, queues it on the volunteer's device and runs it there
    (``World.handle``). A volunteer that is gone does not answer: a dial waits
    ``timeouts.connect_s`` and fails; a request in flight when it goes never returns
    (the caller's timeout ends it), as with a home PC switched off."""

    def __init__(self, world: World, host: Host) -> None:
        self.world = world
        self.host = host
        self.calls = 0

    async def call(
        self, peer: PeerAddress, verb: Verb, header: Any, buffers: Sequence[Any] = ()
    ) -> tuple[Any, list[WireTensor]]:
        world = self.world
        self.calls += 1
        await self.host.cpu.run(world.calibration.client_request_s)
        v = world.by_peer.get(peer.peer_id)
        if v is None or not v.online:
            await trio.sleep(world.config.timeouts.connect_s)
            raise PeerUnreachable(f"{peer.peer_id} does not answer")
        epoch = v.epoch
        size = HEADER_BYTES + sum(len(b) for b in buffers)
        await world.network.send(self.host, v.host, size, "serve")
        if v.epoch != epoch:
            await trio.sleep_forever()
        seconds = world.compute_s(verb, header)
        world.requests += 1
        world.served_s += seconds
        await v.host.cpu.run(seconds)
        if v.epoch != epoch:
            await trio.sleep_forever()
        try:
            reply, data = world.handle(v, verb, header, [bytearray(b) for b in buffers])
        except RemoteError as exc:
            await world.network.send(v.host, self.host, HEADER_BYTES, "serve")
            raise exc
        await world.network.send(
            v.host, self.host, HEADER_BYTES + sum(len(b) for b in data), "serve"
        )
        metas = _metas(reply)
        return reply, [
            WireTensor(m.dtype, tuple(m.shape), memoryview(b))  # type: ignore[arg-type]
            for m, b in zip(metas, data, strict=True)
        ]

    async def hang_up(self, peer_id: str) -> None:
        """A trainer that bans a peer for a timeout closes its connection. The links
        modelled here hold no connections (each call is delivered on its own), so the
        next call is as the first: nothing to close."""

    async def aclose(self) -> None:
        pass


def _metas(reply: Any) -> list[Any]:
    if isinstance(reply, BatchReply):
        return [m for item in reply.items if isinstance(item, TensorReply) for m in item.tensors]
    return list(getattr(reply, "tensors", []))
