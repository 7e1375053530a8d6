"""The simulator's calibration: compute seconds measured with the production code (the
expert backend, the experiment's model, the codecs and a memory RPC round trip), kept
in a JSON file so that a run need not measure again."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from volunteerd.sim.calibration import Calibration, load_or_measure, measure
from volunteerd.train import Experiment, ModelConfig, TrainingConfig

# small enough to measure in a few seconds on a loaded 2-core machine
SMALL = Experiment(
    model=ModelConfig(hidden_dim=64, num_heads=2, seq_len=16, grid=(2, 2)),
    training=TrainingConfig(batch_size=4),
)

SAMPLE = Calibration(
    forward_s=(1e-4, 2e-6),
    backward_s=(2e-4, 4e-6),
    trainer_step_s=0.05,
    server_request_s=1e-3,
    client_request_s=2e-3,
    cores=2,
    machine="test cpu; torch 0",
    inference_s=(5e-5, 1e-6),
    optimizer_step_s=3e-4,
    trainer_forward_s=0.02,
    transport="memory",
    request_bytes=524_288,
    request_byte_s=1e-9,
)


@pytest.fixture(scope="module")
def measured() -> Calibration:
    return measure(SMALL, repeats=3)


def test_measured_seconds_are_positive_and_grow_with_rows(measured: Calibration) -> None:
    for a, b in (measured.forward_s, measured.backward_s, measured.inference_s):
        assert a >= 0
        assert b > 0
    for seconds in (
        measured.trainer_step_s,
        measured.trainer_forward_s,
        measured.server_request_s,
        measured.client_request_s,
        measured.optimizer_step_s,
    ):
        assert math.isfinite(seconds)
        assert seconds > 0
    assert measured.expert_forward_s(512) > measured.expert_forward_s(16)
    assert measured.expert_backward_s(512) > measured.expert_backward_s(16)
    assert measured.cores >= 1
    assert "torch" in measured.machine
    assert measured.transport == "memory"
    # 4 experts a request, of batch tokens * k_best / experts = 4 * 16 * 2 / 4 rows each
    assert measured.request_bytes == 2 * 4 * 32 * 64 * 4
    assert measured.request_byte_s >= 0


def test_request_overheads_scale_with_bytes_around_the_typical_request() -> None:
    typical = SAMPLE.request_bytes
    assert SAMPLE.server_request_s_for(typical) == SAMPLE.server_request_s
    assert SAMPLE.client_request_s_for(typical) == SAMPLE.client_request_s
    more = SAMPLE.server_request_s_for(typical + 1_000_000)
    assert more == pytest.approx(SAMPLE.server_request_s + 1e-3)
    assert SAMPLE.client_request_s_for(0) == pytest.approx(SAMPLE.client_request_s - typical * 1e-9)
    assert SAMPLE.server_request_s_for(0) >= 0


@pytest.mark.slow
def test_request_overheads_measured_over_real_libp2p() -> None:
    over_libp2p = measure(SMALL, repeats=3, transport="libp2p")
    assert over_libp2p.transport == "libp2p"
    assert over_libp2p.server_request_s > 0
    assert over_libp2p.client_request_s > 0
    assert over_libp2p.request_byte_s >= 0


def test_json_round_trip_is_exact(measured: Calibration) -> None:
    for calibration in (SAMPLE, measured):
        text = json.dumps(calibration.to_json())
        assert Calibration.from_json(json.loads(text)) == calibration


def test_json_without_the_optional_fields_reads_them_as_zero() -> None:
    data = SAMPLE.to_json()
    optional = (
        "inference_s",
        "optimizer_step_s",
        "trainer_forward_s",
        "transport",
        "request_bytes",
        "request_byte_s",
    )
    for key in optional:
        del data[key]
    assert Calibration.from_json(data) == replace(
        SAMPLE,
        inference_s=(0.0, 0.0),
        optimizer_step_s=0.0,
        trainer_forward_s=0.0,
        transport="memory",
        request_bytes=0,
        request_byte_s=0.0,
    )


def test_json_missing_a_field_is_refused() -> None:
    data = SAMPLE.to_json()
    del data["forward_s"]
    with pytest.raises(ValueError, match="not a calibration"):
        Calibration.from_json(data)


def test_cached_file_is_loaded_without_measuring(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(SAMPLE.to_json()))
    # the sample's made-up numbers come back: nothing was measured
    assert load_or_measure(path, SMALL) == SAMPLE


def test_missing_or_unreadable_cache_is_measured_and_written(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "calibration.json"
    first = load_or_measure(path, SMALL)
    assert first.machine != SAMPLE.machine
    assert Calibration.from_json(json.loads(path.read_text())) == first
    path.write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    again = load_or_measure(path, SMALL)
    assert Calibration.from_json(json.loads(path.read_text())) == again
