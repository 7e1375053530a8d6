"""Bytes per token and validation loss of the wire compressions: none, float16, bfloat16
and q8 (blockwise 8-bit, ``experts.tensor_codec``).

What it measures
    1. The codec: ``to_wire`` then ``from_wire`` of a 512 x 1024 float32 tensor under
       each compression, in MB/s of float32 values (the best of ``--codec-repeats``:
       the machine is shared, and other work only ever adds time), and the bytes it
       takes on the wire.
    2. The demo experiment (``volunteerd demo``'s embedded default: a character-level
       transformer, 2 DMoE layers of 4x4 ``ffn`` experts, hidden 128, k_best 2, batches
       of 16 x 64 tokens, Adam on both sides) trained for ``--steps`` steps once per
       compression, from the same seeds, against an in-process swarm
       (``testing/inprocess.py``): ``--servers`` servers hosting whole rows of both
       layers, each a real ``ExpertRuntime`` behind the server pipeline and an
       ``RpcServer``, the trainer a real ``RpcClient``; frames travel on memory links
       instead of TCP. Every byte sent while training (not while evaluating) is counted
       on the memory network: whole frames with their headers, without what TCP, Noise
       and yamux would add. Reported per token trained: what the trainer sends (up) and
       receives (down), and what the busiest volunteer receives and sends. Then the
       final validation loss (the trainer's 8 held-out batches) and its difference to
       ``none``.

Run::

    .venv/bin/python benchmarks/compression.py
    .venv/bin/python benchmarks/compression.py --steps 100 --compressions none q8
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, get_args

import torch
import trio

from volunteerd.config import Config
from volunteerd.experts import from_wire, to_wire
from volunteerd.testing.inprocess import open_world
from volunteerd.testing.memnet import Link, MemoryNetwork
from volunteerd.train import Experiment, Trainer, build_model, load_corpus
from volunteerd.wire import Compression, WireTensor


class CountingNetwork(MemoryNetwork):
    """A memory network that counts the bytes each host sends to each other host,
    while ``counting``."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.sent: Counter[tuple[str, str]] = Counter()

    async def _transmit(self, a: str, b: str, size: int) -> Link:
        if self.counting:
            self.sent[(a, b)] += size
        return await super()._transmit(a, b, size)


class TrainingOnly(Trainer):
    """A trainer whose evaluations are not counted on ``network``."""

    network: CountingNetwork

    def evaluate(self, attempts: int = 5) -> float:
        self.network.counting = False
        try:
            return super().evaluate(attempts)
        finally:
            self.network.counting = True


@dataclass(frozen=True, slots=True)
class Run:
    compression: str
    up: float  # bytes per token, trainer -> volunteers
    down: float  # volunteers -> trainer
    volunteer_in: float  # the busiest volunteer's, bytes per token
    volunteer_out: float
    final_val_loss: float
    initial_val_loss: float
    steps: int
    skipped: int
    seconds: float


def codec_speed(repeats: int) -> list[tuple[str, float, int]]:
    x = torch.randn(512, 1024)
    mb = x.numel() * 4 / 1e6
    rows = []
    for compression in get_args(Compression):
        times = []
        size = 0
        for _ in range(repeats):
            started = time.perf_counter()
            meta, data = to_wire(x, compression)
            y = from_wire(WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data))))
            times.append(time.perf_counter() - started)
            size = len(data)
            assert y.shape == x.shape
        rows.append((compression, mb / min(times), size))
    return rows


def server_patterns(experiment: Experiment, servers: int) -> list[str]:
    """Whole rows of every layer per server, as ``volunteerd demo`` places them."""
    m = experiment.model
    rows = m.grid[0]
    per, extra = divmod(rows, servers)
    out = []
    for i in range(servers):
        start = i * per + min(i, extra)
        mine = range(start, start + per + (1 if i < extra else 0))
        out.append(",".join(m.expert_pattern(b, mine) for b in range(m.num_blocks)))
    return out


async def train(compression: str, steps: int, servers: int) -> Run:
    base = Experiment()
    experiment = base.model_copy(
        update={
            "model": base.model.model_copy(update={"compression": compression}),
            "training": base.training.model_copy(update={"steps": steps}),
        }
    )
    m = experiment.model
    config = Config.model_validate(
        {
            "experts": {
                "hidden_dim": m.hidden_dim,
                "optimizer": experiment.experts.model_dump(),
            },
            "runtime": {"device": "cpu", "torch_threads": 1},
        }
    )
    network = CountingNetwork()
    async with open_world(config, network) as world:
        hosts = [await world.add_server(p) for p in server_patterns(experiment, servers)]
        async with world.open_trainer() as client:

            def run() -> tuple[Any, float]:
                corpus = load_corpus(experiment.data)
                torch.manual_seed(experiment.training.seed)
                model = build_model(experiment, client)  # type: ignore[arg-type]
                trainer = TrainingOnly(experiment, model, corpus)
                trainer.network = network
                network.sent.clear()
                started = time.monotonic()
                summary = trainer.run(steps)
                return summary, time.monotonic() - started

            summary, seconds = await trio.to_thread.run_sync(run)
            me = client.host.peer_id
            tokens = summary.tokens
            ids = [s.peer_id for s in hosts]
            return Run(
                compression,
                up=sum(network.sent[(me, p)] for p in ids) / tokens,
                down=sum(network.sent[(p, me)] for p in ids) / tokens,
                volunteer_in=max(network.sent[(me, p)] for p in ids) / tokens,
                volunteer_out=max(network.sent[(p, me)] for p in ids) / tokens,
                final_val_loss=summary.final_val_loss,
                initial_val_loss=summary.initial_val_loss,
                steps=summary.steps,
                skipped=summary.skipped_steps,
                seconds=seconds,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=200, help="training steps per run (0: the codec only)"
    )
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument(
        "--compressions", nargs="+", default=list(get_args(Compression)),
        choices=get_args(Compression),
    )  # fmt: skip
    parser.add_argument("--codec-repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print("codec: to_wire + from_wire of a 512x1024 float32 tensor (2.1 MB)")
    print("| compression | MB/s (float32 in) | bytes on the wire |\n|---|---:|---:|")
    for compression, speed, size in codec_speed(args.codec_repeats):
        print(f"| {compression} | {speed:,.0f} | {size:,} |")
    sys.stdout.flush()

    if args.steps == 0:
        return
    print(
        f"\ndemo experiment, {args.steps} steps, {args.servers} volunteers; bytes per token "
        "trained (frames with headers)"
    )
    print(
        "| compression | trainer up | trainer down | busiest volunteer in | busiest "
        "volunteer out | validation loss | vs none | seconds |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    reference: Run | None = None
    for compression in args.compressions:
        r = trio.run(train, compression, args.steps, args.servers)
        if compression == "none":
            reference = r
        diff = (
            f"{(r.final_val_loss - reference.final_val_loss) / reference.final_val_loss:+.2%}"
            if reference is not None
            else "-"
        )
        skipped = f" ({r.skipped} skipped)" if r.skipped else ""
        print(
            f"| {r.compression} | {r.up:,.0f} | {r.down:,.0f} | {r.volunteer_in:,.0f} | "
            f"{r.volunteer_out:,.0f} | {r.initial_val_loss:.3f} -> {r.final_val_loss:.4f}"
            f"{skipped} | {diff} | {r.seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
