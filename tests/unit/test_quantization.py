"""q8, blockwise 8-bit quantization on the wire: its layout, its error bound, what it
refuses, and an expert runtime answering forward and backward with it."""

from __future__ import annotations

import copy
import math
import struct

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from volunteerd.config import ExpertsConfig, RuntimeConfig, WireLimits
from volunteerd.errors import BadDtype, MalformedFrame, Rejected
from volunteerd.experts import from_wire, to_wire
from volunteerd.runtime import ExpertRuntime
from volunteerd.wire import (
    Q8_BLOCK,
    TensorMeta,
    TensorSchema,
    WireTensor,
    check_against_schema,
    q8_nbytes,
    split_body,
)

FLOAT32_MAX = torch.finfo(torch.float32).max


def wire(meta: TensorMeta, data: bytes | bytearray) -> WireTensor:
    return WireTensor(meta.dtype, meta.shape, memoryview(bytearray(data)))


def round_trip(x: torch.Tensor) -> torch.Tensor:
    return from_wire(wire(*to_wire(x, "q8")))


def scales_of(x: torch.Tensor) -> torch.Tensor:
    """Each value's block scale, as the encoder computes it."""
    _, data = to_wire(x, "q8")
    blocks = -(-x.numel() // Q8_BLOCK)
    scales = torch.tensor(struct.unpack(f"<{blocks}f", data[: 4 * blocks]))
    return scales.repeat_interleave(Q8_BLOCK)[: x.numel()].reshape(x.shape)


# -- layout ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(0,), (1,), (63,), (64,), (65,), (3, 70), (2, 0, 5), (512, 1024)]
)
def test_q8_size_follows_from_the_shape_alone(shape: tuple[int, ...]) -> None:
    meta, data = to_wire(torch.randn(shape), "q8")
    n = math.prod(shape)
    assert meta == TensorMeta(dtype="q8", shape=shape)
    assert len(data) == meta.nbytes == q8_nbytes(n) == 4 * math.ceil(n / 64) + n
    assert round_trip(torch.zeros(shape)).shape == shape


def test_q8_buffer_is_the_block_scales_then_one_signed_code_per_value() -> None:
    x = torch.cat([torch.full((64,), -2.54), torch.tensor([0.5, -1.0, 0.0])])
    _, data = to_wire(x, "q8")
    assert len(data) == 2 * 4 + 67
    scales = struct.unpack("<2f", data[:8])
    assert scales == pytest.approx((2.54 / 127, 1.0 / 127))
    codes = struct.unpack("<67b", data[8:])
    assert codes[:64] == (-127,) * 64
    assert codes[64:] == (64, -127, 0)  # 63.5 rounds to even


def test_q8_compresses_only_floating_point_tensors() -> None:
    ids = torch.arange(10)
    assert to_wire(ids, "q8") == to_wire(ids)
    assert to_wire(torch.randn(2, 3, dtype=torch.bfloat16), "q8")[0].dtype == "q8"
    assert round_trip(torch.randn(4, 8, dtype=torch.float16)).dtype == torch.float32


def test_earlier_compressions_are_unchanged_byte_for_byte() -> None:
    x = torch.randn(5, 7)
    assert to_wire(x, "none") == to_wire(x)
    assert to_wire(x, "float16") == to_wire(x.half())
    assert to_wire(x, "bfloat16") == to_wire(x.bfloat16())
    assert to_wire(x)[1] == x.numpy().tobytes()


def test_schema_check_wants_q8_for_floating_point_tensors_under_q8() -> None:
    schema = [
        TensorSchema(dtype="float32", shape=(None, 8)),
        TensorSchema(dtype="int64", shape=(None,)),
    ]
    q8 = [TensorMeta(dtype="q8", shape=(3, 8)), TensorMeta(dtype="int64", shape=(3,))]
    assert check_against_schema(q8, schema, max_samples=4, compression="q8") == 3
    with pytest.raises(BadDtype):
        check_against_schema(q8, schema, max_samples=4)
    with pytest.raises(BadDtype):
        check_against_schema(q8[:1] * 2, schema, max_samples=4, compression="q8")
    with pytest.raises(ValueError):
        TensorSchema(dtype="q8", shape=(None, 8))  # type: ignore[arg-type]


def test_split_body_cuts_q8_buffers_at_their_computed_sizes() -> None:
    a, b = to_wire(torch.randn(3, 70), "q8"), to_wire(torch.randn(2, 2))
    body = memoryview(a[1] + b[1])
    first, second = split_body([a[0], b[0]], body)
    assert bytes(first.data) == a[1]
    assert bytes(second.data) == b[1]
    with pytest.raises(MalformedFrame):
        split_body([a[0], b[0]], body[:-1])


# -- the error bound ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=300),
    exponent=st.integers(min_value=-30, max_value=30),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_round_trip_error_is_at_most_half_a_block_scale(n: int, exponent: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    # blocks of very different magnitudes side by side
    x = (
        torch.randn(n, generator=generator)
        * 10.0 ** torch.randint(exponent - 3, exponent + 4, (n,), generator=generator).float()
    )
    y = round_trip(x)
    scales = scales_of(x)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= scales / 2 * (1 + 1e-5)).all()
    assert (y.sign() * x.sign() >= 0).all()  # never flips a sign


def test_zeros_are_exact_and_constant_blocks_nearly() -> None:
    assert torch.equal(round_trip(torch.zeros(3, 100)), torch.zeros(3, 100))
    x = torch.tensor([0.0, -0.0, 1.0, 0.0] * 16)
    assert round_trip(x)[[0, 1, 3]].eq(0).all()
    for value in (1.0, -3.7, 1e-20, 2.5e30):
        constant = torch.full((130,), value)
        torch.testing.assert_close(round_trip(constant), constant, rtol=2e-7, atol=0)


@pytest.mark.parametrize("value", [FLOAT32_MAX, 1e38, 1e-30, 1e-34])
def test_huge_and_tiny_values_come_back_finite_and_within_the_bound(value: float) -> None:
    x = torch.tensor([value, -value, value / 3, 0.0] * 20)
    y = round_trip(x)
    assert torch.isfinite(y).all()
    assert ((y - x).abs() <= scales_of(x) / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("value", [1e-37, 1e-40, 1e-44])
def test_blocks_too_small_for_a_normal_scale_lose_at_most_their_values(value: float) -> None:
    """Below 127 * float32's smallest normal number (1.5e-36) the scale is subnormal
    and loses precision: such blocks may come back as zeros, never larger."""
    x = torch.tensor([value, -value, value / 3, 0.0] * 20)
    y = round_trip(x)
    assert ((y - x).abs() <= x.abs()).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_when_quantizing(bad: float) -> None:
    x = torch.randn(100)
    x[70] = bad
    with pytest.raises(Rejected, match="non-finite"):
        to_wire(x, "q8")
    assert to_wire(x, "float16")[0].dtype == "float16"  # the other encodings carry them


# -- refused buffers ------------------------------------------------------------------


def q8_bytes(scales: list[float], codes: list[int]) -> bytes:
    return struct.pack(f"<{len(scales)}f{len(codes)}b", *scales, *codes)


@pytest.mark.parametrize(
    ("scale", "code"),
    [
        (float("nan"), 1),
        (float("inf"), 1),
        (-0.5, 1),
        (-0.0, 1),
        (FLOAT32_MAX / 100, 1),  # 127 times it is infinite
        (0.5, -128),
    ],
)
def test_buffers_no_encoder_makes_are_refused(scale: float, code: int) -> None:
    meta = TensorMeta(dtype="q8", shape=(2, 40))
    data = q8_bytes([1.0, scale], [3] * 79 + [code])
    with pytest.raises(MalformedFrame, match="q8 tensor"):
        from_wire(wire(meta, data))
    # already where a frame's body is cut, on either side of a call
    with pytest.raises(MalformedFrame, match="q8 tensor"):
        split_body([meta], memoryview(data))


@pytest.mark.parametrize("delta", [-1, 1, -4, 4])
def test_buffers_of_the_wrong_size_are_refused(delta: int) -> None:
    meta, data = to_wire(torch.randn(3, 70), "q8")
    data = data[:delta] if delta < 0 else data + b"\0" * delta
    with pytest.raises(MalformedFrame, match="takes 226 bytes"):
        from_wire(wire(meta, data))


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(min_value=0, max_value=70), min_size=1, max_size=2).map(tuple),
    data=st.data(),
)
def test_arbitrary_bytes_decode_to_finite_values_or_are_refused(
    shape: tuple[int, ...], data: st.DataObject
) -> None:
    meta = TensorMeta(dtype="q8", shape=shape)
    body = data.draw(st.binary(min_size=meta.nbytes, max_size=meta.nbytes))
    try:
        y = from_wire(wire(meta, body))
    except MalformedFrame:
        return
    assert y.shape == shape
    assert y.dtype == torch.float32
    assert torch.isfinite(y).all()


# -- an expert runtime answering in q8 --------------------------------------------------

HIDDEN = 64


async def test_runtime_answers_forward_and_backward_in_q8_close_to_uncompressed() -> None:
    uid = "ffn.0.0"
    runtime = ExpertRuntime(
        [uid], ExpertsConfig(hidden_dim=HIDDEN), RuntimeConfig(device="cpu"), WireLimits(),
        torch.device("cpu"),
    )  # fmt: skip
    torch.manual_seed(0)
    x = torch.randn(8, HIDDEN)
    grad = torch.randn(8, HIDDEN) * 0.01
    module = copy.deepcopy(runtime.backend(uid).module)
    x_ref = x.clone().requires_grad_()
    y_ref = module(x_ref)
    y_ref.backward(grad)
    assert x_ref.grad is not None

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert float((got - want).norm() / want.norm()) < 0.02

    async with trio.open_nursery() as nursery:
        await nursery.start(runtime.serve)
        reply, buffers = await runtime.forward(
            uid, [wire(*to_wire(x, "q8"))], compression="q8"
        )  # fmt: skip
        assert [m.dtype for m in reply.tensors] == ["q8"]
        assert len(buffers[0]) == q8_nbytes(8 * HIDDEN)
        close(from_wire(wire(reply.tensors[0], buffers[0])), y_ref.detach())

        reply, buffers = await runtime.backward(
            uid, [wire(*to_wire(x, "q8")), wire(*to_wire(grad, "q8"))], compression="q8"
        )
        assert [m.dtype for m in reply.tensors] == ["q8"]
        close(from_wire(wire(reply.tensors[0], buffers[0])), x_ref.grad)

        with pytest.raises(BadDtype):  # float32 tensors in a request that said q8
            await runtime.forward(uid, [wire(*to_wire(x))], compression="q8")
        runtime.close()
