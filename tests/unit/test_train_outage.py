"""The trainer while no expert of a layer answers (every replica gone at once), in
virtual time: skipped steps do not count toward the steps asked for, the trainer backs
off and says so once, gives up after ``training.wait_for_experts_s`` without a step,
and a validation the swarm cannot answer leaves the last one measured standing in. And
a model that diverges mid-run: the run ends with its summary, the diverged weights not
saved over the last good state.

The "swarm" is the local model's experts made to raise ``NoExpertsAvailable`` while a
test says they are gone; the trainer's clock and pauses are a fake one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.words import write_words
from volunteerd.errors import ModelDiverging, NoExpertsAvailable
from volunteerd.moe import LocalMixtureOfExperts
from volunteerd.train import Experiment, Trainer, TrainSummary, build_model, load_corpus
from volunteerd.train.data import Corpus
from volunteerd.train.state import TrainerStateFolder

STEP_S = 0.1  # virtual seconds each forward pass takes


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return load_corpus(experiment(write_words(tmp_path_factory.mktemp("text"))).data)


def experiment(source: Path | str | None = None, **training: object) -> Experiment:
    return Experiment.model_validate(
        {
            "data": {"source": str(source or "python-stdlib"), "max_bytes": 100_000},
            "model": {
                "hidden_dim": 16,
                "num_blocks": 1,
                "num_heads": 2,
                "seq_len": 8,
                "grid": (2,),
                "k_best": 1,
            },
            "training": {"batch_size": 4, "eval_batches": 1, "eval_every": 10, **training},
        }
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def outage(monkeypatch: pytest.MonkeyPatch, clock: FakeClock) -> list[Callable[[], bool]]:
    """Set ``outage[0]`` to a predicate: while it holds, every forward of the mixture
    raises NoExpertsAvailable. Each forward takes STEP_S of the fake clock."""
    gone: list[Callable[[], bool]] = [lambda: False]
    original = LocalMixtureOfExperts.forward

    def forward(self: LocalMixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
        clock.advance(STEP_S)
        if gone[0]():
            raise NoExpertsAvailable(f"none of the experts chosen under {self.name}. answered")
        return original(self, x)

    monkeypatch.setattr(LocalMixtureOfExperts, "forward", forward)
    return gone


@pytest.fixture
def diverging(monkeypatch: pytest.MonkeyPatch) -> list[Callable[[], bool]]:
    """Set ``diverging[0]`` to a predicate: while it holds, every forward of the mixture
    raises ModelDiverging (as the output checks do when every answer is refused)."""
    when: list[Callable[[], bool]] = [lambda: False]
    original = LocalMixtureOfExperts.forward

    def forward(self: LocalMixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
        if when[0]():
            raise ModelDiverging(f"{self.name}: the layer's input is not finite")
        return original(self, x)

    monkeypatch.setattr(LocalMixtureOfExperts, "forward", forward)
    return when


def trainer(
    exp: Experiment, corpus: Corpus, clock: FakeClock, state: TrainerStateFolder | None = None
) -> Trainer:
    torch.manual_seed(0)
    t = Trainer(exp, build_model(exp, None), corpus, state=state)
    t.clock = clock
    t._pause = clock.advance  # type: ignore[method-assign]
    return t


def said(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


def test_skipped_steps_do_not_count_and_the_trainer_backs_off_saying_so_once(
    corpus: Corpus,
    clock: FakeClock,
    outage: list[Callable[[], bool]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # every expert gone for 60 s from the 15th step: before, each step was skipped as
    # fast as it failed (20 a second, a line each) and counted toward --steps
    t = trainer(experiment(corpus.source), corpus, clock)
    began = clock.now
    outage[0] = lambda: 15 * STEP_S + 1 < clock.now - began < 15 * STEP_S + 61
    with caplog.at_level(logging.INFO, logger="volunteerd.train.loop"):
        s = t.run(40)
    assert s.steps == t.version == 40, "40 steps taken, the skipped ones besides"
    # waits of 1, 2, 4, 8, 16, 30 s: 7 tries span the 60 s (one line, not one a step)
    assert 5 <= s.skipped_steps <= 8, s.skipped_steps
    assert len(said(caplog, "waiting for experts")) == 1
    assert "(1 step skipped so far)" in said(caplog, "waiting for experts")[0]
    assert len(said(caplog, "experts answer again")) == 1
    assert s.error == ""
    assert not s.interrupted
    assert [step for step, _ in s.val_curve] == [0, 10, 20, 30, 40]
    assert s.final_val_step == 40


def test_a_swarm_that_never_comes_back_ends_the_run_with_its_summary(
    corpus: Corpus,
    clock: FakeClock,
    outage: list[Callable[[], bool]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    exp = experiment(corpus.source, wait_for_experts_s=300)
    t = trainer(exp, corpus, clock)
    outage[0] = lambda: t.version >= 25  # gone for good after 25 steps
    began = clock.now
    with caplog.at_level(logging.INFO, logger="volunteerd.train.loop"):
        s = t.run(600)
    assert s.steps == 25
    assert not s.interrupted
    assert "no step taken for" in s.error
    assert "wait_for_experts_s = 300" in s.error
    assert 300 <= clock.now - began <= 310
    # a try every 30 s at most once the backoff is at its most: a handful, not thousands
    assert s.skipped_steps <= 16, s.skipped_steps
    assert len(said(caplog, "waiting for experts")) == 1
    # no validation after step 20 answered: the last one stands in, said to be from then
    assert s.val_curve[-1][0] == 20 == s.final_val_step
    assert s.final_val_loss == s.val_curve[-1][1]


def test_a_final_validation_without_experts_reports_the_last_one_measured(
    corpus: Corpus,
    clock: FakeClock,
    outage: list[Callable[[], bool]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the experts vanish after the last step: the final validation failed 5 times, and
    # its NoExpertsAvailable ended the run before any summary was written
    t = trainer(experiment(corpus.source), corpus, clock)
    outage[0] = lambda: t.version >= 25
    with caplog.at_level(logging.INFO, logger="volunteerd.train.loop"):
        s: TrainSummary = t.run(25)
    assert (s.steps, s.error, s.skipped_steps) == (25, "", 0)
    assert [step for step, _ in s.val_curve] == [0, 10, 20]
    assert (s.final_val_step, s.final_val_loss) == s.val_curve[-1]
    assert said(caplog, "final validation loss") == [
        f"final validation loss {s.final_val_loss:.3f} is from step 20"
    ]


@pytest.mark.parametrize("wait_s", [0, float("inf"), -1])
def test_waiting_for_experts_is_bounded(wait_s: float) -> None:
    with pytest.raises(ValueError, match="wait_for_experts_s"):
        Experiment.model_validate({"training": {"wait_for_experts_s": wait_s}})


def test_giving_up_on_the_swarm_exits_5_not_as_a_bug(capsys: pytest.CaptureFixture[str]) -> None:
    from volunteerd.cli import _training_ended
    from volunteerd.errors import ExitCode

    gave_up = SimpleNamespace(error="no step taken for 600 s", interrupted=False, diverged=False)
    assert _training_ended(gave_up) == ExitCode.UNAVAILABLE
    assert capsys.readouterr().err == "volunteerd: no step taken for 600 s\n"
    assert _training_ended(SimpleNamespace(error="", interrupted=True)) == ExitCode.INTERRUPTED
    assert _training_ended(SimpleNamespace(error="", interrupted=False)) == ExitCode.OK


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_model_that_diverges_ends_the_run_with_its_summary_and_keeps_the_last_good_state(
    corpus: Corpus,
    clock: FakeClock,
    diverging: list[Callable[[], bool]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    in_flight: int,
) -> None:
    # before, ModelDiverging escaped the run: exit 1, no summary, no final save
    exp = experiment(corpus.source, in_flight=in_flight)
    with TrainerStateFolder(tmp_path / "state", 10) as state:
        t = trainer(exp, corpus, clock, state)
        diverging[0] = lambda: t.version >= 25
        with caplog.at_level(logging.INFO, logger="volunteerd.train.loop"):
            s = t.run(100)
        assert s.diverged
        assert s.error.startswith("the model diverged at step ")
        assert "the layer's input is not finite" in s.error
        assert 25 <= s.steps <= 25 + in_flight
        assert not s.interrupted
        # the curve stops at the last validation that could be measured: step 20
        assert [step for step, _ in s.val_curve] == [0, 10, 20]
        assert len(said(caplog, "stopping: the model diverged")) == 1
        # saved every 10 updates: at 20 (or, with two steps back at once, 21)
        saved = state.saved_step
        assert 20 <= saved < 25
        assert said(
            caplog, f"the diverged weights are not saved: the state saved after step {saved}"
        )
    # the state the next run resumes from is the last good one
    with TrainerStateFolder(tmp_path / "state", 10) as state:
        resumed = Trainer(exp, build_model(exp, None), corpus, state=state).resumed
        assert resumed is not None
        assert resumed.step == saved


def test_a_model_that_diverges_at_a_validation_ends_the_run(
    corpus: Corpus, clock: FakeClock, diverging: list[Callable[[], bool]]
) -> None:
    t = trainer(experiment(corpus.source), corpus, clock)
    # validations run on the calling thread, steps on the trainer's pool
    on_main = threading.main_thread
    diverging[0] = lambda: t.version == 10 and threading.current_thread() is on_main()
    s = t.run(30)
    assert s.diverged
    assert s.error.startswith("the model diverged at step 10: ")
    assert s.steps == 10
    assert [step for step, _ in s.val_curve] == [0]


def test_a_diverged_run_exits_1_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from volunteerd.cli import _training_ended
    from volunteerd.errors import ExitCode

    diverged = SimpleNamespace(error="the model diverged at step 9: x", diverged=True)
    assert _training_ended(diverged) == ExitCode.ERROR
    assert capsys.readouterr().err == "volunteerd: the model diverged at step 9: x\n"


def test_a_trainer_started_before_its_swarm_answers_waits_for_it(
    corpus: Corpus,
    clock: FakeClock,
    outage: list[Callable[[], bool]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the first validation gave up after 5 tries 2 s apart: a trainer started while the
    # daemons were still joining exited 1 after ~10 s
    t = trainer(experiment(corpus.source), corpus, clock)
    began = clock.now
    outage[0] = lambda: clock.now - began < 45
    with caplog.at_level(logging.INFO, logger="volunteerd.train.loop"):
        s = t.run(10)
    assert s.steps == 10
    assert s.val_curve[0][0] == 0
    assert len(said(caplog, "waiting for experts")) == 1


def test_a_swarm_that_never_answers_ends_the_first_validation_after_the_wait(
    corpus: Corpus, clock: FakeClock, outage: list[Callable[[], bool]]
) -> None:
    t = trainer(experiment(corpus.source, wait_for_experts_s=120), corpus, clock)
    began = clock.now
    outage[0] = lambda: True
    with pytest.raises(NoExpertsAvailable):
        t.run(10)
    assert 120 <= clock.now - began <= 125


def test_the_progress_lines_expert_count_is_of_experts_answering_now(
    corpus: Corpus, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # it counted every expert that ever answered: a server gone mid-run (its 8 experts
    # unreachable, itself banned) still read "experts 32/32" (an outside audit)
    t = trainer(experiment(corpus.source), corpus, clock)
    answered = {f"ffn.{i}": 0 for i in range(4)}
    monkeypatch.setattr(t, "_by_uid", lambda: {u: [n, 0, 0] for u, n in answered.items()})
    counts = []
    for step in range(1, 31):
        for uid in answered:
            if uid != "ffn.3" or step <= 10:  # ffn.3's server gone after step 10
                answered[uid] += 1
        counts.append(t._answering(step))
    assert counts[:10] == [4] * 10
    assert counts[10:19] == [4] * 9, "answered within the last 10 steps"
    assert counts[20:] == [3] * 10
