"""Beam search over the expert grid, one dimension at a time, alive experts only.

Shape legend: N tokens (samples), D grid dimensions, G_d the grid's size in dimension d,
B the beam, K the experts kept per sample.

An expert's score is the sum of its per-dimension gating scores. At dimension d the
search asks which children of the beam's prefixes are alive (``children``: a batched,
cached DHT lookup), extends every beam entry by every alive child, and keeps the best
``beam_size`` per sample (``k`` at the last dimension).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Route", "beam_search", "prefix_key", "uid_of"]

ChildrenFn = Callable[[list[str]], Mapping[str, Mapping[int, Sequence[object]]]]


def prefix_key(name: str, coords: Sequence[int]) -> str:
    """``("ffn", (3,))`` -> ``"ffn.3."``; ``("ffn", ())`` -> ``"ffn."``."""
    return name + "." + "".join(f"{c}." for c in coords)


def uid_of(name: str, coords: Sequence[int]) -> str:
    return name + "".join(f".{c}" for c in coords)


@dataclass(frozen=True, slots=True)
class Route:
    """The best alive experts per sample, best first.

    ``coords_NKD`` holds grid coordinates (invalid slots are 0), ``valid_NK`` which
    slots hold an expert, ``peers`` who serves each chosen uid.
    """

    coords_NKD: torch.Tensor
    valid_NK: torch.Tensor
    peers: dict[str, Sequence[object]]
    name: str

    def uid(self, n: int, k: int) -> str:
        return uid_of(self.name, self.coords_NKD[n, k].tolist())


def beam_search(
    logits: Sequence[torch.Tensor],
    name: str,
    children: ChildrenFn,
    *,
    beam_size: int,
    k: int,
) -> Route:
    """Search the grid ``name.*`` with per-dimension scores ``logits[d]`` of shape [N, G_d]."""
    N = logits[0].shape[0]
    coords_NBd = torch.zeros(N, 1, 0, dtype=torch.long)
    scores_NB = torch.zeros(N, 1)
    valid_NB = torch.ones(N, 1, dtype=torch.bool)
    last: Mapping[str, Mapping[int, Sequence[object]]] = {}
    prefixes: list[str] = []
    for d, logits_NG in enumerate(logits):
        G = logits_NG.shape[1]
        B = coords_NBd.shape[1]
        flat = coords_NBd.reshape(N * B, d)
        if d == 0:
            unique, inverse = flat[:1], torch.zeros(N * B, dtype=torch.long)
        else:
            unique, inverse = torch.unique(flat, dim=0, return_inverse=True)
        prefixes = [prefix_key(name, row) for row in unique.tolist()]
        last = children(prefixes)
        alive_PG = torch.zeros(len(prefixes), G, dtype=torch.bool)
        for i, prefix in enumerate(prefixes):
            for child in last.get(prefix, {}):
                if 0 <= child < G:
                    alive_PG[i, child] = True
        alive_NBG = alive_PG[inverse].view(N, B, G) & valid_NB[..., None]
        cand_NBG = scores_NB[..., None] + logits_NG.detach().float()[:, None, :]
        cand_NBG = cand_NBG.masked_fill(~alive_NBG, float("-inf"))
        width = min(k if d == len(logits) - 1 else beam_size, B * G)
        top = cand_NBG.reshape(N, B * G).topk(width, dim=1)
        beam_idx, child_idx = top.indices // G, top.indices % G
        coords_NBd = torch.cat(
            [
                coords_NBd.gather(1, beam_idx[..., None].expand(N, width, d)),
                child_idx[..., None],
            ],
            dim=2,
        )
        scores_NB = top.values
        valid_NB = torch.isfinite(scores_NB)
    coords_NBd = coords_NBd.masked_fill(~valid_NB[..., None], 0)
    peers: dict[str, Sequence[object]] = {}
    for n, b in valid_NB.nonzero().tolist():
        row = coords_NBd[n, b].tolist()
        uid = uid_of(name, row)
        if uid not in peers:
            peers[uid] = last[prefix_key(name, row[:-1])][row[-1]]
    return Route(coords_NBd, valid_NB, peers, name)
