"""Which replicas the DHT lists are real: the joiner counts only those.

Anyone can announce a uid under fresh identities. The joiner chooses experts by how
many other replicas each has (``swarm.assignment``), so fake records announcing an
expert made daemons think it well served and leave it to the fakes: an expert starved
of hosts for the price of a few keys. So a listed peer counts as a replica of a uid only
once it has answered ``info`` for that uid as a server hosting it (a typed error other
than ``unknown_expert``, such as ``busy``, counts: a loaded replica is a replica). A
peer that answered is believed for ``verified_s``; one that did not is not asked again
for ``failed_s``. Each round checks at most ``max_checks`` (peer, uid) pairs, taking
one of each uid's in turn, ``at_once`` at a time, so a flood of fake records costs a
bounded number of refused dials per round, and a flooded uid does not keep the others
unchecked. A check that gets no answer within ``check_s`` is a refusal, and no check
starts once less than that is left of ``round_s``: fakes at addresses that accept and
never answer delay a rebalance by ``round_s`` at most. A replica not yet checked does not
count: under a flood, an expert looks less served than it is and gets more hosts, never
fewer. What is remembered is bounded (``_MAX_REMEMBERED`` pairs each).
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence

import trio

from volunteerd.bounded import remember
from volunteerd.errors import PeerError, RemoteError
from volunteerd.net import PeerAddress, RpcClient, Verb, short
from volunteerd.wire import ExpertInfo, InfoRequest

__all__ = ["CheckReplica", "ReplicaChecks", "hosts_uid"]

logger = logging.getLogger(__name__)

# (peer, uid) -> does that peer host uid now?
CheckReplica = Callable[[PeerAddress, str], Awaitable[bool]]

_MAX_REMEMBERED = 65_536


def hosts_uid(rpc: RpcClient) -> CheckReplica:
    """A ``CheckReplica`` that asks the peer ``info`` about the uid (``ReplicaChecks``
    bounds how long it may take)."""

    async def check(peer: PeerAddress, uid: str) -> bool:
        try:
            reply, _ = await rpc.call(peer, Verb.INFO, InfoRequest(uid=uid))
        except RemoteError as exc:
            return exc.code != "unknown_expert"
        except PeerError:
            return False
        return isinstance(reply, ExpertInfo) and reply.uid == uid

    return check


class ReplicaChecks:
    def __init__(
        self,
        check: CheckReplica,
        clock: Callable[[], float],
        *,
        verified_s: float = 1800.0,
        failed_s: float = 300.0,
        max_checks: int = 256,
        at_once: int = 16,
        check_s: float = 15.0,
        round_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self._check = check
        self._clock = clock
        self._verified_s = verified_s
        self._failed_s = failed_s
        self._max_checks = max_checks
        self._at_once = at_once
        self._check_s = check_s
        self._round_s = round_s
        self._rng = rng or random.Random()
        self._verified: OrderedDict[tuple[str, str], float] = OrderedDict()  # -> when
        self._failed: OrderedDict[tuple[str, str], float] = OrderedDict()  # -> retry at
        self.checks = 0  # pairs checked, in all
        self.refused = 0  # of which did not answer as a replica

    def verified(self, peer_id: str, uid: str) -> bool:
        when = self._verified.get((peer_id, uid))
        return when is not None and self._clock() - when <= self._verified_s

    async def real(
        self, listed: Mapping[str, Sequence[PeerAddress]]
    ) -> dict[str, list[PeerAddress]]:
        """Of the peers ``listed`` per uid (in the DHT's order), those that answered as
        replicas, now or within ``verified_s``; checks this round's share of the others
        first."""
        now = self._clock()
        queues: list[deque[tuple[PeerAddress, str]]] = []
        for uid, peers in listed.items():
            unknown = deque(
                (p, uid)
                for p in peers
                if not self.verified(p.peer_id, uid)
                and self._failed.get((p.peer_id, uid), 0.0) <= now
            )
            if unknown:
                queues.append(unknown)
        # One of each uid's in turn (a different order of the uids each round), so a
        # uid listing a thousand fakes takes the budget only when the others are done.
        self._rng.shuffle(queues)
        pairs: list[tuple[PeerAddress, str]] = []
        while queues and len(pairs) < self._max_checks:
            for queue in queues[: self._max_checks - len(pairs)]:
                pairs.append(queue.popleft())
            queues = [q for q in queues if q]
        slots = trio.Semaphore(self._at_once)

        async def check(peer: PeerAddress, uid: str) -> None:
            try:
                with trio.move_on_after(self._check_s):
                    ok = False  # no answer within check_s
                    ok = await self._check(peer, uid)
            except Exception as exc:  # py-libp2p's own errors, for a peer that left
                logger.info("checking %s of %s failed: %r", uid, short(peer.peer_id), exc)
                ok = False
            finally:
                slots.release()
            self.checks += 1
            key = (peer.peer_id, uid)
            if ok:
                self._failed.pop(key, None)
                remember(self._verified, key, self._clock(), _MAX_REMEMBERED)
            else:
                self.refused += 1
                self._verified.pop(key, None)
                remember(self._failed, key, self._clock() + self._failed_s, _MAX_REMEMBERED)

        refused = self.refused
        # Started in order, at_once at a time, and none after the round has no full
        # check_s left: fakes that accept and never answer each hold a slot check_s,
        # and a round lasts round_s at most; what was not started stays unknown.
        last_start = trio.current_time() + max(0.0, self._round_s - self._check_s)
        async with trio.open_nursery() as nursery:
            for peer, uid in pairs:
                await slots.acquire()
                if trio.current_time() > last_start:
                    slots.release()
                    break
                nursery.start_soon(check, peer, uid)
        if pairs:
            logger.debug(
                "checked %d listed replicas: %d did not answer", len(pairs), self.refused - refused
            )
        return {
            uid: [p for p in peers if self.verified(p.peer_id, uid)]
            for uid, peers in listed.items()
        }
