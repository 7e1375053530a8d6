"""Centered clipping: the robust average of weights that replicas and trainers share.

Daemons hosting the same expert (``runtime.averaging``) and trainers of the same
experiment (``train.averaging``) pull their weights together with one rule, applied
tensor by tensor around one's own weights::

    new = own + 1/n * sum_i clip(w_i - own, tau)      n = len(others) + 1 (self included)
    clip(v, tau) = v * min(1, tau / |v|)              tau = clip_ratio * max(|own|, 0.01*sqrt numel)

Weights within tau of one's own are averaged exactly; one that is far off (a bug, or a
lie: weights x1e3, noise) moves each tensor by at most tau/n per round, however far it
is. The floor ``0.01 * sqrt(numel)`` lets a tensor of zeros (a fresh bias) still move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["MIN_RMS", "Params", "centered_clip", "clip_bound"]

Params = dict[str, torch.Tensor]

# tau is never below this fraction of sqrt(numel)
MIN_RMS = 0.01


def clip_bound(own: torch.Tensor, clip_ratio: float) -> float:
    """tau: how far (L2 norm) another's tensor may pull ``own`` before it is clipped."""
    return clip_ratio * max(float(own.norm()), MIN_RMS * math.sqrt(own.numel()))


def centered_clip(
    own: Params, others: Sequence[Params], clip_ratio: float
) -> tuple[Params, list[int]]:
    """One step of centered clipping around ``own``; returns the new weights (new
    tensors; ``own`` is left alone) and, per entry of ``others``, how many of its tensors
    were clipped. ``others`` must have ``own``'s names and shapes (on any device)."""
    n = len(others) + 1
    clipped = [0] * len(others)
    out: Params = {}
    for name, x in own.items():
        tau = clip_bound(x, clip_ratio)
        total = torch.zeros_like(x)
        for i, other in enumerate(others):
            delta = other[name].to(x.device, x.dtype) - x
            norm = float(delta.norm())
            if norm > tau:
                delta.mul_(tau / norm)
                clipped[i] += 1
            total += delta
        out[name] = x + total / n
    return out, clipped
