"""Expert modules, their schemas, and the backend that computes and updates one expert."""

from __future__ import annotations

from volunteerd.experts.backend import ExpertBackend, Retained, WeightsSnapshot, make_optimizer
from volunteerd.experts.clipping import centered_clip, clip_bound
from volunteerd.experts.layers import FeedForwardExpert, TransformerBlockExpert
from volunteerd.experts.registry import EXPERT_TYPES, ExpertType, build_module, schemas_for
from volunteerd.experts.tensor_codec import TORCH_DTYPES, from_wire, to_wire

__all__ = [
    "EXPERT_TYPES",
    "TORCH_DTYPES",
    "ExpertBackend",
    "ExpertType",
    "FeedForwardExpert",
    "Retained",
    "TransformerBlockExpert",
    "WeightsSnapshot",
    "build_module",
    "centered_clip",
    "clip_bound",
    "from_wire",
    "make_optimizer",
    "schemas_for",
    "to_wire",
]
