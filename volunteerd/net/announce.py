"""The announcer: keeps this server's experts findable, and withdraws them on exit.

Every ``announce_period_s`` it signs fresh records (lifetime ``record_ttl_s``) for
every key of every hosted uid and stores them on the closest peers. Leaving
``serve`` (cancellation) publishes withdrawn records within a shielded, bounded grace
period, so a cleanly stopped server vanishes from lookups at once; a crashed one
vanishes when its last records expire, within ``record_ttl_s``. While paused
(``set_paused``) it announces nothing and withdraws what it had announced; once that
withdrawal went out, its rounds (like those of a node hosting nothing) touch the DHT
not at all.

Each round first asks a holder of one of last round's prefix records (in turn) which
record under this node's id it holds now (``ExpertDHT.look_for_copies``): another
daemon using this identity (a copied identity.key) has replaced it since, and is told
(``net.clones``). The prefixes: copies share them even when they host other experts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio

from volunteerd.config import DHTConfig, TimeoutsConfig
from volunteerd.identity import Identity
from volunteerd.net.dht import ExpertDHT, StoreOutcome
from volunteerd.net.records import ExpertRecord, sign_record
from volunteerd.uids import split_uid, uid_prefixes

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["Announcer", "children_by_key"]

logger = logging.getLogger(__name__)


def children_by_key(uids: Iterable[str]) -> dict[str, set[int]]:
    """Every key to announce for ``uids`` -> the next coordinates under it (empty for a uid)."""
    out: dict[str, set[int]] = {}
    for uid in uids:
        _, coords = split_uid(uid)
        for depth, key in enumerate(uid_prefixes(uid)):
            children = out.setdefault(key, set())
            if depth < len(coords):
                children.add(coords[depth])
    return out


class Announcer:
    def __init__(
        self,
        dht: ExpertDHT,
        identity: Identity,
        peer_id: str,
        addrs: Iterable[str],
        config: DHTConfig,
        timeouts: TimeoutsConfig,
    ) -> None:
        self._dht = dht
        self._identity = identity
        self._peer_id = peer_id
        self._addrs = tuple(addrs)
        self._config = config
        self._timeouts = timeouts
        self._uids: set[str] = set()
        self._announced: set[str] = set()
        self._wake = trio.Event()
        self._paused = False
        self._lock = trio.Lock()  # one round at a time: a withdrawal is never overtaken
        self.last_outcome: StoreOutcome | None = None
        self.unheard = False  # the last round's records reached no other peer
        self.withheld = False  # the last read-back found no holder giving a record back
        self._read_backs = 0  # rounds read back: which prefix and uid come next
        self._prefixes: list[str] = []  # the prefix keys announced last round

    def set_addrs(self, addrs: Iterable[str]) -> None:
        """Announce these addresses from the next round on (which starts at once); the
        reachability service calls this when the node moves to or from a relay."""
        self._addrs = tuple(addrs)
        self._wake.set()

    def set_uids(self, uids: Iterable[str]) -> None:
        """Announce exactly these uids from the next round on (which starts at once)."""
        self._uids = set(uids)
        self._wake.set()

    def set_paused(self, paused: bool) -> None:
        """Paused: announce nothing and withdraw the announced uids (in the next round,
        which starts at once; await ``announce_now`` to have it done)."""
        self._paused = paused
        self._wake.set()

    def _live(self) -> set[str]:
        return set() if self._paused else self._uids

    def records(self, *, withdraw: Iterable[str] = ()) -> list[ExpertRecord]:
        active = children_by_key(self._live())
        gone = children_by_key(withdraw)
        now = self._dht.clock.now()  # the swarm's time, where this clock is off
        out = [
            sign_record(
                self._identity,
                self._peer_id,
                key=key,
                addrs=self._addrs,
                children=children,
                ttl_s=self._config.record_ttl_s,
                now=now,
            )
            for key, children in active.items()
        ]
        out.extend(
            sign_record(
                self._identity,
                self._peer_id,
                key=key,
                addrs=self._addrs,
                ttl_s=self._config.record_ttl_s,
                now=now,
                active=False,
            )
            for key in gone
            if key not in active
        )
        return out

    async def announce_now(self) -> StoreOutcome:
        """One round: store fresh records of the live uids and withdrawals of those no
        longer live. A round with neither (paused after its withdrawal went out, or
        hosting nothing) leaves the DHT alone: a paused daemon ran a read-back and an
        empty store every ``announce_period_s`` (an outside audit)."""
        async with self._lock:
            if not self._live() and not self._announced:
                self._prefixes = []
                self.last_outcome = outcome = StoreOutcome({})
                self.unheard = False  # nothing to be heard
                return outcome
            if self._prefixes:  # before this round's records replace last round's
                await self._dht.look_for_copies(
                    self._prefixes[self._read_backs % len(self._prefixes)]
                )
            live = self._live()
            withdrawn = self._announced - live
            records = self.records(withdraw=withdrawn)
            self._prefixes = sorted(r.key for r in records if r.active and r.children)
            outcome = await self._dht.put(records)
            self._announced = set(live)
            self.last_outcome = outcome
        # acks count this node too: 1 is a record no other peer took
        unheard = bool(outcome.acks) and outcome.min_acks <= 1
        if unheard and not self.unheard:
            logger.warning(
                "announcements reach no other peer: only peers that ask this node itself "
                "can find its experts (retrying every round; a node with bootstrap peers "
                "joins through them again when it has lost them)"
            )
        elif self.unheard and not unheard:
            logger.info("announcements reach other peers again")
        self.unheard = unheard
        await self._read_back([r for r in records if r.active])
        return outcome

    async def _read_back(self, records: list[ExpertRecord]) -> None:
        """Ask the peers holding two of this round's records, a prefix's and a uid's
        (each in turn, round after round), for them (``ExpertDHT.read_back``), and say
        so once when none gives one back: its storing peers took it and withhold it
        from readers, and acks cannot show that. A prefix's too: trainers find experts
        through the prefixes (``ffn.``, ``ffn.0.``), and withholders ground near those
        alone hid them while every uid's record read back (an outside re-check)."""
        prefixes = sorted((r for r in records if r.children), key=lambda r: r.key)
        uids = sorted((r for r in records if not r.children), key=lambda r: r.key)
        # in turn, so that every key is checked within as many rounds as there are keys
        picked = [group[self._read_backs % len(group)] for group in (prefixes, uids) if group]
        self._read_backs += 1
        results = [(record.key, await self._dht.read_back(record)) for record in picked]
        withheld = [key for key, result in results if result is False]
        if withheld and not self.withheld:
            logger.warning(
                "no peer holding this node's record for %s gave it back when asked: "
                "trainers may not find its experts (checked every round; said again "
                "only after its holders give records back)",
                " and ".join(withheld),
            )
        elif self.withheld and not withheld and any(r is True for _, r in results):
            logger.info("peers holding this node's records give them back again")
        if withheld:
            self.withheld = True
        elif any(r is True for _, r in results):
            self.withheld = False

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            # Rounds start every announce_period_s, however long each takes: counting
            # the period from a round's end would add a slow round's time (lookups
            # under load) to the gap between refreshes, and records would lapse.
            next_round = trio.current_time() + self._config.announce_period_s
            try:
                await self.announce_now()
                logger.info("announced %d experts", len(self._live()))
            except Exception:  # a peer failing us must not keep the daemon from starting
                logger.exception("first announcement failed; retrying next round")
            task_status.started()
            while True:
                with trio.move_on_at(next_round):
                    await self._wake.wait()
                self._wake = trio.Event()
                next_round = trio.current_time() + self._config.announce_period_s
                try:
                    await self.announce_now()
                except Exception:  # a bad round must not end the server: next round retries
                    logger.exception("announcement round failed")
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self._timeouts.shutdown_grace_s):
                self._uids, withdrawn = set(), self._announced
                if withdrawn:
                    try:
                        records = self.records(withdraw=withdrawn)
                        outcome = await self._dht.put(records)
                        if outcome.min_acks <= 1 and self._dht.routing_table_size():
                            # Only this node took it while it has peers: a connection
                            # closing under the stop, most likely. Once more, else the
                            # records stay findable until they expire.
                            outcome = await self._dht.put(records)
                        logger.info(
                            "withdrew %d experts from the DHT (fewest copies per key: %d)",
                            len(withdrawn),
                            outcome.min_acks,
                        )
                    except Exception as exc:  # the records expire on their own
                        logger.info("could not withdraw the experts: %r", exc)
