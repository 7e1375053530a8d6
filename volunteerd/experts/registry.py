"""Expert types by name: how to build each one and the tensors it accepts.

Initial weights are a pure function of (seed, uid), so every server that creates an
expert from the same configuration starts from the same weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from volunteerd.config import ExpertsConfig
from volunteerd.experts.layers import FeedForwardExpert, TransformerBlockExpert
from volunteerd.wire import TensorSchema

__all__ = ["EXPERT_TYPES", "ExpertType", "build_module", "output_shapes", "schemas_for"]

Shape = tuple[int, ...]


def _shaped_like_inputs(inputs: Sequence[Shape]) -> list[Shape]:
    return list(inputs)


@dataclass(frozen=True, slots=True)
class ExpertType:
    name: str
    build: Callable[[ExpertsConfig], nn.Module]
    # (inputs, outputs) schemas for a wire dtype and hidden size
    schemas: Callable[[str, int], tuple[list[TensorSchema], list[TensorSchema]]]
    # the outputs' exact shapes for inputs of these shapes (the schemas leave the batch
    # and a sequence open; a stateless backward's gradients must have these shapes)
    output_shapes: Callable[[Sequence[Shape]], list[Shape]] = field(default=_shaped_like_inputs)


def _ffn_schemas(dtype: str, hidden: int) -> tuple[list[TensorSchema], list[TensorSchema]]:
    x = TensorSchema(dtype=dtype, shape=(None, hidden))  # type: ignore[arg-type]
    return [x], [x]


def _transformer_schemas(dtype: str, hidden: int) -> tuple[list[TensorSchema], list[TensorSchema]]:
    x = TensorSchema(dtype=dtype, shape=(None, None, hidden))  # type: ignore[arg-type]
    return [x], [x]


EXPERT_TYPES: dict[str, ExpertType] = {
    "ffn": ExpertType("ffn", lambda c: FeedForwardExpert(c.hidden_dim), _ffn_schemas),
    "transformer": ExpertType(
        "transformer",
        lambda c: TransformerBlockExpert(c.hidden_dim, c.num_heads),
        _transformer_schemas,
    ),
}


def seed_for(seed: int, uid: str) -> int:
    digest = hashlib.sha256(f"{seed}/{uid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def build_module(config: ExpertsConfig, uid: str) -> nn.Module:
    """A freshly initialised expert whose weights depend only on (config.seed, uid)."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed_for(config.seed, uid))
        return EXPERT_TYPES[config.type].build(config)
    finally:
        torch.random.set_rng_state(generator_state)


def output_shapes(expert_type: str, inputs: Sequence[Shape]) -> list[Shape]:
    """The shapes of the outputs an expert of ``expert_type`` makes of inputs of the
    shapes ``inputs`` (already checked against its schemas)."""
    return EXPERT_TYPES[expert_type].output_shapes(inputs)


def schemas_for(config: ExpertsConfig) -> tuple[list[TensorSchema], list[TensorSchema]]:
    return EXPERT_TYPES[config.type].schemas(config.dtype, config.hidden_dim)
