"""What this machine has, how fast it runs an expert, and how many experts fit.

* ``detect()``: CUDA GPUs (name, memory, compute capability, bfloat16), Apple MPS, the
  CPU (model, logical and usable cores) and memory (total, available). Reading only:
  no device memory is allocated. On Linux, a memory cgroup's limit (a container's,
  systemd's ``MemoryMax=``) bounds both: the available memory is the lesser of the
  system's ``MemAvailable`` and what the tightest limit over this process's cgroup and
  its ancestors leaves. (It read only ``/proc/meminfo``: in a 1 GiB cgroup on a 24 GiB
  machine the budget was 10.1 GiB, 58 experts "fit", and the daemon was OOM-killed.)
* ``expert_footprint()``: the bytes one hosted expert needs — weights, gradients, the
  optimizer's state, and one copy of the weights for copy-on-write while kept forwards
  are pending — counted from a module built on torch's ``meta`` device (no allocation).
* ``capacity()``: the memory budget (``hardware.memory_budget_mb``, or half of the
  available memory on a CPU, 80 % of the GPU's on CUDA) minus the budget for kept
  forward passes, divided by the footprint.
* ``measure_speed()``: a short self-benchmark (forward + backward + optimizer step of
  one expert, a couple of seconds), cached in the cache folder per device, torch
  version, volunteerd version, expert type and size.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from volunteerd import __version__
from volunteerd.atomic import make_private_dirs, read_small
from volunteerd.config import ExpertsConfig, HardwareConfig, RuntimeConfig
from volunteerd.experts.backend import make_optimizer
from volunteerd.experts.registry import EXPERT_TYPES, build_module

__all__ = [
    "Capacity",
    "GpuInfo",
    "Hardware",
    "Speed",
    "capacity",
    "cpu_model",
    "detect",
    "expert_footprint",
    "measure_speed",
]

logger = logging.getLogger(__name__)

_MIB = 1 << 20
# Optimizer state tensors per weight tensor.
_OPTIMIZER_SLOTS = {"adam": 2, "sgd": 1}


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    memory_bytes: int
    capability: str
    bf16: bool


@dataclass(frozen=True, slots=True)
class Hardware:
    cpu_model: str
    cpu_cores: int  # logical cores in the machine
    usable_cores: int  # cores this process may run on
    memory_bytes: int  # at most a memory cgroup's limit
    available_bytes: int
    gpus: list[GpuInfo] = field(default_factory=list)
    mps: bool = False
    # the memory cgroup whose limit, less its use, set available_bytes (as in "cgroup v2
    # /system.slice/x: limit 1.0 GiB, 0.2 GiB in use"); "" when the system's own
    # available memory was the lesser
    memory_limit: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def detect(*, root: Path = Path("/")) -> Hardware:
    """This machine's hardware; ``root`` is where ``/proc`` and ``/sys`` are read from
    (tests give a fake tree)."""
    total, available, limit = _memory(root)
    cores = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        usable = cores
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append(
                GpuInfo(
                    index=index,
                    name=props.name,
                    memory_bytes=int(props.total_memory),
                    capability=f"{props.major}.{props.minor}",
                    bf16=props.major >= 8,  # Ampere and later compute in bfloat16
                )
            )
    return Hardware(
        cpu_model=cpu_model(),
        cpu_cores=cores,
        usable_cores=usable,
        memory_bytes=total,
        available_bytes=available,
        gpus=gpus,
        mps=bool(torch.backends.mps.is_available()),
        memory_limit=limit,
    )


def _lines(path: Path) -> list[str]:
    """A ``/proc`` file's lines. Their bytes are the kernel's, not UTF-8 text: a mount
    path or a CPU's name may hold any byte (a Latin-1 folder name raised
    UnicodeDecodeError, a traceback for `volunteerd hardware` and for a joiner). Such a
    byte reads as Python reads file names, so a path from here opens the same file."""
    return path.read_bytes().decode("utf-8", "surrogateescape").splitlines()


def cpu_model() -> str:
    try:
        for line in _lines(Path("/proc/cpuinfo")):
            if line.startswith("model name"):
                return (
                    line.split(":", 1)[1]
                    .strip()
                    .encode(errors="surrogateescape")
                    .decode(errors="replace")
                )
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory(root: Path) -> tuple[int, int, str]:
    """(total, available, limit): bytes of RAM, both bounded by the tightest memory
    cgroup limit, and which limit set ``available`` (see ``Hardware.memory_limit``)."""
    total, available = _system_memory(root)
    tightest = _cgroup_room(root, total)
    if tightest is None:
        return total, available, ""
    limit, room, where, smallest = tightest
    total = min(total, smallest)
    if room >= available:
        return total, available, ""
    gib = 1 << 30
    used = limit - room
    return total, room, f"{where}: limit {limit / gib:.1f} GiB, {used / gib:.1f} GiB in use"


def _system_memory(root: Path) -> tuple[int, int]:
    """(total, available) bytes of the machine's RAM."""
    try:
        info = {}
        for line in (root / "proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:  # macOS and other POSIX systems
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        try:
            available = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            available = total // 2
        return total, available
    except (ValueError, OSError, AttributeError):
        return 0, 0


# Per cgroup version: the limit, the usage and, in memory.stat, the page cache that the
# kernel reclaims before it goes near the limit (counted in the usage; left out of it as
# the kubelet's "working set" does, else the checkpoints a daemon wrote, cached, would
# shrink the next start's budget towards nothing)
_CGROUP_FILES = {
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    "v2": ("memory.max", "memory.current", "inactive_file"),
}


def _cgroup_room(root: Path, total: int) -> tuple[int, int, str, int] | None:
    """(limit, room, "cgroup vN /path", smallest limit): the memory cgroup, among this
    process's and its ancestors (a parent's limit holds for all below it) in either
    cgroup version, whose limit less its use leaves the least room, and the smallest
    limit of them all; None when none has a limit below ``total`` or nothing can be read
    (not Linux). A level whose files are missing, unreadable or say "max" limits
    nothing."""
    try:
        memberships = _lines(root / "proc/self/cgroup")
        mounts = _lines(root / "proc/self/mountinfo")
    except OSError:
        return None
    paths: dict[str, str] = {}  # version -> the process's cgroup path in that hierarchy
    for line in memberships:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    best: tuple[int, int, str] | None = None
    smallest = total
    for line in mounts:
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            continue
        after = fields[fields.index("-") + 1 :]
        if after[:1] == ["cgroup2"]:
            version = "v2"
        elif after[:1] == ["cgroup"] and "memory" in after[-1].split(","):
            version = "v1"
        else:
            continue
        # the mount shows the hierarchy from `mount_root` down (a container's own cgroup)
        mount_root, mount_point = fields[3], _unescape(fields[4])
        ours = paths.get(version)
        if ours is None or not (ours + "/").startswith(mount_root.rstrip("/") + "/"):
            continue  # not mounted, or our cgroup is outside what the mount shows
        top = root / mount_point.lstrip("/")
        below = ours[len(mount_root.rstrip("/")) :].strip("/")
        parts = below.split("/") if below else []
        for depth in range(len(parts), -1, -1):
            level = _cgroup_level(top.joinpath(*parts[:depth]), version, total)
            if level is None:
                continue
            smallest = min(smallest, level[0])
            if best is None or level[1] < best[1]:
                name = "/".join([mount_root.rstrip("/"), *parts[:depth]]) or "/"
                best = (level[0], level[1], f"cgroup {version} {name}")
    return None if best is None else (*best, smallest)


def _cgroup_level(folder: Path, version: str, total: int) -> tuple[int, int] | None:
    """(limit, room) of one cgroup, or None when it has no limit below ``total``."""
    limit_file, usage_file, cache_key = _CGROUP_FILES[version]
    try:
        limit = int((folder / limit_file).read_text().strip())  # "max" raises
    except (OSError, ValueError):
        return None
    if limit >= total > 0:  # v1 says "none" with 9223372036854771712
        return None
    try:
        usage = int((folder / usage_file).read_text().strip())
    except (OSError, ValueError):
        usage = 0  # the limit still holds
    cache = 0
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                cache = int(value)
    except (OSError, ValueError):
        pass
    return limit, max(0, limit - max(0, usage - cache))


def _unescape(text: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash come octal-escaped."""
    for code in ("040", "011", "012", "134"):
        text = text.replace("\\" + code, chr(int(code, 8)))
    return text


def expert_footprint(experts: ExpertsConfig) -> int:
    """Bytes one hosted expert needs on its device (see the module docstring)."""
    with torch.device("meta"):
        module = EXPERT_TYPES[experts.type].build(experts)
    weights = sum(p.numel() * 4 for p in module.parameters())  # float32
    slots = _OPTIMIZER_SLOTS.get(experts.optimizer.name, 2)
    return weights * (1 + 1 + slots + 1)


@dataclass(frozen=True, slots=True)
class Capacity:
    device: str
    budget_bytes: int
    budget_source: str  # "configured" or how the automatic budget was chosen
    per_expert_bytes: int
    experts: int


def capacity(
    hardware: Hardware,
    device: torch.device,
    experts: ExpertsConfig,
    runtime: RuntimeConfig,
    config: HardwareConfig,
    *,
    limit: int = 0,
) -> Capacity:
    """How many experts of ``experts``' kind fit this node's memory budget (at most
    ``limit`` when it is not 0)."""
    if config.memory_budget_mb:
        budget, source = config.memory_budget_mb * _MIB, "configured"
    elif device.type == "cuda":
        gpu = next((g for g in hardware.gpus if g.index == (device.index or 0)), None)
        budget = int(0.8 * gpu.memory_bytes) if gpu else 0
        source = "80% of the GPU's memory"
    else:
        budget, source = hardware.available_bytes // 2, "half of the available memory"
        if hardware.memory_limit:
            source += f" under {hardware.memory_limit}"
    per_expert = expert_footprint(experts)
    usable = max(0, budget - runtime.retain_activations_mb * _MIB)
    fit = usable // per_expert if per_expert else 0
    if limit:
        fit = min(fit, limit)
    return Capacity(str(device), budget, source, per_expert, int(fit))


@dataclass(frozen=True, slots=True)
class Speed:
    samples_per_s: float  # forward + backward + optimizer step, per expert
    batch: int
    measured_at: float
    key: str
    cached: bool = False


def _speed_key(device: torch.device, experts: ExpertsConfig) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        name = f"{cpu_model()} x{torch.get_num_threads()}"
    else:
        name = device.type
    return (
        f"{name}|{device}|torch {torch.__version__}|volunteerd {__version__}|"
        f"{experts.type} {experts.hidden_dim}"
    )


def measure_speed(
    device: torch.device,
    experts: ExpertsConfig,
    cache_file: Path,
    *,
    seconds: float = 2.0,
    batch: int = 256,
    refresh: bool = False,
) -> Speed:
    """Samples per second one expert trains at on ``device``; cached in ``cache_file``."""
    key = _speed_key(device, experts)
    cache = _read_cache(cache_file)
    if not refresh and key in cache:
        entry = cache[key]
        return Speed(entry["samples_per_s"], entry["batch"], entry["measured_at"], key, True)
    module = build_module(experts, "benchmark.0").to(device)
    optimizer = make_optimizer(list(module.parameters()), experts.optimizer)
    shape = (batch, 16, experts.hidden_dim) if experts.type == "transformer" else None
    x = torch.randn(shape or (batch, experts.hidden_dim), device=device)

    def one() -> None:
        out = module(x)
        out.backward(torch.ones_like(out))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    one()  # warm up (allocations, kernel selection)
    _sync(device)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or done < 2:
        one()
        done += 1
    _sync(device)
    elapsed = time.perf_counter() - started
    samples = done * batch * (shape[1] if shape else 1)
    speed = Speed(samples / elapsed, batch, time.time(), key)
    cache[key] = {
        "samples_per_s": speed.samples_per_s,
        "batch": batch,
        "measured_at": speed.measured_at,
    }
    _write_cache(cache_file, cache)
    return speed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(read_small(path, 2**20))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    make_private_dirs(path.parent)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cache, indent=2))
    os.replace(tmp, path)
