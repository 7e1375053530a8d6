"""A character-level transformer language model whose feed-forward layers are
decentralized mixtures of experts.

Shape legend: B batch, T sequence, H hidden, V vocabulary (256 bytes).

Each block is pre-norm: ``x + attention(LN(x))`` computed by the trainer, then
``x + moe(LN(x))`` where the mixture's experts are ``ffn`` experts (remote for
training on the swarm, local for the baseline). A token no expert answered gets a zero
update from the mixture and keeps its residual stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from volunteerd.train.data import VOCAB
from volunteerd.train.experiment import ModelConfig

__all__ = ["MoETransformerLM"]


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        B, T, H = x_BTH.shape
        q, k, v = self.qkv(x_BTH).split(H, dim=-1)
        q, k, v = (t.view(B, T, self.heads, H // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(B, T, H))


class _Block(nn.Module):
    def __init__(self, config: ModelConfig, moe: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_dim)
        self.attn = _Attention(config.hidden_dim, config.num_heads)
        self.norm2 = nn.LayerNorm(config.hidden_dim)
        self.moe = moe

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        x_BTH = x_BTH + self.attn(self.norm1(x_BTH))
        return x_BTH + self.moe(self.norm2(x_BTH))


class MoETransformerLM(nn.Module):
    """``make_moe(block)`` builds block ``block``'s mixture of experts."""

    def __init__(self, config: ModelConfig, make_moe: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.hidden_dim)
        self.position = nn.Embedding(config.seq_len, config.hidden_dim)
        self.blocks = nn.ModuleList([_Block(config, make_moe(i)) for i in range(config.num_blocks)])
        self.norm = nn.LayerNorm(config.hidden_dim)
        self.head = nn.Linear(config.hidden_dim, VOCAB)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """Next-byte logits [B, T, V]."""
        T = tokens_BT.shape[1]
        x_BTH = self.embed(tokens_BT) + self.position(torch.arange(T, device=tokens_BT.device))
        for block in self.blocks:
            x_BTH = block(x_BTH)
        return self.head(self.norm(x_BTH))

    def loss(self, tokens_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        logits_BTV = self(tokens_BT)
        return F.cross_entropy(logits_BTV.reshape(-1, VOCAB), targets_BT.reshape(-1))

    def trainer_parameters(self) -> list[nn.Parameter]:
        """What the trainer optimizes itself: everything but the experts (the gates of
        the mixtures included)."""
        experts = {
            id(p)
            for block in self.blocks
            if isinstance(block, _Block)
            for name, p in block.moe.named_parameters()
            if name.startswith("experts.")
        }
        return [p for p in self.parameters() if id(p) not in experts]
