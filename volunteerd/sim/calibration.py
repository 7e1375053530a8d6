"""What the simulator charges for compute: measured on this machine with the production code.

The simulator runs the trainer's real routing under a virtual clock; the seconds that
torch and the codecs would take are charged instead of spent. ``measure`` times, with
one torch thread (as a daemon's executor computes), in CPU seconds of the measuring
thread (process, for round trips), the fastest of ``repeats`` runs: what the work costs
with a core to itself, as reproducible as this shared machine allows (medians moved by
up to 2x between runs while other processes ran); sharing the cores is the simulator's
to model:

* one expert call on an ``ExpertBackend`` built as the experiment's daemons build it
  (``train.expert_config``): the kept forward a training step sends
  (``forward_retained``), the backward through it (``backward_retained``), the plain
  forward of a validation (``forward``) and the optimizer step a backward is followed
  by (checked as a daemon checks it), at several row counts, fitted to ``a + b * rows``
  by least squares;
* the trainer's own compute per step: the experiment's model (``train.build_model``,
  local mixtures) with every expert replaced by the identity, so what is left is the
  embedding, attention, gating, routing, mixing, head, loss, the backward of all that
  and the trainer's Adam step, plus the weight copy into the batch's replica the
  trainer makes each step; and its forward alone (a validation batch);
* per request, what a server and the trainer spend besides the math: the tensor codecs
  (``experts.to_wire``/``from_wire``), the headers (``wire``), the server's input check
  (``runtime.guard.RequestGuard``) and a real ``RpcServer``/``RpcClient`` round trip
  over ``testing.memnet`` (no latency, so no sleeping), or with ``transport="libp2p"``
  between two real libp2p nodes on 127.0.0.1 (noise, yamux, TCP: what a daemon pays),
  for a typical batched request: ``_PER_REQUEST`` experts (the trainer's batching,
  ``moe.dispatch``) of ``batch tokens * k_best / experts`` rows each, and at a quarter
  and four times that size for the cost per byte. Memory streams cost far less than
  py-libp2p's; ``docs/scale.md`` compares both with a real run.

Shape legend: R rows (tokens) sent to one expert, H hidden.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import trio
from torch import nn

from volunteerd.atomic import write_atomic
from volunteerd.config import GuardConfig, PeerLimitsConfig, TimeoutsConfig, WireLimits
from volunteerd.experts import ExpertBackend, from_wire, to_wire
from volunteerd.experts.backend import StepCheck
from volunteerd.moe import LocalMixtureOfExperts
from volunteerd.net import PeerAddress, RpcClient, RpcServer, Verb
from volunteerd.net.rpc import Handler, Reply, Request
from volunteerd.runtime.guard import RequestGuard
from volunteerd.runtime.hardware import cpu_model
from volunteerd.testing.memnet import MemoryNetwork
from volunteerd.train import Experiment, build_model, expert_config
from volunteerd.wire import (
    PREFIX,
    BatchReply,
    ForwardBatchRequest,
    ForwardRequest,
    TensorReply,
    decode_header,
    encode_frame,
    parse_prefix,
    split_body,
)

__all__ = ["Calibration", "Transport", "load_or_measure", "measure"]

Transport = Literal["memory", "libp2p"]

# row counts the expert calls are timed at (the demo sends ~128 rows to an expert)
_ROWS = (16, 32, 64, 128, 256, 512)
# expert calls per request the calibration times: a few experts per server per step
# (the trainer sends one message per server, moe.dispatch)
_PER_REQUEST = 4


@dataclass(frozen=True, slots=True)
class Calibration:
    """Seconds of compute, as ``a + b * rows`` per expert call or flat per step/request.

    ``forward_s``/``backward_s``/``trainer_step_s``/``server_request_s``/
    ``client_request_s`` are what the simulator charges; the fields after ``machine``
    are measured too, for what a step also costs: the plain forward of a validation, the
    optimizer step a server takes after each backward (after answering it: off the
    trainer's critical path, but on the server's CPU) and the trainer's forward of one
    validation batch."""

    forward_s: tuple[float, float]  # one kept forward (retain=True): a + b * rows
    backward_s: tuple[float, float]  # one backward through a kept forward: a + b * rows
    trainer_step_s: float  # trainer's own compute per step, experts excluded
    server_request_s: float  # a server's CPU per request besides the expert math
    client_request_s: float  # the trainer's CPU per request besides the math
    cores: int
    machine: str
    inference_s: tuple[float, float] = (0.0, 0.0)  # one plain forward (validation)
    optimizer_step_s: float = 0.0  # one expert's optimizer step (after each backward)
    trainer_forward_s: float = 0.0  # trainer's own forward of one batch, experts excluded
    # what the request overheads were measured over ("memory" or "libp2p"), the request
    # + reply bytes of the typical request they are for, and the CPU seconds each side
    # adds per byte more (or saves per byte less) in a request and its reply
    transport: str = "memory"
    request_bytes: int = 0
    request_byte_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Calibration:
        """The calibration ``to_json`` wrote; raises ValueError if ``d`` is not one."""
        try:
            return cls(
                forward_s=_pair(d["forward_s"]),
                backward_s=_pair(d["backward_s"]),
                trainer_step_s=float(d["trainer_step_s"]),
                server_request_s=float(d["server_request_s"]),
                client_request_s=float(d["client_request_s"]),
                cores=int(d["cores"]),
                machine=str(d["machine"]),
                inference_s=_pair(d.get("inference_s", (0.0, 0.0))),
                optimizer_step_s=float(d.get("optimizer_step_s", 0.0)),
                trainer_forward_s=float(d.get("trainer_forward_s", 0.0)),
                transport=str(d.get("transport", "memory")),
                request_bytes=int(d.get("request_bytes", 0)),
                request_byte_s=float(d.get("request_byte_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"not a calibration: {exc!r}") from None

    def expert_forward_s(self, rows: int) -> float:
        a, b = self.forward_s
        return a + b * rows

    def expert_backward_s(self, rows: int) -> float:
        a, b = self.backward_s
        return a + b * rows

    def server_request_s_for(self, nbytes: int) -> float:
        """A server's CPU for a request whose request + reply carry ``nbytes``."""
        return max(0.0, self.server_request_s + self.request_byte_s * (nbytes - self.request_bytes))

    def client_request_s_for(self, nbytes: int) -> float:
        """The trainer's CPU for a request whose request + reply carry ``nbytes``."""
        return max(0.0, self.client_request_s + self.request_byte_s * (nbytes - self.request_bytes))


def _pair(value: Any) -> tuple[float, float]:
    a, b = value
    return float(a), float(b)


def load_or_measure(
    path: Path | None, experiment: Experiment, *, transport: Transport = "memory"
) -> Calibration:
    """The calibration cached in ``path`` if it holds one, else measured now (over
    ``transport``) and written there, when ``path`` is given. The cache is not checked
    against ``experiment``: use one file per experiment, machine and transport."""
    if path is not None and path.exists():
        try:
            return Calibration.from_json(json.loads(path.read_text()))
        except ValueError:
            pass  # unreadable or foreign: measure again and replace it
    calibration = measure(experiment, transport=transport)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(calibration.to_json(), indent=2) + "\n")
    return calibration


def measure(
    experiment: Experiment, *, repeats: int = 20, transport: Transport = "memory"
) -> Calibration:
    """Time ``experiment``'s expert calls, trainer step and request handling here (the
    module docstring says how). Takes a few seconds; runs with one torch thread and puts
    the thread count back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, t = experiment.model, experiment.training
        backend = ExpertBackend(
            "calibration.0.0", expert_config(experiment), torch.device("cpu"), 1
        )
        forward, backward, inference, opt_step = _expert_calls(backend, m.hidden_dim, repeats)
        step_s, forward_only_s = _trainer_step(experiment, repeats)
        tokens = t.batch_size * m.seq_len
        experts = math.prod(m.grid)
        rows = max(1, round(tokens * m.k_best / experts))
        server_s, client_s, request_bytes, byte_s = _request_overheads(
            m.hidden_dim, rows, repeats, transport
        )
    finally:
        torch.set_num_threads(threads)
    return Calibration(
        forward_s=forward,
        backward_s=backward,
        trainer_step_s=step_s,
        server_request_s=server_s,
        client_request_s=client_s,
        cores=_cores(),
        machine=f"{cpu_model()}; torch {torch.__version__}; python {platform.python_version()}",
        inference_s=inference,
        optimizer_step_s=opt_step,
        trainer_forward_s=forward_only_s,
        transport=transport,
        request_bytes=request_bytes,
        request_byte_s=byte_s,
    )


# --- expert calls -----------------------------------------------------------------------


def _expert_calls(
    backend: ExpertBackend, hidden: int, repeats: int
) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float], float]:
    """(kept forward, backward, plain forward) fits and the optimizer step's seconds,
    the step checked as a daemon checks it once its guard has warmed up (the cheap
    prediction; ``runtime.service``)."""
    guard = GuardConfig()
    check = StepCheck(guard.max_step_ratio, full_every=guard.full_check_every)
    generator = torch.Generator().manual_seed(0)
    forward: list[tuple[int, float]] = []
    backward: list[tuple[int, float]] = []
    inference: list[tuple[int, float]] = []
    steps: list[float] = []
    for rows in _ROWS:
        x_RH = torch.randn(rows, hidden, generator=generator)
        g_RH = torch.randn(rows, hidden, generator=generator)
        for i in range(repeats + 1):  # the first of each size warms up
            start = time.thread_time()
            backend.forward([x_RH])
            after_inference = time.thread_time()
            _, retained = backend.forward_retained([x_RH])
            after_forward = time.thread_time()
            backend.backward_retained([(retained, [g_RH])])
            after_backward = time.thread_time()
            backend.step(check if guard.check_steps else None)
            after_step = time.thread_time()
            if i:
                inference.append((rows, after_inference - start))
                forward.append((rows, after_forward - after_inference))
                backward.append((rows, after_backward - after_forward))
                steps.append(after_step - after_backward)
    return _fit(forward), _fit(backward), _fit(inference), min(steps)


def _fit(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``a + b * rows`` through each row count's fastest seconds (a
    context switch or a busy neighbour now and then should not tilt the line); ``a``
    at least 0."""
    by_rows: dict[int, list[float]] = {}
    for rows, seconds in samples:
        by_rows.setdefault(rows, []).append(seconds)
    xs = sorted(by_rows)
    ys = [min(by_rows[x]) for x in xs]
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - x_mean) ** 2 for x in xs)
    b = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / var
    a = y_mean - b * x_mean
    if a < 0:  # a line through the origin instead
        a, b = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return a, b


# --- the trainer's own step ---------------------------------------------------------------


def _trainer_step(experiment: Experiment, repeats: int) -> tuple[float, float]:
    """CPU seconds of the trainer's step and of its forward alone, experts free."""
    model = build_model(experiment, None)
    for block in model.blocks:
        if isinstance(block.moe, LocalMixtureOfExperts):
            block.moe.experts = nn.ModuleDict({name: nn.Identity() for name in block.moe.experts})
    replica = build_model(experiment, None)  # the batch thread's copy, as Trainer keeps
    params = model.trainer_parameters()
    optimizer = torch.optim.Adam(params, lr=experiment.training.lr)
    trained = dict(model.named_parameters())
    m, t = experiment.model, experiment.training
    generator = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 256, (t.batch_size, m.seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        with torch.no_grad():  # Trainer._load: the replica takes the weights of now
            for name, p in replica.named_parameters():
                source = trained.get(name)
                if source is not None and source.shape == p.shape:
                    p.copy_(source)
        x, y = batch()
        loss = model.loss(x, y)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer.step()

    def forward() -> None:
        with torch.no_grad():
            model.loss(*batch())

    return _fastest_cpu(step, repeats), _fastest_cpu(forward, repeats)


def _fastest_cpu(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        samples.append(time.thread_time() - start)
    return min(samples)


# --- per-request overheads ----------------------------------------------------------------


def _request_overheads(
    hidden: int, rows: int, repeats: int, transport: Transport
) -> tuple[float, float, int, float]:
    """(server, trainer) CPU seconds per batched request of ``rows`` rows per expert
    besides the math: each side's codec work timed directly, plus an even share of the
    rest of a round trip over ``transport`` (streams, framing, trio; encryption and
    multiplexing over libp2p); then the request + reply bytes of such a request and the
    seconds per byte each side adds (half the round trip's slope over three sizes)."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, hidden, generator=generator) for _ in range(_PER_REQUEST)]
    uids = [f"calibration.0.{i}" for i in range(_PER_REQUEST)]

    def client_encode() -> tuple[ForwardBatchRequest, list[bytes]]:
        items, buffers = [], []
        for uid, x in zip(uids, inputs, strict=True):
            meta, data = to_wire(x)
            items.append(ForwardRequest(uid=uid, tensors=[meta], retain=True))
            buffers.append(data)
        return ForwardBatchRequest(items=items), buffers

    guard = RequestGuard(GuardConfig())

    def server_reply(request: ForwardBatchRequest, body: memoryview) -> bytes:
        xs = [from_wire(w) for w in split_body(request.tensors, body)]
        for item, x in zip(request.items, xs, strict=True):
            guard.check_inputs(item.uid, "trainer", [x])
        metas, buffers = zip(*(to_wire(x) for x in xs), strict=True)
        items = [TensorReply(tensors=[meta]) for meta in metas]
        return encode_frame(BatchReply(items=items), buffers)

    def client_decode(frame: bytes) -> None:
        view = memoryview(frame)
        sizes = parse_prefix(
            bytes(view[: PREFIX.size]), max_header_bytes=1 << 20, max_body_bytes=1 << 30
        )
        end = PREFIX.size + sizes.header_bytes
        reply = decode_header(BatchReply, view[PREFIX.size : end])
        for w in split_body(reply.tensors, view[end:]):
            from_wire(w)

    header, buffers = client_encode()
    request_frame = encode_frame(header, buffers)
    reply_frame = server_reply(header, memoryview(b"".join(buffers)))

    def server_side() -> None:
        view = memoryview(request_frame)
        sizes = parse_prefix(
            bytes(view[: PREFIX.size]), max_header_bytes=1 << 20, max_body_bytes=1 << 30
        )
        end = PREFIX.size + sizes.header_bytes
        request = decode_header(ForwardBatchRequest, view[PREFIX.size : end])
        server_reply(request, view[end:])

    def client_side() -> None:
        h, b = client_encode()
        encode_frame(h, b)
        client_decode(reply_frame)

    server_codec = _fastest_cpu(server_side, repeats)
    client_codec = _fastest_cpu(client_side, repeats)
    sizes = (max(1, rows // 4), rows, 4 * rows)
    trips = trio.run(_round_trips, transport, hidden, sizes, max(repeats, 10))
    a, b = _fit(trips)  # seconds of a round trip, both sides, by request + reply bytes
    typical = 2 * _PER_REQUEST * rows * hidden * 4
    rest = max(0.0, a + b * typical - server_codec - client_codec)
    # A byte costs something: a slope below 0 is the noise of a busy machine (seen once,
    # -1e-10 s a byte, beside two busy loops), not a discount for larger requests.
    return server_codec + rest / 2, client_codec + rest / 2, typical, max(0.0, b) / 2


async def _round_trips(
    transport: Transport, hidden: int, sizes: Sequence[int], repeats: int
) -> list[tuple[int, float]]:
    """(request + reply bytes, CPU seconds) of batched forward requests of ``sizes``
    rows per expert, each with its reply, over ``transport`` between two hosts of this
    process (both sides' work counted); the server echoes the inputs (no math)."""
    guard = RequestGuard(GuardConfig())

    async def echo(request: Request) -> Reply:
        xs = [from_wire(w) for w in request.tensors]
        for item, x in zip(request.header.items, xs, strict=True):
            guard.check_inputs(item.uid, request.peer_id, [x])
        metas, buffers = zip(*(to_wire(x) for x in xs), strict=True)
        return Reply(BatchReply(items=[TensorReply(tensors=[meta]) for meta in metas]), buffers)

    generator = torch.Generator().manual_seed(1)
    uids = [f"calibration.0.{i}" for i in range(_PER_REQUEST)]
    samples: list[tuple[int, float]] = []
    async with _open_pair(transport, echo) as (client, server):
        for rows in sizes:
            inputs = [torch.randn(rows, hidden, generator=generator) for _ in uids]
            for i in range(repeats + 1):  # the first connects and opens the stream
                start = time.process_time()
                items, buffers = [], []
                for uid, x in zip(uids, inputs, strict=True):
                    meta, data = to_wire(x)
                    items.append(ForwardRequest(uid=uid, tensors=[meta], retain=True))
                    buffers.append(data)
                _, tensors = await client.call(
                    server, Verb.FORWARD_BATCH, ForwardBatchRequest(items=items), buffers
                )
                for w in tensors:
                    from_wire(w)
                seconds = time.process_time() - start
                if i:
                    nbytes = sum(len(b) for b in buffers) + sum(w.data.nbytes for w in tensors)
                    samples.append((nbytes, seconds))
    return samples


@asynccontextmanager
async def _open_pair(
    transport: Transport, handler: Handler
) -> AsyncIterator[tuple[RpcClient, PeerAddress]]:
    """A client and the address of a server answering ``forward-batch`` with
    ``handler``: memory hosts (``testing.memnet``) or two real libp2p nodes on
    127.0.0.1 (``testing.nodes``)."""
    if transport == "libp2p":
        # (imported here: it brings the whole daemon along)
        from volunteerd.testing.nodes import local_config, open_peer

        config = local_config(uids="")
        async with open_peer(config) as server, open_peer(config) as client:
            server.server.add({Verb.FORWARD_BATCH: handler})
            yield client.rpc, server.address
        return
    network = MemoryNetwork(seed=0)
    async with network.open_host() as server_host, network.open_host() as client_host:
        rpc_server = RpcServer(
            server_host,
            {Verb.FORWARD_BATCH: handler},
            WireLimits(),
            TimeoutsConfig(),
            PeerLimitsConfig(),
        )
        rpc_server.install()
        rpc_client = RpcClient(client_host, WireLimits(), TimeoutsConfig())
        try:
            yield rpc_client, server_host.address
        finally:
            await rpc_client.aclose()


# --- the machine --------------------------------------------------------------------------


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1
