"""A trainer's own state (volunteerd.train.state): saved, and resumed from on the next
start bit for bit; a damaged newest file set aside for the one before it; a state of
another model refused; one trainer per folder.

An outside audit killed a trainer at step 60 (validation loss 3.157) and restarted it:
it began again at step 0, loss 5.001, from the seed. These tests train the local model
(no swarm), whose steps are deterministic, so "continues where it stopped" is checked
as equal weights.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.words import write_words
from volunteerd.errors import ConfigError, ResourceUnavailable
from volunteerd.train import Experiment, Trainer, build_model, load_corpus
from volunteerd.train.data import Corpus
from volunteerd.train.state import TrainerStateFolder, default_state_dir


def experiment(
    source: Path | str = "python-stdlib", hidden: int = 16, **training: Any
) -> Experiment:
    return Experiment.model_validate(
        {
            "name": "state-test",
            "data": {"source": str(source), "max_bytes": 100_000, "val_every": 2},
            "model": {
                "hidden_dim": hidden,
                "num_blocks": 1,
                "num_heads": 2,
                "seq_len": 8,
                "grid": (2,),
                "k_best": 1,
                "spot_check": 0.0,
            },
            "training": {"batch_size": 4, "eval_batches": 1, "eval_every": 5, **training},
        }
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return load_corpus(experiment(write_words(tmp_path_factory.mktemp("text"))).data)


def trainer(
    exp: Experiment, corpus: Corpus, state: TrainerStateFolder | None, seed: int = 0
) -> Trainer:
    torch.manual_seed(seed)
    return Trainer(exp, build_model(exp, None), corpus, state=state)


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


def optimizer_states(t: Trainer) -> list[dict[int, dict[str, torch.Tensor]]]:
    optimizers = [t.optimizer] + ([t.expert_optimizer] if t.expert_optimizer else [])
    return [o.state_dict()["state"] for o in optimizers]


def assert_same(a: Any, b: Any) -> None:
    """Equal bit for bit: tensors (same dtype, shape and bytes), nested in dicts/lists."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert torch.equal(
            a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
        )
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_a_restarted_trainer_continues_where_it_stopped_bit_for_bit(
    corpus: Corpus, tmp_path: Path
) -> None:
    exp = experiment(corpus.source, save_every_steps=4)
    # one trainer straight through 10 steps
    reference = trainer(exp, corpus, None)
    reference.run(10)

    folder = tmp_path / "state"
    with TrainerStateFolder(folder, 4) as state:
        first = trainer(exp, corpus, state)
        assert first.resumed is None
        s1 = first.run(6)
        # saved at update 4 and on the way out, at 6: the newest two kept
        assert len(state.files()) == 2
        saved_weights, saved_optim = weights(first), optimizer_states(first)
        saved_generator = first.generator.get_state()

    with TrainerStateFolder(folder, 4) as state:
        # another seed: what it holds after loading comes from the folder alone
        second = trainer(exp, corpus, state, seed=1)
        assert second.resumed is not None
        assert (second.resumed.step, second.resumed.version) == (6, 6)
        assert second.version == 6
        assert second.tokens_trained == first.tokens_trained
        assert_same(weights(second), saved_weights)
        assert_same(optimizer_states(second), saved_optim)
        assert torch.equal(second.generator.get_state(), saved_generator)
        s2 = second.run(10)

    assert s1.started_from == "seed"
    assert s2.started_from == "state"
    assert s2.started_from_step == 6
    assert s2.started_from_version == 6
    assert s2.state_file.endswith(".ckpt")
    # steps count from where it stopped: 4 more, validation at 6 (the start) and 10
    assert s2.steps == 4
    assert [step for step, _ in s2.val_curve] == [6, 10]
    assert second.version == 10
    assert_same(weights(second), weights(reference))
    assert_same(optimizer_states(second), optimizer_states(reference))


def test_a_clean_stop_saves_the_state(corpus: Corpus, tmp_path: Path) -> None:
    exp = experiment(corpus.source, save_every_steps=1000)
    stop = threading.Event()
    with TrainerStateFolder(tmp_path / "state", 1000) as state:
        t = trainer(exp, corpus, state)
        original = t._apply

        def apply_then_stop(step: Any) -> float | None:
            loss = original(step)
            if t.version == 3:
                stop.set()  # what Ctrl-C or SIGTERM does
            return loss

        t.stop = stop
        t._apply = apply_then_stop  # type: ignore[method-assign]
        summary = t.run(100)
        assert summary.interrupted
        assert len(state.files()) == 1
        resumed = trainer(exp, corpus, state).resumed
    assert resumed is not None
    assert resumed.step == 3
    assert resumed.version == 3


def test_a_damaged_newest_state_is_set_aside_and_the_one_before_used(
    corpus: Corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    exp = experiment(corpus.source, save_every_steps=2)
    folder = tmp_path / "state"
    with TrainerStateFolder(folder, 2) as state:
        trainer(exp, corpus, state).run(5)  # saves at 2, 4 and 5: keeps 4 and 5
        newest, older = state.files()
        data = bytearray(newest.read_bytes())
        data[-10] ^= 0xFF
        newest.write_bytes(bytes(data))

        resumed = trainer(exp, corpus, state).resumed
        assert resumed is not None
        assert resumed.path == older
        assert resumed.step == 4
        assert not newest.exists()
        assert newest.with_name(newest.name + ".damaged").is_file()
        assert "payload checksum mismatch" in caplog.text

        # every file damaged: the seed, not a crash
        older.write_bytes(b"not a checkpoint")
        assert trainer(exp, corpus, state).resumed is None


def test_a_state_of_another_model_is_refused_naming_the_folder(
    corpus: Corpus, tmp_path: Path
) -> None:
    folder = tmp_path / "state"
    with TrainerStateFolder(folder, 2) as state:
        trainer(experiment(corpus.source, save_every_steps=2), corpus, state).run(2)
        wider = experiment(corpus.source, hidden=32, save_every_steps=2)
        with pytest.raises(ConfigError) as refused:
            trainer(wider, corpus, state)
        message = str(refused.value)
        assert "\n" not in message
        assert str(folder) in message
        assert "not of this experiment" in message
        assert "[256, 16] float32 saved, this model's is [256, 32] float32" in message
        # nothing loaded, nothing deleted
        assert len(state.files()) == 1


def test_a_second_trainer_on_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    with (
        TrainerStateFolder(folder, 2),
        pytest.raises(ResourceUnavailable, match="another trainer is using"),
    ):
        TrainerStateFolder(folder, 2).__enter__()
    with TrainerStateFolder(folder, 2):  # released
        pass


def test_the_default_folder_is_named_after_the_experiment(tmp_path: Path) -> None:
    assert default_state_dir(tmp_path, "stdlib-chars") == tmp_path / "stdlib-chars"
    odd = default_state_dir(tmp_path, "../a b")
    assert odd.parent == tmp_path
    assert "/" not in odd.name
    assert odd.name != ".."


def test_with_several_batches_in_flight_the_steps_still_count_on(
    corpus: Corpus, tmp_path: Path
) -> None:
    exp = experiment(corpus.source, in_flight=3, save_every_steps=2)
    with TrainerStateFolder(tmp_path / "state", 2) as state:
        first = trainer(exp, corpus, state).run(7)
        second = trainer(exp, corpus, state)
        assert second.resumed is not None
        assert second.resumed.step == 7
        summary = second.run(9)
    assert first.steps == 7
    assert summary.steps == 2
    assert summary.val_curve[0][0] == 7
    assert summary.val_curve[-1][0] == 9
