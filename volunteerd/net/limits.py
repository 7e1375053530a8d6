"""Per-peer limits on inbound RPC: request rate, inbound bytes, concurrent streams.

Each peer gets two token buckets (requests and bytes) and a count of its open inbound
streams. Memory is bounded by the peers seen recently: a peer with no open stream is
forgotten once it has been idle long enough for both buckets to refill, so forgetting
it never lets it exceed its limits (it comes back with full buckets, as it would have).

Pure and clock-injected, so the arithmetic is tested without a network.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from volunteerd.config import PeerLimitsConfig

__all__ = ["PeerLimiter", "TokenBucket"]

_MIB = 1 << 20
_SWEEP_EVERY_S = 1.0


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens a second up to ``burst``; starts full."""

    rate: float
    burst: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, now: float, amount: float = 1.0) -> bool:
        """Take ``amount`` tokens if there are that many; False (and take none) if not."""
        self._refill(now)
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True

    def charge(self, now: float, amount: float) -> bool:
        """Admit while the balance is positive, then charge ``amount`` (it may go into
        debt): a single item larger than ``burst`` still passes on a full bucket, and
        the debt delays the next one, so the long-run rate holds."""
        self._refill(now)
        if self.tokens <= 0:
            return False
        self.tokens -= amount
        return True

    def is_full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


@dataclass(slots=True)
class _Peer:
    requests: TokenBucket
    bytes: TokenBucket
    streams: int
    last_seen: float


class PeerLimiter:
    """Admission decisions for inbound streams and requests, one state per peer.

    ``open_stream``/``close_stream`` bracket an inbound stream; ``admit`` is asked
    before reading each request frame with its declared size. Each returns the reason
    for a refusal ("streams", "requests" or "bytes") or None when admitted.
    """

    def __init__(
        self, config: PeerLimitsConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._config = config
        self._clock = clock
        self._peers: dict[str, _Peer] = {}
        self._last_sweep = clock()

    def __len__(self) -> int:
        """Peers currently remembered."""
        return len(self._peers)

    def streams(self, peer_id: str) -> int:
        """Inbound streams ``peer_id`` holds open now."""
        peer = self._peers.get(peer_id)
        return peer.streams if peer is not None else 0

    def open_stream(self, peer_id: str) -> str | None:
        peer = self._peer(peer_id)
        if peer.streams >= self._config.max_streams:
            return "streams"
        peer.streams += 1
        return None

    def close_stream(self, peer_id: str) -> None:
        peer = self._peers.get(peer_id)
        if peer is not None and peer.streams > 0:
            peer.streams -= 1
            peer.last_seen = self._clock()

    def admit(self, peer_id: str, nbytes: int) -> str | None:
        """Count one request of ``nbytes`` declared bytes, unless it is refused."""
        peer = self._peer(peer_id)
        now = peer.last_seen
        if not peer.requests.take(now):
            return "requests"
        if not peer.bytes.charge(now, nbytes / _MIB):
            peer.requests.tokens += 1  # not served: give the request token back
            return "bytes"
        return None

    def _peer(self, peer_id: str) -> _Peer:
        now = self._clock()
        if now - self._last_sweep >= _SWEEP_EVERY_S:
            self._forget_idle(now)
        peer = self._peers.get(peer_id)
        if peer is None:
            config = self._config
            peer = self._peers[peer_id] = _Peer(
                requests=TokenBucket.full(config.requests_per_s, config.request_burst, now),
                bytes=TokenBucket.full(config.inbound_mib_per_s, config.inbound_burst_mib, now),
                streams=0,
                last_seen=now,
            )
        peer.last_seen = now
        return peer

    def _forget_idle(self, now: float) -> None:
        self._last_sweep = now
        idle = [
            peer_id
            for peer_id, peer in self._peers.items()
            if peer.streams == 0 and peer.requests.is_full(now) and peer.bytes.is_full(now)
        ]
        for peer_id in idle:
            del self._peers[peer_id]
