"""Expert checkpoints: bit-exact round trips, and a damaged, partial or foreign file is
never loaded: the previous good one is, and the log says which was skipped and why. A
broken state is never written."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from volunteerd.checkpoint_folders import OTHERS_KEPT, trim_others
from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.config.models import CheckpointConfig
from volunteerd.experts import ExpertBackend, checkpoint_file, to_wire
from volunteerd.experts.checkpoint_file import (
    MAGIC,
    CheckpointError,
    CheckpointStore,
    decode_checkpoint,
    encode_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from volunteerd.runtime import ExpertRuntime
from volunteerd.runtime.checkpointer import Checkpointer
from volunteerd.wire import WireTensor

UID = "ffn.0.1"
HIDDEN = 16


def two_experts(experts: ExpertsConfig) -> ExpertRuntime:
    """A CPU runtime of ffn.0.0 and ffn.0.1 built from ``experts``."""
    return ExpertRuntime(
        ["ffn.0.0", "ffn.0.1"], experts, RuntimeConfig(device="cpu"), WireLimits(),
        torch.device("cpu"),
    )  # fmt: skip


def backend(optimizer: str = "adam", hidden: int = HIDDEN, uid: str = UID) -> ExpertBackend:
    config = ExpertsConfig(hidden_dim=hidden, optimizer={"name": optimizer, "lr": 0.01})
    return ExpertBackend(uid, config, torch.device("cpu"), 1024)


def train(b: ExpertBackend, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, b.info.hidden_dim, generator=generator)
        g = torch.randn(8, b.info.hidden_dim, generator=generator)
        b.backward([x], [g])
        b.step()


def assert_same_state(a: ExpertBackend, b: ExpertBackend) -> None:
    sa, sb = a.state(), b.state()
    assert sa.updates == sb.updates
    assert list(sa.params) == list(sb.params)
    for name in sa.params:
        assert torch.equal(sa.params[name], sb.params[name]), name
    assert sa.optimizer_state.keys() == sb.optimizer_state.keys()
    for index, entry in sa.optimizer_state.items():
        assert entry.keys() == sb.optimizer_state[index].keys()
        for key, value in entry.items():
            assert torch.equal(value, sb.optimizer_state[index][key]), (index, key)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_round_trip_is_bit_exact_and_training_continues_identically(
    tmp_path: Path, optimizer: str
) -> None:
    original = backend(optimizer)
    train(original, 5, seed=1)
    store = CheckpointStore(tmp_path)
    path = store.save(original.state())

    restored = backend(optimizer)
    state = read_checkpoint(path)
    restored.load_state(state)
    assert restored.updates == 5
    assert_same_state(original, restored)
    if optimizer == "adam":
        assert set(state.optimizer_state[0]) == {"step", "exp_avg", "exp_avg_sq"}

    train(original, 3, seed=2)
    train(restored, 3, seed=2)
    assert_same_state(original, restored)


def test_hyperparameters_come_from_the_config_not_the_file(tmp_path: Path) -> None:
    trained = backend()
    train(trained, 2, seed=0)
    path = CheckpointStore(tmp_path).save(trained.state())
    config = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.5})
    other = ExpertBackend(UID, config, torch.device("cpu"), 1024)
    other.load_state(read_checkpoint(path))
    assert other.optimizer.param_groups[0]["lr"] == 0.5


def test_a_file_holds_no_pickle_only_a_header_and_raw_bytes(tmp_path: Path) -> None:
    b = backend()
    path = CheckpointStore(tmp_path).save(b.state())
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    header_len = int.from_bytes(data[8:12], "little")
    header = json.loads(data[44 : 44 + header_len])
    assert header["uid"] == UID
    assert header["expert_type"] == "ffn"
    assert header["hidden_dim"] == HIDDEN
    names = [t["name"] for t in header["tensors"]]
    assert names[:2] == ["param/norm.weight", "param/norm.bias"]
    assert header["payload_bytes"] == len(data) - 44 - header_len
    assert b"\x80\x04" not in data[:12]  # no pickle protocol marker at the start


def saved_twice(tmp_path: Path) -> tuple[CheckpointStore, ExpertBackend, Path, Path]:
    """Two checkpoints of the same expert, after 2 and after 4 updates."""
    store = CheckpointStore(tmp_path, keep=3)
    b = backend()
    train(b, 2, seed=0)
    older = store.save(b.state())
    train(b, 2, seed=1)
    newer = store.save(b.state())
    return store, b, older, newer


def test_the_newest_good_checkpoint_is_loaded(tmp_path: Path) -> None:
    store, _, _, newer = saved_twice(tmp_path)
    found = store.load_newest(UID, backend().check_state)
    assert found is not None
    state, path = found
    assert path == newer
    assert state.updates == 4


def test_truncated_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, _, older, newer = saved_twice(tmp_path)
    data = newer.read_bytes()
    newer.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING):
        found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == older
    assert found[0].updates == 2
    assert f"skipping checkpoint {newer}" in caplog.text
    assert "payload is" in caplog.text  # says why


@pytest.mark.parametrize(
    ("where", "reason"), [("payload", "payload checksum mismatch"), ("header", "header checksum")]
)
def test_flipped_byte_is_caught_by_the_checksum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str, reason: str
) -> None:
    store, _, older, newer = saved_twice(tmp_path)
    data = bytearray(newer.read_bytes())
    data[-5 if where == "payload" else 60] ^= 0x01
    newer.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=reason):
        read_checkpoint(newer)
    with caplog.at_level(logging.WARNING):
        found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == older
    assert reason in caplog.text


def test_wrong_schema_or_foreign_file_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, _, older, newer = saved_twice(tmp_path)
    # A well-formed checkpoint of another size of expert, under this uid's name.
    write_checkpoint(newer, backend(hidden=HIDDEN * 2).state())
    with caplog.at_level(logging.WARNING):
        found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == older
    assert "ffn of width 32, this expert is ffn of width 16" in caplog.text

    # Not a checkpoint at all, and one of a format version we do not know.
    newer.write_bytes(b"PK\x03\x04 this is a zip file, maybe torch.save output")
    with pytest.raises(CheckpointError, match="bad magic"):
        read_checkpoint(newer)


def test_another_experts_checkpoint_is_not_loaded(tmp_path: Path) -> None:
    store, _, older, newer = saved_twice(tmp_path)
    write_checkpoint(newer, backend(uid="ffn.3.3").state())
    found = store.load_newest(UID)
    assert found is not None
    assert found[1] == older


def test_non_finite_weights_are_not_loaded(tmp_path: Path) -> None:
    store, b, older, newer = saved_twice(tmp_path)
    state = b.state()
    state.params["up.weight"][0, 0] = float("nan")
    write_checkpoint(newer, state)
    found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == older


def test_leftover_temp_file_is_removed_and_the_last_good_one_used(tmp_path: Path) -> None:
    store, _, _, newer = saved_twice(tmp_path)
    # What SIGKILL during a save leaves: a half-written temporary next to the good ones.
    tmp = newer.with_name("000000000003.ckpt.tmp")
    tmp.write_bytes(newer.read_bytes()[:100])
    assert store.remove_temporaries() == 1
    assert not tmp.exists()
    found = store.load_newest(UID)
    assert found is not None
    assert found[1] == newer


def test_only_the_newest_keep_files_stay(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    b = backend()
    paths = []
    for seed in range(4):
        train(b, 1, seed)
        paths.append(store.save(b.state()))
    assert store.files(UID) == [paths[3], paths[2]]
    assert [p.name for p in paths] == [f"{i:012d}.v2.ckpt" for i in range(1, 5)]


def test_no_good_checkpoint_means_none(tmp_path: Path) -> None:
    store, _, older, newer = saved_twice(tmp_path)
    for path in (older, newer):
        path.write_bytes(path.read_bytes()[:-1])
    assert store.load_newest(UID) is None
    assert CheckpointStore(tmp_path / "nothing").load_newest(UID) is None


def test_load_refuses_a_misfit_without_changing_anything() -> None:
    b = backend()
    before = b.state()
    with pytest.raises(CheckpointError):
        b.load_state(backend(hidden=HIDDEN * 2).state())
    assert_same_state_values(before.params, b.state().params)
    assert b.revision == 0


def _adam_entry(entry: dict[str, torch.Tensor], lie: str) -> dict[str, torch.Tensor]:
    if lie == "step_not_one_number":
        return {**entry, "step": torch.tensor([3.0, 3.0])}
    if lie == "step_negative":
        return {**entry, "step": torch.tensor(-1.0)}
    if lie == "step_an_integer":
        return {**entry, "step": torch.tensor(3)}
    if lie == "buffer_missing":
        return {k: v for k, v in entry.items() if k != "exp_avg"}
    if lie == "buffer_unknown":
        return {**entry, "junk": torch.zeros_like(entry["exp_avg"])}
    if lie == "buffer_integer":
        return {**entry, "exp_avg": entry["exp_avg"].to(torch.int32)}
    assert lie == "squares_negative"
    return {**entry, "exp_avg_sq": -entry["exp_avg_sq"] - 1}


@pytest.mark.parametrize(
    "lie",
    [
        "step_not_one_number",
        "step_negative",
        "step_an_integer",
        "buffer_missing",
        "buffer_unknown",
        "buffer_integer",
        "squares_negative",
    ],
)
def test_an_optimizer_state_the_next_step_would_choke_on_is_refused(lie: str) -> None:
    """A replica's state comes from a stranger: an Adam state whose next step would
    raise (and so fail every expert stepped in the same pass) or turn the weights
    non-finite is refused whole, and the expert keeps stepping."""
    source, b = backend(), backend()
    train(source, 2, seed=1)
    state = source.state()
    state.optimizer_state = {i: _adam_entry(e, lie) for i, e in state.optimizer_state.items()}
    before = b.state()
    with pytest.raises(CheckpointError, match="optimizer"):
        b.load_state(state)
    assert_same_state_values(before.params, b.state().params)
    train(b, 1, seed=2)
    assert b.updates == 1


def test_an_sgd_state_without_momentum_buffers_is_fine() -> None:
    source, b = backend("sgd"), backend("sgd")
    train(source, 2, seed=1)
    state = source.state()
    state.optimizer_state = {i: {} for i in state.optimizer_state}
    b.load_state(state)
    train(b, 1, seed=2)
    assert all(torch.isfinite(p).all() for p in b.module.parameters())


def assert_same_state_values(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(a[k], b[k]) for k in a)


async def test_checkpointer_saves_changed_experts_and_restores_them(tmp_path: Path) -> None:
    experts = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.01})

    def runtime() -> ExpertRuntime:
        return two_experts(experts)

    config = CheckpointConfig(every_s=60, keep=2)
    first = runtime()
    saver = Checkpointer(first, tmp_path, config)
    assert await saver.restore() == {}
    assert await saver.save_changed() == 0  # seeded weights: a function of the config
    await first.with_expert("ffn.0.1", lambda b: train(b, 3, seed=7))
    assert await saver.save_changed() == 1
    assert await saver.save_changed() == 0  # nothing changed since
    await first.with_expert("ffn.0.1", lambda b: train(b, 1, seed=8))
    await first.with_expert("ffn.0.0", lambda b: train(b, 1, seed=9))
    assert await saver.save_changed() == 2
    assert saver.statistics().saves == 3

    second = runtime()
    loaded = await Checkpointer(second, tmp_path, config).restore()
    assert sorted(loaded) == ["ffn.0.0", "ffn.0.1"]
    assert loaded["ffn.0.1"].name == "000000000002.v2.ckpt"
    assert second.backend("ffn.0.1").updates == 4
    assert_same_state(first.backend("ffn.0.1"), second.backend("ffn.0.1"))


def test_a_non_finite_state_is_never_written_and_the_good_files_stay(tmp_path: Path) -> None:
    store, b, older, newer = saved_twice(tmp_path)
    state = b.state()
    # What the attack of issue 12 left: finite weights, an infinite Adam second moment.
    state.optimizer_state[2]["exp_avg_sq"][0, 0] = float("inf")
    assert state.non_finite() == ["optim/2/exp_avg_sq"]
    with pytest.raises(CheckpointError, match="optim/2/exp_avg_sq not finite"):
        store.save(state)
    assert store.files(UID) == [newer, older]
    found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == newer


async def test_checkpointer_refuses_a_broken_state_once_and_keeps_the_last_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    experts = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.01})

    def runtime() -> ExpertRuntime:
        return ExpertRuntime(
            [UID], experts, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
        )

    config = CheckpointConfig(every_s=60, keep=2)
    first = runtime()
    saver = Checkpointer(first, tmp_path, config)
    await saver.restore()
    await first.with_expert(UID, lambda b: train(b, 3, seed=7))
    assert await saver.save_changed() == 1
    good = saver.store.files(UID)

    def wreck(b: ExpertBackend) -> None:  # weights broken by something other than a step
        with torch.no_grad():
            b.module.up.weight[0, 0] = float("nan")  # type: ignore[index]
        b.updates += 1

    await first.with_expert(UID, wreck)
    with caplog.at_level(logging.ERROR):
        assert await saver.save_changed() == 0
    assert "up.weight not finite; its last good checkpoint stays" in caplog.text
    assert await saver.save_changed() == 0  # the same broken state is not tried again
    assert saver.statistics().refused == 1
    assert saver.store.files(UID) == good

    second = runtime()
    loaded = await Checkpointer(second, tmp_path, config).restore()
    assert loaded == {UID: good[0]}
    assert second.backend(UID).updates == 3


async def test_an_undone_step_never_reaches_a_checkpoint(tmp_path: Path) -> None:
    """A backward whose step the runtime undoes (SGD, gradients just under the guard's
    bound) changes nothing a checkpoint could see: nothing new is written."""
    experts = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "sgd", "lr": 0.01})
    run = ExpertRuntime(
        [UID], experts, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )
    saver = Checkpointer(run, tmp_path, CheckpointConfig(every_s=60, keep=2))

    def wire(t: torch.Tensor) -> WireTensor:
        meta, data = to_wire(t)
        return WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))

    async with trio.open_nursery() as nursery:
        await nursery.start(run.serve)
        await saver.restore()
        x = torch.randn(1, HIDDEN)
        await run.backward(UID, [wire(x), wire(torch.randn(1, HIDDEN) * 0.01)], peer_id="a")
        await run.settled()
        assert await saver.save_changed() == 1
        before = run.backend(UID).state()
        await run.backward(UID, [wire(x), wire(torch.full((1, HIDDEN), 9e5))], peer_id="b")
        await run.settled()
        assert run.guard.undone == {(UID, "too_large_step"): 1}
        assert await saver.save_changed() == 0
        found = saver.store.load_newest(UID)
        assert found is not None
        assert all(torch.equal(found[0].params[k], before.params[k]) for k in before.params)
        run.close()


async def test_checkpoints_stay_within_the_disk_budget(tmp_path: Path) -> None:
    """Over the budget, older checkpoints go first (each expert keeps its newest); a
    save that cannot fit is skipped with one warning, and saving resumes once the
    budget is raised. Downloaded shards count too."""
    from volunteerd.config import RuntimeConfig, WireLimits

    experts = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.01})
    uids = ["ffn.0.0", "ffn.0.1"]
    runtime = ExpertRuntime(
        uids, experts, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )
    checkpoints, downloads = tmp_path / "checkpoints", tmp_path / "downloads"
    budget = [0]
    warnings: list[str] = []
    saver = Checkpointer(
        runtime,
        checkpoints,
        CheckpointConfig(keep=3),
        budget_bytes=lambda: budget[0],
        also_counted=[downloads],
        on_warning=warnings.append,
    )

    async def step_all(seed: int) -> int:
        for uid in uids:
            await runtime.with_expert(uid, lambda b: train(b, 1, seed=seed))
        return await saver.save_changed()

    def kept() -> list[int]:
        return [len(saver.store.files(uid)) for uid in uids]

    def disk() -> int:
        return sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())

    for seed in range(3):  # no budget: keep = 3 files each
        assert await step_all(seed) == 2
    assert kept() == [3, 3]
    size = saver.store.files("ffn.0.0")[0].stat().st_size

    budget[0] = 3 * size + size // 2  # room for the newest of each and one more
    assert await step_all(3) == 2
    assert disk() <= budget[0]
    assert sorted(kept()) == [1, 2]
    newest = {uid: saver.store.files(uid)[0] for uid in uids}
    assert all(saver.store.load_newest(uid) is not None for uid in uids)

    budget[0] = size + size // 2  # not even the newest of each: nothing is saved
    assert await step_all(4) == 0
    assert await step_all(5) == 0
    assert {uid: saver.store.files(uid)[0] for uid in uids} == newest  # nothing lost
    assert len(warnings) == 1  # once, not at every round
    assert "disk budget" in warnings[0]
    assert saver.statistics().over_budget == 4

    budget[0] = 10 * size  # raised: saving again
    assert await step_all(6) == 2
    assert {uid: saver.store.files(uid)[0] for uid in uids} != newest

    # a large download takes the room: the checkpoints wait, the shard is not touched
    downloads.mkdir()
    (downloads / "ffn.0.7.ckpt").write_bytes(b"\0" * 9 * size)
    assert await step_all(7) == 0
    assert (downloads / "ffn.0.7.ckpt").exists()
    assert len(warnings) == 2


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**41], [2**63, 0]])
def test_a_tensor_of_no_bytes_and_an_absurd_dimension_is_refused(shape: list[int]) -> None:
    """Zero bytes pass every size check; torch.empty overflowed on the dimension and the
    TypeError of a replica's state escaped the joiner (which then tried no other)."""
    pieces = encode_checkpoint(backend().state())
    header = json.loads(bytes(pieces[1]))
    header["tensors"].append({"name": "param/extra", "dtype": "float32", "shape": shape})
    raw = json.dumps(header).encode()
    magic = bytes(pieces[0])[:8]  # the format the state was encoded in
    prefix = checkpoint_file._PREFIX.pack(magic, len(raw), hashlib.sha256(raw).digest())
    with pytest.raises(CheckpointError, match="bad header: tensors"):
        decode_checkpoint(b"".join([prefix, raw, *(bytes(p) for p in pieces[2:])]))


def _with_header(data: bytes, change: Callable[[dict[str, Any]], object]) -> bytes:
    """A checkpoint's bytes with its header changed by ``change``, its checksum right."""
    prefix = checkpoint_file._PREFIX
    magic, size, _ = prefix.unpack_from(data)
    header = json.loads(data[prefix.size : prefix.size + size])
    change(header)
    raw = json.dumps(header).encode()
    return (
        prefix.pack(magic, len(raw), hashlib.sha256(raw).digest())
        + raw
        + data[prefix.size + size :]
    )


@pytest.mark.parametrize("digit", ["\u00b2", "\u0660"])  # superscript two, Arabic-Indic zero
def test_an_optimizer_index_of_digits_not_ascii_is_a_damaged_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, digit: str
) -> None:
    """``str.isdigit()`` takes "²", which ``int()`` refuses: the ValueError left
    ``load_newest``, which sets aside only CheckpointErrors (a fuzzing audit)."""

    def rename(header: dict[str, Any]) -> None:
        entry = next(e for e in header["tensors"] if e["name"].startswith("optim/0/"))
        entry["name"] = entry["name"].replace("optim/0/", f"optim/{digit}/")

    store, _, older, newer = saved_twice(tmp_path)
    newer.write_bytes(_with_header(newer.read_bytes(), rename))
    with pytest.raises(CheckpointError, match="unexpected tensor name"):
        read_checkpoint(newer)
    with caplog.at_level(logging.WARNING):
        found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == older
    assert f"skipping checkpoint {newer}" in caplog.text


@pytest.mark.parametrize("saved_at", [math.nan, math.inf, -math.inf, -1e308])
def test_a_header_saved_at_no_time_is_damaged(tmp_path: Path, saved_at: float) -> None:
    """A NaN ``saved_at`` is in no comparison of ages: an expert restored from an old
    file was not held back until caught up, and served at once (a fuzzing audit)."""

    def stamp(header: dict[str, Any]) -> None:
        header["saved_at"] = saved_at

    store, _, older, newer = saved_twice(tmp_path)
    newer.write_bytes(_with_header(newer.read_bytes(), stamp))
    with pytest.raises(CheckpointError, match="saved_at"):
        read_checkpoint(newer)
    found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == older


@pytest.mark.parametrize("name", ["9.v2.ckpt\n", "\u0669.v2.ckpt"])
def test_a_file_named_like_a_checkpoint_but_for_a_newline_or_its_digits_is_none(
    tmp_path: Path, name: str
) -> None:
    """``^\\d...$`` took a name ending in a newline, and Arabic-Indic digits (which
    ``int()`` reads): such a file was loaded before the newest of ours, or deleted as
    one of ours."""
    store, _, _, newer = saved_twice(tmp_path)
    odd = newer.with_name(name)
    odd.write_bytes(newer.read_bytes())
    found = store.load_newest(UID, backend().check_state)
    assert found is not None
    assert found[1] == newer
    for _ in range(4):  # past checkpoints.keep (3): the oldest of ours are deleted
        store.save(backend().state())
    assert not newer.exists()
    assert odd.exists()


@pytest.mark.parametrize("nested", ["header", "field"])
def test_a_header_nested_past_the_recursion_limit_is_a_checkpoint_error(nested: str) -> None:
    """Its version was read with ``json.loads`` before the strict check: a header of
    100k brackets, checksum right, raised RecursionError, no CheckpointError."""
    data = b"".join(bytes(p) for p in encode_checkpoint(backend().state()))
    prefix = checkpoint_file._PREFIX
    deep = b"[" * 100_000 + b"]" * 100_000
    raw = deep if nested == "header" else b'{"version": 1, "x": ' + deep + b"}"
    magic = data[:8]
    bad = prefix.pack(magic, len(raw), hashlib.sha256(raw).digest()) + raw
    with pytest.raises(CheckpointError, match="bad header"):
        decode_checkpoint(bad)


def test_a_checkpoint_of_another_projects_expert_of_the_same_name_is_refused(
    tmp_path: Path,
) -> None:
    """Checkpoints are kept by uid: after leaving project A and joining B (both naming
    their experts ffn.*), B's ffn.0.0 started from A's trained weights."""
    a = backend()
    a.experiment = "12D3KooWownerA/proj-a"
    train(a, 3, seed=1)
    store = CheckpointStore(tmp_path)
    store.save(a.state())
    kept = read_checkpoint(store.files(UID)[0])
    assert kept.experiment == "12D3KooWownerA/proj-a"
    b = backend()
    b.experiment = "12D3KooWownerB/proj-b"
    with pytest.raises(CheckpointError, match=r"proj-a's ffn\.0\.1, this expert is .*proj-b's"):
        b.check_state(kept)
    assert store.load_newest(UID, b.check_state) is None  # B starts elsewhere
    # the same name under another owner (an invitation that replaced A's project) too
    taken_over = backend()
    taken_over.experiment = "12D3KooWownerB/proj-a"
    assert store.load_newest(UID, taken_over.check_state) is None
    mine = backend()
    mine.experiment = "12D3KooWownerA/proj-a"
    mine.load_state(kept)  # A again: its own weights back
    assert mine.updates == 3
    loose = backend()  # the config's experts.uids: no project's weights either
    with pytest.raises(CheckpointError):
        loose.check_state(kept)


def test_a_state_of_no_project_is_written_as_before_and_taken_by_any() -> None:
    """Files written before the experiment was kept (and the config's experts) have no
    such field, so that earlier versions still read them; any expert takes them."""
    plain = backend().state()
    header = json.loads(bytes(encode_checkpoint(plain)[1]))
    assert "experiment" not in header
    b = backend()
    b.experiment = "12D3KooWownerB/proj-b"
    b.load_state(decode_checkpoint(b"".join(bytes(p) for p in encode_checkpoint(plain))))


def _leave_checkpoints(store: CheckpointStore, uids: list[str], first_mtime: float) -> None:
    """Two checkpoint files of each of ``uids`` (experts dropped since), the later
    ones saved later: as a daemon whose experts moved away one after another left."""
    for n, uid in enumerate(uids):
        b = backend(uid=uid)
        for _ in range(2):
            path = store.save(b.state())
            os.utime(path, (first_mtime + n, first_mtime + n))


async def test_experts_no_longer_hosted_keep_their_newest_and_only_the_last_saved(
    tmp_path: Path,
) -> None:
    """Nothing deleted the checkpoints of experts a daemon no longer hosts (moved to
    another volunteer, of a project left): two files of every expert it ever hosted
    stayed for good. After each round but the first (when the experts are added), those
    keep their newest file, and only the ``OTHERS_KEPT`` saved last keep any; the hosted
    experts keep ``keep``."""
    experts = ExpertsConfig(hidden_dim=HIDDEN, optimizer={"name": "adam", "lr": 0.01})
    runtime = ExpertRuntime(
        [UID], experts, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )
    saver = Checkpointer(runtime, tmp_path, CheckpointConfig(every_s=0.05, keep=2))
    gone = [f"ffn.9.{n}" for n in range(OTHERS_KEPT + 3)]
    _leave_checkpoints(saver.store, gone, first_mtime=time.time() - 3600)
    for seed in range(2):
        await runtime.with_expert(UID, lambda b, seed=seed: train(b, 1, seed=seed))
        await saver.save_changed()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(saver.serve)
        with trio.fail_after(10):
            while saver.store.files(gone[0]):  # noqa: ASYNC110 - polling the disk
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert len(saver.store.files(UID)) == 2
    assert [len(saver.store.files(uid)) for uid in gone] == [0] * 3 + [1] * OTHERS_KEPT
    folders = await trio.to_thread.run_sync(lambda: sorted(p.name for p in tmp_path.iterdir()))
    assert folders == sorted([UID, *gone[3:]])  # the emptied ones removed


def test_a_daemon_hosting_nothing_trims_what_its_experts_left(tmp_path: Path) -> None:
    """A daemon that left its project hosts nothing and runs no checkpointer: it trims
    at its start (``trim_others`` with nothing hosted), without torch."""
    store = CheckpointStore(tmp_path)
    gone = [f"ffn.9.{n}" for n in range(OTHERS_KEPT + 1)]
    _leave_checkpoints(store, gone, first_mtime=time.time() - 3600)
    deleted = trim_others(tmp_path, (), OTHERS_KEPT)
    assert len(deleted) == 2 + OTHERS_KEPT
    assert [len(store.files(uid)) for uid in gone] == [0] + [1] * OTHERS_KEPT


async def test_the_disk_budget_takes_experts_no_longer_hosted_before_skipping_a_save(
    tmp_path: Path,
) -> None:
    """Within a disk budget, only files that were not an expert's newest could go: the
    newest checkpoints of experts dropped long ago filled it, and the hosted experts'
    saves were skipped (an outside probe: 81 of 200). They go first now, the oldest
    first."""
    # large enough that a first save's estimate (its tensors and 64 KiB) is its size
    experts = ExpertsConfig(hidden_dim=128, optimizer={"name": "adam", "lr": 0.01})
    runtime = ExpertRuntime(
        [UID], experts, RuntimeConfig(device="cpu"), WireLimits(), torch.device("cpu")
    )
    budget = [0]
    saver = Checkpointer(
        runtime, tmp_path, CheckpointConfig(keep=1), budget_bytes=lambda: budget[0]
    )
    gone = ["ffn.9.0", "ffn.9.1"]
    for n, uid in enumerate(gone):
        dropped = backend(hidden=128, uid=uid)
        train(dropped, 1, seed=n)  # as large as the hosted one's: Adam's moments too
        path = saver.store.save(dropped.state())
        os.utime(path, (time.time() - 3600 + n, time.time() - 3600 + n))
    size = saver.store.files(gone[0])[0].stat().st_size
    budget[0] = 2 * size + size // 2  # the hosted expert's file and one other
    await runtime.with_expert(UID, lambda b: train(b, 1, seed=0))
    assert await saver.save_changed() == 1
    assert [len(saver.store.files(uid)) for uid in [UID, *gone]] == [1, 0, 1]
    assert saver.statistics().over_budget == 0


async def test_a_restored_experts_age_is_its_headers_or_the_last_graceful_stops(
    tmp_path: Path,
) -> None:
    """What the daemon holds back by (``ReplicaAverager.hold_restored``): the time in
    the file's header, not its mtime (a backup put back with `cp -r` looks new); the
    last graceful stop's, for an expert whose newest file was unchanged until then."""
    experts = ExpertsConfig(hidden_dim=HIDDEN)

    def runtime() -> ExpertRuntime:
        return two_experts(experts)

    config = CheckpointConfig(every_s=60, keep=2)
    first = runtime()
    for uid in first.uids:
        state = first.backend(uid).state()
        path = CheckpointStore(tmp_path).save(state)  # written 8 hours ago, copied now
        path.write_bytes(
            b"".join(encode_checkpoint(state, saved_at=time.time() - 8 * 3600, version=2))
        )
    saver = Checkpointer(first, tmp_path, config)
    assert sorted(await saver.restore()) == ["ffn.0.0", "ffn.0.1"]
    ages = {uid: time.time() - at for uid, at in saver.take_restored(first.uids).items()}
    assert all(8 * 3600 - 5 < age < 8 * 3600 + 5 for age in ages.values())
    assert ages.keys() == {"ffn.0.0", "ffn.0.1"}
    assert saver.take_restored(first.uids) == {}  # given once

    await first.with_expert("ffn.0.1", lambda b: train(b, 1, seed=7))  # changed, not saved
    await trio.to_thread.run_sync(saver.mark_stopped)  # a stop whose last save failed
    second = runtime()
    restored = Checkpointer(second, tmp_path, config)
    await restored.restore()
    ages = {uid: time.time() - at for uid, at in restored.take_restored(second.uids).items()}
    assert ages["ffn.0.0"] < 5  # held its weights until the stop: a restart in place
    assert ages["ffn.0.1"] > 8 * 3600 - 5  # its weights had moved on: the file is old

    # a stop recorded in the future (the clock was ahead, set right since): its time
    # says nothing, the header's goes
    stopped_file = tmp_path / "stopped.json"
    stopped = json.loads(stopped_file.read_text())
    stopped["stopped_at"] = time.time() + 3600
    stopped_file.write_text(json.dumps(stopped))
    third = runtime()
    again = Checkpointer(third, tmp_path, config)
    await again.restore()
    ages = {uid: time.time() - at for uid, at in again.take_restored(third.uids).items()}
    assert ages["ffn.0.0"] > 8 * 3600 - 5
