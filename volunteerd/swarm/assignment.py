"""Which of an experiment's experts this daemon hosts: a pure function of what it sees.

Inputs: the experiment's uids, the other live replicas of each (peer ids from the
full-uid DHT records), what this node hosts now and since when, its capacity (a number
of experts), the replication target and its peer id. Output: the uids to add and to
drop. The rules (docs/decisions/0007):

1. **Fill.** Free capacity takes the experts with the fewest other replicas; ties go to
   the experts this node has checkpoints of (a restart resumes them), then are broken by
   ``sha256(peer id, uid)``, so daemons that start together, seeing the same empty
   swarm, pick different experts instead of all the same ones.
2. **Shrink.** Over capacity (or hosting uids the experiment no longer has), the
   experts with the most other replicas are dropped first.
3. **Move, with hysteresis.** A hosted expert ``h`` is exchanged for a non-hosted ``c``
   only when the gain is clear: ``c`` has no live replica and ``h`` keeps at least one
   without this node, or ``c`` is below the replication target and ``h`` has at least
   two more other replicas than ``c`` (after the move ``h`` still has at least as
   many as ``c``, so the move never undoes itself). An expert is never moved before
   ``min_stay_s``; at most ``max_moves`` moves a round; and of the daemons hosting
   ``h`` only the one ranked first by ``sha256(peer id, h)`` may leave it in a round,
   so two replicas do not abandon the same expert at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Choice", "choose_experts", "tie_break"]


@dataclass(frozen=True, slots=True)
class Choice:
    add: tuple[str, ...]
    drop: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return bool(self.add or self.drop)

    def applied_to(self, hosted: Collection[str]) -> set[str]:
        return (set(hosted) - set(self.drop)) | set(self.add)


def tie_break(peer_id: str, uid: str) -> bytes:
    """This peer's private order of the experts: the same everywhere for one peer,
    uncorrelated between peers."""
    return hashlib.sha256(f"{peer_id}\0{uid}".encode()).digest()


def choose_experts(
    experiment_uids: Sequence[str],
    others: Mapping[str, Collection[str]],
    hosted: Mapping[str, float],
    *,
    capacity: int,
    peer_id: str,
    replication: int,
    now: float,
    min_stay_s: float,
    max_moves: int = 2,
    prefer: Collection[str] = (),
) -> Choice:
    """What to add and drop. ``others``: uid -> peer ids of the live replicas on other
    peers (this peer's id, if present, is ignored); ``hosted``: uid -> when this node
    started hosting it, on the monotonic clock that ``now`` reads (on the wall clock,
    one set back 5 h froze every move for 5 h); ``prefer``: uids to take first among
    equally replicated ones (those this node has checkpoints of, so a restart resumes
    what it hosted)."""
    wanted = dict.fromkeys(experiment_uids)
    counts = {uid: len(set(others.get(uid, ())) - {peer_id}) for uid in wanted}
    preferred = set(prefer)

    def order(uid: str) -> tuple[int, bool, bytes]:
        return counts[uid], uid not in preferred, tie_break(peer_id, uid)

    drop = [uid for uid in hosted if uid not in wanted]
    keep = sorted((uid for uid in hosted if uid in wanted), key=order)
    capacity = max(capacity, 0)
    if len(keep) > capacity:
        drop.extend(keep[capacity:])
        keep = keep[:capacity]
    candidates = sorted((uid for uid in wanted if uid not in hosted), key=order)
    free = capacity - len(keep)
    add = candidates[:free]
    candidates = candidates[free:]

    movable = [
        uid
        for uid in keep
        if now - hosted[uid] >= min_stay_s and _leaves_first(peer_id, uid, others.get(uid, ()))
    ]
    movable.sort(key=lambda uid: (-counts[uid], tie_break(peer_id, uid)))
    moved: list[tuple[str, str]] = []
    for target in candidates:
        if len(moved) >= max_moves or not movable:
            break
        have = counts[target]
        if have >= replication:
            break  # candidates are sorted: none further is below the target either
        source = movable[0]
        needed = 1 if have == 0 else 2
        if counts[source] - have < needed:
            break  # the most replicated movable expert is the best source there is
        movable.pop(0)
        keep.remove(source)
        drop.append(source)
        add.append(target)
        moved.append((source, target))
    return Choice(add=tuple(add), drop=tuple(drop))


def _leaves_first(peer_id: str, uid: str, hosts: Collection[str]) -> bool:
    """Whether this peer ranks first among ``uid``'s hosts to leave it."""
    mine = tie_break(peer_id, uid)
    return all(tie_break(p, uid) <= mine for p in hosts if p != peer_id)
