"""Throughput baseline: hivemind (the reference Learning@home implementation) on this machine.

What it measures
    One hivemind MoE server (``hivemind.moe.Server.create``) hosts ``--experts`` experts of
    hivemind's built-in expert class ``"ffn"`` (Linear H->4H, GELU, Linear 4H->H, LayerNorm)
    with hidden size ``--hidden`` and an Adam optimizer, using hivemind's default batching
    settings (``Server.create`` defaults: max_batch_size 4096, 8 connection handlers per
    expert). ``--clients`` client processes each hold ``RemoteExpert`` handles to every
    expert and run training steps: pick the next expert (round robin), forward a random
    ``--batch`` x ``--hidden`` float32 batch that requires grad, then
    ``out.sum().backward()``. That is one forward RPC and one backward RPC (which also
    applies the expert's optimizer step on the server) per step, through hivemind's normal
    client path (p2pd + libp2p streams).

    Once every client has connected, fetched expert info and done its untimed warm-up
    steps, a shared event opens a window of ``--seconds``. Every client keeps stepping
    until it has finished a step after the window closed, so all of them are busy for the
    whole window; samples/s counts the steps done inside it (the one under way at the end
    by the share of it done). Over the same window the server's CPU time is read from
    /proc: this process (the server's threads and its runtime) and every process below it
    that is not a client or a client's p2pd (connection handlers, the DHT process, the
    server's p2pd), divided by the samples trained in the window. The result is printed
    as ONE JSON line on stdout::

        {"system": "hivemind", "version": ..., "hidden": H, "batch": B, "experts": E,
         "clients": C, "seconds": s, "compression": ..., "steps": n, "samples": n*B,
         "samples_per_s": x,
         "server_cpu_s": c, "server_cpu_us_per_sample": u}

    Logs go to stderr. The exit status is non-zero if any client failed.

Network
    Every p2p daemon (the server's and each client's) listens on 127.0.0.1 only, with NAT
    port mapping off and no bootstrap peers, so no traffic leaves the machine.

Cleanup
    The script makes itself a child subreaper, so p2p daemons orphaned by a dead client are
    re-parented to it; on exit (normal, error, Ctrl-C or SIGTERM) it shuts the server down
    and then terminates every process still descended from it. Last it deletes the unix
    socket files its own processes bound in /tmp and left there: hivemind never shuts down
    a connection handler's p2p replica, so each handler (16 with 2 experts) would leave a
    ``/tmp/hivemind-p2pclient-*.sock`` behind (``hivemind_procs.hivemind_socket_paths``).

How to run (with hivemind's own virtual environment, see benchmarks/setup_hivemind.sh)::

    .hivemind-venv/bin/python benchmarks/hivemind_throughput.py \\
        --hidden 1024 --batch 512 --experts 2 --clients 2 --seconds 10

This script deliberately imports nothing from volunteerd.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import hivemind
import torch
from hivemind.moe.client.expert import RemoteExpert
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.moe.expert_uid import ExpertInfo
from hivemind.moe.server import Server
from hivemind.p2p import P2P, PeerID
from hivemind.proto.runtime_pb2 import CompressionType
from hivemind_procs import (
    Interrupted,
    become_subreaper,
    cpu_seconds,
    descendants,
    hivemind_socket_paths,
    install_sigterm_handler,
    kill_descendants,
    remove_stale_sockets,
    steps_in_window,
)

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ["/ip4/127.0.0.1/tcp/0"]
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class ClientConfig:
    """Everything a client process needs; picklable for the spawn start method."""

    index: int
    server_peer_id: bytes
    server_maddrs: list[str]
    expert_uids: list[str]
    hidden: int
    batch: int
    seconds: float
    warmup: int
    timeout: float
    log_level: str


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measure hivemind MoE forward+backward throughput on 127.0.0.1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--hidden", type=_positive_int, default=1024, help="expert hidden size")
    parser.add_argument("--batch", type=_positive_int, default=512, help="samples per request")
    parser.add_argument("--experts", type=_positive_int, default=2, help="experts on the server")
    parser.add_argument("--clients", type=_positive_int, default=2, help="client processes")
    parser.add_argument(
        "--seconds", type=_positive_float, default=10.0, help="length of the timing window"
    )
    parser.add_argument(
        "--warmup-batches", type=_non_negative_int, default=3, help="untimed steps per client"
    )
    parser.add_argument("--lr", type=_positive_float, default=1e-3, help="Adam learning rate")
    parser.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=None,
        help="server max_batch_size (default: hivemind's Server.create default, 4096)",
    )
    parser.add_argument(
        "--num-handlers",
        type=_positive_int,
        default=None,
        help="server connection handlers (default: hivemind's, 8 per expert)",
    )
    parser.add_argument(
        "--compression",
        default="none",
        choices=["none", "float16"],
        help="Server.create's compression (float16: CompressionType.FLOAT16, which hivemind "
        "applies to the inputs both ways and to the input gradients, not to the outputs or "
        "their gradients)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds allowed for each phase (client start-up, timed run)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level for this script and for hivemind (stderr)",
    )
    return parser.parse_args(argv)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format="%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s",
    )
    # hivemind installs its own stderr handler on the "hivemind" logger.
    logging.getLogger("hivemind").setLevel(level)


def _client_step(expert: RemoteExpert, inputs: torch.Tensor) -> None:
    x = inputs.detach().requires_grad_(True)
    out = expert(x)
    if out.shape != x.shape:
        raise RuntimeError(f"expert {expert.uid} returned shape {tuple(out.shape)}")
    out.sum().backward()
    if x.grad is None:
        raise RuntimeError(f"expert {expert.uid} returned no input gradient")


def _client_main(cfg: ClientConfig, messages: Any, go: Any, window_start: Any) -> None:
    """Entry point of one client process: connect, warm up, wait for ``go``, step until a
    step finishes after the window (``window_start.value`` + ``cfg.seconds``), report
    when each step finished."""
    _setup_logging(cfg.log_level)
    install_sigterm_handler()
    torch.set_num_threads(1)
    p2p: P2P | None = None
    exit_code = 0
    try:
        p2p = RemoteExpertWorker.run_coroutine(
            P2P.create(
                initial_peers=cfg.server_maddrs,
                host_maddrs=LOOPBACK_MADDRS,
                nat_port_map=False,
            )
        )
        peer_id = PeerID(cfg.server_peer_id)
        experts = [
            RemoteExpert(ExpertInfo(uid=uid, peer_id=peer_id), p2p) for uid in cfg.expert_uids
        ]
        for expert in experts:
            _ = expert.info  # rpc_info round trip, outside the timed region
        generator = torch.Generator().manual_seed(cfg.index)
        inputs = torch.randn(cfg.batch, cfg.hidden, generator=generator, dtype=torch.float32)
        step = 0
        for _ in range(cfg.warmup):
            _client_step(experts[step % len(experts)], inputs)
            step += 1
        messages.put(("ready", cfg.index, None))
        if not go.wait(cfg.timeout):
            raise TimeoutError(f"no start signal within {cfg.timeout} s")
        window_end = window_start.value + cfg.seconds
        finished: list[float] = []
        while not finished or finished[-1] <= window_end:
            _client_step(experts[step % len(experts)], inputs)
            step += 1
            finished.append(time.perf_counter())  # CLOCK_MONOTONIC: one clock for all
        messages.put(("done", cfg.index, finished))
    except BaseException:
        exit_code = 1
        messages.put(("error", cfg.index, traceback.format_exc()[-MAX_ERROR_CHARS:]))
    finally:
        if p2p is not None:
            with contextlib.suppress(BaseException):
                RemoteExpertWorker.run_coroutine(p2p.shutdown())
    if exit_code:
        sys.exit(exit_code)


# ---------------------------------------------------------------------------------------------
# driver


class ClientFailed(RuntimeError):
    pass


def _collect(
    messages: Any,
    clients: list[Any],
    kind: str,
    timeout: float,
) -> dict[int, Any]:
    """Wait until every client sent a ``kind`` message; fail fast on errors or dead clients."""
    received: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(received) < len(clients):
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(clients))) - set(received))
            raise ClientFailed(f"clients {missing} sent no '{kind}' within {timeout} s")
        try:
            what, index, payload = messages.get(timeout=0.5)
        except queue.Empty:
            for index, proc in enumerate(clients):
                if index not in received and proc.exitcode is not None:
                    raise ClientFailed(
                        f"client {index} exited with code {proc.exitcode} before '{kind}'"
                    ) from None
            continue
        if what == "error":
            raise ClientFailed(f"client {index} failed:\n{payload}")
        if what != kind:
            raise ClientFailed(f"client {index} sent '{what}' while waiting for '{kind}'")
        received[index] = payload
    return received


def _shutdown_server(server: Server, timeout: float = 20.0) -> None:
    def _stop() -> None:
        server.shutdown()
        server.join()

    stopper = threading.Thread(target=_stop, name="server-shutdown", daemon=True)
    stopper.start()
    stopper.join(timeout)
    if stopper.is_alive():
        logger.warning("hivemind server did not shut down within %.0f s", timeout)


def _server_pids(clients: list[Any]) -> list[int]:
    """This process and every process below it that is not a client or below one."""
    client_side = set()
    for proc in clients:
        client_side.update([proc.pid, *descendants(proc.pid)])
    me = os.getpid()
    return [me, *(pid for pid in descendants(me) if pid not in client_side)]


def _cpu_of(pids: list[int]) -> dict[int, float]:
    return {pid: cpu for pid in pids if (cpu := cpu_seconds(pid)) is not None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    server: Server | None = None
    clients: list[Any] = []
    sockets: set[str] = set()
    began = time.perf_counter()
    try:
        expert_uids = [f"expert.{i}" for i in range(args.experts)]
        create_kwargs: dict[str, Any] = {}
        if args.max_batch_size is not None:
            create_kwargs["max_batch_size"] = args.max_batch_size
        if args.num_handlers is not None:
            create_kwargs["num_handlers"] = args.num_handlers
        server = Server.create(
            expert_uids=expert_uids,
            expert_cls="ffn",
            hidden_dim=args.hidden,
            optim_cls=functools.partial(torch.optim.Adam, lr=args.lr),
            device="cpu",
            start=True,
            # forwarded to the DHT's p2p daemon: loopback only, no NAT port mapping
            host_maddrs=LOOPBACK_MADDRS,
            nat_port_map=False,
            compression=getattr(CompressionType, args.compression.upper()),
            **create_kwargs,
        )
        maddrs = [str(a) for a in server.dht.get_visible_maddrs()]
        loopback = [a for a in maddrs if a.startswith("/ip4/127.0.0.1/")]
        if not loopback:
            raise RuntimeError(f"server has no 127.0.0.1 address: {maddrs}")
        logger.info(
            "server ready in %.1f s: %d expert(s), %d handler(s), maddrs %s",
            time.perf_counter() - began,
            args.experts,
            len(server.conn_handlers),
            loopback,
        )

        ctx = mp.get_context("spawn")
        messages = ctx.Queue()
        go = ctx.Event()
        window_start = ctx.Value("d", 0.0)
        for index in range(args.clients):
            cfg = ClientConfig(
                index=index,
                server_peer_id=server.dht.peer_id.to_bytes(),
                server_maddrs=loopback,
                expert_uids=expert_uids,
                hidden=args.hidden,
                batch=args.batch,
                seconds=args.seconds,
                warmup=args.warmup_batches,
                timeout=args.timeout,
                log_level=args.log_level,
            )
            proc = ctx.Process(
                target=_client_main,
                args=(cfg, messages, go, window_start),
                name=f"hivemind-client-{index}",
                daemon=True,
            )
            proc.start()
            clients.append(proc)

        _collect(messages, clients, "ready", args.timeout)
        logger.info("all %d clients ready after %.1f s", args.clients, time.perf_counter() - began)
        sockets |= hivemind_socket_paths([os.getpid(), *descendants(os.getpid())])
        server_pids = _server_pids(clients)
        cpu_before = _cpu_of(server_pids)
        start = time.perf_counter()
        window_start.value = start
        go.set()
        time.sleep(max(0.0, start + args.seconds - time.perf_counter()))
        cpu_after = _cpu_of(server_pids)
        server_cpu_s = sum(cpu_after[p] - cpu_before[p] for p in cpu_after if p in cpu_before)
        per_client = _collect(messages, clients, "done", args.timeout)
        per_client_steps = {
            index: steps_in_window(finished, start, start + args.seconds)
            for index, finished in per_client.items()
        }
        steps = sum(per_client_steps.values())
        for index, done in sorted(per_client_steps.items()):
            logger.info("client %d: %.1f steps in the window", index, done)

        for proc in clients:
            proc.join(30)
        failed = [i for i, proc in enumerate(clients) if proc.exitcode != 0]
        if failed:
            raise ClientFailed(f"clients {failed} exited non-zero")
    finally:
        sockets |= hivemind_socket_paths([os.getpid(), *descendants(os.getpid())])
        for proc in clients:
            if proc.is_alive():
                proc.terminate()
        for proc in clients:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if server is not None:
            dead = {
                handler.pid: handler.exitcode
                for handler in server.conn_handlers
                if handler.exitcode is not None
            }
            if dead:
                logger.warning("hivemind connection handlers already exited (pid: code): %s", dead)
            _shutdown_server(server)
        kill_descendants()
        remove_stale_sockets(sockets)
        logger.info("total wall time %.1f s", time.perf_counter() - began)

    samples = round(steps * args.batch)
    return {
        "system": "hivemind",
        "version": hivemind.__version__,
        "hidden": args.hidden,
        "batch": args.batch,
        "experts": args.experts,
        "clients": args.clients,
        "seconds": args.seconds,
        "compression": args.compression,
        "steps": round(steps, 2),
        "samples": samples,
        "samples_per_s": round(samples / args.seconds, 2),
        "server_cpu_s": round(server_cpu_s, 3),
        "server_cpu_us_per_sample": round(server_cpu_s / samples * 1e6, 1) if samples else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _setup_logging(args.log_level)
    become_subreaper()
    install_sigterm_handler()
    logger.info("config: %s", json.dumps(vars(args)))
    try:
        result = run(args)
    except (KeyboardInterrupt, Interrupted) as exc:
        logger.error("interrupted (%s)", type(exc).__name__)
        return 130
    except ClientFailed as exc:
        logger.error("%s", exc)
        return 1
    except Exception:
        logger.exception("benchmark failed")
        return 1
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
