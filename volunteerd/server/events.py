"""What happens in a daemon, posted to its event sink as it happens.

The services that change something say so themselves: the volunteer's controls post
``state`` and ``limits`` (``server.pausing``), the scheduler posts ``schedule``
(``volunteerd.schedule``), the contribution counter posts ``peers``
for a trainer's first request and ``error`` when the statistics cannot be written
(``server.contribution``). The services below ``server`` (runtime, guard, node) know
nothing of events; they take a callback, and :func:`open_events` connects them, turning
what they report into events:

==============  ====================================================================
kind            posted when
==============  ====================================================================
started         the daemon serves (then the opening state, experts, reachability)
state           serving stops or starts: paused, snoozed, resumed, quota used up,
                held by the schedule (computer in use, on battery, outside hours)
limits          limits changed through the API or reloaded on SIGHUP
schedule        the schedule's rules changed through the API or reloaded on SIGHUP
experts         the runtime takes an expert on or drops one (``add_expert``/``remove_``)
reachability    the node's reachability mode changes (direct, relayed, unreachable)
peers           a trainer's first request since the start; idle connections closed
bans            the request guard bans a peer
error           something failed that the volunteer should know of (logged as well): a
                SIGHUP reload, writing the statistics, an expert restored after a
                step broke its weights, checkpoints skipped for the disk budget, a
                project's expert whose checkpoints were all damaged (the
                checkpointer's ``on_warning``)
==============  ====================================================================

Peers are not posted per connection: DHT traffic opens and closes connections all the
time; a trainer is posted once (the contribution counter remembers at most 1,000).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from volunteerd import __version__
from volunteerd.control.events import EventSink
from volunteerd.net import Node, short

if TYPE_CHECKING:
    # Only for types: a daemon that hosts nothing never imports torch.
    from volunteerd.runtime import ExpertRuntime

__all__ = ["open_events"]


def open_events(sink: EventSink, node: Node, runtime: ExpertRuntime | None, state: str) -> None:
    """Once the services run: post ``started`` and what a client needs to know from the
    start (``state``, the experts hosted, the reachability once decided), then connect
    the runtime (None: hosting nothing), guard and node to ``sink``
    (``_connect_sources``)."""
    sink.post("started", f"volunteerd {__version__} started as {node.peer_id}")
    sink.post("state", state)
    if runtime is not None and runtime.uids:
        sink.post("experts", _experts_message(runtime.uids, []))
    reach = node.reachability
    if reach is not None and reach.mode != "unknown":
        sink.post("reachability", f"reachability: {reach.mode}")
    _connect_sources(sink, node, runtime)


def _connect_sources(sink: EventSink, node: Node, runtime: ExpertRuntime | None) -> None:
    """From now on, the runtime, the guard and the node post their changes to ``sink``."""
    if runtime is not None:
        guard = runtime.guard
        runtime.on_experts_changed = lambda added, dropped: sink.post(
            "experts", _experts_message(added, dropped)
        )
        runtime.on_error = lambda message: sink.post("error", message)
        guard.on_ban = lambda peer, why: sink.post(
            "bans", f"banned {short(peer)} for {guard.config.ban_s:g} s: {why}"
        )
    if node.reachability is not None:
        node.reachability.watch_mode(
            lambda mode: sink.post("reachability", f"reachability: {mode}")
        )
    node.connections.on_trimmed = lambda closed, used, total: sink.post(
        "peers", f"closed {closed} idle connections to free slots ({used} of {total} taken)"
    )


def _experts_message(added: Sequence[str], dropped: Sequence[str]) -> str:
    parts = ([f"hosting {', '.join(sorted(added))}"] if added else []) + (
        [f"dropped {', '.join(sorted(dropped))}"] if dropped else []
    )
    return "; ".join(parts)
