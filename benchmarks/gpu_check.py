"""The CUDA paths, checked on a machine with a GPU: detection, the expert runtime's
compute, residency while paused, and a real swarm of daemons on the GPU.

What it checks (one row each; the script exits 1 if any row fails)

    detect      ``volunteerd hardware --json`` lists the GPU and ``runtime.device =
                "auto"`` picks it.
    unit tests  the suite's device-parametrised tests (tests/unit/test_residency.py,
                test_hardware.py, test_stacked.py: experts stacked on the GPU train as
                they do one by one) pass with none skipped.
    parity      ``--experts`` ffn experts of ``--hidden`` built on the CPU and on the GPU
                from the same weights take the same 5 rounds of backward + checked Adam
                step (``ExpertBackend.step`` with the runtime's ``StepCheck``); their
                outputs agree within 1e-3 relative (float32 on two devices, through
                Adam), and the GPU experts stepped one by one and together (``step_many``)
                within 1e-4.
    residency   16 experts of hidden 1024 with Adam state: the GPU memory they hold,
                then after ``release_device`` (the pause) and ``restore_device``; they
                compute the same afterwards.
    speed       one expert's backward + step (256 rows of hidden 1024) on the CPU and on
                the GPU: samples/s, for the record (not judged).
    daemons     a bootstrap node and two ``volunteerd serve`` daemons with ``runtime.device
                = "cuda"`` host the demo's model at hidden 512; a trainer on the CPU trains
                ``--steps`` steps over libp2p on 127.0.0.1 (the daemons stack their
                experts, ``runtime.stack_experts = "auto"``); both daemons are paused (their
                GPU memory, read with nvidia-smi, must fall), resumed, one is restarted
                from its checkpoints, and the trainer trains again: no expert call may fail.

Run (on the GPU machine, from the repository's root)::

    python benchmarks/gpu_check.py --json gpu_check.json
    python benchmarks/gpu_check.py --device cpu    # the same paths on the CPU (a dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from volunteerd.config import ExpertsConfig, GuardConfig, RuntimeConfig, WireLimits  # noqa: E402
from volunteerd.experts import ExpertBackend  # noqa: E402
from volunteerd.experts.multistep import step_many  # noqa: E402
from volunteerd.experts.stepcheck import StepCheck  # noqa: E402

MIB = 2**20


@dataclass
class Row:
    name: str
    ok: bool
    figures: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated_mib(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / MIB if device.type == "cuda" else 0.0


def check_detect(device: torch.device) -> Row:
    from volunteerd.runtime.devices import choose_device

    with tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VOLUNTEERD_")}
        env.update(
            VOLUNTEERD_CONFIG=f"{home}/config.toml",
            VOLUNTEERD_DATA_DIR=f"{home}/data",
            VOLUNTEERD_CACHE_DIR=f"{home}/cache",
        )
        done = subprocess.run(
            [sys.executable, "-m", "volunteerd", "hardware", "--json"],
            env=env, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
        )  # fmt: skip
    if done.returncode != 0:
        return Row("detect", False, error=done.stderr[-2000:])
    found = json.loads(done.stdout)
    gpus = found["hardware"]["gpus"]
    auto = str(choose_device("auto"))
    want_gpu = device.type == "cuda"
    ok = (
        (len(gpus) >= 1) == want_gpu
        and auto.startswith("cuda") == want_gpu
        and found["device"].startswith("cuda") == want_gpu
    )
    figures = {
        "auto": auto,
        "gpus": gpus,
        "cli_device": found["device"],
        "capacity": found.get("capacity"),
        "speed": found.get("speed"),
    }
    return Row("detect", ok, figures)


# pytest-benchmark (on some GPU images) refuses to run beside xdist with a warning that
# the suite's warnings-as-errors turn into an internal error
_PYTEST = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:benchmark"]


def check_unit_tests(device: torch.device) -> Row:
    tests = [
        "tests/unit/test_residency.py",
        "tests/unit/test_hardware.py",
        "tests/unit/test_stacked.py",
    ]
    done = subprocess.run(
        [sys.executable, *_PYTEST, *tests],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    skipped = "skipped" in last
    ok = done.returncode == 0 and (not skipped or device.type != "cuda")
    error = "" if ok else (done.stdout + done.stderr)[-3000:]
    return Row("unit tests", ok, {"summary": last}, error)


def _experts(count: int, hidden: int, device: torch.device) -> list[ExpertBackend]:
    config = ExpertsConfig(hidden_dim=hidden)
    return [ExpertBackend(f"ffn.0.{i}", config, device, 1024) for i in range(count)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


def check_parity(device: torch.device, count: int, hidden: int) -> Row:
    cpu = _experts(count, hidden, torch.device("cpu"))
    one = _experts(count, hidden, device)
    together = _experts(count, hidden, device)
    for a, b, c in zip(cpu, one, together, strict=True):
        b.module.load_state_dict(a.module.state_dict())
        c.module.load_state_dict(a.module.state_dict())
    guard = GuardConfig()
    checks = [StepCheck(guard.max_step_ratio, full_every=guard.full_check_every) for _ in "abc"]
    generator = torch.Generator().manual_seed(0)
    outcomes = []
    for _ in range(5):
        for i in range(count):
            x = torch.randn(64, hidden, generator=generator)
            g = torch.randn(64, hidden, generator=generator) * 1e-2
            for backend in (cpu[i], one[i], together[i]):
                backend.backward([x], [g])
        outcomes += [cpu[i].step(checks[0]) for i in range(count)]
        outcomes += [one[i].step(checks[1]) for i in range(count)]
        outcomes += step_many(together, checks[2], [False] * count)
    sync(device)
    undone = sum(o.undone is not None for o in outcomes)
    x = torch.randn(32, hidden, generator=generator)
    vs_cpu = max(
        _relative(b.forward([x])[0], a.forward([x])[0]) for a, b in zip(cpu, one, strict=True)
    )
    vs_many = max(
        _relative(c.forward([x])[0], b.forward([x])[0]) for b, c in zip(one, together, strict=True)
    )
    updates = {b.updates for b in [*cpu, *one, *together]}
    ok = vs_cpu < 1e-3 and vs_many < 1e-4 and undone == 0 and updates == {5}
    figures = {
        "experts": count,
        "hidden": hidden,
        "max_rel_diff_vs_cpu": vs_cpu,
        "max_rel_diff_one_by_one_vs_together": vs_many,
        "undone_steps": undone,
        "updates": sorted(updates),
    }
    return Row("parity", ok, figures)


def check_residency(device: torch.device) -> Row:
    import trio

    from volunteerd.runtime import ExpertRuntime
    from volunteerd.runtime.residency import release_device, restore_device

    experts = ExpertsConfig(uids="ffn.0.[0:16]", hidden_dim=1024)
    if device.type == "cuda":  # what earlier checks left in the cache
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    base = allocated_mib(device)
    runtime = ExpertRuntime(
        experts.uid_list(), experts, RuntimeConfig(device=str(device)), WireLimits(), device
    )
    x = torch.randn(16, 1024)
    for uid in runtime.uids:
        backend = runtime.backend(uid)
        backend.backward([x], [torch.ones(16, 1024) * 1e-3])
        backend.step()
    before = {uid: runtime.backend(uid).forward([x])[0].cpu() for uid in runtime.uids}
    sync(device)
    held = allocated_mib(device) - base

    async def release() -> float:
        start = time.perf_counter()
        await release_device(runtime)
        return time.perf_counter() - start

    async def restore() -> float:
        start = time.perf_counter()
        await restore_device(runtime)
        sync(device)
        return time.perf_counter() - start

    async def both() -> tuple[float, float, float, float, float]:
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            released_s = await release()
            paused = allocated_mib(device) - base
            reserved = torch.cuda.memory_reserved(device) / MIB if device.type == "cuda" else 0
            restored_s = await restore()
            back = allocated_mib(device) - base
            nursery.cancel_scope.cancel()
        return released_s, paused, reserved, restored_s, back

    try:
        released_s, paused, reserved, restored_s, back = trio.run(both)
    finally:
        runtime.close()
    same = all(
        torch.equal(runtime.backend(uid).forward([x])[0].cpu(), before[uid]) for uid in runtime.uids
    )
    places = {
        p.device.type for uid in runtime.uids for p in runtime.backend(uid).module.parameters()
    }
    ok = same and places == {device.type}
    if device.type == "cuda":
        ok = ok and paused < 0.02 * held and back > 0.9 * held
    figures = {
        "held_mib": round(held, 1),
        "paused_allocated_mib": round(paused, 2),
        "paused_reserved_mib": round(reserved, 1),
        "restored_mib": round(back, 1),
        "release_ms": round(released_s * 1e3, 1),
        "restore_ms": round(restored_s * 1e3, 1),
        "same_outputs": same,
    }
    return Row("residency", ok, figures)


def check_speed(device: torch.device) -> Row:
    figures = {}
    for where in dict.fromkeys(["cpu", str(device)]):
        dev = torch.device(where)
        (backend,) = _experts(1, 1024, dev)
        x, g = torch.randn(256, 1024), torch.randn(256, 1024) * 1e-3
        for _ in range(3):
            backend.backward([x], [g])
            backend.step()
        sync(dev)
        rounds = 50 if dev.type == "cuda" else 10
        start = time.perf_counter()
        for _ in range(rounds):
            backend.backward([x], [g])
            backend.step()
        sync(dev)
        figures[f"{where}_samples_per_s"] = round(256 * rounds / (time.perf_counter() - start))
    figures["cpu_threads"] = torch.get_num_threads()
    return Row("speed", True, figures)


def _gpu_mib_by_pid() -> dict[int, float]:
    """Each process's GPU memory as nvidia-smi reports it (empty without nvidia-smi)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in done.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = float(mib)
    return used


def _settled_gpu_mib(
    pids: list[int], below: list[float] | None, timeout_s: float = 30
) -> list[float]:
    """The daemons' GPU memory; with ``below`` given, waits until each is under it."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = _gpu_mib_by_pid()
        now = [used.get(pid, -1.0) for pid in pids]
        if below is None or not used or all(0 <= n < b for n, b in zip(now, below, strict=True)):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def _bare_cuda_process_mib() -> float:
    """The GPU memory of a process that did one matrix product and holds nothing: its
    CUDA context and libraries, what a paused daemon cannot give back either."""
    code = (
        "import torch, time; a = torch.ones(64, 64, device='cuda'); (a @ a).sum().item(); "
        "del a; torch._C._cuda_clearCublasWorkspaces(); torch.cuda.empty_cache(); "
        "print('ready', flush=True); time.sleep(60)"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as p:
        try:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                return -1.0
            time.sleep(1)
            return _gpu_mib_by_pid().get(p.pid, -1.0)
        finally:
            p.kill()


def check_daemons(device: torch.device, steps: int, log: Path) -> Row:
    from volunteerd.control.client import ControlClient
    from volunteerd.demo.local_swarm import LocalSwarm
    from volunteerd.demo.run import run_training, trainer_config
    from volunteerd.moe import SwarmClient
    from volunteerd.train import Experiment

    base = Experiment()
    experiment = base.model_copy(
        update={
            "model": base.model.model_copy(update={"hidden_dim": 512}),
            "training": base.training.model_copy(update={"steps": steps, "eval_every": steps}),
        }
    )
    figures: dict[str, Any] = {}
    if device.type == "cuda":
        figures["bare_cuda_process_mib"] = _bare_cuda_process_mib()
    setting = f'runtime.device="{device}"'
    with (
        log.open("w") as out,
        LocalSwarm.for_experiment(experiment, 2, settings=[setting]) as swarm,
    ):
        try:
            controls = [ControlClient.for_data_dir(d.data_dir) for d in swarm.daemons]
            figures["status_device"] = [c.status().device for c in controls]
            pids = [d.process.pid for d in swarm.daemons]

            def train(label: str) -> Any:
                config = trainer_config(swarm.bootstrap_addrs, listen_host="127.0.0.1")
                with SwarmClient(config) as client:
                    summary = run_training(experiment, client=client, steps=steps, out=out)
                figures[label] = {
                    "steps": summary.steps,
                    "val_loss": [
                        round(summary.initial_val_loss, 3),
                        round(summary.final_val_loss, 3),
                    ],
                    "expert_calls": summary.expert_calls,
                    "failed_calls": summary.failed_calls,
                    "seconds": round(summary.seconds, 1),
                }
                return summary

            first = train("train")
            serving = _settled_gpu_mib(pids, None)
            for c in controls:
                c.pause()
            paused = _settled_gpu_mib(pids, [s - 8 for s in serving])
            figures["status_paused"] = [c.status().serving for c in controls]
            for c in controls:
                c.resume()
            time.sleep(1)
            resumed = _settled_gpu_mib(pids, None)
            figures["gpu_mib_serving_paused_resumed"] = [serving, paused, resumed]
            swarm.daemons[0].process.terminate()  # saves its checkpoints on the way out
            swarm.daemons[0].process.wait(30)
            swarm.restart(0)
            restarted = ControlClient.for_data_dir(swarm.daemons[0].data_dir)
            figures["updates_after_restart"] = sum(e.updates for e in restarted.experts())
            time.sleep(4)  # its records reach the DHT (announce period 3 s)
            second = train("train_after")
            figures["daemon_status_after"] = [
                ControlClient.for_data_dir(d.data_dir).status().serving for d in swarm.daemons
            ]
        finally:  # the daemons' logs, for when something failed
            with log.with_name(log.name + ".daemons").open("w") as dump:
                for node in [swarm.bootstrap, *swarm.daemons]:
                    if node is not None:
                        text = node.log_file.read_text(errors="replace")
                        dump.write(f"--- {node.name}\n{text[-20000:]}\n")
    ok = (
        all(d.startswith(device.type) for d in figures["status_device"])
        and figures["status_paused"] == [False, False]
        and first.failed_calls == 0
        and second.failed_calls == 0
        and first.final_val_loss < first.initial_val_loss
        and second.final_val_loss < second.initial_val_loss
        and figures["updates_after_restart"] > 0  # its checkpoints came back onto the device
    )
    if device.type == "cuda":
        ok = ok and all(0 <= p < s for p, s in zip(paused, serving, strict=True))
    return Row("daemons", ok, figures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="trainer steps each time")
    parser.add_argument("--json", type=Path, help="write the rows here as JSON")
    parser.add_argument(
        "--log",
        type=Path,
        default=Path(tempfile.gettempdir()) / "volunteerd-gpu-check.log",
        help="the trainer's output (the daemons' logs go beside it, in LOG.daemons)",
    )
    parser.add_argument("--only", nargs="*", help="run only these checks")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    checks: dict[str, Callable[[], Row]] = {
        "detect": lambda: check_detect(device),
        "unit": lambda: check_unit_tests(device),
        "parity": lambda: check_parity(device, args.experts, args.hidden),
        "residency": lambda: check_residency(device),
        "speed": lambda: check_speed(device),
        "daemons": lambda: check_daemons(device, args.steps, args.log),
    }
    print(f"torch {torch.__version__}, device {device}", flush=True)
    rows = []
    for name, check in checks.items():
        if args.only and name not in args.only:
            continue
        start = time.monotonic()
        try:
            row = check()
        except Exception:
            row = Row(name, False, error=traceback.format_exc()[-3000:])
        row.figures["check_s"] = round(time.monotonic() - start, 1)
        rows.append(row)
        print(f"{'ok ' if row.ok else 'FAIL'} {row.name:<11} {json.dumps(row.figures)}", flush=True)
        if row.error:
            print(row.error, flush=True)
    if args.json:
        args.json.write_text(json.dumps([row.__dict__ for row in rows], indent=2))
    sys.exit(0 if all(row.ok for row in rows) else 1)


if __name__ == "__main__":
    main()
