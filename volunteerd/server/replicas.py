"""The replica averager's view of the swarm (``runtime.averaging.ReplicaAverager``):
who else hosts an expert, from the DHT's full-uid records, and their parameters over
this node's RPC client (the connections already open).

Both kinds of bulk transfer, averaging with replicas and downloading an expert's state
when joining, wait for the schedule's network hours: ``SwarmReplicas`` raises Paused
outside them (the round averages nothing; held experts stay held), ``WindowedDownloader``
waits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from volunteerd.bounded import remember
from volunteerd.errors import Paused, PeerUnreachable, RemoteError, ReplyTooLarge
from volunteerd.net import Node, PeerAddress, Verb, short
from volunteerd.wire import WireTensor
from volunteerd.wire.messages import ParamsReply, ParamsRequest

if TYPE_CHECKING:
    # Only for types: this module is imported by daemons that host nothing (no torch).
    from volunteerd.experts import ExpertBackend
    from volunteerd.experts.checkpoint_file import ExpertState

__all__ = ["SwarmReplicas", "WindowedDownloader"]

# Uids one DHT lookup of ``SwarmReplicas.replicas_of`` asks for: a few requests to each
# storing peer (64 keys a request), so that a lookup is done within its bound.
LOOKUP_KEYS = 256
# Replicas remembered as older than ``ParamsRequest.max_bytes`` (asked without it), or
# than ``unless_version``, and for how long before they are asked with it again (they may
# have been upgraded).
MAX_OLDER = 1024
OLDER_RECHECK_S = 3600.0


class SwarmReplicas:
    """``allowed`` says whether bulk transfers may run now (the schedule's network
    hours, ``Volunteer.network_allowed``)."""

    def __init__(
        self, node: Node, lookup_s: float, *, allowed: Callable[[], bool] = lambda: True
    ) -> None:
        self._node = node
        self._lookup_s = lookup_s
        self._allowed = allowed
        # uid -> peer id -> address, from the latest lookup of that uid only: fresh
        # identities announcing a uid round after round are not all remembered.
        self._addresses: dict[str, dict[str, PeerAddress]] = {}
        # peer id -> when (trio's clock) it refused a ``params`` request that carried
        # ``max_bytes`` as malformed (a release older than the field)
        self._older: OrderedDict[str, float] = OrderedDict()
        # ... and that refused one carrying ``unless_version`` (a release older than it)
        self._unversioned: OrderedDict[str, float] = OrderedDict()

    async def replicas(self, uid: str) -> list[str]:
        """The other peers announcing ``uid``; Paused while network use is not allowed
        (``allowed``: paused, outside the network hours, over quota). A lookup
        that takes too long gives the last one's answer: "no replica" would end a
        catch-up after a freeze at once (its first lookups, connections gone stale,
        are the likeliest to time out), and the averager backs off from replicas
        that have gone."""
        return (await self.replicas_of([uid]))[uid]

    async def replicas_of(self, uids: Sequence[str]) -> dict[str, list[str]]:
        """``replicas`` of each of ``uids``, looked up ``LOOKUP_KEYS`` uids a lookup (the
        DHT asks each storing peer for 64 keys a request), all at once, each bounded
        as one uid's lookup is. One lookup per uid, experts with no replica included, ran
        every averaging round of a daemon of 512 experts out of time (outside audit)."""
        uids = list(dict.fromkeys(uids))
        if not self._allowed():
            # Not "no replica": the catch-up served held experts un-caught-up on that.
            raise Paused("network use is not allowed now")

        async def look_up(keys: list[str]) -> None:
            with trio.move_on_after(self._lookup_s):
                found = await self._node.dht.get(keys)
                for uid in keys:
                    others = {
                        r.peer_id: PeerAddress(r.peer_id, r.addrs)
                        for r in found.get(uid, [])
                        if r.peer_id != self._node.peer_id
                    }
                    if others:
                        self._addresses[uid] = others
                    else:  # most hosted experts have none: nothing kept for them
                        self._addresses.pop(uid, None)

        async with trio.open_nursery() as nursery:
            for start in range(0, len(uids), LOOKUP_KEYS):
                nursery.start_soon(look_up, uids[start : start + LOOKUP_KEYS])
        return {uid: list(self._addresses.get(uid, {})) for uid in uids}

    async def fetch(
        self,
        peer_id: str,
        uid: str,
        *,
        max_bytes: int,
        timeout_s: float | None = None,
        unless_version: str | None = None,
    ) -> tuple[ParamsReply, list[WireTensor]]:
        """``uid``'s parameters from ``peer_id`` (found by ``replicas`` before), at most
        ``max_bytes`` of tensors (this node's own copy's size, over ``wire.max_body_bytes``
        if need be): a reply declaring more is refused from its prefix (ReplyTooLarge, a
        FrameTooLarge), its body never read. The request says ``max_bytes`` too, and a
        replica whose parameters are larger refuses before building them (also
        ReplyTooLarge); one older than that field refuses the request as malformed and
        is asked again without it (and for ``OLDER_RECHECK_S`` after). The same for
        ``unless_version`` (the version of its last reply, "" for none: a reply
        ``unchanged`` while it holds, see ``ParamsRequest``), a newer field, left out
        first. Within ``timeout_s`` (the averager's fetch bound; a second ask gets what
        is left of it), ReplyTooSlow when that cut a reply that was arriving; Paused while
        network use is not allowed (a catch-up's rounds fetch without a lookup)."""
        if not self._allowed():
            raise Paused("network use is not allowed now")
        address = self._addresses.get(uid, {}).get(peer_id)
        if address is None:  # the uid's lookup since then no longer lists it
            raise PeerUnreachable(f"{short(peer_id)} no longer announces {uid}")
        began = trio.current_time()
        capped = not self._is_older(self._older, peer_id, began)
        versioned = unless_version is not None and not self._is_older(
            self._unversioned, peer_id, began
        )
        while True:
            spent_s = trio.current_time() - began
            left_s = None if timeout_s is None else max(0.0, timeout_s - spent_s)
            try:
                got = await self._call(
                    address, uid, max_bytes, capped, unless_version if versioned else None, left_s
                )
            except RemoteError as exc:
                if exc.code == "too_large":  # refused from our cap, before it was built
                    raise ReplyTooLarge(f"params of {uid} from {short(peer_id)}: {exc}") from None
                if exc.code != "malformed" or not (capped or versioned):
                    raise
                # A release older than the newest field sent: asked again at once
                # without it (a reply is still capped from its prefix), and without it
                # for a while.
                if versioned:
                    remember(self._unversioned, peer_id, trio.current_time(), MAX_OLDER)
                    versioned = False
                else:
                    remember(self._older, peer_id, trio.current_time(), MAX_OLDER)
                    capped = False
                continue
            if capped:
                self._older.pop(peer_id, None)  # upgraded since
            if versioned:
                self._unversioned.pop(peer_id, None)
            return got

    @staticmethod
    def _is_older(older: OrderedDict[str, float], peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` refused a field lately (within ``OLDER_RECHECK_S``)."""
        refused = older.get(peer_id)
        return refused is not None and now - refused < OLDER_RECHECK_S

    async def _call(
        self,
        address: PeerAddress,
        uid: str,
        max_bytes: int,
        capped: bool,
        unless_version: str | None,
        timeout_s: float | None,
    ) -> tuple[ParamsReply, list[WireTensor]]:
        request = ParamsRequest(
            uid=uid, max_bytes=max_bytes if capped else None, unless_version=unless_version
        )
        reply, tensors = await self._node.rpc.call(
            address, Verb.PARAMS, request, max_body_bytes=max_bytes, timeout_s=timeout_s
        )
        return reply, tensors


class _Downloader(Protocol):
    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> ExpertState: ...

    async def discard(self, uid: str) -> None: ...


class WindowedDownloader:
    """``downloader`` (``swarm.download.ShardDownloader``), each download started only
    once ``wait`` returns (``Volunteer.wait_for_network``: within the network hours).
    Waiting, not failing: a joiner whose downloads all fail seeds fresh weights."""

    def __init__(self, downloader: _Downloader, wait: Callable[[], Awaitable[None]]) -> None:
        self._downloader = downloader
        self._wait = wait

    async def download(self, peer: PeerAddress, backend: ExpertBackend) -> ExpertState:
        await self._wait()
        return await self._downloader.download(peer, backend)

    async def discard(self, uid: str) -> None:
        await self._downloader.discard(uid)
