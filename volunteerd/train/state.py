"""A trainer's own state on disk, so that a restarted ``volunteerd train`` goes on
where it stopped instead of starting over from the seed.

Nothing of a trainer was saved before: a trainer killed at step 60 (validation loss
3.157) started again at step 0, loss 5.001, its summary saying ``started_from: "seed"``
(an outside audit). The experts were safe on the daemons; the embeddings, attention,
gates and head, Adam's moments and the position in the data were lost.

``TrainerStateFolder`` is one folder (``training.state_dir``; ``volunteerd train``
defaults to ``<data dir>/trainers/<experiment name>``)::

    lock                         held while a trainer uses the folder: a second is refused
    trainer/<sequence>.v2.ckpt   the state, in the checkpoint format (experts.checkpoint_file)

A state holds the trainer-side parameters (and, for a trainer with local experts, those
and their optimizer's state), Adam's state, the update count (``updates``: what the
averaging publishes as the trainer's version) and under ``progress/`` the step count,
the tokens trained, the data shard and the training batches' random generator as it
stood before the first batch not yet applied: a resumed trainer draws the batches the
stopped one would have drawn next, and with one batch in flight it makes the very
updates it would have made.

It is written every ``training.save_every_steps`` updates and when training ends or is
stopped (Ctrl-C, SIGTERM), by ``CheckpointStore``: a temporary file, fsync, read back,
rename, fsync of the folder, and only then the older files deleted (the newest two
kept), so a crash at any moment leaves the previous good state. A save that fails (a
full disk, a value not finite) is logged and training goes on; the last good file
stays. On start the newest file that reads back intact is loaded: a damaged one is set
aside as ``<name>.damaged`` (logged) and the one before it used, or, with none left, the
seed. A sound state that does not fit the experiment (another experiment's, another
model's names or shapes) is refused with one line naming the folder: loading nothing
and saving over it would delete a run's state because a setting changed.

Files of the format before (``trainer/<sequence>.ckpt``) are loaded when there is no
good one of this format, and deleted by the first save; a state of a newer format is
left as it is, with a warning to upgrade, and the trainer starts as if it had none
(``checkpoint_folders``): it is neither loaded nor deleted, so the version that wrote it
finds it again.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from volunteerd.atomic import make_private_dirs
from volunteerd.checkpoint_folders import unreachable
from volunteerd.errors import CheckpointError, ConfigError, ResourceUnavailable
from volunteerd.experts.checkpoint_file import CheckpointStore, ExpertState
from volunteerd.paths import DataDirLock

if TYPE_CHECKING:
    from volunteerd.train.loop import Trainer

__all__ = ["Resumed", "TrainerStateFolder", "default_state_dir"]

logger = logging.getLogger(__name__)

UID = "trainer"
KEEP = 2  # the new state and the one before it


def default_state_dir(trainers_dir: Path, experiment_name: str) -> Path:
    """``<trainers_dir>/<name>``, the experiment's name made a safe folder name (any
    character but letters, digits, ``-``, ``_`` and ``.`` replaced, plus a short hash of
    the name when one was, so two names stay two folders)."""
    import hashlib
    import re

    safe = re.sub(r"[^A-Za-z0-9._-]", "_", experiment_name).strip(".") or "_"
    if safe != experiment_name:
        safe = f"{safe[:64]}-{hashlib.sha256(experiment_name.encode()).hexdigest()[:8]}"
    return trainers_dir / safe


@dataclass(frozen=True, slots=True)
class Resumed:
    """Where a trainer resumed: the file, its step count, update count and tokens, and
    its smoothed training loss when it had one."""

    path: Path
    step: int
    version: int
    tokens: int
    train_loss: float | None


class TrainerStateFolder:
    """``with TrainerStateFolder(folder, save_every):`` holds the folder's lock; ``load``
    and ``save`` a trainer's state in it (see the module docstring)."""

    def __init__(self, folder: Path, save_every: int = 100) -> None:
        self.folder = folder
        self.save_every = save_every
        self._store = CheckpointStore(folder, keep=KEEP)
        self._lock = DataDirLock(folder / "lock")
        self._applied = 0  # updates since the last save
        self.saved_step = 0  # the step count of the state last saved or loaded

    def __enter__(self) -> TrainerStateFolder:
        reason = unreachable(self.folder, "trainer state folder") or self._store.unreachable(UID)
        if reason is not None:
            raise ConfigError(reason)
        try:
            make_private_dirs(self.folder)
        except OSError as exc:
            raise ConfigError(f"trainer state folder {self.folder}: {exc}") from None
        try:
            self._lock.__enter__()
        except ResourceUnavailable:
            raise ResourceUnavailable(
                f"another trainer is using the trainer state folder {self.folder}: give "
                "this one its own (--state-dir, or training.state_dir)"
            ) from None
        self._store.remove_temporaries()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.__exit__(*exc)

    def files(self) -> list[Path]:
        """The state files, newest first."""
        return self._store.files(UID)

    # --- loading ---------------------------------------------------------------------

    def load(self, trainer: Trainer) -> Resumed | None:
        """Load the newest good state into ``trainer``; None (nothing changed) when there
        is none. Raises ConfigError when the newest sound state is not of this
        trainer's experiment and model."""
        moved: list[Path] = []
        found = self._store.load_newest(UID, moved_aside=moved)
        if found is None:
            if moved:
                logger.warning(
                    "no usable trainer state in %s (%d damaged, set aside): starting afresh",
                    self.folder,
                    len(moved),
                )
            return None
        state, path = found
        problem = _misfit(state, trainer)
        if problem is not None:
            raise ConfigError(
                f"the trainer state in {self.folder} is not of this experiment ({problem}): "
                "move it away, or give this experiment another training.state_dir"
            )
        resumed = _restore(state, path, trainer)
        self.saved_step = resumed.step
        return resumed

    # --- saving ----------------------------------------------------------------------

    def count_update(self) -> None:
        """Count one update applied."""
        self._applied += 1

    @property
    def due(self) -> bool:
        """Whether a save is due: ``save_every`` updates since the last one."""
        return self.save_every > 0 and self._applied >= self.save_every

    def save(
        self,
        trainer: Trainer,
        step: int,
        generator_state: torch.Tensor,
        train_loss: float | None,
    ) -> Path | None:
        """Write ``trainer``'s state after ``step`` steps, the training batches' generator
        standing at ``generator_state``; returns the file, or None when it could not be
        written (logged; the previous file stays)."""
        self._applied = 0
        state = _snapshot(trainer, step, generator_state, train_loss)
        try:
            path = self._store.save(state)
        except (OSError, CheckpointError) as exc:
            logger.warning("trainer state not saved in %s: %s", self.folder, exc)
            return None
        self.saved_step = step
        return path


def _optimizers(trainer: Trainer) -> list[torch.optim.Optimizer]:
    """The trainer's optimizers in the order their states are numbered: the trainer's
    Adam, then its local experts' optimizer if it has one."""
    out: list[torch.optim.Optimizer] = [trainer.optimizer]
    if trainer.expert_optimizer is not None:
        out.append(trainer.expert_optimizer)
    return out


def _param_count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _snapshot(
    trainer: Trainer, step: int, generator_state: torch.Tensor, train_loss: float | None
) -> ExpertState:
    with torch.no_grad():
        params = {n: p.detach().to("cpu", copy=True) for n, p in trainer._trained.items()}
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    offset = 0
    for optimizer in _optimizers(trainer):
        for index, values in optimizer.state_dict()["state"].items():
            optimizer_state[offset + int(index)] = {
                key: (t.detach().to("cpu", copy=True) if torch.is_tensor(t) else torch.tensor(t))
                for key, t in values.items()
                if t is not None
            }
        offset += _param_count(optimizer)
    progress = {
        "step": torch.tensor(step, dtype=torch.int64),
        "tokens": torch.tensor(trainer.tokens_trained, dtype=torch.int64),
        "data_shard": torch.tensor(trainer.data_shard, dtype=torch.int64),
        # a uint8 tensor, a dtype the format does not store: one int32 per byte
        "generator": generator_state.to(torch.int32),
    }
    if train_loss is not None and math.isfinite(train_loss):
        progress["train_loss"] = torch.tensor(train_loss, dtype=torch.float64)
    return ExpertState(
        uid=UID,
        expert_type="trainer",
        hidden_dim=trainer.experiment.model.hidden_dim,
        optimizer="adam",
        updates=trainer.version,
        params=params,
        optimizer_state=optimizer_state,
        experiment=trainer.experiment.name,
        progress=progress,
    )


_PROGRESS_KEYS = {"step", "tokens", "data_shard", "generator"}


def _misfit(state: ExpertState, trainer: Trainer) -> str | None:
    """Why ``state`` cannot be ``trainer``'s, in a few words; None when it fits."""
    if state.expert_type != "trainer":
        return f"a state of {state.expert_type!r}, not of a trainer"
    if state.experiment != trainer.experiment.name:
        return f"experiment {state.experiment!r}, not {trainer.experiment.name!r}"
    own = trainer._trained
    if set(state.params) != set(own):
        missing = sorted(set(own) - set(state.params))
        extra = sorted(set(state.params) - set(own))
        return (
            f"{len(missing)} parameters missing, {len(extra)} not of this model, e.g. "
            f"{(missing or extra)[0]}"
        )
    for name, p in own.items():
        saved = state.params[name]
        if tuple(saved.shape) != tuple(p.shape) or saved.dtype != p.dtype:
            return f"{name}: {_kind(saved)} saved, this model's is {_kind(p)}"
    groups = [g for opt in _optimizers(trainer) for g in opt.param_groups]
    shapes = [tuple(p.shape) for g in groups for p in g["params"]]
    for index, values in state.optimizer_state.items():
        if index >= len(shapes):
            return f"optimizer state of parameter {index}, which this model does not have"
        for key, t in values.items():
            if key != "step" and tuple(t.shape) != shapes[index]:
                return f"optimizer state {index}/{key}: {list(t.shape)}, not {list(shapes[index])}"
    if not set(state.progress) >= _PROGRESS_KEYS:
        return f"no {sorted(_PROGRESS_KEYS - set(state.progress))[0]} recorded"
    generator = state.progress["generator"]
    current = torch.Generator().get_state()
    if generator.shape != current.shape or bool(((generator < 0) | (generator > 255)).any()):
        return "a data position this version cannot use"
    return None


def _kind(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _restore(state: ExpertState, path: Path, trainer: Trainer) -> Resumed:
    with torch.no_grad():
        for name, p in trainer._trained.items():
            p.copy_(state.params[name])
    offset = 0
    for optimizer in _optimizers(trainer):
        count = _param_count(optimizer)
        current = optimizer.state_dict()
        optimizer.load_state_dict(
            {
                "state": {
                    index - offset: values
                    for index, values in state.optimizer_state.items()
                    if offset <= index < offset + count
                },
                "param_groups": current["param_groups"],
            }
        )
        offset += count
    progress = state.progress
    shard = int(progress["data_shard"])
    if trainer.experiment.training.data_shard in (None, shard):
        # its own stream of batches, where it stood (a restarted trainer has a new peer
        # id, so a new derived shard: it goes on with the old one's)
        trainer.data_shard = shard
        if trainer.averager is not None:
            trainer.averager.data_shard = shard
        trainer.generator.set_state(progress["generator"].to(torch.uint8))
    else:
        logger.warning(
            "trainer state of data shard %d, training.data_shard says %d: drawing that "
            "shard's batches from its start",
            shard,
            trainer.data_shard,
        )
    trainer.version = state.updates
    trainer.tokens_trained = int(progress["tokens"])
    loss = progress.get("train_loss")
    return Resumed(
        path=path,
        step=int(progress["step"]),
        version=state.updates,
        tokens=int(progress["tokens"]),
        train_loss=None if loss is None else float(loss),
    )
