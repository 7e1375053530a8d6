"""What a DHT lookup costs at a given swarm size: py-libp2p's Kademlia, modelled.

volunteerd's DHT is py-libp2p's ``KadDHT`` (``net/dht.py``): its routing table and its
iterative lookup find the peers closest to a key, and our records live on the
``replication`` closest. A simulated swarm of 10,000 volunteers cannot run 10,000
libp2p hosts, so this module reproduces the two pieces of py-libp2p that decide how
many requests and how many sequential rounds a lookup takes, and measures them.

The model, read from ``libp2p/kad_dht`` (``common.py``, ``routing_table.py``,
``peer_routing.py``, ``kad_dht.py``):

* **Keys.** A node's key is sha256 of its peer id bytes; a lookup's target is sha256
  of the key looked up; distance is the XOR of the two as 256-bit integers.
* **Routing table.** Not the textbook table of buckets by shared prefix with the local
  id: py-libp2p's buckets cover *absolute* key ranges. The table starts as one bucket
  of ``[0, 2**256)``; a peer arriving in a full bucket (``BUCKET_SIZE`` = 20 peers)
  splits it at its midpoint, whichever bucket it is, until the table holds
  ``MAXIMUM_BUCKETS`` = 256 buckets; from then on a full bucket keeps its peers (the
  oldest answers its ping) and the newcomer is dropped. So a table holds at most
  256 x 20 = 5,120 peers, spread evenly over the key space: every node of a swarm up to
  ~3,500 nodes knows everyone, while in a swarm of 100,000 a node knows ~5 %, and
  knows no more about its own neighbourhood than about any other.
* **Lookup** (``PeerRouting.find_closest_peers_network(key, count)``, whose steps
  volunteerd's own lookup, ``net/lookup.walk``, takes too: it differs in what it
  believes, not in what it asks when everyone answers). Start from the
  ``count`` closest peers in the own table. Each round sends FIND_NODE to the (at most
  ``ALPHA`` = 10) closest not yet queried, in parallel, and waits for all answers; each
  answer is the queried node's ``BUCKET_SIZE`` closest known peers to the target (the
  asker itself left out). Merge, keep the ``count`` closest. The lookup ends when a
  round leaves that list unchanged, when no peer in it is left to query, or after
  ``MAX_LOOKUP_ROUNDS`` rounds (py-libp2p's BETA check only ``continue``s the loop, so
  it changes nothing). volunteerd asks for ``count = dht.replication`` (5) peers
  (``ExpertDHT._closest``), so at most 5 queries go out per round and ALPHA never binds.

What "a node knows" is a saturated table: the structure above filled with peers met
over time (every answer a node receives adds its peers), i.e. each bucket holds
``min(BUCKET_SIZE, nodes in its range)`` random nodes of its range. Tables are built
lazily, for the nodes a lookup visits, from one sorted array of node keys (``bisect``
finds a bucket's nodes), and only the buckets a query needs. The bucket layout of a
table comes from simulating py-libp2p's split rule on random arrivals; nodes share a
pool of ``_SHAPES`` such layouts (their contents are drawn per node), which keeps
100,000 nodes cheap. Everyone is alive and answers: the churn models of the simulator
decide who is there, not this one.

Not modelled: the 30 s overall budget of a lookup and the 10 s per query (time is the
simulator's, hops x round trip), the fallback to connected peers of a table holding
fewer than 5 peers, and ``ExpertDHT._closest``'s reuse of a lookup for 30 s while the
routing table keeps its size.

The sim layer may not import libp2p (only ``net`` does, docs/architecture.md), so the
constants below are py-libp2p's copied, and ``tests/unit/test_sim_kademlia.py`` checks
them against the installed library and runs py-libp2p's own lookup code and
``net/lookup.walk`` over this model's tables to check that they take the same rounds and
requests, and find the same peers (the walk only those that answered).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from volunteerd.config import DHTConfig

__all__ = [
    "ALPHA",
    "BUCKET_SIZE",
    "FIND_NODE_REPLY_BYTES",
    "FIND_NODE_REQUEST_BYTES",
    "MAXIMUM_BUCKETS",
    "MAX_LOOKUP_ROUNDS",
    "KademliaModel",
    "Lookup",
    "LookupCost",
    "find_messages",
    "lookup_cost",
    "store_messages",
]

# py-libp2p's values (libp2p.kad_dht.common and .peer_routing), pinned by a test.
BUCKET_SIZE = 20
"""k: peers per bucket, and peers in each FIND_NODE answer."""
ALPHA = 10
"""Most FIND_NODE requests a lookup has in flight (and sends per round)."""
MAXIMUM_BUCKETS = 256
"""Buckets a routing table splits into at most."""
MAX_LOOKUP_ROUNDS = 20
"""Rounds after which a lookup stops whatever it has found."""

# What the messages weigh (protobuf sizes measured by the test, plus stream set-up:
# each query opens a stream and negotiates /ipfs/kad/1.0.0, then a varint prefix and
# the muxer's and Noise's framing): for traffic accounting.
FIND_NODE_REQUEST_BYTES = 300
"""One FIND_NODE request: the key and the asker's signed peer record (~190 B for an
Ed25519 key and two addresses)."""
FIND_NODE_REPLY_BYTES = 5_500
"""One answer: ``BUCKET_SIZE`` peers, each its id (38 B), two addresses and signed peer
record (~260 B in all), and the answerer's own record."""

_KEY_BITS = 256
# A peer id's bytes: the identity multihash of an Ed25519 public key, as py-libp2p
# makes them (0x00 identity, 0x24 = 36 bytes, protobuf PublicKey{Type: Ed25519, Data}).
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
# Bucket layouts drawn per model; each node takes one (its contents are its own).
_SHAPES = 32


@dataclass(frozen=True, slots=True)
class LookupCost:
    """What one lookup costs in a swarm of ``nodes``, over the lookups sampled."""

    nodes: int
    hops_mean: float
    """Sequential query rounds until the lookup ends (what its latency scales with:
    each round waits for the slowest of its answers)."""
    hops_p95: float
    messages_mean: float
    """FIND_NODE requests the looking-up node sends per lookup (each has one answer)."""
    messages_p95: float
    found_closest: float
    """Share of lookups whose final set holds the node truly closest to the key."""
    found_record: float
    """Share of lookups whose final set shares a peer with a second lookup of the same
    key from another random node: a record stored by one is found by the other."""


@dataclass(frozen=True, slots=True)
class Lookup:
    """One lookup: its rounds, its requests and the nodes it ends with, closest first."""

    hops: int
    messages: int
    closest: tuple[int, ...]


# A table's layout: its buckets' start keys (sorted) and depths (a bucket at depth d
# covers 2**(256 - d) keys). None: the table never filled, it holds every node.
_Shape = tuple[list[int], list[int]] | None


def _table_shape(rng: random.Random, arrivals: int, k: int, max_buckets: int) -> _Shape:
    """The bucket layout py-libp2p's split rule gives a table that meets ``arrivals``
    peers at uniformly random keys, or None if it never reaches ``max_buckets``.

    Only counts are kept: the peers of a full bucket are uniform over its range, so a
    split sends Binomial(k, 1/2) of them to the lower half."""
    starts, depths, counts = [0], [0], [0]
    for _ in range(arrivals):
        key = rng.getrandbits(_KEY_BITS)
        i = bisect_right(starts, key) - 1
        while counts[i] >= k and len(starts) < max_buckets:
            depth = depths[i] + 1
            middle = starts[i] + (1 << (_KEY_BITS - depth))
            lower = bin(rng.getrandbits(k)).count("1")
            starts.insert(i + 1, middle)
            depths[i] = depth
            depths.insert(i + 1, depth)
            counts.insert(i + 1, counts[i] - lower)
            counts[i] = lower
            if key >= middle:
                i += 1
        if counts[i] < k:
            counts[i] += 1
        if len(starts) >= max_buckets:
            return starts, depths
    return None


class KademliaModel:
    """A swarm of ``nodes`` with saturated py-libp2p routing tables (module docstring).

    Nodes are numbered ``0..nodes-1`` in key order. Deterministic given ``seed``: the
    keys, the table layouts and each table's contents (drawn per node and bucket, so
    they do not depend on which lookups ran first)."""

    def __init__(
        self,
        nodes: int,
        *,
        k: int = BUCKET_SIZE,
        max_buckets: int = MAXIMUM_BUCKETS,
        seed: int = 0,
    ) -> None:
        if nodes < 2:
            raise ValueError(f"a lookup needs at least 2 nodes, not {nodes}")
        if k < 1 or max_buckets < 1:
            raise ValueError("k and max_buckets must be >= 1")
        self.nodes = nodes
        self.k = k
        self._seed = seed
        rng = random.Random(seed)
        by_key = sorted(
            (int.from_bytes(hashlib.sha256(peer_id).digest(), "big"), peer_id)
            for peer_id in (_PEER_ID_PREFIX + rng.randbytes(32) for _ in range(nodes))
        )
        self.keys = [key for key, _ in by_key]
        self._peer_ids = [peer_id for _, peer_id in by_key]
        self._shapes = [_table_shape(rng, nodes - 1, k, max_buckets) for _ in range(_SHAPES)]
        self._members: dict[tuple[int, int], list[int]] = {}

    def peer_id(self, node: int) -> bytes:
        """The peer id (bytes) whose sha256 is ``node``'s key."""
        return self._peer_ids[node]

    @staticmethod
    def target(key: bytes) -> int:
        """Where a looked-up key lies: sha256 of it, as py-libp2p places it."""
        return int.from_bytes(hashlib.sha256(key).digest(), "big")

    def table(self, node: int) -> list[int]:
        """Every peer ``node``'s routing table holds, in key order (builds all of it:
        lookups only build the buckets they need)."""
        shape = self._shapes[node % _SHAPES]
        if shape is None:
            return [n for n in range(self.nodes) if n != node]
        return [n for i in range(len(shape[0])) for n in self._bucket(node, shape, i)]

    def closest_known(self, node: int, target: int, count: int) -> list[int]:
        """``node``'s ``count`` closest known peers to ``target``, closest first: its
        routing table's ``find_local_closest_peers``."""
        shape = self._shapes[node % _SHAPES]
        if shape is None:
            return self._closest_of_all(target, count, node)
        starts, depths = shape
        i = bisect_right(starts, target) - 1
        found = list(self._bucket(node, shape, i))
        # Every key of the target's bucket is closer than any key outside it; then the
        # sibling subtrees, deepest first, each closer than the next.
        for level in range(depths[i] - 1, -1, -1):
            if len(found) >= count:
                break
            bit = _KEY_BITS - 1 - level
            low = ((target >> bit) ^ 1) << bit
            high = low + (1 << bit)
            for j in range(bisect_left(starts, low), bisect_left(starts, high)):
                found.extend(self._bucket(node, shape, j))
        keys = self.keys
        found.sort(key=lambda n: keys[n] ^ target)
        return found[:count]

    def closest(self, target: int, count: int, exclude: int | None = None) -> list[int]:
        """The ``count`` nodes truly closest to ``target`` (``exclude`` left out)."""
        return self._closest_of_all(target, count, exclude)

    def lookup(self, origin: int, target: int, *, count: int, alpha: int = ALPHA) -> Lookup:
        """``origin``'s lookup of the ``count`` closest peers to ``target``, round by
        round as ``find_closest_peers_network`` does it."""
        keys = self.keys
        closest = self.closest_known(origin, target, count)
        queried: set[int] = set()
        hops = messages = 0
        for _ in range(MAX_LOOKUP_ROUNDS):
            to_query = [p for p in closest if p not in queried][:alpha]
            if not to_query:
                break
            hops += 1
            new: dict[int, None] = {}
            for peer in to_query:
                queried.add(peer)
                messages += 1
                for found in self.closest_known(peer, target, self.k):
                    if found != origin:
                        new[found] = None
            if not new:
                if any(p not in queried for p in closest[:BUCKET_SIZE]):
                    continue
                break
            previous = closest
            candidates = dict.fromkeys([*closest, *new])
            closest = sorted(candidates, key=lambda n: keys[n] ^ target)[:count]
            if closest == previous:
                break
        return Lookup(hops, messages, tuple(closest))

    # -- tables ------------------------------------------------------------------------

    def _bucket(self, node: int, shape: tuple[list[int], list[int]], i: int) -> list[int]:
        """The peers ``node`` keeps in bucket ``i`` of its layout: all of the range's
        nodes, or ``k`` of them at random when more live there."""
        cached = self._members.get((node, i))
        if cached is not None:
            return cached
        starts, depths = shape
        start = starts[i]
        low = bisect_left(self.keys, start)
        high = bisect_left(self.keys, start + (1 << (_KEY_BITS - depths[i])))
        if high - low - (low <= node < high) <= self.k:
            members = [n for n in range(low, high) if n != node]
        else:
            rng = random.Random(((self._seed << 32 | node) << _KEY_BITS) | start)
            members = [n for n in rng.sample(range(low, high), self.k + 1) if n != node]
        members = members[: self.k]
        self._members[(node, i)] = members
        return members

    def _closest_of_all(self, target: int, count: int, exclude: int | None) -> list[int]:
        keys = self.keys
        want = count + (exclude is not None)
        # the longest prefix of the target whose subtree still holds `want` nodes
        shallow, deep = 0, _KEY_BITS
        while shallow < deep:
            depth = (shallow + deep + 1) // 2
            bit = _KEY_BITS - depth
            low = (target >> bit) << bit
            if bisect_left(keys, low + (1 << bit)) - bisect_left(keys, low) >= want:
                shallow = depth
            else:
                deep = depth - 1
        bit = _KEY_BITS - shallow
        low = (target >> bit) << bit
        span = range(bisect_left(keys, low), bisect_left(keys, low + (1 << bit)))
        found = sorted((n for n in span if n != exclude), key=lambda n: keys[n] ^ target)
        return found[:count]


def _p95(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)])


@functools.lru_cache(maxsize=64)
def lookup_cost(
    nodes: int,
    *,
    k: int | None = None,
    alpha: int | None = None,
    count: int | None = None,
    samples: int = 200,
    seed: int = 0,
) -> LookupCost:
    """Hops, requests and accuracy of ``samples`` lookups of random keys from random
    nodes in a swarm of ``nodes`` (each sample also runs a second lookup of the same key
    from another node, for ``found_record``). Deterministic given ``seed``.

    ``k`` and ``alpha``: py-libp2p's BUCKET_SIZE and ALPHA when None. ``count``: the
    peers a lookup asks for, ``DHTConfig().replication`` when None (as volunteerd's
    ``ExpertDHT`` asks). Results are cached per arguments.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, not {samples}")
    bucket = BUCKET_SIZE if k is None else k
    parallel = ALPHA if alpha is None else alpha
    wanted = DHTConfig().replication if count is None else count
    model = KademliaModel(nodes, k=bucket, seed=seed)
    rng = random.Random(seed + 1)
    hops: list[int] = []
    messages: list[int] = []
    found_closest = found_record = 0
    for _ in range(samples):
        target = model.target(rng.randbytes(16))
        writer = rng.randrange(nodes)
        reader = (writer + rng.randrange(1, nodes)) % nodes
        written = model.lookup(writer, target, count=wanted, alpha=parallel)
        read = model.lookup(reader, target, count=wanted, alpha=parallel)
        hops.append(written.hops)
        messages.append(written.messages)
        found_closest += model.closest(target, 1, exclude=writer)[0] in written.closest
        found_record += not set(written.closest).isdisjoint(read.closest)
    return LookupCost(
        nodes=nodes,
        hops_mean=sum(hops) / samples,
        hops_p95=_p95(hops),
        messages_mean=sum(messages) / samples,
        messages_p95=_p95(messages),
        found_closest=found_closest / samples,
        found_record=found_record / samples,
    )


def store_messages(nodes: int, replication: int) -> float:
    """Requests one node sends to put one record: a lookup of the ``replication``
    closest peers, then one store request to each (volunteerd batches up to 256
    records per store request to a peer, so a batch of keys costs this per key for the
    lookup, and the store requests are shared among keys stored on the same peer)."""
    return lookup_cost(nodes, count=replication).messages_mean + replication


def find_messages(nodes: int, replication: int) -> float:
    """Requests one node sends to find one key's records: a lookup, then one find
    request to each of the ``replication`` closest peers (the same as a store)."""
    return store_messages(nodes, replication)
