"""Configuration: defaults, the commented default file, overrides, and clear errors."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from volunteerd.cli import main
from volunteerd.config import (
    CONFIG_VERSION,
    Config,
    LimitsConfig,
    dump_toml,
    load_config,
    migrations,
)
from volunteerd.control.models import LimitsChange
from volunteerd.errors import ConfigError, ExitCode

ROOT = Path(__file__).resolve().parents[2]


def test_commented_default_file_is_exactly_the_defaults() -> None:
    with (ROOT / "config" / "default.toml").open("rb") as f:
        data = tomllib.load(f)
    assert Config.model_validate(data) == Config()


def test_the_default_file_is_ascii_so_any_code_page_writes_it_alike() -> None:
    """`volunteerd config default > config.toml` on Windows wrote its em dash in the
    console's code page, and the daemon refused the file as not UTF-8."""
    from volunteerd.config.schema import commented_default_toml

    assert commented_default_toml().isascii()


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


@pytest.mark.parametrize(
    ("env", "overrides", "line"),
    [
        (
            {"VOLUNTEERD_BOGUS__X": "1"},
            [],
            "bogus: unknown key (environment VOLUNTEERD_BOGUS__X)",
        ),
        ({}, ["bogus.x=1"], "bogus: unknown key (flag --set bogus.x=1)"),
        (
            {},
            ["network.port.x=1"],
            "network.port: Input should be a valid integer (flag --set network.port.x=1)",
        ),
        (
            {"VOLUNTEERD_BOGUS__X": "1"},
            ["bogus.y=2"],
            "bogus: unknown key (environment VOLUNTEERD_BOGUS__X, flag --set bogus.y=2)",
        ),
    ],
    ids=["environment", "set", "set-below-a-value", "environment-and-set"],
)
def test_a_section_made_by_the_environment_or_a_flag_is_blamed_on_them(
    env: dict[str, str], overrides: list[str], line: str
) -> None:
    # they were blamed on "(defaults)": only the sections above an error were looked up
    with pytest.raises(ConfigError) as info:
        load_config(None, env=env, overrides=overrides)
    assert str(info.value).splitlines()[1:] == [f"  {line}"]


def test_a_value_set_over_a_section_is_blamed_alone(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[bogus]\nx = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={}, overrides=["bogus=2"])
    assert str(info.value).splitlines()[1:] == ["  bogus = 2: unknown key (flag --set bogus=2)"]


def test_the_config_validate_command_names_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VOLUNTEERD_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("VOLUNTEERD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("VOLUNTEERD_BOGUS__X", "1")
    assert main(["config", "validate"]) == ExitCode.CONFIG
    assert capsys.readouterr().err == (
        "volunteerd: invalid configuration:\n"
        "  bogus: unknown key (environment VOLUNTEERD_BOGUS__X)\n"
    )


def test_unknown_section_and_bad_toml_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[netwrok]\nport = 1\n")
    with pytest.raises(ConfigError, match="netwrok: unknown key"):
        load_config(path, env={})
    path.write_text("[network\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})


DAMAGED = {
    "an integer of 5,000 digits": ("[limits]\nupload_mbit = 1" + "0" * 5000, "4300 digits"),
    "arrays nested 3,000 deep": ("[limits]\nupload_mbit = " + "[" * 3000 + "]" * 3000, "nested"),
    "bytes that are not UTF-8": ("[limits]\nupload_mbit = 1 # \udcff", "UTF-8"),
}


@pytest.mark.parametrize("damage", DAMAGED, ids=list(DAMAGED))
def test_every_toml_file_read_refuses_damage_with_a_config_error(
    tmp_path: Path, damage: str
) -> None:
    """tomllib raises ValueError for a huge integer and RecursionError for deep
    nesting, not only TOMLDecodeError: a damaged limits.toml reloaded on SIGHUP
    stopped the daemon with a traceback."""
    from volunteerd.swarm.manifest import load_manifest_file
    from volunteerd.swarm.projects import load_projects
    from volunteerd.train.experiment import load_experiment

    text, why = DAMAGED[damage]
    bad = tmp_path / "bad.toml"
    bad.write_bytes(text.encode("utf-8", "surrogateescape"))
    (tmp_path / "limits.toml").write_bytes(bad.read_bytes())
    readers = {
        "config": lambda: load_config(bad, env={}),
        "limits.toml": lambda: load_config(None, run_time_dir=tmp_path, env={}),
        "projects": lambda: load_projects(bad),
        "experiment": lambda: load_experiment(bad),
        "manifest": lambda: load_manifest_file(bad, owner="12D3KooWowner"),
    }
    for name, read in readers.items():
        with pytest.raises(ConfigError, match=f"not valid TOML: .*{why}") as error:
            read()
        assert len(str(error.value)) < 400, name


NOTEPAD = {
    "a UTF-8 byte order mark": lambda text: b"\xef\xbb\xbf" + text.encode(),
    "UTF-16 LE with its mark": lambda text: text.encode("utf-16"),  # Notepad's "Unicode"
    "UTF-16 BE with its mark": lambda text: b"\xfe\xff" + text.encode("utf-16-be"),
    "UTF-32 LE with its mark": lambda text: text.encode("utf-32"),
    "UTF-32 BE with its mark": lambda text: b"\x00\x00\xfe\xff" + text.encode("utf-32-be"),
    "a Ctrl-Z at the end": lambda text: text.encode() + b"\x1a",
    "CRLF, a mark and a Ctrl-Z": lambda text: (
        b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode() + b"\x1a"
    ),
}


@pytest.mark.parametrize("saved", NOTEPAD, ids=list(NOTEPAD))
def test_every_toml_file_reads_as_windows_notepad_saves_it(tmp_path: Path, saved: str) -> None:
    """A byte order mark read as "Invalid statement (at line 1, column 1)", UTF-16 as
    "'utf-8' codec can't decode byte 0xff in position 0", a trailing Ctrl-Z as an
    invalid statement on the last line; a projects.toml with a mark stopped the daemon
    (exit 3, which systemd does not restart)."""
    from volunteerd.swarm.projects import read_projects

    encode = NOTEPAD[saved]
    text = "# Müller's settings — überall\n[limits]\nupload_mbit = 3\n"
    (tmp_path / "config.toml").write_bytes(encode(text))
    assert load_config(tmp_path / "config.toml", env={}).limits.upload_mbit == 3
    (tmp_path / "limits.toml").write_bytes(encode(text.replace("3", "7")))
    assert load_config(None, run_time_dir=tmp_path, env={}).limits.upload_mbit == 7
    (tmp_path / "projects.toml").write_bytes(encode("# joined by José\n"))
    assert read_projects(tmp_path / "projects.toml").projects == []


def test_a_byte_that_is_not_utf8_is_named_by_line_and_column(tmp_path: Path) -> None:
    """A Latin-1 "ü" in a comment was reported as a byte offset in a codec's words."""
    path = tmp_path / "config.toml"
    path.write_bytes("[limits]\n# für dich\nupload_mbit = 3\n".encode("latin-1"))
    with pytest.raises(ConfigError) as error:
        load_config(path, env={})
    assert str(error.value) == (
        f"{path}: not valid TOML: byte 0xfc at line 2, column 4 is not UTF-8: "
        "save the file as UTF-8"
    )
    path.write_bytes(b"\xff\xfe[\x00l\x00i")  # UTF-16 cut in the middle of a letter
    with pytest.raises(ConfigError, match="saved as UTF-16 but damaged: save it as UTF-8"):
        load_config(path, env={})


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_utf16_or_utf32_without_a_mark_is_named(tmp_path: Path, codec: str) -> None:
    """UTF-16 without a byte order mark read as "Invalid initial character for a key
    part (at line 1, column 2)": nothing said the file was saved in the wrong encoding."""
    path = tmp_path / "config.toml"
    path.write_bytes("[limits]\nupload_mbit = 3\n".encode(codec))
    with pytest.raises(ConfigError) as error:
        load_config(path, env={})
    assert str(error.value) == (
        f"{path}: not valid TOML: looks like UTF-16 or UTF-32 without a byte order mark: "
        "save it as UTF-8"
    )
    # one stray NUL in UTF-8 text is not mistaken for UTF-16: tomllib names its place
    path.write_bytes(b"[limits]\nupload_mbit = 3\n# \x00\n")
    with pytest.raises(ConfigError, match=r"invalid character .* \(at line 3, column 3\)"):
        load_config(path, env={})


def test_a_fifo_a_folder_or_a_huge_file_is_refused_without_waiting(tmp_path: Path) -> None:
    """A FIFO nobody writes to, given as the config, blocked ``config validate`` (and
    a daemon's start or SIGHUP reload) forever; a folder or a file of gigabytes is
    not a config either."""
    import os
    import threading

    from volunteerd.config.toml_files import MAX_BYTES, read_toml

    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            read_toml(fifo)
        except BaseException as exc:  # the test looks at it below
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock it before failing, so the test run can go on
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO blocked")
    assert isinstance(outcome[0], ConfigError), outcome
    assert "not a regular file" in str(outcome[0])
    with pytest.raises(ConfigError, match="not a regular file"):
        read_toml(tmp_path)
    huge = tmp_path / "huge.toml"
    with huge.open("wb") as f:
        f.truncate(MAX_BYTES + 1)
    with pytest.raises(ConfigError, match="larger than 16 MiB"):
        load_config(huge, env={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[network]\nport = true", "network.port = True: Input should be a valid integer"),
        ('[limits]\nupload_mbit = "5"', "limits.upload_mbit = '5': Input should be a valid number"),
        ('[schedule]\non_battery = "yes"', "schedule.on_battery = 'yes': Input should be a valid"),
        (
            "[runtime]\nqueue_size = 2.0",
            "runtime.queue_size = 2.0: Input should be a valid integer",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_converted(
    tmp_path: Path, text: str, message: str
) -> None:
    """``port = true`` was port 1 and ``upload_mbit = "5"`` 5 Mbit/s, silently."""
    path = tmp_path / "config.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path, env={})
    config = load_config(
        None, overrides=["limits.upload_mbit=5", "experts.optimizer.betas=[0.8, 0.9]"], env={}
    )
    assert (config.limits.upload_mbit, config.experts.optimizer.betas) == (5.0, (0.8, 0.9))


def test_a_value_of_thousands_of_characters_is_shown_by_its_start() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides=["network.port=1" + "0" * 5000], env={})
    message = str(error.value)
    assert "network.port = '1000" in message
    assert "(5003 characters)" in message  # its repr's
    assert len(message) < 400


@pytest.mark.parametrize(
    "addr",
    [
        "/dns4/me.example/tcp/38400",
        "/ip4/0.0.0.0/tcp/38400",
        "/ip4/224.0.0.1/tcp/38400",
        "/ip4/203.0.113.7/tcp/99999",
        "/ip4/203.0.113.7/udp/38400",
        "203.0.113.7:38400",
    ],
)
def test_an_announced_address_peers_cannot_dial_is_a_config_error(
    tmp_path: Path, addr: str
) -> None:
    # the records' rule: these started a node that announced nothing dialable (the port,
    # a traceback); now the file's line is named before anything starts
    path = tmp_path / "config.toml"
    path.write_text(f'[network]\nannounce_addrs = ["{addr}"]\n')
    with pytest.raises(ConfigError, match=r"network\.announce_addrs.*not an address peers can"):
        load_config(path, env={})


def test_announced_addresses_peers_can_dial_are_accepted() -> None:
    relay = "12D3KooWGzBqzUvBQ6Nv4cPJ4ZnqUQLKCG1GwhrsJvNdCmhnYe4Q"
    addrs = ["/ip4/203.0.113.7/tcp/38400", "/ip6/2001:db8::1/tcp/1",
             f"/ip4/198.51.100.2/tcp/4001/p2p/{relay}/p2p-circuit"]  # fmt: skip
    setting = "network.announce_addrs=[" + ",".join(f'"{a}"' for a in addrs) + "]"
    assert load_config(None, env={}, overrides=[setting]).network.announce_addrs == addrs


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


@pytest.mark.parametrize(
    ("pattern", "prefix", "children"),
    [
        ("ffn.[0:300]", "ffn.", 300),
        ("ffn.[0:2].[0:257]", "ffn.0.", 257),
        ("ffn.[0:200], ffn.[300:400]", "ffn.", 300),
    ],
)
def test_more_experts_along_one_dimension_than_a_record_lists_is_refused(
    pattern: str, prefix: str, children: int
) -> None:
    """A prefix record lists its next coordinates, and every peer refuses one of more
    than 256 (dht.max_children_per_record), this node's own store too: hosting
    "ffn.[0:300]" counted an invalid record each announce round, logged nothing, and
    none of the 300 experts could be found (outside audit)."""
    wide = f"{children} experts under {prefix!r}; at most 256 along one grid dimension"
    with pytest.raises(ConfigError, match=re.escape(wide)) as refused:
        load_config(None, env={}, overrides=[f"experts.uids={pattern}"])
    assert "dht.max_children_per_record" in str(refused.value)
    uncapped = "experiments.max_experts=0"  # the width is checked, not the number
    assert load_config(None, env={}, overrides=["experts.uids=ffn.[0:256].[0:2]", uncapped])


def test_more_experts_along_one_dimension_than_this_nodes_own_store_takes_is_refused() -> None:
    """Checked against 256 alone, a node set to accept fewer children a record hosted a
    prefix its own store refused (an outside audit, config validate)."""
    narrow = "dht.max_children_per_record=64"
    with pytest.raises(ConfigError, match=re.escape("100 experts under 'ffn.', more than dht.max")):
        load_config(None, env={}, overrides=["experts.uids=ffn.[0:100]", narrow])
    assert load_config(None, env={}, overrides=["experts.uids=ffn.[0:64]", narrow])


def test_hosting_more_experts_than_max_experts_is_refused_saying_how_to_raise_it() -> None:
    """experiments.max_experts capped only joined projects: experts.uids of 4,096 tiny
    experts started with the default cap of 128 and no message (startup 67 s, /metrics
    1 MB; outside audit), though docs/security.md says a daemon hosts at most that many."""
    too_many = "experts.uids names 256 experts, more than experiments.max_experts (128)"
    with pytest.raises(ConfigError, match=re.escape(too_many)) as refused:
        load_config(None, env={}, overrides=["experts.uids=ffn.[0:16].[0:16]"])
    assert "raise experiments.max_experts (0 = no cap)" in str(refused.value)
    with pytest.raises(ConfigError, match=r"names 3 experts, more than .*max_experts \(2\)"):
        load_config(None, env={}, overrides=["experts.uids=ffn.[0:3]", "experiments.max_experts=2"])
    # within the cap, with no cap, or while joining an experiment (which ignores uids)
    assert load_config(None, env={}, overrides=["experts.uids=ffn.[0:2].[0:64]"])
    assert load_config(
        None, env={}, overrides=["experts.uids=ffn.[0:16].[0:16]", "experiments.max_experts=0"]
    )
    joining = ["experts.uids=ffn.[0:16].[0:16]", 'experiments.join="demo"']
    assert load_config(None, env={}, overrides=joining)


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        load_config(None, env={}, overrides=["network.port"])


def test_models_are_frozen_and_dump_round_trips() -> None:
    config = Config()
    with pytest.raises(Exception, match="frozen"):
        config.network.port = 1  # type: ignore[misc]
    assert Config.model_validate(tomllib.loads(dump_toml(config))) == config


# -- migrations (volunteerd/config/migrations.py) -------------------------------------------


def test_a_file_without_a_version_is_the_first_format(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[network]\nport = 4001\n")
    config = load_config(path, env={})
    assert config.version == 1
    assert config.network.port == 4001


def test_a_file_from_a_newer_volunteerd_says_to_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"version = {CONFIG_VERSION + 1}\n[network]\nport = 4001\n")
    with pytest.raises(ConfigError, match="written by a newer volunteerd") as info:
        load_config(path, env={})
    assert "upgrade volunteerd" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("version", ["0", '"one"', "true", "1.5"])
def test_a_version_no_migration_knows_is_a_clear_error(tmp_path: Path, version: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"version = {version}\n")
    with pytest.raises(ConfigError, match=r"version = .*config format"):
        load_config(path, env={})


def test_registered_migrations_run_before_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rename_portnumber(data: dict[str, Any]) -> dict[str, Any]:
        network = data.get("network", {})
        if "portnumber" in network:
            network["port"] = network.pop("portnumber")
        return data

    # a made-up format 0 whose [network] said portnumber where format 1 says port
    monkeypatch.setattr(migrations, "MIGRATIONS", {0: rename_portnumber})
    path = tmp_path / "config.toml"
    text = "version = 0\n[network]\nportnumber = 4001\n"
    path.write_text(text)
    config = load_config(path, env={"VOLUNTEERD_EXPERTS__HIDDEN_DIM": "64"})
    assert config.network.port == 4001
    assert config.experts.hidden_dim == 64  # environment and flags apply after migrating
    assert path.read_text() == text  # in memory only: the user's file is left as it was
    assert "port = 4001" in dump_toml(config)  # what `volunteerd config show` prints
    path.write_text("version = 0\n[network]\nportnumber = 99999\n")
    source = re.escape(f"(file {path})")
    with pytest.raises(ConfigError, match=r"network\.port = 99999: .*" + source):
        load_config(path, env={})


def test_migrations_chain_in_order_and_leave_the_input_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []

    def step(version: int) -> migrations.Migration:
        def run(data: dict[str, Any]) -> dict[str, Any]:
            seen.append(data["version"])
            data.setdefault("steps", []).append(version)
            return data

        return run

    monkeypatch.setattr(migrations, "MIGRATIONS", {1: step(1), 2: step(2)})
    original = {"version": 1, "network": {"port": 1}}
    migrated = migrations.migrate(original, "test", current=3)
    assert migrated == {"version": 3, "network": {"port": 1}, "steps": [1, 2]}
    assert seen == [1, 2]
    assert original == {"version": 1, "network": {"port": 1}}
    with pytest.raises(ConfigError, match="newer volunteerd"):
        migrations.migrate({"version": 4}, "test", current=3)


# -- numbers that are not numbers (issue 12) --------------------------------------------------


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    found = [model]
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found += _models(field.annotation)
    return found


def test_no_setting_takes_infinity_or_nan() -> None:
    """TOML spells them ``inf`` and ``nan``; no setting means either (an infinite
    limit, period or lifetime breaks arithmetic and JSON far from its key)."""
    for model in _models(Config):
        assert model.model_config.get("allow_inf_nan") is False, model.__name__
    assert len(_models(Config)) > 15


def test_inf_and_nan_in_the_file_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(
        "[limits]\nupload_mbit = inf\nduty_cycle = nan\n"
        "[dht]\nmax_record_ttl_s = inf\n[timeouts]\nrequest_s = -inf\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, env={"VOLUNTEERD_LIMITS__MONTHLY_QUOTA_GB": "1e300"})
    text = str(info.value)
    for key in ("limits.upload_mbit", "limits.duty_cycle", "dht.max_record_ttl_s"):
        assert re.search(rf"{re.escape(key)} = (inf|nan): Input should be a finite number", text)
    assert "timeouts.request_s = -inf: Input should be a finite number" in text
    assert "limits.monthly_quota_gb = 1e+300: Input should be less than or equal to 1000000" in text
    assert "VOLUNTEERD_LIMITS__MONTHLY_QUOTA_GB" in text


def test_a_limits_file_with_infinity_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "limits.toml").write_text("[limits]\nupload_mbit = inf\n")
    with pytest.raises(ConfigError, match=r"limits\.upload_mbit = inf: .*finite") as info:
        load_config(tmp_path / "config.toml", env={}, run_time_dir=tmp_path)
    assert str(tmp_path / "limits.toml") in str(info.value)


def test_the_api_accepts_exactly_the_limits_the_config_accepts() -> None:
    """``control`` imports no config, so LimitsChange repeats the ranges."""
    assert set(LimitsChange.model_fields) == set(LimitsConfig.model_fields)
    for name, field in LimitsConfig.model_fields.items():
        assert LimitsChange.model_fields[name].metadata == field.metadata, name
    assert LimitsChange.model_config.get("allow_inf_nan") is False


@pytest.mark.parametrize("betas", [[1.5, 0.999], [0.9, 1.0], [-0.1, 0.999]])
def test_adam_betas_outside_zero_to_one_are_refused_when_the_config_is_read(
    tmp_path: Path, betas: list[float]
) -> None:
    """torch refuses them only when an expert is built: `config validate` passed, then
    the daemon failed to start with "unreachable"."""
    path = tmp_path / "config.toml"
    path.write_text(f"[experts.optimizer]\nbetas = {betas}\n")
    with pytest.raises(ConfigError, match=r"experts\.optimizer\.betas"):
        load_config(path)


@pytest.mark.parametrize(
    "raw",
    [
        "5\n[network]\nport = 1",  # the port was set by the second line, silently
        "5\r\nfoo = 1",
        "4001\nthis is not toml at all = = =",  # the second line was dropped unread
        "[1,\n2]",
    ],
)
def test_a_value_of_more_than_one_line_is_refused_naming_its_source(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"VOLUNTEERD_LIMITS__UPLOAD_MBIT": raw})
    assert str(info.value).startswith("environment VOLUNTEERD_LIMITS__UPLOAD_MBIT: ")
    assert "one line" in str(info.value)
    with pytest.raises(ConfigError, match=r"^flag --set 'limits.upload_mbit=.*one line"):
        load_config(None, env={}, overrides=[f"limits.upload_mbit={raw}"])


def test_a_line_break_around_a_value_is_no_line_break_in_it() -> None:
    config = load_config(None, env={"VOLUNTEERD_LIMITS__UPLOAD_MBIT": "5\n"})
    assert config.limits.upload_mbit == 5
    config = load_config(None, env={}, overrides=["limits.upload_mbit=6\n"])
    assert config.limits.upload_mbit == 6


def test_trusted_owners_are_peer_ids_as_an_invitation_checks_them() -> None:
    from volunteerd.config.addrs import is_ed25519_peer_id
    from volunteerd.identity import Identity
    from volunteerd.net.peers import public_key_of

    owner = "12D3KooWN2cK7Wt448ipDy2ZHnA1dhJcHcwcL4T48AvWZFauku7K"
    config = load_config(None, env={}, overrides=[f'experiments.trusted_owners=["{owner}"]'])
    assert config.experiments.trusted_owners == [owner]
    for bad in (
        "someone",
        owner[:-4],  # cut short
        owner + "1",
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # not an Ed25519 key's
        f"/ip4/1.2.3.4/tcp/1/p2p/{owner}",
        "",
        "1" * 5000,
    ):
        with pytest.raises(ConfigError, match=r"experiments\.trusted_owners.*not a peer id"):
            load_config(None, env={}, overrides=[f'experiments.trusted_owners=["{bad}"]'])
    # the same answer as the network layer's (libp2p's) for ids and near misses
    from volunteerd.net.peers import peer_id_for

    ids = [str(peer_id_for(Identity(bytes([n]) * 32))) for n in range(20)]
    near = [i[:k] + c + i[k + 1 :] for i in ids[:5] for k in (0, 1, 8, 30, -1) for c in "1zA"]
    for text in [*ids, *near, *(i[:-1] for i in ids), "1", "11111", "2" * 52]:
        assert is_ed25519_peer_id(text) == (public_key_of(text) is not None), text


@pytest.mark.parametrize("decay", [1e308, 1.5, -0.1])
def test_a_weight_decay_outweighing_any_gradient_is_refused(decay: float) -> None:
    # a manifest's 1e308 was accepted (an outside audit): SGD made every weight infinite
    from pydantic import ValidationError

    from volunteerd.config.models import OptimizerConfig

    with pytest.raises(ValidationError, match="weight_decay"):
        OptimizerConfig(weight_decay=decay)
    assert OptimizerConfig(weight_decay=1.0).weight_decay == 1.0
