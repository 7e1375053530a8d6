"""An experiment: the model, its data, how to train it, and the swarm hosting its experts.

Read from TOML by ``volunteerd train --config trainer.toml`` (examples/trainer.toml;
the file ``volunteerd publish`` reads is the experiment's manifest, examples/
experiment.toml); ``volunteerd demo`` uses ``Experiment()`` — the embedded default —
unchanged. Each DMoE layer ``i`` of the model uses the expert grid
``<layer name>.[0:g0].[0:g1]...`` of ``ffn`` experts of width ``model.hidden_dim``,
where the layer names are ``model.layer_names`` when given (``["ffn"]`` reaches a swarm
started with ``serve --experts "ffn.[0:4].[0:4]"``) and ``<uid_prefix>0``,
``<uid_prefix>1``, ... otherwise; the daemons hosting them must use the same width and
the optimizer in ``experts``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from volunteerd import uids
from volunteerd.config import MAX_GRID_DIMENSION, OptimizerConfig
from volunteerd.config.toml_files import read_toml
from volunteerd.errors import ConfigError
from volunteerd.moe.timing import REPLY_WINDOW_S
from volunteerd.swarm.manifest import MAX_EXPERTS

__all__ = [
    "AveragingConfig",
    "DataConfig",
    "Experiment",
    "ModelConfig",
    "SwarmConfig",
    "TrainingConfig",
    "load_experiment",
]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class DataConfig(_Model):
    """Text to learn from, read as bytes (a character-level model over 256 symbols)."""

    source: str = Field(
        "python-stdlib",
        description='"python-stdlib" (the source of Python\'s own standard library, on '
        "every machine) or the path of a text file or folder",
    )
    max_bytes: int = Field(3_000_000, ge=10_000, description="read at most this much text")
    val_every: int = Field(
        10,
        ge=2,
        description="every n-th file is held out for validation (the last file read when "
        "fewer are read; the last 1/n of a single file)",
    )


class ModelConfig(_Model):
    """embedding -> blocks of (causal self-attention, DMoE feed-forward) -> head."""

    hidden_dim: int = Field(128, ge=8, le=8192)
    num_blocks: int = Field(2, ge=1, le=64)
    num_heads: int = Field(4, ge=1, le=64)
    seq_len: int = Field(64, ge=2, le=4096)
    grid: tuple[int, ...] = Field(
        (4, 4),
        min_length=1,
        max_length=uids.MAX_DIMS,
        description=f"experts along each dimension of a block's grid; at most {MAX_EXPERTS} "
        "experts in all blocks together, as a manifest",
    )
    uid_prefix: str = Field(
        "mlp", description="block i uses the experts <uid_prefix><i>.* (without layer_names)"
    )
    layer_names: tuple[str, ...] = Field(
        (),
        max_length=64,
        description="the expert grid of each block, in order: block i uses the experts "
        '<layer_names[i]>.*, e.g. ["ffn"] for a swarm started with `volunteerd serve '
        '--experts "ffn.[0:4].[0:4]"`; num_blocks defaults to their number',
    )
    k_best: int = Field(2, ge=1, le=64)
    k_min: int = Field(1, ge=1, le=64)
    # Finite, as every timeout of the daemon's config: inf was accepted and waited forever.
    # At most REPLY_WINDOW_S: servers send no reply later than that after a request.
    forward_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    backward_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    grace_after_k_min_s: float = Field(0.5, ge=0, allow_inf_nan=False)
    compression: Literal["none", "float16", "bfloat16", "q8"] = "none"
    spot_check: float = Field(
        0.02,
        ge=0,
        le=1,
        description="fraction of expert calls also sent to a second replica and compared",
    )
    max_output_abs: float = Field(
        1e4, gt=0, description="an expert answer with a larger element is dropped"
    )

    @field_validator("forward_timeout_s", "backward_timeout_s")
    @classmethod
    def _within_the_servers_reply_window(cls, seconds: float) -> float:
        # a longer wait got nothing: a server drops a reply still going out its
        # timeouts.request_s (60 s) after the request began, and so does the trainer
        if seconds > REPLY_WINDOW_S:
            raise ValueError(
                f"{seconds:g} s; at most {REPLY_WINDOW_S:g} s (servers send no reply "
                "later than that after a request)"
            )
        return seconds

    @field_validator("grid")
    @classmethod
    def _at_least_one_expert_a_dimension(cls, grid: tuple[int, ...]) -> tuple[int, ...]:
        # 0 left the trainer retrying "is the swarm reachable", -3 failed in torch
        if any(g < 1 for g in grid):
            raise ValueError(f"every dimension needs at least one expert, not {list(grid)}")
        if max(grid, default=0) > MAX_GRID_DIMENSION:
            # the daemons' record under a prefix would list more children than peers
            # accept (dht.max_children_per_record): the trainer would find none of them
            raise ValueError(
                f"a grid dimension of {max(grid)} experts; at most {MAX_GRID_DIMENSION} "
                "(what peers accept in one DHT record, dht.max_children_per_record)"
            )
        return grid

    @model_validator(mode="before")
    @classmethod
    def _blocks_of_layer_names(cls, data: Any) -> Any:
        # One block per named grid unless num_blocks says otherwise (then it must agree).
        if isinstance(data, dict) and data.get("layer_names") and "num_blocks" not in data:
            return {**data, "num_blocks": len(data["layer_names"])}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.hidden_dim % self.num_heads:
            raise ValueError("hidden_dim must be a multiple of num_heads")
        if self.k_min > self.k_best:
            raise ValueError("k_min must not exceed k_best")
        per_block = math.prod(self.grid)
        if self.num_blocks * per_block > MAX_EXPERTS:  # a manifest's limit; 10^10 passed
            blocks = "" if self.num_blocks == 1 else f" a block, in {self.num_blocks} blocks"
            raise ValueError(
                f"grid {list(self.grid)} names {per_block} experts{blocks}; "
                f"at most {MAX_EXPERTS} in all"
            )
        if not uids.is_valid_key(f"{self.uid_prefix}0."):
            raise ValueError(f"uid_prefix {self.uid_prefix!r} must be a lowercase name")
        if self.layer_names:
            if len(self.layer_names) != self.num_blocks:
                raise ValueError(
                    f"layer_names names {len(self.layer_names)} grids for "
                    f"{self.num_blocks} blocks (num_blocks)"
                )
            for name in self.layer_names:
                if "." in name or not uids.is_valid_key(f"{name}."):
                    raise ValueError(f"layer name {name!r} must be a lowercase name, like 'ffn'")
            if len(set(self.layer_names)) != len(self.layer_names):
                raise ValueError("layer_names names a grid twice: each block needs its own")
        return self

    def layer_name(self, block: int) -> str:
        """The grid of block ``block``: its experts are ``<layer name>.<i>.<j>...``."""
        if self.layer_names:
            return self.layer_names[block]
        return f"{self.uid_prefix}{block}"

    def expert_pattern(self, block: int, rows: range | None = None) -> str:
        """The pattern naming layer ``block``'s experts (optionally only some first rows)."""
        rest = "".join(f".[0:{g}]" for g in self.grid[1:])
        rows = rows if rows is not None else range(self.grid[0])
        return ",".join(f"{self.layer_name(block)}.{r}{rest}" for r in rows)


class TrainingConfig(_Model):
    batch_size: int = Field(16, ge=1, le=4096)
    steps: int = Field(200, ge=1)
    # finite and at most 10, as experts.lr: with lr = inf (or 1e30) the first update
    # made the trainer's weights inf or NaN, and it blamed the swarm for a minute
    lr: float = Field(
        3e-3,
        gt=0,
        le=10,
        allow_inf_nan=False,
        description="learning rate of the trainer's own parameters",
    )
    eval_every: int = Field(50, ge=1)
    # held in memory all at once: 1e9 grew without bound before the first step
    eval_batches: int = Field(8, ge=1, le=1024)
    seed: int = 0
    in_flight: int = Field(
        1,
        ge=1,
        le=64,
        description="batches (or, with max_staleness = 0, micro-batches of one batch) "
        "computed at once, each waiting for its experts while the others run",
    )
    max_staleness: int = Field(
        8,
        ge=0,
        le=1024,
        description="trainer updates allowed between a batch's forward and the update "
        "applying its gradient; an older gradient is dropped. 0: each step's batch is cut "
        "into in_flight micro-batches computed from the same weights, one update when all "
        "are done (synchronous, as one batch)",
    )
    data_shard: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="which stream of training batches this trainer draws (with seed); "
        "unset: 0 without a swarm, and derived from the trainer's peer id on one, so "
        "several trainers of an experiment learn from different batches. Validation "
        "batches are the same for every shard",
    )
    state_dir: str = Field(
        "",
        max_length=4096,
        description="the folder where this trainer keeps its own state (weights, Adam's "
        "state, step count, data position) and resumes from on the next start; a relative "
        "path is from the experiment file's folder. Empty: <data dir>/trainers/<name> "
        "under `volunteerd train` (docs/training.md)",
    )
    save_every_steps: int = Field(
        100,
        ge=0,
        description="save the trainer's state every this many updates, and when training "
        "ends or is stopped; 0: keep no state (every start is from the seed or a peer)",
    )

    wait_for_experts_s: float = Field(
        600.0,
        gt=0,
        le=7 * 86_400,
        allow_inf_nan=False,
        description="give up (exit status 5, the summary still written) when no step was "
        "taken for this long: no expert of some layer answered. Meanwhile skipped steps "
        "do not count toward steps, and the trainer waits 1 s, 2 s, 4 s ... up to 30 s "
        "between tries",
    )

    @model_validator(mode="after")
    def _micro_batches(self) -> Self:
        if self.max_staleness == 0 and self.in_flight > self.batch_size:
            raise ValueError("with max_staleness = 0, in_flight must not exceed batch_size")
        return self


class SwarmConfig(_Model):
    bootstrap_peers: list[str] = Field(default_factory=list)
    manifest: str = Field(
        "",
        description="name of a published experiment manifest: its experts' settings "
        "(grid, width, layers, optimizer, compression) replace the model's",
    )
    trusted_owners: list[str] = Field(
        default_factory=list, description="peer ids whose manifests are accepted"
    )
    rendezvous: str = Field(
        "",
        description="the DHT key under which this experiment's trainers find each other "
        "(default: derived from the name)",
    )

    @model_validator(mode="after")
    def _rendezvous_key(self) -> Self:
        if self.rendezvous and not uids.is_valid_uid(self.rendezvous):
            raise ValueError(
                f"rendezvous {self.rendezvous!r} must be a valid expert uid, like 'mytrainers.0'"
            )
        return self


class AveragingConfig(_Model):
    """Decentralized averaging of the trainer-side weights with the experiment's other
    trainers (docs/training.md): small random groups, centered clipping."""

    enabled: bool = Field(True, description="average with the experiment's other trainers")
    every_s: float = Field(
        20.0, gt=0, le=86_400, description="seconds between rounds (jittered +-20 %)"
    )
    group_size: int = Field(
        3, ge=2, le=64, description="this trainer and up to group_size - 1 others per round"
    )
    clip_ratio: float = Field(
        0.5,
        gt=0,
        le=10,
        description="centered clipping bound: another trainer moves a tensor by at most "
        "clip_ratio * |own| / n",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="a peer that has not answered by then is left out of the round",
    )
    join_from_peers: bool = Field(
        True, description="a late trainer starts from a peer's state, not from the seed"
    )
    # inf failed in max_state_bytes (OverflowError); 1 TiB is more than a trainer holds
    max_state_mb: float = Field(
        1024,
        gt=0,
        le=1 << 20,
        allow_inf_nan=False,
        description="refuse larger snapshots (parameters, or state to join from)",
    )

    @property
    def max_state_bytes(self) -> int:
        return int(self.max_state_mb * (1 << 20))


class Experiment(_Model):
    name: str = Field(
        "stdlib-chars",
        min_length=1,
        max_length=128,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="the experiment's name: its trainers find each other by it",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    experts: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(name="adam", lr=3e-3),
        description="the optimizer the daemons use for this experiment's experts",
    )
    swarm: SwarmConfig = Field(default_factory=SwarmConfig)
    averaging: AveragingConfig = Field(default_factory=AveragingConfig)


def load_experiment(path: Path) -> Experiment:
    """Read an experiment file; raises ConfigError naming each bad key."""
    try:
        data = read_toml(path)
    except FileNotFoundError:
        raise ConfigError(f"experiment file not found: {path}") from None
    try:
        return Experiment.model_validate(data)
    except ValidationError as exc:
        lines = [f"invalid experiment {path}:"]
        for error in exc.errors():
            key = ".".join(str(p) for p in error["loc"]) or "(top level)"
            message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
            lines.append(f"  {key}: {message}")
        raise ConfigError("\n".join(lines)) from None
