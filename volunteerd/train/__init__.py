"""Training on the swarm: experiments, data, the model and the loop."""

from __future__ import annotations

from volunteerd.train.data import Corpus, load_corpus
from volunteerd.train.experiment import (
    DataConfig,
    Experiment,
    ModelConfig,
    TrainingConfig,
    load_experiment,
)
from volunteerd.train.loop import Trainer, TrainSummary, build_model, expert_config
from volunteerd.train.model import MoETransformerLM
from volunteerd.train.progress import Progress

__all__ = [
    "Corpus",
    "DataConfig",
    "Experiment",
    "MoETransformerLM",
    "ModelConfig",
    "Progress",
    "TrainSummary",
    "Trainer",
    "TrainingConfig",
    "build_model",
    "expert_config",
    "load_corpus",
    "load_experiment",
]
