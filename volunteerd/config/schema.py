"""The config file's documentation, generated from the models (one source of truth).

``python -m volunteerd.config.schema`` rewrites ``config/default.toml`` (every key with
its default and a comment) and ``config/schema.json``; a test fails when they are stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel

from volunteerd.config.models import Config

__all__ = ["commented_default_toml", "json_schema"]

_HEADER = """\
# volunteerd configuration - every key with its default value.
#
# Copy this file to the path `volunteerd config path` prints and change what you need;
# keys you leave out keep their defaults. Any key can also be set for one run with
# `--set section.key=value` or the environment variable VOLUNTEERD_SECTION__KEY.
# `volunteerd config validate` checks a file; `volunteerd config show` prints the
# effective configuration.
"""


def json_schema() -> dict[str, Any]:
    return Config.model_json_schema()


def _value(value: Any) -> str:
    if isinstance(value, list) and all(not isinstance(v, list | dict) for v in value):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).strip()[len("v = ") :]


def _section(model: BaseModel, name: str, out: list[str]) -> None:
    scalars: list[str] = []
    tables: list[tuple[str, BaseModel]] = []
    for key, field in type(model).model_fields.items():
        value = getattr(model, key)
        if isinstance(value, BaseModel):
            tables.append((key, value))
            continue
        if field.description:
            scalars.append(f"# {field.description}")
        dumped = model.model_dump(mode="json")[key]
        scalars.append(f"{key} = {_value(dumped)}")
    if name:
        doc = (type(model).__doc__ or "").strip().splitlines()
        out.append("")
        if doc and not doc[0].startswith("!"):
            out.append(f"# {doc[0]}")
        out.append(f"[{name}]")
    out.extend(scalars)
    for key, sub in tables:
        _section(sub, f"{name}.{key}" if name else key, out)


def commented_default_toml() -> str:
    lines: list[str] = []
    _section(Config(), "", lines)
    return _HEADER + "\n" + "\n".join(lines).lstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path("config")
    root.mkdir(parents=True, exist_ok=True)
    (root / "default.toml").write_text(commented_default_toml(), encoding="utf-8")
    (root / "schema.json").write_text(json.dumps(json_schema(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {root / 'default.toml'} and {root / 'schema.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
