"""ExpertDirectory: which experts are alive, as the DHT says, cached for training.

Lives on the trainer node's trio loop. ``children`` answers from the cache and fetches
what it lacks in one batched DHT lookup; ``serve`` refreshes, every ``refresh_s``, the
keys used recently, so a training step seldom waits for the DHT. Peers that failed a
call are banned for ``ban_s``: their experts are not offered to the beam search from the
next step on, whatever the DHT still says.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from volunteerd.net import ExpertDHT, PeerAddress, short

if TYPE_CHECKING:
    # trio's TaskStatus as libp2p's trio-typing stubs spell it
    from trio_typing import TaskStatus

__all__ = ["Children", "ExpertDirectory"]

logger = logging.getLogger(__name__)

# prefix key -> next coordinate -> servers announcing it
Children = dict[int, list[PeerAddress]]


@dataclass(slots=True)
class _Entry:
    children: Children
    fetched_at: float
    used_at: float


class ExpertDirectory:
    def __init__(
        self,
        dht: ExpertDHT,
        *,
        refresh_s: float = 5.0,
        ban_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._dht = dht
        self._refresh_s = refresh_s
        self._ban_s = ban_s
        self._clock = clock
        self._cache: dict[str, _Entry] = {}
        self._banned: dict[str, float] = {}
        self.ban_reasons: Counter[str] = Counter()  # reason (first word) -> bans
        self.lookups = 0
        self.empty_answers = 0  # refreshes that found nobody and were not believed

    async def children(self, prefixes: Iterable[str]) -> dict[str, Children]:
        """Alive children of each prefix key, without banned peers."""
        now = self._clock()
        wanted = list(dict.fromkeys(prefixes))
        stale_after = 3 * self._refresh_s
        missing = [
            p
            for p in wanted
            if p not in self._cache or now - self._cache[p].fetched_at > stale_after
        ]
        if missing:
            await self._fetch(missing)
        self._banned = {p: t for p, t in self._banned.items() if t > now}
        out: dict[str, Children] = {}
        for prefix in wanted:
            entry = self._cache[prefix]
            entry.used_at = now
            alive = {
                child: [p for p in peers if p.peer_id not in self._banned]
                for child, peers in entry.children.items()
            }
            out[prefix] = {child: peers for child, peers in alive.items() if peers}
        return out

    def ban(self, peer_id: str, reason: str, seconds: float | None = None) -> None:
        """Offer none of ``peer_id``'s experts for ``seconds`` (default ``ban_s``)."""
        seconds = self._ban_s if seconds is None else seconds
        until = self._clock() + seconds
        if not self.is_banned(peer_id):
            logger.info("not choosing %s for %.0fs: %s", short(peer_id), seconds, reason)
            self.ban_reasons[reason.split(":", 1)[0]] += 1
        self._banned[peer_id] = max(until, self._banned.get(peer_id, until))

    def is_banned(self, peer_id: str) -> bool:
        until = self._banned.get(peer_id)
        return until is not None and until > self._clock()

    @property
    def banned(self) -> Mapping[str, float]:
        return dict(self._banned)

    async def _fetch(self, keys: list[str]) -> None:
        self.lookups += 1
        records = await self._dht.get(keys)
        now = self._clock()
        for key in keys:
            children: Children = {}
            for record in records.get(key, []):
                peer = PeerAddress(record.peer_id, record.addrs)
                for child in record.children:
                    children.setdefault(child, []).append(peer)
            old = self._cache.get(key)
            if (
                not children
                and old is not None
                and old.children
                and now - old.fetched_at < 3 * self._refresh_s
            ):
                # Nobody at all, where servers answered moments ago: more likely a lookup
                # that failed (a loaded machine, a lost DHT round) than every server gone
                # at once. Keep the last answer until it is stale; servers that are really
                # gone fail their calls and are banned meanwhile.
                self.empty_answers += 1
                continue
            self._cache[key] = _Entry(children, now, old.used_at if old else now)

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh recently used keys every ``refresh_s`` until cancelled."""
        task_status.started()
        while True:
            await trio.sleep(self._refresh_s)
            now = self._clock()
            recent = [k for k, e in self._cache.items() if now - e.used_at < 10 * self._refresh_s]
            for key in [k for k in self._cache if k not in recent]:
                del self._cache[key]
            if recent:
                try:
                    with trio.fail_after(max(self._refresh_s, 5.0)):
                        await self._fetch(recent)
                except (trio.TooSlowError, Exception) as exc:  # the next round retries
                    logger.warning("refreshing %d DHT keys failed: %s", len(recent), exc)
