"""Node identity: an Ed25519 key that signs records and names the node on libp2p."""

from __future__ import annotations

from volunteerd.identity.keys import (
    SEED_BYTES,
    Identity,
    load_or_create_identity,
    verify_signature,
)

__all__ = ["SEED_BYTES", "Identity", "load_or_create_identity", "verify_signature"]
