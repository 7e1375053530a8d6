"""Training on the swarm: experiments, data, the model and the loop."""

from __future__ import annotations

from volunteerd.train.averaging import (
    AveragingStatistics,
    TrainerAverager,
    TrainerNetwork,
    start_averaging,
)
from volunteerd.train.data import Corpus, load_corpus
from volunteerd.train.experiment import (
    AveragingConfig,
    DataConfig,
    Experiment,
    ModelConfig,
    SwarmConfig,
    TrainingConfig,
    load_experiment,
)
from volunteerd.train.loop import Trainer, TrainSummary, build_model, expert_config
from volunteerd.train.model import MoETransformerLM
from volunteerd.train.progress import Progress

__all__ = [
    "AveragingConfig",
    "AveragingStatistics",
    "Corpus",
    "DataConfig",
    "Experiment",
    "MoETransformerLM",
    "ModelConfig",
    "Progress",
    "SwarmConfig",
    "TrainSummary",
    "Trainer",
    "TrainerAverager",
    "TrainerNetwork",
    "TrainingConfig",
    "build_model",
    "expert_config",
    "load_corpus",
    "load_experiment",
    "start_averaging",
]
