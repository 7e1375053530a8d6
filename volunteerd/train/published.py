"""The trainer reads the same experiment manifest the daemons join.

An experiment file may name a published manifest (``swarm.manifest``) and the owners it
trusts (``swarm.trusted_owners``). Before training, the trainer looks the manifest up in
the DHT by (name, owner) for each trusted owner, accepts it only from them (as daemons
do), and takes from it what must agree with the daemons hosting the experts: the uid
prefix, the number of layers (one grid per transformer block), the grid, the experts'
width, their optimizer and the wire compression. Everything else (data, attention,
training schedule) stays the trainer's own.
"""

from __future__ import annotations

import logging
import time

from volunteerd.errors import ConfigError
from volunteerd.moe import SwarmClient
from volunteerd.swarm.manifest import ExperimentManifest, choose_trusted, lookup_manifests
from volunteerd.train.experiment import Experiment

__all__ = ["apply_manifest", "resolve_manifest"]

logger = logging.getLogger(__name__)


def apply_manifest(experiment: Experiment, manifest: ExperimentManifest) -> Experiment:
    """``experiment`` with its experts' settings taken from ``manifest``."""
    if manifest.expert_type != "ffn":
        raise ConfigError(
            f"manifest {manifest.name!r} hosts {manifest.expert_type} experts; the trainer's "
            "model needs ffn experts in its feed-forward layers"
        )
    if manifest.layers < 1:
        raise ConfigError(
            f"manifest {manifest.name!r} has one grid named {manifest.uid_prefix!r}; the "
            "trainer's model needs one grid per block (publish it with layers >= 1)"
        )
    model = experiment.model
    try:
        model = model.model_validate(
            {
                **model.model_dump(),
                "hidden_dim": manifest.hidden_dim,
                "uid_prefix": manifest.uid_prefix,
                "num_blocks": manifest.layers,
                "grid": manifest.grid,
                "compression": manifest.compression,
            }
        )
    except ValueError as exc:
        raise ConfigError(f"manifest {manifest.name!r} does not fit the model: {exc}") from None
    return experiment.model_copy(update={"model": model, "experts": manifest.optimizer})


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
        manifest = choose_trusted(swarm.manifest, records, swarm.trusted_owners)
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
