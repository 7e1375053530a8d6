"""Step-latency baseline: hivemind's Decentralized Mixture-of-Experts on this machine.

What it measures
    A standalone hivemind DHT (the bootstrap peer) and ``--servers`` hivemind MoE server
    processes (``hivemind.moe.Server.create``) together host a 4x4 grid of hivemind's built-in
    ``"ffn"`` experts named ``ffn.{i}.{j}`` (hidden size ``--hidden``, Adam optimizer,
    hivemind's default batching and handler settings). The 16 experts are split over the
    servers in contiguous runs of uids, as evenly as possible (with 2 or 4 servers that is
    by row ``i``). Before anything is timed, the script checks through the bootstrap DHT that
    every uid key and every ``ffn.{i}.`` prefix subkey is declared by the right server.

    The trainer (this process) joins the swarm with its own DHT and builds
    ``hivemind.moe.RemoteMixtureOfExperts(in_features=H, grid_size=(4, 4), uid_prefix="ffn.",
    k_best=4, k_min=1)`` with hivemind's default timeouts (``None``: wait for every chosen
    expert) unless ``--forward-timeout``/``--backward-timeout``/``--timeout-after-k-min`` are
    given. One step is: forward a fresh random ``--batch`` x H float32 batch that requires grad
    (beam search over the DHT + one forward RPC per chosen expert), then ``out.sum().backward()``
    (one backward RPC per expert that answered, which also runs the expert's Adam step on its
    server). ``--warmup`` untimed steps are followed by ``--steps`` steps, each timed with
    ``time.perf_counter``. Result: ONE JSON line on stdout::

        {"system": "hivemind", "version": ..., "hidden": H, "batch": B, "servers": S,
         "k_best": 4, "steps": N, "median_ms": ..., "p95_ms": ..., "mean_ms": ..., "all_ms": [...],
         "forward_timeout": ..., "backward_timeout": ..., "timeout_after_k_min": ...}

    With ``--kill-one``, after the timed steps the last server's whole process tree (server,
    its DHT process, its p2pd, task pools and connection handlers) gets SIGKILL, like a
    volunteer's machine losing power. The trainer keeps stepping for at most ``--kill-max-s``
    seconds and the JSON gains::

        "kill_until_not_chosen_s": seconds from the kill until the beam search of the first of
            ``--kill-confirm-steps`` consecutive steps chose no expert of the killed server
            (null if that did not happen within the limit),
        "kill_last_chosen_s": seconds from the kill until the last step that still chose one,
        "steps_after_kill", "failed_steps_after_kill" (steps that raised),
        "failed_expert_calls_after_kill" (expert RPCs hivemind reported failed; it logs one
            warning each, which this phase counts and drops unless --log-level DEBUG),
        "killed_server", "killed_experts",
        "after_kill_median_ms" (median of the steps that did not raise)

    Which experts a step chose is recorded by wrapping the layer's
    ``MoEBeamSearcher.batch_find_best_experts``. Servers re-declare their experts every 30 s
    and DHT entries expire 60 s after a declaration (hivemind defaults), so expect 30-60 s.

    Logs go to stderr. Exit status: 0 on success, 1 on failure, 130 when interrupted.

Network
    Every DHT/p2pd listens on 127.0.0.1 only (``host_maddrs=["/ip4/127.0.0.1/tcp/0"]``), with
    NAT port mapping off; the only initial peer is the local bootstrap DHT.

Cleanup
    The script makes itself a child subreaper, so p2p daemons orphaned by a dead server are
    re-parented to it; on exit (normal, error, Ctrl-C or SIGTERM) it asks the servers to shut
    down, shuts its DHTs down and then terminates every process still descended from it.
    It also deletes the unix socket files its hivemind processes leave in /tmp (each hivemind
    connection handler leaves one, and so does the p2pd of a killed server).

How to run (with hivemind's own virtual environment, see benchmarks/setup_hivemind.sh)::

    .hivemind-venv/bin/python benchmarks/hivemind_step_latency.py            # defaults
    .hivemind-venv/bin/python benchmarks/hivemind_step_latency.py --servers 2 --kill-one

This script deliberately imports nothing from volunteerd.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

import hivemind
import torch
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.moe.server import Server
from hivemind_procs import (
    Interrupted,
    become_subreaper,
    descendants,
    hivemind_socket_paths,
    install_sigterm_handler,
    kill_descendants,
    remove_stale_sockets,
)

logger = logging.getLogger(__name__)

LOOPBACK_MADDRS = ["/ip4/127.0.0.1/tcp/0"]
MAX_ERROR_CHARS = 4000
GRID = (4, 4)
UID_PREFIX = "ffn."
K_BEST = 4
K_MIN = 1


class BenchmarkFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server process needs; picklable for the spawn start method."""

    index: int
    expert_uids: list[str]
    hidden: int
    lr: float
    num_handlers: int | None
    initial_peers: list[str]
    log_level: str


@dataclass
class ServerHandle:
    index: int
    expert_uids: list[str]
    process: Any
    conn: Connection
    peer_id: str = ""
    pid: int = 0


@dataclass
class ChoiceRecorder:
    """Wraps ``MoEBeamSearcher.batch_find_best_experts`` to record which experts a step chose."""

    inner: Any
    last_uids: list[str] | None = None
    last_at: float = 0.0
    calls: int = field(default=0)

    def __call__(self, batch_grid_scores: Any, beam_size: int, return_future: bool = False) -> Any:
        result = self.inner(batch_grid_scores, beam_size, return_future)
        if not return_future:
            self.last_uids = [expert.uid for row in result for expert in row]
            self.last_at = time.perf_counter()
            self.calls += 1
        return result

    def reset(self) -> None:
        self.last_uids = None
        self.last_at = 0.0


class FailedCallFilter(logging.Filter):
    """Counts (and, unless ``keep``, drops) hivemind's one-warning-per-failed-expert-call.

    After a server dies, ``hivemind.moe.client.moe._process_dispatched_task`` logs a warning
    for every call to one of its experts (dozens per step) until the DHT entries expire.
    """

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.keep = keep
        self.count = 0
        self.first: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName != "_process_dispatched_task" or record.levelno != logging.WARNING:
            return True
        self.count += 1
        if self.first is None:
            self.first = record.getMessage()[:300]
        return self.keep


# ---------------------------------------------------------------------------------------------
# command line


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
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measure hivemind RemoteMixtureOfExperts training-step latency on 127.0.0.1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--servers", type=_positive_int, default=3, help="server processes sharing the 16 experts"
    )
    parser.add_argument("--hidden", type=_positive_int, default=512, help="expert hidden size")
    parser.add_argument("--batch", type=_positive_int, default=64, help="samples per step")
    parser.add_argument("--steps", type=_positive_int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=_non_negative_int, default=3, help="untimed steps")
    parser.add_argument("--lr", type=_positive_float, default=1e-3, help="experts' Adam lr")
    parser.add_argument(
        "--num-handlers",
        type=_positive_int,
        default=None,
        help="connection handlers per server (default: hivemind's, 8 per expert)",
    )
    parser.add_argument(
        "--forward-timeout",
        type=_positive_float,
        default=None,
        help="RemoteMixtureOfExperts forward_timeout (default: hivemind's, None)",
    )
    parser.add_argument(
        "--backward-timeout",
        type=_positive_float,
        default=None,
        help="RemoteMixtureOfExperts backward_timeout (default: hivemind's, None)",
    )
    parser.add_argument(
        "--timeout-after-k-min",
        type=_positive_float,
        default=None,
        help="RemoteMixtureOfExperts timeout_after_k_min (default: hivemind's, None)",
    )
    parser.add_argument(
        "--kill-one",
        action="store_true",
        help="after the timed steps, SIGKILL the last server and time until its experts drop out",
    )
    parser.add_argument(
        "--kill-max-s",
        type=_positive_float,
        default=90.0,
        help="with --kill-one: keep stepping for at most this many seconds after the kill",
    )
    parser.add_argument(
        "--kill-confirm-steps",
        type=_positive_int,
        default=3,
        help="with --kill-one: consecutive steps without a killed expert that end the phase",
    )
    parser.add_argument(
        "--startup-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds allowed for the servers to start and declare their experts",
    )
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the trainer")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level for this script and for hivemind (stderr)",
    )
    args = parser.parse_args(argv)
    num_experts = GRID[0] * GRID[1]
    if args.servers > num_experts:
        parser.error(f"--servers must be <= {num_experts} (one expert each at least)")
    if args.kill_one and args.servers < 2:
        parser.error("--kill-one needs --servers >= 2 (someone must survive)")
    return args


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format="%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s",
    )
    # hivemind installs its own stderr handler on the "hivemind" logger.
    logging.getLogger("hivemind").setLevel(level)


def _sigkill_tree(root: int) -> list[int]:
    """SIGKILL ``root`` and everything below it, as close to at once as /proc allows."""
    victims = [root, *descendants(root)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # Anything forked in between (unlikely: the tree is idle apart from serving requests).
    for pid in descendants(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            victims.append(pid)
    return victims


# ---------------------------------------------------------------------------------------------
# server process


def _split_experts(uids: list[str], parts: int) -> list[list[str]]:
    """Contiguous runs of ``uids``, sizes differing by at most one (by row when it divides)."""
    base, extra = divmod(len(uids), parts)
    chunks: list[list[str]] = []
    start = 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        chunks.append(uids[start : start + size])
        start += size
    return chunks


def _server_main(cfg: ServerConfig, conn: Connection) -> None:
    """Entry point of one server process: start, report, serve until told to stop."""
    _setup_logging(cfg.log_level)
    # Ctrl-C reaches the whole process group: let the driver alone react to it and stop this
    # server through the pipe. SIGTERM keeps its default action (die); the driver's clean-up
    # then terminates what is left of this server's tree (it is a child subreaper).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    server: Server | None = None
    try:
        create_kwargs: dict[str, Any] = {}
        if cfg.num_handlers is not None:
            create_kwargs["num_handlers"] = cfg.num_handlers
        server = Server.create(
            expert_uids=cfg.expert_uids,
            expert_cls="ffn",
            hidden_dim=cfg.hidden,
            optim_cls=functools.partial(torch.optim.Adam, lr=cfg.lr),
            device="cpu",
            initial_peers=cfg.initial_peers,
            start=True,
            # forwarded to the DHT's p2p daemon: loopback only, no NAT port mapping
            host_maddrs=LOOPBACK_MADDRS,
            nat_port_map=False,
            **create_kwargs,
        )
        maddrs = [str(a) for a in server.dht.get_visible_maddrs()]
        conn.send(("ready", server.dht.peer_id.to_base58(), maddrs, os.getpid()))
        while True:
            if conn.poll(1.0):
                with contextlib.suppress(EOFError, OSError):
                    conn.recv()  # "stop", or EOF when the driver closed its end
                break
            if os.getppid() != parent:
                logger.error("server %d: driver is gone, shutting down", cfg.index)
                break
    except BaseException:
        with contextlib.suppress(BaseException):
            conn.send(("error", traceback.format_exc()[-MAX_ERROR_CHARS:]))
        raise
    finally:
        if server is not None:
            # Server.run calls shutdown() again once the runtime stops, and that second call
            # warns once per (already stopped) connection handler; keep stderr readable.
            logging.getLogger("hivemind.moe.server.connection_handler").setLevel(logging.ERROR)
            server.shutdown()
            server.join(30)


# ---------------------------------------------------------------------------------------------
# driver


def _dht_maddrs(dht: hivemind.DHT) -> list[str]:
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    loopback = [a for a in maddrs if a.startswith("/ip4/127.0.0.1/")]
    if not loopback:
        raise BenchmarkFailed(f"DHT has no 127.0.0.1 address: {maddrs}")
    return loopback


def _start_servers(
    args: argparse.Namespace, initial_peers: list[str], servers: list[ServerHandle]
) -> None:
    ctx = mp.get_context("spawn")
    all_uids = [f"{UID_PREFIX}{i}.{j}" for i in range(GRID[0]) for j in range(GRID[1])]
    for index, uids in enumerate(_split_experts(all_uids, args.servers)):
        cfg = ServerConfig(
            index=index,
            expert_uids=uids,
            hidden=args.hidden,
            lr=args.lr,
            num_handlers=args.num_handlers,
            initial_peers=initial_peers,
            log_level=args.log_level,
        )
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_server_main,
            args=(cfg, child_conn),
            name=f"hivemind-server-{index}",
            daemon=False,  # it forks hivemind's own processes, which daemons may not do
        )
        proc.start()
        child_conn.close()
        servers.append(ServerHandle(index=index, expert_uids=uids, process=proc, conn=parent_conn))

    deadline = time.monotonic() + args.startup_timeout
    pending = {handle.conn: handle for handle in servers}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(handle.index for handle in pending.values())
            raise BenchmarkFailed(f"servers {missing} not ready within {args.startup_timeout} s")
        for conn in wait_connections(list(pending), timeout=min(remaining, 1.0)):
            handle = pending.pop(conn)  # type: ignore[call-overload]
            try:
                message = conn.recv()  # type: ignore[union-attr]
            except EOFError:
                raise BenchmarkFailed(
                    f"server {handle.index} exited (code {handle.process.exitcode}) before ready"
                ) from None
            if message[0] != "ready":
                raise BenchmarkFailed(f"server {handle.index} failed to start:\n{message[1]}")
            _, handle.peer_id, maddrs, handle.pid = message
            logger.info(
                "server %d (pid %d, peer %s…) ready: %d expert(s) %s..%s, maddrs %s",
                handle.index,
                handle.pid,
                handle.peer_id[:12],
                len(handle.expert_uids),
                handle.expert_uids[0],
                handle.expert_uids[-1],
                [a for a in maddrs if "/127.0.0.1/" in a],
            )
        for handle in pending.values():
            if handle.process.exitcode is not None:
                raise BenchmarkFailed(
                    f"server {handle.index} exited (code {handle.process.exitcode}) before ready"
                )


def _declared(dht: hivemind.DHT, servers: list[ServerHandle]) -> list[str]:
    """What is still missing from the DHT (uid keys and ``ffn.{i}`` prefix subkeys)."""
    expected = {uid: handle.peer_id for handle in servers for uid in handle.expert_uids}
    missing: list[str] = []
    for uid, peer_id in expected.items():
        found = dht.get(uid, latest=True)
        if found is None or found.value != peer_id:
            missing.append(uid)
    for i in range(GRID[0]):
        prefix = f"{UID_PREFIX}{i}"
        # declare_experts stores "ffn.0.0" under the key "ffn.0." (trailing dot), subkey 0
        found = dht.get(f"{prefix}.", latest=True)
        subkeys: dict[Any, Any] = found.value if found is not None else {}
        if not isinstance(subkeys, dict):
            missing.append(f"{prefix} (not a dictionary)")
            continue
        for j in range(GRID[1]):
            uid = f"{prefix}.{j}"
            entry = subkeys.get(j)
            if entry is None or tuple(entry.value) != (uid, expected[uid]):
                missing.append(f"{prefix}[{j}]")
    return missing


def _wait_declared(dht: hivemind.DHT, servers: list[ServerHandle], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        missing = _declared(dht, servers)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise BenchmarkFailed(f"experts not declared within {timeout} s: {missing}")
        logger.info("waiting for %d DHT entries: %s", len(missing), missing[:6])
        time.sleep(1.0)


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _train_step(moe: hivemind.moe.RemoteMixtureOfExperts, batch: int, hidden: int) -> float:
    """One training step; returns its duration in milliseconds."""
    inputs = torch.randn(batch, hidden, dtype=torch.float32, requires_grad=True)
    moe.zero_grad(set_to_none=True)
    started = time.perf_counter()
    out = moe(inputs)
    out.sum().backward()
    elapsed = time.perf_counter() - started
    if out.shape != inputs.shape:
        raise BenchmarkFailed(f"MoE returned shape {tuple(out.shape)} for {tuple(inputs.shape)}")
    if inputs.grad is None:
        raise BenchmarkFailed("MoE returned no input gradient")
    return elapsed * 1000.0


def _kill_phase(
    args: argparse.Namespace,
    moe: hivemind.moe.RemoteMixtureOfExperts,
    recorder: ChoiceRecorder,
    victim: ServerHandle,
    stale_sockets: set[str],
) -> dict[str, Any]:
    killed = set(victim.expert_uids)
    logger.info("SIGKILL server %d (pid %d) and its process tree", victim.index, victim.pid)
    sockets = hivemind_socket_paths([victim.pid, *descendants(victim.pid)])
    killed_at = time.perf_counter()
    victims = _sigkill_tree(victim.pid)
    logger.info("killed %d process(es): %s", len(victims), victims)
    stale_sockets.update(sockets)

    steps = failed = clean_run = 0
    first_clean_at: float | None = None
    last_chosen_at: float | None = None
    ok_ms: list[float] = []
    calls = FailedCallFilter(keep=logger.isEnabledFor(logging.DEBUG))
    moe_logger = logging.getLogger("hivemind.moe.client.moe")
    moe_logger.addFilter(calls)
    try:
        while time.perf_counter() - killed_at < args.kill_max_s:
            recorder.reset()
            steps += 1
            error = ""
            calls_before = calls.count
            try:
                ok_ms.append(_train_step(moe, args.batch, args.hidden))
            except Exception as exc:
                failed += 1
                error = f"{type(exc).__name__}: {exc}"[:300]
            if recorder.last_uids is None:
                chosen_killed = -1  # the beam search itself did not finish
                clean_run = 0
            else:
                chosen_killed = sum(uid in killed for uid in recorder.last_uids)
                if chosen_killed:
                    clean_run = 0
                    last_chosen_at = recorder.last_at
                else:
                    if clean_run == 0:
                        first_clean_at = recorder.last_at
                    clean_run += 1
            logger.info(
                "after kill +%.1f s: step %d chose %s killed expert slot(s), %d expert call(s) "
                "failed; %s",
                time.perf_counter() - killed_at,
                steps,
                "?" if chosen_killed < 0 else chosen_killed,
                calls.count - calls_before,
                f"FAILED {error}" if error else f"{ok_ms[-1]:.0f} ms",
            )
            if clean_run >= args.kill_confirm_steps:
                break
    finally:
        moe_logger.removeFilter(calls)
    if calls.first is not None:
        logger.info("first failed expert call after the kill: %s", calls.first)

    until = None
    if clean_run >= args.kill_confirm_steps and first_clean_at is not None:
        until = round(first_clean_at - killed_at, 3)
    return {
        "killed_server": victim.index,
        "killed_experts": sorted(killed),
        "kill_until_not_chosen_s": until,
        "kill_last_chosen_s": (
            None if last_chosen_at is None else round(last_chosen_at - killed_at, 3)
        ),
        "steps_after_kill": steps,
        "failed_steps_after_kill": failed,
        "failed_expert_calls_after_kill": calls.count,
        "after_kill_median_ms": round(statistics.median(ok_ms), 3) if ok_ms else None,
    }


def _stop_servers(servers: list[ServerHandle], timeout: float = 20.0) -> None:
    for handle in servers:
        if handle.process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                handle.conn.send("stop")
    deadline = time.monotonic() + timeout
    for handle in servers:
        handle.process.join(max(0.0, deadline - time.monotonic()))
        if handle.process.is_alive():
            logger.warning("server %d did not shut down within %.0f s", handle.index, timeout)
        handle.conn.close()


def _close_trainer_p2p(dht: hivemind.DHT | None) -> None:
    """Close the trainer's p2p replica inside RemoteExpertWorker's event loop.

    Otherwise its destructors run at interpreter exit, outside any event loop, and print
    "no current event loop" tracebacks.
    """
    if dht is None or not dht.is_alive():
        return

    async def _close() -> None:
        replica = await dht.replicate_p2p()  # the cached replica the experts used
        await replica.shutdown()
        await asyncio.sleep(0.1)  # let the cancelled reader/writer tasks finish

    try:
        RemoteExpertWorker.run_coroutine(_close(), return_future=True).result(timeout=10)
    except Exception as exc:
        logger.debug("closing the trainer's p2p replica failed: %r", exc)


def _shutdown_dht(dht: hivemind.DHT | None) -> None:
    if dht is None:
        return
    try:
        dht.shutdown()
    except Exception as exc:
        logger.warning("DHT shutdown failed: %s", exc)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    servers: list[ServerHandle] = []
    bootstrap: hivemind.DHT | None = None
    trainer_dht: hivemind.DHT | None = None
    stale_sockets: set[str] = set()
    began = time.perf_counter()
    try:
        bootstrap = hivemind.DHT(start=True, host_maddrs=LOOPBACK_MADDRS, nat_port_map=False)
        initial_peers = _dht_maddrs(bootstrap)
        logger.info("bootstrap DHT on %s", initial_peers)

        _start_servers(args, initial_peers, servers)
        _wait_declared(bootstrap, servers, args.startup_timeout)
        logger.info(
            "all %d experts declared by %d server(s) after %.1f s",
            GRID[0] * GRID[1],
            len(servers),
            time.perf_counter() - began,
        )

        trainer_dht = hivemind.DHT(
            initial_peers=initial_peers,
            start=True,
            host_maddrs=LOOPBACK_MADDRS,
            nat_port_map=False,
        )
        moe = hivemind.moe.RemoteMixtureOfExperts(
            in_features=args.hidden,
            grid_size=GRID,
            dht=trainer_dht,
            uid_prefix=UID_PREFIX,
            k_best=K_BEST,
            k_min=K_MIN,
            forward_timeout=args.forward_timeout,
            backward_timeout=args.backward_timeout,
            timeout_after_k_min=args.timeout_after_k_min,
        )
        recorder = ChoiceRecorder(moe.beam_search.batch_find_best_experts)
        moe.beam_search.batch_find_best_experts = recorder  # type: ignore[method-assign]

        for step in range(args.warmup):
            ms = _train_step(moe, args.batch, args.hidden)
            logger.info("warm-up step %d: %.1f ms", step, ms)
        all_ms: list[float] = []
        for step in range(args.steps):
            all_ms.append(_train_step(moe, args.batch, args.hidden))
            logger.debug("step %d: %.1f ms", step, all_ms[-1])
        logger.info(
            "%d steps: median %.1f ms, p95 %.1f ms (chosen in last step: %d distinct experts)",
            len(all_ms),
            statistics.median(all_ms),
            _percentile(all_ms, 0.95),
            len(set(recorder.last_uids or [])),
        )

        result: dict[str, Any] = {
            "system": "hivemind",
            "version": hivemind.__version__,
            "hidden": args.hidden,
            "batch": args.batch,
            "servers": args.servers,
            "k_best": K_BEST,
            "steps": len(all_ms),
            "median_ms": round(statistics.median(all_ms), 3),
            "p95_ms": round(_percentile(all_ms, 0.95), 3),
            "mean_ms": round(statistics.fmean(all_ms), 3),
            "all_ms": [round(ms, 3) for ms in all_ms],
            "forward_timeout": args.forward_timeout,
            "backward_timeout": args.backward_timeout,
            "timeout_after_k_min": args.timeout_after_k_min,
        }
        if args.kill_one:
            result.update(_kill_phase(args, moe, recorder, servers[-1], stale_sockets))
        return result
    finally:
        stale_sockets.update(hivemind_socket_paths([os.getpid(), *descendants(os.getpid())]))
        _stop_servers(servers)
        _close_trainer_p2p(trainer_dht)
        _shutdown_dht(trainer_dht)
        _shutdown_dht(bootstrap)
        kill_descendants()
        remove_stale_sockets(stale_sockets)
        logger.info("total wall time %.1f s", time.perf_counter() - began)


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
    except BenchmarkFailed as exc:
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
