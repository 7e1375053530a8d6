"""Expert uids: grid coordinates such as ``ffn.3.17``, their prefixes, and grid patterns.

A uid is a lowercase name followed by one to four non-negative integer coordinates.
Its *prefixes* are the keys under which a server announces it in the DHT, so a trainer
can search the grid one dimension at a time::

    uid_prefixes("ffn.3.17") == ["ffn.", "ffn.3.", "ffn.3.17"]

A *pattern* names a set of uids in a config file: ``ffn.[0:4].[0:4]`` is the 4x4 grid,
``ffn.2.[0:8]`` one row, and several patterns can be joined with commas.
"""

from __future__ import annotations

import itertools
import re

__all__ = [
    "MAX_DIMS",
    "MAX_UID_LENGTH",
    "expand_pattern",
    "is_valid_key",
    "is_valid_uid",
    "split_uid",
    "uid_prefixes",
]

MAX_UID_LENGTH = 64
MAX_DIMS = 4
MAX_COORDINATE = 1_000_000
MAX_PATTERN_UIDS = 65_536

_NAME = r"[a-z][a-z0-9_]{0,31}"
_UID_RE = re.compile(rf"^({_NAME})((?:\.(?:0|[1-9][0-9]{{0,5}})){{1,{MAX_DIMS}}})$")
# A DHT key is a uid or a strict prefix of one ending in a dot: "ffn." or "ffn.3.".
_KEY_RE = re.compile(rf"^{_NAME}\.(?:(?:0|[1-9][0-9]{{0,5}})\.){{0,{MAX_DIMS - 1}}}$")
_PART_RE = re.compile(r"^(?:(0|[1-9][0-9]*)|\[(0|[1-9][0-9]*):(0|[1-9][0-9]*)\])$")


# fullmatch, not match: "$" also matches before a trailing newline ("ffn.0.0\n").
def is_valid_uid(uid: str) -> bool:
    return len(uid) <= MAX_UID_LENGTH and _UID_RE.fullmatch(uid) is not None


def is_valid_key(key: str) -> bool:
    """A DHT key: a full uid, or a prefix such as ``ffn.`` or ``ffn.3.``."""
    return len(key) <= MAX_UID_LENGTH and (
        _KEY_RE.fullmatch(key) is not None or _UID_RE.fullmatch(key) is not None
    )


def split_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """``"ffn.3.17"`` -> ``("ffn", (3, 17))``; raises ValueError for a bad uid."""
    match = _UID_RE.fullmatch(uid) if len(uid) <= MAX_UID_LENGTH else None
    if match is None:
        raise ValueError(f"not a valid expert uid: {uid!r} (expected e.g. 'ffn.3.17')")
    name, coords = match.groups()
    return name, tuple(int(c) for c in coords.split(".")[1:])


def uid_prefixes(uid: str) -> list[str]:
    """Every DHT key a server announces ``uid`` under, shortest first, ending with the uid."""
    name, coords = split_uid(uid)
    keys = [f"{name}."]
    for i in range(1, len(coords)):
        keys.append(f"{name}." + "".join(f"{c}." for c in coords[:i]))
    keys.append(uid)
    return keys


def expand_pattern(pattern: str) -> list[str]:
    """Expand ``"ffn.[0:4].[0:2], attn.0.1"`` into sorted, de-duplicated uids.

    Raises ValueError naming the part that is wrong.
    """
    uids: set[str] = set()
    for item in (p.strip() for p in pattern.split(",")):
        if not item:
            continue
        name, _, rest = item.partition(".")
        if not re.fullmatch(_NAME, name) or not rest:
            raise ValueError(f"bad expert pattern {item!r}: expected e.g. 'ffn.[0:4].[0:4]'")
        axes: list[range] = []
        for part in rest.split("."):
            match = _PART_RE.fullmatch(part)
            if match is None:
                raise ValueError(
                    f"bad expert pattern {item!r}: {part!r} is neither a number nor [a:b]"
                )
            single, lo, hi = match.groups()
            if single is not None:
                axes.append(range(int(single), int(single) + 1))
            else:
                if int(hi) <= int(lo):
                    raise ValueError(f"bad expert pattern {item!r}: empty range {part}")
                axes.append(range(int(lo), int(hi)))
        if len(axes) > MAX_DIMS:
            raise ValueError(f"bad expert pattern {item!r}: at most {MAX_DIMS} dimensions")
        if any(ax.stop - 1 > MAX_COORDINATE for ax in axes):
            raise ValueError(f"bad expert pattern {item!r}: coordinates above {MAX_COORDINATE}")
        count = 1
        for ax in axes:
            count *= len(ax)
        if len(uids) + count > MAX_PATTERN_UIDS:
            raise ValueError(f"expert pattern {pattern!r} names over {MAX_PATTERN_UIDS} experts")
        for coords in itertools.product(*axes):
            uid = name + "".join(f".{c}" for c in coords)
            if not is_valid_uid(uid):
                raise ValueError(f"bad expert pattern {item!r}: {uid!r} is not a valid uid")
            uids.add(uid)
    return sorted(uids, key=lambda u: split_uid(u))
