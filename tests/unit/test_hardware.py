"""Hardware detection, the expert footprint, capacity and the cached self-benchmark."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from volunteerd.cli import main
from volunteerd.config import ExpertsConfig, HardwareConfig, RuntimeConfig
from volunteerd.experts.registry import build_module
from volunteerd.runtime.hardware import capacity, detect, expert_footprint, measure_speed

MIB = 1 << 20
GIB = 1 << 30


def test_detect_reports_this_machine() -> None:
    found = detect()
    assert found.cpu_cores == os.cpu_count()
    assert 1 <= found.usable_cores <= found.cpu_cores
    assert found.memory_bytes > found.available_bytes > 0
    assert len(found.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert found.cpu_model


@pytest.mark.parametrize(("optimizer", "slots"), [("adam", 2), ("sgd", 1)])
def test_footprint_counts_weights_grads_optimizer_state_and_a_copy(
    optimizer: str, slots: int
) -> None:
    config = ExpertsConfig(hidden_dim=64, optimizer={"name": optimizer})  # type: ignore[arg-type]
    weights = sum(p.numel() for p in build_module(config, "ffn.0").parameters()) * 4
    assert expert_footprint(config) == weights * (3 + slots)


def test_capacity_divides_the_budget_left_after_kept_forwards() -> None:
    experts = ExpertsConfig(hidden_dim=256)
    per = expert_footprint(experts)
    cpu = torch.device("cpu")
    runtime = RuntimeConfig(retain_activations_mb=100)
    room = capacity(detect(), cpu, experts, runtime, HardwareConfig(memory_budget_mb=1100))
    assert room.budget_source == "configured"
    assert room.experts == (1000 * MIB) // per
    assert capacity(
        detect(), cpu, experts, runtime, HardwareConfig(memory_budget_mb=1100), limit=3
    ).experts == min(3, room.experts)
    tiny = capacity(detect(), cpu, experts, runtime, HardwareConfig(memory_budget_mb=50))
    assert tiny.experts == 0
    auto = capacity(detect(), cpu, experts, RuntimeConfig(), HardwareConfig())
    assert auto.budget_source.startswith("half of the available memory")  # maybe "under" a cgroup
    assert auto.experts > 0


V1_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
V2_MOUNT = "41 31 0:38 / /sys/fs/cgroup{at} rw,relatime - cgroup2 cgroup2 rw"


def fake_linux(tmp_path: Path, cgroup: str, mounts: list[str], files: dict[str, str]) -> Path:
    """A /proc and /sys tree: 16 GiB of memory, 12 available, this process in ``cgroup``
    (/proc/self/cgroup's lines), ``files`` under /sys/fs/cgroup."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(
        f"MemTotal: {16 * GIB // 1024} kB\nMemFree: 1 kB\nMemAvailable: {12 * GIB // 1024} kB\n"
    )
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text("\n".join(mounts) + "\n")
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


UNLIMITED_V1 = str(9223372036854771712)  # what v1 says for no limit
CGROUPS = {
    # a container or a cgroup made by hand (cgroup v1, with the hybrid's empty v2 line)
    "v1": (
        "4:memory:/box\n1:cpu:/\n0::/\n",
        [V1_MOUNT.format(root="/"), V2_MOUNT.format(at="/unified")],
        {
            "memory/memory.limit_in_bytes": UNLIMITED_V1,
            "memory/box/memory.limit_in_bytes": str(GIB),
            "memory/box/memory.usage_in_bytes": str(400 * MIB),
            # page cache the kernel reclaims first is not counted as in use
            "memory/box/memory.stat": f"cache 1\ntotal_inactive_file {200 * MIB}\n",
        },
        (GIB, GIB - 200 * MIB, "cgroup v1 /box: limit 1.0 GiB, 0.2 GiB in use"),
    ),
    # Docker on v1 without a cgroup namespace: the mount shows the container's cgroup
    "v1 container": (
        "4:memory:/docker/abc\n",
        [V1_MOUNT.format(root="/docker/abc")],
        {"memory/memory.limit_in_bytes": str(2 * GIB), "memory/memory.usage_in_bytes": "0"},
        (2 * GIB, 2 * GIB, "cgroup v1 /docker/abc: limit 2.0 GiB, 0.0 GiB in use"),
    ),
    "v2": (
        "0::/box\n",
        [V2_MOUNT.format(at="")],
        {"box/memory.max": str(GIB), "box/memory.current": str(GIB // 4)},
        (GIB, GIB * 3 // 4, "cgroup v2 /box: limit 1.0 GiB, 0.2 GiB in use"),
    ),
    # systemd's MemoryMax= on the slice, not on the service itself
    "nested v2": (
        "0::/system.slice/volunteerd.service\n",
        [V2_MOUNT.format(at="")],
        {
            "system.slice/memory.max": str(3 * GIB),
            "system.slice/memory.current": str(2 * GIB),
            "system.slice/volunteerd.service/memory.max": "max",
            "system.slice/volunteerd.service/memory.current": str(GIB // 2),
        },
        (3 * GIB, GIB, "cgroup v2 /system.slice: limit 3.0 GiB, 2.0 GiB in use"),
    ),
    "unlimited": (
        "4:memory:/box\n0::/box\n",
        [V1_MOUNT.format(root="/"), V2_MOUNT.format(at="/unified")],
        {
            "memory/box/memory.limit_in_bytes": UNLIMITED_V1,
            "memory/box/memory.usage_in_bytes": str(GIB),
            "unified/box/memory.max": "max",
            "unified/box/memory.current": str(GIB),
        },
        (16 * GIB, 12 * GIB, ""),
    ),
    # a limit that leaves more than the system has available bounds only the total
    "looser than the system": (
        "0::/box\n",
        [V2_MOUNT.format(at="")],
        {"box/memory.max": str(14 * GIB), "box/memory.current": str(GIB)},
        (14 * GIB, 12 * GIB, ""),
    ),
    # the smallest limit bounds the total even where another leaves less room
    "smaller limit, more room": (
        "0::/busy/box\n",
        [V2_MOUNT.format(at="")],
        {
            "busy/memory.max": str(8 * GIB),
            "busy/memory.current": str(7 * GIB),
            "busy/box/memory.max": str(4 * GIB),
            "busy/box/memory.current": "0",
        },
        (4 * GIB, GIB, "cgroup v2 /busy: limit 8.0 GiB, 7.0 GiB in use"),
    ),
    # unreadable or odd files limit nothing; a limit without its usage still holds
    "unreadable": (
        "0::/a/b/c\n",
        [V2_MOUNT.format(at="")],
        {
            "a/b/c/memory.max/not-a-file": "",
            "a/b/memory.max": "lots",
            "a/memory.max": str(4 * GIB),
            "a/memory.stat": "inactive_file many\n",
        },
        (4 * GIB, 4 * GIB, "cgroup v2 /a: limit 4.0 GiB, 0.0 GiB in use"),
    ),
    "no cgroups": ("", [], {}, (16 * GIB, 12 * GIB, "")),
}


@pytest.mark.parametrize("case", list(CGROUPS))
def test_the_memory_budget_keeps_within_a_memory_cgroup_limit(case: str, tmp_path: Path) -> None:
    """In a 1 GiB memory cgroup `volunteerd hardware` said "budget 10.1 GiB (half of the
    available memory) ... 58 fit" and `serve` was OOM-killed (an outside audit): the
    available memory is the lesser of MemAvailable and the tightest cgroup's limit less
    its use, and the budget says so."""
    cgroup, mounts, files, (total, available, limit) = CGROUPS[case]
    found = detect(root=fake_linux(tmp_path, cgroup, mounts, files))
    assert (found.memory_bytes, found.available_bytes, found.memory_limit) == (
        total,
        available,
        limit,
    )
    room = capacity(found, torch.device("cpu"), ExpertsConfig(), RuntimeConfig(), HardwareConfig())
    assert room.budget_bytes == available // 2
    expected = "half of the available memory" + (f" under {limit}" if limit else "")
    assert room.budget_source == expected


def test_no_proc_tree_falls_back_to_the_system_calls(tmp_path: Path) -> None:
    found = detect(root=tmp_path)  # nothing there: sysconf, as on macOS
    assert found.memory_bytes >= found.available_bytes > 0
    assert found.memory_limit == ""


def test_speed_is_measured_once_per_device_and_expert_kind(tmp_path: Path) -> None:
    cache = tmp_path / "speed.json"
    small = ExpertsConfig(hidden_dim=32)
    cpu = torch.device("cpu")
    first = measure_speed(cpu, small, cache, seconds=0.05, batch=8)
    assert not first.cached
    assert first.samples_per_s > 0
    again = measure_speed(cpu, small, cache, seconds=0.05, batch=8)
    assert again.cached
    assert again.samples_per_s == first.samples_per_s
    other = measure_speed(cpu, ExpertsConfig(hidden_dim=48), cache, seconds=0.05, batch=8)
    assert not other.cached
    assert len(json.loads(cache.read_text())) == 2
    assert not measure_speed(cpu, small, cache, seconds=0.05, batch=8, refresh=True).cached
    cache.write_text("not json")
    assert not measure_speed(cpu, small, cache, seconds=0.05, batch=8).cached


def test_hardware_command_prints_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VOLUNTEERD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "data"))
    args = ["hardware", "--json", "--config", str(tmp_path / "none.toml")]
    (tmp_path / "none.toml").write_text('[experts]\nhidden_dim = 16\n[runtime]\ndevice = "cpu"\n')
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == "cpu"
    assert report["capacity"]["experts"] > 0
    assert report["speed"]["samples_per_s"] > 0
    assert (tmp_path / "cache" / "speed.json").exists()


def wider_than_memory() -> ExpertsConfig:
    """Experts of which one needs more than this computer's whole memory."""
    whole = detect().memory_bytes
    width = 1024
    while expert_footprint(ExpertsConfig(hidden_dim=width)) <= whole:
        width *= 2
    return ExpertsConfig(hidden_dim=width)


def test_an_expert_larger_than_the_whole_memory_is_a_clear_error_not_one_anyway() -> None:
    """ "At least one expert" tried to allocate a width-65536 expert (64 GiB) every
    minute and failed with the allocator's words."""
    from volunteerd.config import Config
    from volunteerd.errors import ConfigError
    from volunteerd.swarm.joiner import capacity_for

    config = Config.model_validate({"hardware": {"memory_budget_mb": 3000}})
    experts_that_fit = capacity_for(config, torch.device("cpu"))
    with pytest.raises(ConfigError, match="more than all of this computer's memory"):
        experts_that_fit(wider_than_memory())


def test_max_experts_caps_what_fits_and_never_skips_the_memory_check() -> None:
    """``experiments.max_experts`` ("experts to host at most") replaced the memory check:
    with it set to 4, a manifest of 960 GiB experts had a 24 GiB machine allocate four
    (an outside probe). It now caps what fits; the whole-memory refusal always holds."""
    from volunteerd.config import Config
    from volunteerd.errors import ConfigError
    from volunteerd.swarm.joiner import capacity_for

    budget = {"memory_budget_mb": 3000}  # the kept forwards' 2 GiB, then experts
    small, large = ExpertsConfig(hidden_dim=64), ExpertsConfig(hidden_dim=2048)
    fits = capacity_for(Config.model_validate({"hardware": budget}), torch.device("cpu"))
    assert fits(small) > 4
    assert fits(large) < 4
    capped = capacity_for(
        Config.model_validate({"hardware": budget, "experiments": {"max_experts": 4}}),
        torch.device("cpu"),
    )
    assert capped(small) == 4  # at most four
    assert capped(large) == fits(large)  # no more than fit
    with pytest.raises(ConfigError, match="more than all of this computer's memory"):
        capped(wider_than_memory())


GIB = 1 << 30


def room_on(
    monkeypatch: pytest.MonkeyPatch, total_gib: float, available_gib: float, **config: object
) -> Callable[[ExpertsConfig], int]:
    """``capacity_for`` on a simulated CPU machine (``detect`` reads no real memory)."""
    from volunteerd.config import Config
    from volunteerd.runtime.hardware import Hardware
    from volunteerd.swarm import joiner

    machine = Hardware("simulated", 4, 4, int(total_gib * GIB), int(available_gib * GIB))
    monkeypatch.setattr(joiner, "detect", lambda: machine)
    return joiner.capacity_for(Config.model_validate(config), torch.device("cpu"))


def of_size(at_least: int) -> ExpertsConfig:
    """The narrowest ffn experts of which one needs at least ``at_least`` bytes."""
    width = 64
    while expert_footprint(ExpertsConfig(hidden_dim=width)) < at_least:
        width += 64
    return ExpertsConfig(hidden_dim=width)


def test_an_expert_over_a_configured_budget_is_refused_not_hosted_anyway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 498 MiB expert was hosted under the 64 MiB budget the volunteer had set, with
    a log line ("hosting one anyway") and "memhog (1 expert)" in the status (an outside
    probe). Not even one fitting a configured budget now fails the project, saying so;
    one that fits the budget but not beside the kept forwards' share is still hosted."""
    from volunteerd.errors import ConfigError

    budget = {"hardware": {"memory_budget_mb": 64}, "runtime": {"retain_activations_mb": 32}}
    room = room_on(monkeypatch, 32, 28, **budget)
    with pytest.raises(ConfigError, match=r"memory budget .*memory_budget_mb = 64"):
        room(of_size(100 * MIB))
    assert room(of_size(48 * MIB)) == 1  # within 64 MiB, not beside 32 MiB of forwards
    assert room(of_size(8 * MIB)) == (32 * MIB) // expert_footprint(of_size(8 * MIB))


def test_with_the_default_budget_one_expert_must_fit_the_available_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the default budget (half of the available memory) a 15 GiB expert was
    hosted on a 16 GiB computer with 4 GiB available: it was compared with the whole
    memory. It is refused now (ResourceUnavailable: memory may be freed later); one
    that fits the available memory but not half of it is still hosted, alone."""
    from volunteerd.errors import ResourceUnavailable

    room = room_on(monkeypatch, 16, 4)
    with pytest.raises(ResourceUnavailable, match=r"memory available now \(4.0 GiB of 16.0 GiB"):
        room(of_size(5 * GIB))
    assert room(of_size(3 * GIB)) == 1


def test_max_experts_caps_a_project_of_tiny_experts_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A manifest of 4,096 experts of hidden 8 had every volunteer host all of them
    ("room for 872714 here"): most of their 4,161 keys were refused by storing peers
    (1,024 keys a writer), and the idle daemon used 20-40 % of a core. Unless the
    volunteer says otherwise, a daemon hosts at most 128 experts; 0 lifts the cap."""
    from volunteerd.config import ExperimentsConfig

    assert ExperimentsConfig().max_experts == 128
    tiny = ExpertsConfig(hidden_dim=8)
    assert room_on(monkeypatch, 32, 28)(tiny) == 128
    assert room_on(monkeypatch, 32, 28, experiments={"max_experts": 4})(tiny) == 4
    assert room_on(monkeypatch, 32, 28, experiments={"max_experts": 0})(tiny) > 100_000


def test_a_mount_path_that_is_not_utf8_is_read(tmp_path: Path) -> None:
    """/proc/self/mountinfo read as UTF-8: a mounted folder with a Latin-1 byte in its
    name (a USB stick named on an older system) made `volunteerd hardware`, and a
    joiner, stop with UnicodeDecodeError."""
    cgroup, mounts, files, (total, available, limit) = CGROUPS["v2"]
    root = fake_linux(tmp_path, cgroup, mounts, files)
    stick = b"52 31 8:17 / /media/Jos\xe9/USB rw,relatime - vfat /dev/sdb1 rw\n"
    with (root / "proc/self/mountinfo").open("ab") as f:
        f.write(stick)
    found = detect(root=root)
    assert (found.memory_bytes, found.available_bytes, found.memory_limit) == (
        total,
        available,
        limit,
    )
