"""Per-peer limits on inbound RPC: request rate, inbound bytes, concurrent streams;
and the same budgets, ``per_address`` times larger, shared by every peer connecting
from one IP address.

Each peer gets two token buckets (requests and bytes) and a count of its open inbound
streams; so does each address (an IPv4 address, an IPv6 /64: ``address_key``), for
all its peers together, so that identities, which cost nothing to make, do not
multiply what one machine may ask. A peer whose address is unknown (a relayed
connection: the relay bounds those) and, unless ``limit_loopback``, one on loopback
(this machine's own processes) has only its own budget. Memory is bounded by the peers
and addresses seen recently: one with no open stream is forgotten once it has been idle
long enough for both buckets to refill, so forgetting it never lets it exceed its limits
(it comes back with full buckets, as it would have).

``MessagePacer`` keeps the same kind of buckets for a protocol whose messages are
delayed rather than refused (Kademlia's: ``net/kademlia.py``; identify, ping and the
negotiation of every inbound stream: ``net/paced.py``; small Yamux frames:
``net/host.py``).

Pure and clock-injected, so the arithmetic is tested without a network (``wait``, the
one coroutine, sleeps on trio's clock until ``wait_s`` lets a message through).
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from volunteerd.config import PeerLimitsConfig

__all__ = ["MessagePacer", "PeerLimiter", "TokenBucket", "address_key"]

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

    def shortfall_s(self, now: float, amount: float = 1.0) -> float:
        """Seconds until the bucket holds ``amount`` tokens (0.0 if it does now, or
        within a nanosecond: asked again after the wait it named, the refill's rounding
        left it 1e-17 s short, and the caller slept again for that)."""
        self._refill(now)
        wait = (amount - self.tokens) / self.rate
        return wait if wait > 1e-9 else 0.0

    def is_full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


@functools.lru_cache(maxsize=4096)  # asked per message by the pacers: parse each once
def address_key(host: str | None, *, loopback: bool = False) -> str | None:
    """The key an address's budget is kept under: an IPv4 address (IPv4-mapped IPv6
    ones too) as it is, a public IPv6 address's /64 (a single host is routinely given
    a whole /64), a unique-local or link-local IPv6 address as it is (machines of one
    LAN share its /64, as private IPv4 ones do not share a key); None (no budget by
    address) for None, an unparsable host, and a loopback address unless
    ``loopback``."""
    if host is None:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback and not loopback:
        return None
    if address.version == 4 or address in _LAN_V6 or address.is_link_local:
        return str(address)
    return str(ipaddress.ip_network(f"{address}/64", strict=False))


# Unique-local IPv6 (fc00::/7): a LAN's own addresses, never routed from the internet.
_LAN_V6 = ipaddress.ip_network("fc00::/7")


@dataclass(slots=True)
class _Budget:
    """What one peer, or one address for all its peers, has left."""

    requests: TokenBucket
    bytes: TokenBucket
    streams: int
    last_seen: float

    def idle(self, now: float) -> bool:
        return self.streams == 0 and self.requests.is_full(now) and self.bytes.is_full(now)


class PeerLimiter:
    """Admission decisions for inbound streams and requests, one state per peer and one
    per address.

    ``open_stream``/``close_stream`` bracket an inbound stream; ``admit`` is asked
    before reading each request frame with its declared size. Each takes the peer and
    the IP address its connection comes from (None when unknown) and returns the reason
    for a refusal ("streams", "requests", "bytes" for the peer's own budget;
    "address_streams", "address_requests", "address_bytes" for its address's) or None
    when admitted.
    """

    def __init__(
        self, config: PeerLimitsConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._config = config
        self._clock = clock
        self._peers: dict[str, _Budget] = {}
        self._addresses: dict[str, _Budget] = {}
        self._last_sweep = clock()

    def __len__(self) -> int:
        """Peers currently remembered."""
        return len(self._peers)

    @property
    def addresses(self) -> int:
        """Addresses currently remembered."""
        return len(self._addresses)

    def streams(self, peer_id: str) -> int:
        """Inbound streams ``peer_id`` holds open now."""
        peer = self._peers.get(peer_id)
        return peer.streams if peer is not None else 0

    def address_streams(self, host: str) -> int:
        """Inbound streams the peers at ``host`` hold open now, all together (0 for an
        address without a budget of its own)."""
        key = self._key(host)
        budget = self._addresses.get(key) if key is not None else None
        return budget.streams if budget is not None else 0

    def open_stream(self, peer_id: str, host: str | None = None) -> str | None:
        peer = self._peer(peer_id)
        if peer.streams >= self._config.max_streams:
            return "streams"
        address = self._address(host, peer.last_seen)
        if address is not None:
            if address.streams >= self._config.max_streams * self._config.per_address:
                return "address_streams"
            address.streams += 1
        peer.streams += 1
        return None

    def close_stream(self, peer_id: str, host: str | None = None) -> None:
        now = self._clock()
        peer = self._peers.get(peer_id)
        if peer is not None and peer.streams > 0:
            peer.streams -= 1
            peer.last_seen = now
        key = self._key(host)
        address = self._addresses.get(key) if key is not None else None
        if address is not None and address.streams > 0:
            address.streams -= 1
            address.last_seen = now

    def admit(self, peer_id: str, nbytes: int, host: str | None = None) -> str | None:
        """Count one request of ``nbytes`` declared bytes, unless it is refused."""
        peer = self._peer(peer_id)
        now = peer.last_seen
        if not peer.requests.take(now):
            return "requests"
        if not peer.bytes.charge(now, nbytes / _MIB):
            peer.requests.tokens += 1  # not served: give the request token back
            return "bytes"
        address = self._address(host, now)
        if address is None:
            return None
        if not address.requests.take(now):
            reason = "address_requests"
        elif not address.bytes.charge(now, nbytes / _MIB):
            address.requests.tokens += 1
            reason = "address_bytes"
        else:
            return None
        # Refused by the address: the peer's own budget is not charged either.
        peer.requests.tokens += 1
        peer.bytes.tokens += nbytes / _MIB
        return reason

    def _key(self, host: str | None) -> str | None:
        if self._config.per_address <= 0:
            return None
        return address_key(host, loopback=self._config.limit_loopback)

    def _new_budget(self, scale: float, now: float) -> _Budget:
        config = self._config
        return _Budget(
            requests=TokenBucket.full(
                config.requests_per_s * scale, config.request_burst * scale, now
            ),
            bytes=TokenBucket.full(
                config.inbound_mib_per_s * scale, config.inbound_burst_mib * scale, now
            ),
            streams=0,
            last_seen=now,
        )

    def _peer(self, peer_id: str) -> _Budget:
        now = self._clock()
        if now - self._last_sweep >= _SWEEP_EVERY_S:
            self._forget_idle(now)
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._peers[peer_id] = self._new_budget(1.0, now)
        peer.last_seen = now
        return peer

    def _address(self, host: str | None, now: float) -> _Budget | None:
        key = self._key(host)
        if key is None:
            return None
        address = self._addresses.get(key)
        if address is None:
            address = self._addresses[key] = self._new_budget(self._config.per_address, now)
        address.last_seen = now
        return address

    def _forget_idle(self, now: float) -> None:
        self._last_sweep = now
        for table in (self._peers, self._addresses):
            for key in [key for key, budget in table.items() if budget.idle(now)]:
                del table[key]


class MessagePacer:
    """Paces messages (not refuses them) per peer and per address: each message takes a
    token from its peer's bucket (``rate`` a second up to ``burst``) and from its
    address's (``per_address`` times both), and waits when either is empty.

    For protocols whose honest traffic comes in bursts that must not fail (a Kademlia
    lookup that finds its answer refused misses a peer), pacing bounds what a flood
    costs without refusing anyone. Addresses are keyed as ``address_key`` does; memory
    is bounded like ``PeerLimiter``'s (idle, full buckets are forgotten).
    """

    def __init__(
        self,
        rate: float,
        burst: float,
        per_address: float,
        *,
        loopback: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = rate
        self._burst = burst
        self._per_address = per_address
        self._loopback = loopback
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._last_sweep = clock()
        self.messages = 0  # admitted
        self.waits = 0  # times a message had to wait
        self.refused = 0  # refused by its caller: too many of the peer's were waiting

    @classmethod
    def for_peers(cls, rate: float, burst: float, limits: PeerLimitsConfig) -> MessagePacer:
        """A pacer with ``rate`` and ``burst`` per peer, and the addresses' share and
        loopback rule of ``limits``."""
        return cls(rate, burst, limits.per_address, loopback=limits.limit_loopback)

    def __len__(self) -> int:
        """Peers and addresses currently remembered."""
        return len(self._buckets)

    def wait_s(self, peer_id: str, host: str | None = None, amount: int = 1) -> float:
        """0.0 after taking a token for one message of ``peer_id`` (from ``host``), or
        the seconds until its buckets both hold one, taking none (ask again then).

        ``amount`` messages at once take as many tokens (a bucket smaller than that
        is waited on until full, then goes into debt, so the long-run rate holds)."""
        now = self._clock()
        if now - self._last_sweep >= _SWEEP_EVERY_S:
            self._last_sweep = now
            for key in [k for k, bucket in self._buckets.items() if bucket.is_full(now)]:
                del self._buckets[key]
        buckets = [self._bucket(f"peer:{peer_id}", 1.0, now)]
        address = address_key(host, loopback=self._loopback) if self._per_address > 0 else None
        if address is not None:
            buckets.append(self._bucket(address, self._per_address, now))
        wait = max(bucket.shortfall_s(now, min(amount, bucket.burst)) for bucket in buckets)
        if wait > 0:
            self.waits += 1
            return wait
        for bucket in buckets:
            bucket.tokens -= amount
        self.messages += amount
        return 0.0

    async def wait(self, peer_id: str, host: str | None = None, amount: int = 1) -> None:
        """Return once ``amount`` messages of ``peer_id`` (from ``host``) may pass."""
        delay = self.wait_s(peer_id, host, amount)
        while delay > 0:  # the buckets refill with time, not on an event
            await trio.sleep(delay)
            delay = self.wait_s(peer_id, host, amount)

    def _bucket(self, key: str, scale: float, now: float) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket.full(
                self._rate * scale, self._burst * scale, now
            )
        return bucket
