"""Load the configuration: TOML file, then environment, then command-line overrides.

Later sources win. An environment variable ``VOLUNTEERD_<SECTION>__<KEY>`` (double
underscore between levels) and a flag ``--set section.key=value`` both take a TOML
value (``8080``, ``"text"``, ``[1, 2]``); a bare word is read as a string. Flags of
their own (``--port 4001``) come last, as ``Flag``s that name themselves in errors.
Every error names the key, the value and where the value came from. A file of an
older format is migrated first, in memory (``migrations``).

Limits changed at run time (pause controls, tray) are kept apart from the person's
config file, whose comments must survive: in ``limits.toml`` in the daemon's data
folder (each daemon its own: two with different ``--data-dir`` may share a config
file), holding only a ``[limits]`` section, whose keys take the place of the config
file's (environment and flags still win). Deleting ``limits.toml`` returns to the
config file's limits. The schedule set at run time is kept the same way, in
``schedule.toml`` beside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ValidationError

from volunteerd.config.migrations import migrate
from volunteerd.config.models import Config, LimitsConfig, ScheduleConfig
from volunteerd.config.toml_files import parse_toml, read_toml
from volunteerd.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "LIMITS_FILE",
    "SCHEDULE_FILE",
    "Flag",
    "check_limits_overlay",
    "dump_toml",
    "limits_overlay_toml",
    "load_config",
    "parse_override",
    "run_time_changes",
    "schedule_overlay_toml",
    "updated_overlay_toml",
]

ENV_PREFIX = "VOLUNTEERD_"
LIMITS_FILE = "limits.toml"
SCHEDULE_FILE = "schedule.toml"  # beside limits.toml: the schedule set at run time


@dataclass(frozen=True, slots=True)
class Flag:
    """A command-line flag that sets one key, e.g. ``Flag("network.port", 4001,
    "--port 4001")``; errors name ``typed``, what the user typed."""

    key: str
    value: Any
    typed: str


def load_config(
    path: Path | None,
    *,
    required: bool = False,
    env: Mapping[str, str] | None = None,
    overrides: Iterable[str] = (),
    flags: Iterable[Flag] = (),
    run_time_dir: Path | None = None,
) -> Config:
    """Build the effective configuration.

    ``path`` is read if it exists; a missing file means defaults, unless ``required``
    (the user named the file explicitly). ``run_time_dir`` holds the settings changed
    while running (``limits.toml``, ``schedule.toml``: the data folder); None reads
    none. Raises ConfigError naming the key, the value and its source for every
    problem found.
    """
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    # A link to nothing is no missing file: read, it is an error naming the link (it
    # meant default settings, silently, for a config on a drive not mounted).
    if path is not None and (path.exists() or path.is_symlink()):
        try:
            data = read_toml(path)
        except FileNotFoundError:  # gone since exists()
            raise ConfigError(f"{path}: cannot read: it is gone") from None
        data = migrate(data, f"file {path}")
        _record_sources(data, (), f"file {path}", sources)
    elif path is not None and required:
        raise ConfigError(f"config file not found: {path}")
    if run_time_dir is not None:
        _apply_overlay(run_time_dir / LIMITS_FILE, "limits", data, sources)
        _apply_overlay(run_time_dir / SCHEDULE_FILE, "schedule", data, sources)

    for name, raw in sorted((os.environ if env is None else env).items()):
        if not name.startswith(ENV_PREFIX) or "__" not in name[len(ENV_PREFIX) :]:
            continue
        keys = tuple(k.lower() for k in name[len(ENV_PREFIX) :].split("__"))
        source = f"environment {name}"
        _set_path(data, keys, _parse_value(raw, source), source, sources)

    for item in overrides:
        keys, value = parse_override(item)
        shown = item if len(item) <= _SHOWN_CHARS else f"{item[:_SHOWN_CHARS]}…"
        _set_path(data, keys, value, f"flag --set {shown}", sources)

    for flag in flags:
        _set_path(data, tuple(flag.key.split(".")), flag.value, f"flag {flag.typed}", sources)

    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from None


def parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    """``"network.port=4001"`` -> ``(("network", "port"), 4001)``."""
    name, sep, raw = item.partition("=")
    keys = tuple(k.strip() for k in name.split("."))
    if not sep or not all(keys):
        raise ConfigError(f"bad override {_shown(item)}: expected section.key=value")
    return keys, _parse_value(raw.strip(), f"flag --set {_shown(item)}")


def dump_toml(config: Config) -> str:
    return tomli_w.dumps(config.model_dump(mode="json"))


_OVERLAY_HEADER = """\
# Written by volunteerd when its limits are changed while it runs (tray, control API),
# with the limits changed then. These keys take the place of the config file's [limits]
# (environment variables and flags still win). Delete this file to go back to the
# config file's limits.
"""


def limits_overlay_toml(limits: LimitsConfig) -> str:
    """The text of ``limits.toml`` for ``limits``."""
    return _OVERLAY_HEADER + tomli_w.dumps({"limits": limits.model_dump(mode="json")})


_SCHEDULE_HEADER = """\
# Written by volunteerd when its schedule is changed while it runs (dashboard, control
# API, `volunteerd schedule`). These keys take the place of the [schedule] section of
# the config file. Delete this file to go back to the config file's schedule.
"""


def schedule_overlay_toml(schedule: ScheduleConfig) -> str:
    """The text of ``schedule.toml`` for ``schedule``."""
    return _SCHEDULE_HEADER + tomli_w.dumps({"schedule": schedule.model_dump(mode="json")})


def run_time_changes(old: BaseModel, new: BaseModel, named: Iterable[str]) -> dict[str, Any]:
    """What a change at run time sets (for ``updated_overlay_toml``): the keys it
    ``named`` and any other whose value it changed (a whole new section), with their
    new values as TOML takes them."""
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    named = set(named)
    return {k: v for k, v in after.items() if k in named or before.get(k) != v}


def updated_overlay_toml(path: Path, section: str, changed: Mapping[str, Any]) -> str:
    """The new text of ``path`` (``limits.toml`` or ``schedule.toml``, holding only
    ``[section]``): what it holds, with the ``changed`` keys set over it. Only what was
    changed at run time is kept there: a value from the config file, the environment
    or a flag (``--set limits.upload_mbit=3`` for one run) is not made permanent by an
    unrelated change (all the limits were written, the temporary one with them).
    Raises ConfigError for a file that holds something else (then it is left alone)."""
    try:
        overlay = read_toml(path)
    except FileNotFoundError:
        overlay = {}
    values = overlay.get(section, {})
    if set(overlay) - {section} or not isinstance(values, dict):
        raise ConfigError(f"{path}: may hold only a [{section}] section; fix or delete it")
    header = _OVERLAY_HEADER if section == "limits" else _SCHEDULE_HEADER
    return header + tomli_w.dumps({section: {**values, **changed}})


def check_limits_overlay(path: Path) -> None:
    """Raises ConfigError, in one line, unless ``path`` holds what a ``limits.toml`` of
    volunteerd's holds: a ``[limits]`` section only, of valid limits (FileNotFoundError
    when there is none)."""
    data: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
    if not path.exists():
        raise FileNotFoundError(path)
    if "limits" not in read_toml(path):  # empty: loaded as nothing set, but not ours
        raise ConfigError(f"{path}: holds no [limits] section")
    _apply_overlay(path, "limits", data, sources)
    try:
        Config.model_validate(data)
    except ValidationError as exc:
        details = _describe(exc, sources).splitlines()[1:]
        raise ConfigError("; ".join(line.strip() for line in details)) from None


def _apply_overlay(
    path: Path, section: str, data: dict[str, Any], sources: dict[tuple[str, ...], str]
) -> None:
    """Put the keys of ``path``'s only section, ``section``, in the place of the config
    file's (``limits.toml``, ``schedule.toml``)."""
    try:
        overlay = read_toml(path)
    except FileNotFoundError:
        return
    # an empty file (or one of comments only) sets nothing: it stopped the start,
    # saying it "may hold only a [limits] section"
    values = overlay.get(section, {})
    if set(overlay) - {section} or not isinstance(values, dict):
        raise ConfigError(
            f"{path}: may hold only a [{section}] section: fix it, or delete it to use "
            "the config file's settings"
        )
    for key, value in values.items():
        _set_path(data, (section, key), value, f"file {path}", sources)


def _parse_value(raw: str, source: str) -> Any:
    """The TOML value ``raw`` (a bare word: the text itself). Raises ConfigError, naming
    ``source``, for a value of more than one line: read as the document ``v = <raw>``,
    its other lines set keys of their own, silently dropped (``"5\\n[network]..."``)."""
    if any(c in raw.strip() for c in "\r\n"):
        raise ConfigError(f"{source}: a value must be one line, without line breaks: {_shown(raw)}")
    try:
        document = parse_toml(f"v = {raw}", "value")
    except ConfigError:  # a bare word; or past TOML's limits, then refused as a string
        return raw
    if set(document) != {"v"}:  # one line holds one key, but never take more than it
        raise ConfigError(f"{source}: not a single value: {_shown(raw)}")
    return document["v"]


def _shown(text: str) -> str:
    """``text`` quoted (line breaks escaped) for an error message, its start if long."""
    shown = repr(text)
    if len(shown) <= _SHOWN_CHARS:
        return shown
    return f"{shown[:_SHOWN_CHARS]}… ({len(text)} characters)"


def _set_path(
    data: dict[str, Any],
    keys: tuple[str, ...],
    value: Any,
    source: str,
    sources: dict[tuple[str, ...], str],
) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(keys[: i + 1])} is not a section ({source})")
        node = child
    node[keys[-1]] = value
    # what was set below ``keys`` is gone: its sources must not be blamed for ``value``
    for stale in [k for k in sources if len(k) > len(keys) and k[: len(keys)] == keys]:
        del sources[stale]
    sources[keys] = source


def _record_sources(
    node: Mapping[str, Any],
    prefix: tuple[str, ...],
    source: str,
    sources: dict[tuple[str, ...], str],
) -> None:
    for key, value in node.items():
        sources[(*prefix, key)] = source
        if isinstance(value, dict):
            _record_sources(value, (*prefix, key), source, sources)


_SHOWN_CHARS = 80


def _describe(exc: ValidationError, sources: Mapping[tuple[str, ...], str]) -> str:
    lines = ["invalid configuration:"]
    for error in exc.errors():
        loc = tuple(str(p) for p in error["loc"])
        key = ".".join(loc) or "(top level)"
        source = _source_of(loc, sources)
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        if "input" in error and error["type"] != "missing" and not isinstance(error["input"], dict):
            shown = repr(error["input"])
            if len(shown) > _SHOWN_CHARS:  # a value of thousands of characters: its start
                shown = f"{shown[:_SHOWN_CHARS]}… ({len(shown)} characters)"
            lines.append(f"  {key} = {shown}: {message} ({source})")
        else:
            lines.append(f"  {key}: {message} ({source})")
    return "\n".join(lines)


def _source_of(loc: tuple[str, ...], sources: Mapping[tuple[str, ...], str]) -> str:
    """Where the value at ``loc`` came from: what set it or a key below it (a section
    that ``VOLUNTEERD_BOGUS__X`` or ``--set network.port.x=1`` made), else the nearest
    section above it that was set (an item of a list), else the defaults."""
    below = [source for keys, source in sources.items() if keys[: len(loc)] == loc]
    if below:
        return ", ".join(dict.fromkeys(below))  # each source once, in the order applied
    return next(
        (sources[loc[:n]] for n in range(len(loc) - 1, 0, -1) if loc[:n] in sources),
        "defaults",
    )
