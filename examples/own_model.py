"""A decentralized mixture of experts inside your own PyTorch model.

The model below is ordinary torch: an input layer, one ``RemoteMixtureOfExperts`` whose
experts live on volunteers' daemons, and an output layer. It learns a fixed random
function of its input. Only the trainer's own parameters (the two linear layers and the
mixture's gate) are in the optimizer here: each expert is updated by the daemon hosting
it, with the optimizer of its experiment, when the backward pass reaches it.

Start a swarm that hosts the grid ``ffn.[0:4].[0:4]`` (docs/training.md), e.g. by hand:

    volunteerd bootstrap --listen-host 127.0.0.1 --port 38400 --data-dir /tmp/vd-boot
    volunteerd serve --listen-host 127.0.0.1 --port 0 --data-dir /tmp/vd-a \\
        --experts "ffn.[0:4].[0:4]" --set experts.hidden_dim=128 \\
        --bootstrap /ip4/127.0.0.1/tcp/38400/p2p/12D3KooW...

then train against it:

    python examples/own_model.py --bootstrap /ip4/127.0.0.1/tcp/38400/p2p/12D3KooW...

The width, grid and name must be those of the experts the swarm hosts (``--hidden-dim``,
``--grid``, ``--layer``): a published experiment's are in its manifest.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from volunteerd.config import Config
from volunteerd.moe import NoExpertsAvailable, RemoteMixtureOfExperts, SwarmClient

IN_FEATURES = 8
OUT_FEATURES = 4


class SwarmRegressor(nn.Module):
    """x [B, 8] -> y [B, 4]: linear, a residual mixture of remote experts, linear."""

    def __init__(
        self, client: SwarmClient, hidden_dim: int, grid: tuple[int, ...], layer: str
    ) -> None:
        super().__init__()
        self.encode = nn.Linear(IN_FEATURES, hidden_dim)
        self.moe = RemoteMixtureOfExperts(
            hidden_dim,
            grid,
            layer,  # the grid's name: experts ffn.0.0, ffn.0.1, ... for "ffn"
            k_best=2,  # each sample goes to its 2 best-scoring alive experts
            k_min=1,  # go on once 1 answered and the grace period passed
            forward_timeout_s=10.0,
            backward_timeout_s=20.0,
            client=client,
        )
        self.decode = nn.Linear(hidden_dim, OUT_FEATURES)

    def forward(self, x_BI: torch.Tensor) -> torch.Tensor:
        h_BH = torch.tanh(self.encode(x_BI))
        h_BH = h_BH + self.moe(h_BH)  # any leading shape works: [..., hidden_dim]
        return self.decode(h_BH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR")
    parser.add_argument("--listen-host", default="127.0.0.1", metavar="IP")
    parser.add_argument("--hidden-dim", type=int, default=128)
    parser.add_argument("--grid", type=int, nargs="+", default=[4, 4])
    parser.add_argument("--layer", default="ffn", help="the experts' grid name")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    torch.manual_seed(0)
    target = nn.Linear(IN_FEATURES, OUT_FEATURES)  # the function to learn
    # The trainer's node: any free port; peers of the swarm dial it for DHT traffic.
    config = Config.model_validate(
        {
            "network": {
                "listen_host": args.listen_host,
                "port": 0,
                "bootstrap_peers": args.bootstrap,
            }
        }
    )
    with SwarmClient(config) as client:
        model = SwarmRegressor(client, args.hidden_dim, tuple(args.grid), args.layer)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        for step in range(1, args.steps + 1):
            x_BI = torch.randn(32, IN_FEATURES)
            with torch.no_grad():
                y_BO = torch.sin(3 * target(x_BI))
            try:
                loss = F.mse_loss(model(x_BI), y_BO)
            except NoExpertsAvailable as exc:
                # Nobody hosts the layer right now (volunteers come and go): skip the step.
                print(f"step {step}: skipped ({exc})")
                continue
            optimizer.zero_grad()
            loss.backward()  # the experts' gradients travel to their daemons here
            optimizer.step()
            if step % 10 == 0 or step == 1:
                print(f"step {step}: loss {loss.item():.4f}")
        stats = model.moe.stats
        print(
            f"done: {stats.forward_ok} expert answers, {stats.forward_failed} failed; "
            f"experts used: {len(stats.by_uid)}"
        )


if __name__ == "__main__":
    main()
