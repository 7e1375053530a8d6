"""Tables of what a node remembers about peers, bounded: the oldest entry goes first.

Identities are free, so anything kept per peer id must have a size limit that a flood
of new ids cannot push past."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["remember"]

K = TypeVar("K")
V = TypeVar("V")


def remember(table: OrderedDict[K, V], key: K, value: V, limit: int) -> list[K]:
    """Set ``key`` as the newest entry of ``table``; forget the oldest beyond ``limit``
    (returned, oldest first, for whatever else is kept about them)."""
    table[key] = value
    table.move_to_end(key)
    forgotten = []
    while len(table) > limit:
        forgotten.append(table.popitem(last=False)[0])
    return forgotten
