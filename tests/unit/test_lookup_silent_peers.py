"""net/lookup.py: a peer found silent (connected, answering nothing) is asked by no
walk for a while, and asked again once that while is over."""

from __future__ import annotations

import os

import trio
import trio.lowlevel
from libp2p.peer.id import ID

from volunteerd.net.lookup import SUSPECT_S, Answer, LookupMemory, Referral, walk

KEY = b"ffn.0."
_ED25519_ID = b"\x00\x24\x08\x01\x12\x20"


def _peers(count: int) -> list[ID]:
    return [ID(_ED25519_ID + os.urandom(32)) for _ in range(count)]


async def _look(memory: LookupMemory, me: ID, others: list[ID]) -> tuple[list[ID], list[ID]]:
    """A walk over ``others`` (all connected, all answering with everyone): the peers
    it found and those it asked."""
    asked: list[ID] = []

    async def ask(peer: ID, addrs: tuple[str, ...]) -> Answer:
        asked.append(peer)
        await trio.lowlevel.checkpoint()
        return Answer(True, [Referral(p, ()) for p in others if p != peer])

    result = await walk(KEY, 5, others, ask, self_id=me, known=lambda peer: True, memory=memory)
    return result.closest, asked


async def test_a_silent_peer_is_neither_asked_nor_found() -> None:
    me, *others = _peers(4)
    silent = others[0]
    memory = LookupMemory()
    memory.mark_silent(silent)
    found, asked = await _look(memory, me, others)
    assert silent not in asked
    assert set(found) == set(others[1:])


async def test_a_silent_peer_is_asked_again_after_its_while() -> None:
    now = [0.0]
    me, *others = _peers(4)
    silent = others[0]
    memory = LookupMemory(clock=lambda: now[0])
    memory.mark_silent(silent)
    now[0] += SUSPECT_S - 1
    assert memory.silent(silent)
    now[0] += 2
    assert not memory.silent(silent)
    found, asked = await _look(memory, me, others)
    assert silent in asked
    assert set(found) == set(others)
