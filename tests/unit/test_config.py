"""Configuration: defaults, the commented default file, overrides, and clear errors."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from volunteerd.config import Config, dump_toml, load_config
from volunteerd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_commented_default_file_is_exactly_the_defaults() -> None:
    with (ROOT / "config" / "default.toml").open("rb") as f:
        data = tomllib.load(f)
    assert Config.model_validate(data) == Config()


def test_generated_schema_is_up_to_date() -> None:
    on_disk = json.loads((ROOT / "config" / "schema.json").read_text())
    assert on_disk == Config.model_json_schema(), "run: python -m volunteerd.config.schema"


def test_missing_file_means_defaults_unless_required(tmp_path: Path) -> None:
    assert load_config(tmp_path / "none.toml", env={}) == Config()
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.toml", required=True, env={})


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        '[network]\nport = 1000\nlisten_host = "127.0.0.1"\n[experts]\nhidden_dim = 64\n'
    )
    config = load_config(
        path,
        env={"VOLUNTEERD_NETWORK__PORT": "2000", "VOLUNTEERD_EXPERTS__HIDDEN_DIM": "128"},
        overrides=["network.port=3000"],
    )
    assert config.network.port == 3000
    assert config.network.listen_host == "127.0.0.1"
    assert config.experts.hidden_dim == 128


def test_environment_variables_without_double_underscore_are_not_config() -> None:
    assert load_config(None, env={"VOLUNTEERD_DATA_DIR": "/x", "VOLUNTEERD_PORT": "1"}) == Config()


def test_error_names_key_value_and_source(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[network]\nport = "many"\n[runtime]\ndevice = "tpu"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env={"VOLUNTEERD_DHT__REPLICATION": "0"}, overrides=["experts.colour=1"])
    text = str(info.value)
    assert "network.port = 'many'" in text
    assert f"file {path}" in text
    assert "runtime.device = 'tpu'" in text
    assert "dht.replication = 0" in text
    assert "VOLUNTEERD_DHT__REPLICATION" in text
    assert "experts.colour = 1: unknown key" in text
    assert "--set experts.colour=1" in text


def test_unknown_section_and_bad_toml_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[netwrok]\nport = 1\n")
    with pytest.raises(ConfigError, match="netwrok: unknown key"):
        load_config(path, env={})
    path.write_text("[network\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match="record_ttl_s"):
        load_config(None, env={}, overrides=["dht.record_ttl_s=5", "dht.announce_period_s=10"])
    with pytest.raises(ConfigError, match="multiple of num_heads"):
        load_config(
            None,
            env={},
            overrides=[
                'experts.type="transformer"',
                "experts.hidden_dim=100",
                "experts.num_heads=8",
            ],
        )
    with pytest.raises(ConfigError, match="empty range"):
        load_config(None, env={}, overrides=["experts.uids=ffn.[3:1]"])


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(None, env={}, overrides=["network.port"])


def test_models_are_frozen_and_dump_round_trips() -> None:
    config = Config()
    with pytest.raises(Exception, match="frozen"):
        config.network.port = 1  # type: ignore[misc]
    assert Config.model_validate(tomllib.loads(dump_toml(config))) == config
