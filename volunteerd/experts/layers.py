"""The expert architectures built into volunteerd. No code travels over the network:
a manifest or config can only pick one of these by name and set its sizes.

Shape legend: B batch (samples), T sequence length, H hidden size, F = 4H.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForwardExpert", "TransformerBlockExpert"]


class FeedForwardExpert(nn.Module):
    """``ffn``: a residual feed-forward block, ``x + W2·gelu(W1·LN(x))``; [B, H] -> [B, H]."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden_dim)
        self.up = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.down = nn.Linear(4 * hidden_dim, hidden_dim)

    def forward(self, x_BH: torch.Tensor) -> torch.Tensor:
        h_BF = F.gelu(self.up(self.norm(x_BH)))
        return x_BH + self.down(h_BF)


class TransformerBlockExpert(nn.Module):
    """``transformer``: a pre-norm causal self-attention + feed-forward block;
    [B, T, H] -> [B, T, H]."""

    def __init__(self, hidden_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(hidden_dim)
        self.qkv = nn.Linear(hidden_dim, 3 * hidden_dim)
        self.proj = nn.Linear(hidden_dim, hidden_dim)
        self.norm2 = nn.LayerNorm(hidden_dim)
        self.up = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.down = nn.Linear(4 * hidden_dim, hidden_dim)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        B, T, H = x_BTH.shape
        q, k, v = self.qkv(self.norm1(x_BTH)).split(H, dim=-1)
        # [B, T, H] -> [B, heads, T, H/heads]
        q, k, v = (
            t.view(B, T, self.num_heads, H // self.num_heads).transpose(1, 2) for t in (q, k, v)
        )
        att_BTH = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BTH = x_BTH + self.proj(att_BTH.transpose(1, 2).reshape(B, T, H))
        return x_BTH + self.down(F.gelu(self.up(self.norm2(x_BTH))))
