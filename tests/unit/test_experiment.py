"""Experiment files: which experts each block uses (``layer_names`` or
``<uid_prefix><i>``), and the example files the docs show parse and fit together."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from volunteerd.errors import ConfigError
from volunteerd.identity import Identity
from volunteerd.net.peers import peer_id_for
from volunteerd.swarm.invitation import Invitation
from volunteerd.swarm.manifest import load_manifest_file
from volunteerd.train import Experiment, ModelConfig, load_experiment
from volunteerd.train.loop import expert_config
from volunteerd.train.published import apply_invitation, apply_manifest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_blocks_use_uid_prefix_and_their_index_by_default() -> None:
    m = ModelConfig(uid_prefix="mlp", num_blocks=2, grid=(2, 3))
    assert [m.layer_name(b) for b in range(2)] == ["mlp0", "mlp1"]
    assert m.expert_pattern(1) == "mlp1.0.[0:3],mlp1.1.[0:3]"


def test_layer_names_name_each_blocks_grid_and_set_the_number_of_blocks() -> None:
    m = ModelConfig.model_validate({"layer_names": ["ffn"], "grid": [2, 2]})
    assert (m.num_blocks, m.layer_name(0)) == (1, "ffn")
    experiment = Experiment(model=m)
    assert expert_config(experiment).uid_list() == ["ffn.0.0", "ffn.0.1", "ffn.1.0", "ffn.1.1"]
    two = ModelConfig.model_validate({"layer_names": ["enc", "dec"], "num_blocks": 2})
    assert [two.layer_name(b) for b in range(2)] == ["enc", "dec"]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"layer_names": ["ffn"], "num_blocks": 2}, "1 grids for 2 blocks"),
        ({"layer_names": ["ffn", "ffn"]}, "a grid twice"),
        ({"layer_names": ["FFN"]}, "lowercase name"),
        ({"layer_names": ["ffn.0"]}, "lowercase name"),
        ({"layer_names": [""]}, "lowercase name"),
    ],
)
def test_bad_layer_names_are_refused_saying_why(
    tmp_path: Path, model: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.model_validate(model)
    path = tmp_path / "trainer.toml"
    names = ", ".join(f'"{n}"' for n in model["layer_names"])  # type: ignore[attr-defined]
    blocks = f"num_blocks = {model['num_blocks']}\n" if "num_blocks" in model else ""
    path.write_text(f"[model]\nlayer_names = [{names}]\n{blocks}")
    with pytest.raises(ConfigError, match="model: "):
        load_experiment(path)


def test_the_example_manifest_and_trainer_file_parse_and_fit_together() -> None:
    manifest = load_manifest_file(EXAMPLES / "experiment.toml", owner="owner")
    assert manifest.description
    assert manifest.homepage.startswith("https://")
    trainer = load_experiment(EXAMPLES / "trainer.toml")
    assert trainer.swarm.manifest == manifest.name
    applied = apply_manifest(trainer, manifest)
    model = applied.model
    assert [model.layer_name(b) for b in range(model.num_blocks)] == manifest.layer_names()
    # The trainer calls exactly the experts the manifest's daemons host.
    assert expert_config(applied).uid_list() == manifest.uids()
    assert (model.hidden_dim, model.grid) == (manifest.hidden_dim, manifest.grid)


def test_the_training_page_quotes_the_tested_example_verbatim() -> None:
    """docs/training.md shows parts of examples/own_model.py, which the e2e tests run."""
    page = (ROOT / "docs" / "training.md").read_text()
    source = (EXAMPLES / "own_model.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert len(blocks) >= 2
    for block in blocks:
        assert block in source, block[:200]
    for toml in re.findall(r"```toml\n(.*?)```", page, flags=re.DOTALL):
        tomllib.loads(toml)


def test_an_invitation_names_the_manifest_its_trusted_owner_and_the_peers() -> None:
    owner = str(peer_id_for(Identity.generate()))
    boot = f"/ip4/203.0.113.7/tcp/38400/p2p/{peer_id_for(Identity.generate())}"
    other = f"/ip4/198.51.100.1/tcp/1/p2p/{peer_id_for(Identity.generate())}"
    invitation = Invitation("stdlib-chars", owner, (boot,))
    trainer = load_experiment(EXAMPLES / "trainer.toml")
    swarm = apply_invitation(trainer, invitation).swarm
    assert (swarm.manifest, swarm.trusted_owners, swarm.bootstrap_peers) == (
        "stdlib-chars",
        [owner],
        [boot],
    )
    mine = Experiment.model_validate(
        {"swarm": {"trusted_owners": ["someone", owner], "bootstrap_peers": [other, boot]}}
    )
    swarm = apply_invitation(mine, invitation).swarm
    assert swarm.trusted_owners == [owner, "someone"]
    assert swarm.bootstrap_peers == [boot, other]
    with pytest.raises(ConfigError, match="invitation is to 'other'"):
        apply_invitation(trainer, Invitation("other", owner, (boot,)))


@pytest.mark.parametrize(
    ("section", "key", "value", "says"),
    [
        # each was accepted and failed later: a traceback, retries, or memory without bound
        ("model", "grid", "[-3, 4]", "model.grid: Value error, every dimension needs at least"),
        ("model", "grid", "[0, 4]", "model.grid: Value error, every dimension needs at least"),
        ("model", "grid", "[256, 256, 256]", "names 16777216 experts a block"),
        # a daemon's record under the prefix would list more children than peers accept
        ("model", "grid", "[4096]", "a grid dimension of 4096 experts; at most 256"),
        ("model", "grid", "[64, 64]", "names 4096 experts a block, in 2 blocks; at most 4096"),
        ("model", "forward_timeout_s", "inf", "model.forward_timeout_s: Input should be a finite"),
        ("model", "backward_timeout_s", "inf", "model.backward_timeout_s: Input should be a fin"),
        # servers send no reply later than 60 s after a request: a longer wait got nothing
        ("model", "forward_timeout_s", "90", "model.forward_timeout_s: Value error, 90 s; at m"),
        ("model", "backward_timeout_s", "61", "backward_timeout_s: Value error, 61 s; at most 60"),
        ("model", "grace_after_k_min_s", "inf", "model.grace_after_k_min_s: Input should be a f"),
        ("training", "eval_batches", "1000000000", "training.eval_batches: Input should be less"),
        ("averaging", "timeout_s", "inf", "averaging.timeout_s: Input should be a finite"),
        ("averaging", "max_state_mb", "inf", "averaging.max_state_mb: Input should be a finite"),
        ("averaging", "max_state_mb", "1e12", "averaging.max_state_mb: Input should be less"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_key(
    tmp_path: Path, section: str, key: str, value: str, says: str
) -> None:
    path = tmp_path / "trainer.toml"
    path.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as refused:
        load_experiment(path)
    lines = str(refused.value).splitlines()
    assert lines[0] == f"invalid experiment {path}:"
    assert len(lines) == 2, lines  # one line for the one bad key
    assert says in lines[1]


def test_the_largest_values_allowed_load() -> None:
    experiment = Experiment.model_validate(
        {
            "model": {"grid": [64, 64], "num_blocks": 1, "forward_timeout_s": 60},
            "training": {"eval_batches": 1024},
            "averaging": {"max_state_mb": 1 << 20, "timeout_s": 3600},
        }
    )
    assert experiment.averaging.max_state_bytes == 1 << 40
    assert ModelConfig(grid=(1,), num_blocks=64).grid == (1,)


@pytest.mark.parametrize("lr", ["inf", "nan", "1e30"])
def test_a_trainer_learning_rate_that_cannot_train_is_refused_as_experts_lr_is(
    tmp_path: Path, lr: str
) -> None:
    # lr = inf was accepted: the first update made the trainer's weights inf or NaN
    path = tmp_path / "trainer.toml"
    path.write_text(f"[training]\nlr = {lr}\n")
    with pytest.raises(ConfigError, match=r"training\.lr"):
        load_experiment(path)
