"""Hardware detection, the expert footprint, capacity and the cached self-benchmark."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from volunteerd.cli import main
from volunteerd.config import ExpertsConfig, HardwareConfig, RuntimeConfig
from volunteerd.experts.registry import build_module
from volunteerd.runtime.hardware import capacity, detect, expert_footprint, measure_speed

MIB = 1 << 20


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
    assert auto.budget_source == "half of the available memory"
    assert auto.experts > 0


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
    minute and failed with the allocator's words; an expert that fits the budget
    nowhere but the memory still is hosted (one)."""
    from volunteerd.config import Config
    from volunteerd.errors import ConfigError
    from volunteerd.swarm.joiner import capacity_for

    config = Config.model_validate({"hardware": {"memory_budget_mb": 1}})
    experts_that_fit = capacity_for(config, torch.device("cpu"))
    assert experts_that_fit(ExpertsConfig(hidden_dim=256)) == 1  # over the budget: one
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
