"""The import graph of docs/architecture.md, enforced: a wrong edge fails here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "volunteerd"

LEAVES = {
    "errors",
    "uids",
    "atomic",
    "detached",
    "bounded",
    "malloc",
    "shown",
    "checkpoint_folders",
    "awake",
    "localtime",
}
# layer -> the internal layers it may import (leaves are always allowed)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "uids": set(),
    "atomic": set(),
    "detached": set(),
    "bounded": set(),
    "malloc": set(),
    "shown": set(),
    "checkpoint_folders": set(),
    "awake": set(),
    "localtime": set(),
    "paths": set(),
    "stats": set(),
    "logs": set(),
    "config": set(),
    "identity": set(),
    "wire": set(),
    # logs: to tame py-libp2p's loggers as soon as it is imported
    "net": {"wire", "identity", "config", "logs"},
    "experts": {"wire", "config"},
    "runtime": {"wire", "config", "experts"},
    "moe": {"net", "wire", "experts", "config", "identity"},
    "swarm": {"net", "wire", "experts", "config", "identity", "runtime"},
    # paths: the lock a trainer's state folder shares with the data folder's
    "train": {"moe", "experts", "config", "swarm", "paths"},
    # testing: the WAN emulator that `volunteerd demo --wan` places its processes in
    "demo": {"train", "moe", "config", "control", "testing"},
    # the control API knows HTTP and its own models; the daemon hands it snapshots
    "control": set(),
    "dashboard": set(),
    "tray": {"control", "paths"},
    # autostart files and service managers; finds the daemon through control.client
    "service": {"control", "config", "paths"},
    # the serving side: request pipeline, pause gate, contribution counting, what the
    # control API reads (with the projects joined: swarm)
    "server": {
        "config",
        "control",
        "experts",
        "net",
        "runtime",
        "schedule",
        "stats",
        "swarm",
        "wire",
    },
    # what a daemon with something to host adds (torch); only the daemon imports it
    "hosting": {"config", "net", "paths", "runtime", "server", "swarm"},
    # when to compute: idle, power, hours; holds the daemon back through a protocol
    "schedule": {"config", "control"},
    "daemon": {
        "control",
        "hosting",
        "schedule",
        "server",
        "stats",
        "config",
        "identity",
        "net",
        "paths",
        "runtime",
        "experts",
        "wire",
        "swarm",
    },
    # in-memory test worlds are built from the real parts
    "testing": {
        "config",
        "daemon",
        "experts",
        "identity",
        "moe",
        "net",
        "paths",
        "runtime",
        "schedule",
        "server",
        "swarm",
        "wire",
    },
    "cli": {
        "control",
        "service",
        "tray",
        "config",
        "daemon",
        "identity",
        "net",
        "paths",
        "logs",
        "demo",
        "moe",
        "train",
        "runtime",
        "swarm",
    },
    # the swarm simulated with the production decision code (benchmarks/scale.py);
    # testing: memory links for calibrating a request's cost
    "sim": {"moe", "swarm", "train", "experts", "net", "config", "wire", "runtime", "testing"},
    "__init__": set(),
    "__main__": {"cli"},
}
TORCH_FREE = {
    "atomic",
    "checkpoint_folders",
    "bounded",
    "malloc",
    "detached",
    "errors",
    "uids",
    "paths",
    "logs",
    "config",
    "identity",
    "wire",
    "net",
    "stats",
    "control",
    "dashboard",
    "tray",
    "service",
    "schedule",
}
ONLY_NET_MAY_IMPORT = {"libp2p", "multiaddr"}


def layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """Every module ``path`` (or ``source``, read as if at ``path``) imports, absolute:
    ``from volunteerd import net`` is ``volunteerd.net`` (a name that is no module, e.g.
    ``__version__``, is the package ``volunteerd``); relative imports are resolved."""
    tree = ast.parse(path.read_text() if source is None else source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node.module, node.level)
            names.add(module)
            if module == "volunteerd":
                names.update(f"volunteerd.{a.name}" for a in node.names if _is_module(a.name))
    return names


def _absolute(path: Path, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = ["volunteerd", *path.relative_to(PACKAGE).parent.parts]
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _is_module(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def test_imports_of_sees_every_form() -> None:
    source = (
        "import volunteerd.net\n"
        "from volunteerd import daemon, __version__\n"
        "from volunteerd.wire import frames\n"
        "from . import pausing\n"
        "from ..control import events\n"
    )
    names = imports_of(PACKAGE / "server" / "example.py", source)
    assert names == {
        "volunteerd.net",
        "volunteerd",
        "volunteerd.daemon",
        "volunteerd.wire",
        "volunteerd.server",
        "volunteerd.control",
    }


def test_layers_import_only_what_the_architecture_allows() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = layer_of(path)
        assert layer in ALLOWED, f"{path}: new top-level module; add it to the graph"
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "volunteerd" and len(parts) > 1:
                target = parts[1]
                if target not in (ALLOWED[layer] | LEAVES | {layer}) and name != "volunteerd":
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if parts[0] == "torch" and layer in TORCH_FREE:
                wrong.append(f"{path.relative_to(PACKAGE)} imports torch")
            if parts[0] in ONLY_NET_MAY_IMPORT and layer != "net":
                wrong.append(f"{path.relative_to(PACKAGE)} imports {parts[0]}")
            if parts[0] == "appdirs" and layer != "paths":
                wrong.append(f"{path.relative_to(PACKAGE)} imports appdirs")
            if parts[0] == "pickle":
                wrong.append(f"{path.relative_to(PACKAGE)} imports pickle")
    assert wrong == []


def test_no_utils_junk_drawer() -> None:
    assert not list(PACKAGE.rglob("util*")), "a helper without a home is a concept to name"


def test_the_tray_talks_to_the_daemon_only_through_the_client() -> None:
    allowed = {"volunteerd.control.client", "volunteerd.control.models", "volunteerd.paths"}
    wrong = []
    for path in sorted((PACKAGE / "tray").rglob("*.py")):
        for name in imports_of(path):
            internal = name.startswith("volunteerd.") and not name.startswith("volunteerd.tray")
            if internal and name not in allowed and name.split(".")[1] not in LEAVES:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert wrong == []


def test_the_service_verbs_talk_to_the_daemon_only_through_the_client() -> None:
    wrong = []
    for path in sorted((PACKAGE / "service").rglob("*.py")):
        for name in imports_of(path):
            if name.startswith("volunteerd.control") and name != "volunteerd.control.client":
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert wrong == []
