"""The swarm at scale, simulated with the production decision code (docs/scale.md)."""
