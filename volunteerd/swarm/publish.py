"""``volunteerd publish``: sign an experiment manifest and store it in the DHT.

The owner's key signs; a short-lived node with a throwaway identity (so it never
collides with a daemon running under the owner's key) joins through the bootstrap
peers, stores the envelope on the closest peers of ``experiment/<name>`` and leaves.
Daemons that join the experiment store it again periodically, so it outlives this
command. It also makes the experiment's invitation: its name, the owner's peer id and
the bootstrap peers it was published through, the peers volunteers join through.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from volunteerd.config import Config
from volunteerd.errors import ConfigError, ResourceUnavailable
from volunteerd.identity import Identity
from volunteerd.net import open_node, peer_id_for
from volunteerd.net.dht import UNEXPLAINED
from volunteerd.swarm.invitation import MAX_PEERS, Invitation
from volunteerd.swarm.manifest import ExperimentManifest, load_manifest_file, sign_manifest

__all__ = ["Published", "make_invitation", "publish_manifest", "refusal_message"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Published:
    manifest: ExperimentManifest
    acks: int  # peers (this short-lived node excluded) that stored it
    invitation: Invitation
    left_out: tuple[str, ...]  # bootstrap peers that cannot go in an invitation, and why


def make_invitation(
    manifest: ExperimentManifest, peers: list[str]
) -> tuple[Invitation, tuple[str, ...]]:
    """The invitation to ``manifest`` through the first 8 of ``peers`` that fit in one
    (direct multiaddrs ending in an Ed25519 /p2p/ id), and each peer left out with the
    reason. Raises ConfigError when none fits: volunteers would have no way in."""
    fitting: list[str] = []
    left_out: list[str] = []
    for peer in dict.fromkeys(peers):
        if len(fitting) == MAX_PEERS:
            left_out.append(f"{peer}: an invitation names at most {MAX_PEERS} peers")
            continue
        try:
            Invitation(manifest.name, manifest.owner, (peer,))
        except ConfigError as exc:
            left_out.append(f"{peer}: {str(exc).removeprefix('not a valid invitation: ')}")
            continue
        fitting.append(peer)
    if not fitting:
        raise ConfigError(
            "no bootstrap peer can go in the invitation volunteers join with:\n  "
            + "\n  ".join(left_out)
        )
    return Invitation(manifest.name, manifest.owner, tuple(fitting)), tuple(left_out)


async def publish_manifest(config: Config, owner: Identity, path: Path) -> Published:
    """Sign the manifest in ``path`` with ``owner`` and store it through
    ``config.network.bootstrap_peers``. Raises ConfigError (a bad file, or no
    bootstrap peer) and ResourceUnavailable (no peer stored it)."""
    if not config.network.bootstrap_peers:
        raise ConfigError("publishing needs a peer to store the manifest: pass --bootstrap")
    manifest = load_manifest_file(path, owner=str(peer_id_for(owner)))
    # Before storing anything: a manifest nobody can be invited to is a mistake.
    invitation, left_out = make_invitation(manifest, config.network.bootstrap_peers)
    record = sign_manifest(manifest, owner)
    node_config = config.model_copy(
        update={"network": config.network.model_copy(update={"port": 0})}
    )
    async with open_node(Identity.generate(), node_config) as node:
        outcome = await node.dht.store_manifest(record)
        # This node is about to leave: only the copies on other peers count.
        acks = outcome.acks - int(bool(node.dht.manifests.get(manifest.name)))
    if acks < 1:
        raise ResourceUnavailable(refusal_message(manifest, outcome.refused, config))
    if outcome.refused:
        logger.warning("%s", refusal_message(manifest, outcome.refused, config, stored=acks))
    logger.info("stored manifest %r on %d peers", manifest.name, acks)
    return Published(manifest, acks, invitation, left_out)


def refusal_message(
    manifest: ExperimentManifest, refused: dict[str, int], config: Config, *, stored: int = 0
) -> str:
    """What the owner is told when peers refused ``manifest``: each reason the peers gave
    (``refused``: peers by ``StoreReply.refused`` code), and nothing they did not give.

    Before, "no peer stored it" was always blamed on this computer's clock, and an owner
    whose name 16 strangers had filled first was told to check a clock that was right
    (audit-join)."""
    name, owner = manifest.name, manifest.owner
    head = (
        f"the manifest of {name!r} was stored on {stored} peers, but not on all"
        if stored
        else f"no peer stored the manifest of {name!r}"
    )
    lines = []
    for code, count in sorted(refused.items(), key=lambda item: -item[1]):
        peers = f"{count} peer{'s' if count != 1 else ''}"
        if code == "name_full":
            lines.append(
                f"{peers} refused it: the name {name!r} already has the most owners a peer "
                f"keeps ({config.dht.max_owners_per_name}), others who stored theirs first; "
                "publish under another name, or have the storing peers trust your owner id "
                f"{owner} (experiments.trusted_owners) so that they keep yours first"
            )
        elif code == "future":
            lines.append(
                f"{peers} refused it as issued more than {config.dht.max_clock_skew_s:g} s "
                "ahead of their clocks: is this computer's clock right?"
            )
        elif code == "stale":
            lines.append(
                f"{peers} hold a manifest of {name!r} by this owner issued later than this "
                "one: was it published since from another computer, or is this one's "
                "clock behind?"
            )
        elif code == UNEXPLAINED:
            lines.append(f"{peers} refused it without saying why (older versions do not)")
        else:
            lines.append(
                f"{peers} refused it for another reason (a full store, or this owner's "
                "most names a peer keeps)"
            )
    if not lines:
        lines.append("no peer that it was sent to answered")
    return head + ":\n  " + "\n  ".join(lines)
