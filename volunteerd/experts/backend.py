"""ExpertBackend: one expert's module, its own optimizer, and the two compute calls.

Stateless, as in Learning@home: ``backward`` gets the inputs again together with the
gradients of the outputs, re-runs the forward with autograd on, returns the input
gradients and steps the expert's optimizer. These methods block and must run on the
device's worker thread, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from volunteerd.config import ExpertsConfig, OptimizerConfig
from volunteerd.experts.registry import build_module, schemas_for
from volunteerd.experts.tensor_codec import TORCH_DTYPES
from volunteerd.wire import ExpertInfo

__all__ = ["ExpertBackend", "make_optimizer"]


def make_optimizer(
    params: Sequence[nn.Parameter], config: OptimizerConfig
) -> torch.optim.Optimizer:
    if config.name == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    return torch.optim.Adam(
        params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )


class ExpertBackend:
    """A hosted expert. Parameters are float32 on ``device``; the wire dtype may be
    narrower (inputs are widened for compute and outputs narrowed back)."""

    def __init__(
        self, uid: str, config: ExpertsConfig, device: torch.device, max_batch_size: int
    ) -> None:
        self.uid = uid
        self.device = device
        self.module = build_module(config, uid).to(device)
        self.optimizer = make_optimizer(list(self.module.parameters()), config.optimizer)
        self.wire_dtype = TORCH_DTYPES[config.dtype]
        inputs, outputs = schemas_for(config)
        self.info = ExpertInfo(
            uid=uid,
            expert_type=config.type,
            hidden_dim=config.hidden_dim,
            inputs=inputs,
            outputs=outputs,
            max_batch_size=max_batch_size,
        )
        self.updates = 0

    def _compute(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.module(*(x.to(self.device, torch.float32) for x in inputs))
        return out

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [self._compute(inputs).to(self.wire_dtype)]

    def backward(
        self, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Input gradients for ``grad_outputs``; steps the optimizer once."""
        leaves = [x.to(self.device, torch.float32).requires_grad_() for x in inputs]
        with torch.enable_grad():
            out = self.module(*leaves)
            torch.autograd.backward([out], [g.to(self.device, torch.float32) for g in grad_outputs])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return [
            (x.grad if x.grad is not None else torch.zeros_like(x)).to(self.wire_dtype)
            for x in leaves
        ]
