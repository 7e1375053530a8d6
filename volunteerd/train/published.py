"""The trainer reads the same experiment manifest the daemons join.

An experiment file may name a published manifest (``swarm.manifest``) and the owners it
trusts (``swarm.trusted_owners``). Before training, the trainer looks the manifest up in
the DHT by (name, owner) for each trusted owner, accepts it only from them (as daemons
do), and takes from it what must agree with the daemons hosting the experts: the
layer names (one grid per transformer block; a manifest with ``layers = 0`` has one
grid, named ``uid_prefix``), the grid, the experts' width, their optimizer and the wire
compression. Everything else (data, attention, training schedule) stays the trainer's
own.

``volunteerd train --invitation <invitation>`` takes them from the invitation
``volunteerd publish`` printed (``apply_invitation``): the manifest's name, its owner to
trust, and the peers to join through.
"""

from __future__ import annotations

import logging
import time

from volunteerd.errors import ConfigError, UntrustedManifest
from volunteerd.moe import SwarmClient
from volunteerd.swarm.invitation import Invitation
from volunteerd.swarm.manifest import ExperimentManifest, choose_trusted, lookup_manifests
from volunteerd.train.experiment import Experiment

__all__ = ["apply_invitation", "apply_manifest", "resolve_manifest"]

logger = logging.getLogger(__name__)


def apply_invitation(experiment: Experiment, invitation: Invitation) -> Experiment:
    """``experiment`` training with the invitation's manifest, trusting its owner and
    joining through its peers (before the file's own). Raises ConfigError when the file
    names another manifest: one of the two is not what the researcher meant."""
    swarm = experiment.swarm
    if swarm.manifest and swarm.manifest != invitation.name:
        raise ConfigError(
            f"the invitation is to {invitation.name!r} but swarm.manifest names "
            f"{swarm.manifest!r}: remove one of them"
        )
    swarm = swarm.model_copy(
        update={
            "manifest": invitation.name,
            "trusted_owners": list(dict.fromkeys([invitation.owner, *swarm.trusted_owners])),
            "bootstrap_peers": list(dict.fromkeys([*invitation.peers, *swarm.bootstrap_peers])),
        }
    )
    return experiment.model_copy(update={"swarm": swarm})


def apply_manifest(experiment: Experiment, manifest: ExperimentManifest) -> Experiment:
    """``experiment`` with its experts' settings taken from ``manifest``."""
    if manifest.expert_type != "ffn":
        raise ConfigError(
            f"manifest {manifest.name!r} hosts {manifest.expert_type} experts; the trainer's "
            "model needs ffn experts in its feed-forward layers"
        )
    model = experiment.model
    # One block per grid of the manifest: layers = 0 is one grid named uid_prefix.
    layer_names = manifest.layer_names()
    try:
        model = model.model_validate(
            {
                **model.model_dump(),
                "hidden_dim": manifest.hidden_dim,
                "uid_prefix": manifest.uid_prefix,
                "layer_names": layer_names,
                "num_blocks": len(layer_names),
                "grid": manifest.grid,
                "compression": manifest.compression,
            }
        )
    except ValueError as exc:
        raise ConfigError(f"manifest {manifest.name!r} does not fit the model: {exc}") from None
    update: dict[str, object] = {"model": model, "experts": manifest.optimizer}
    if manifest.rendezvous:  # where the experiment's trainers find each other
        update["swarm"] = experiment.swarm.model_copy(update={"rendezvous": manifest.rendezvous})
    return experiment.model_copy(update=update)


def resolve_manifest(
    experiment: Experiment, client: SwarmClient, *, timeout_s: float = 30.0
) -> Experiment:
    """Look up ``experiment.swarm.manifest`` and apply it; unchanged when none is named.

    Raises UntrustedManifest (naming the owners found) when no owner is trusted and
    others published it, ConfigError when no trusted owner's is found within
    ``timeout_s``."""
    swarm = experiment.swarm
    if not swarm.manifest:
        return experiment
    deadline = time.monotonic() + timeout_s
    while True:
        records = client.run(
            lookup_manifests, client.node.node.dht, swarm.manifest, swarm.trusted_owners
        )
        try:
            manifest = choose_trusted(swarm.manifest, records, swarm.trusted_owners)
        except UntrustedManifest as exc:
            raise UntrustedManifest(exc.name, exc.owners, trainer=True) from None
        if manifest is not None:
            break
        if time.monotonic() > deadline:
            whose = " from a trusted owner (swarm.trusted_owners)" if swarm.trusted_owners else ""
            raise ConfigError(
                f"experiment manifest {swarm.manifest!r} not found in the swarm{whose} within "
                f"{timeout_s:.0f}s: was it published (volunteerd publish)?"
            )
        time.sleep(1.0)
    logger.info("training with manifest %r of %s", manifest.name, manifest.owner)
    return apply_manifest(experiment, manifest)
