"""The wire codec: round trips, and refusal of malformed, truncated and oversized input."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from volunteerd.errors import (
    BadDtype,
    BadShape,
    FrameTooLarge,
    MalformedFrame,
    UnsupportedVersion,
)
from volunteerd.experts import TORCH_DTYPES, from_wire, to_wire
from volunteerd.wire import (
    PREFIX,
    ForwardRequest,
    TensorMeta,
    TensorSchema,
    check_against_schema,
    decode_header,
    encode_frame,
    parse_prefix,
    split_body,
)

CAPS = {"max_header_bytes": 64 * 1024, "max_body_bytes": 1 << 20}


def decode(frame: bytes, model=ForwardRequest, **caps):  # type: ignore[no-untyped-def]
    sizes = parse_prefix(frame[: PREFIX.size], **(caps or CAPS))
    header_end = PREFIX.size + sizes.header_bytes
    if len(frame) != header_end + sizes.body_bytes:
        raise MalformedFrame("truncated")
    header = decode_header(model, frame[PREFIX.size : header_end])
    return header, split_body(header.tensors, memoryview(frame)[header_end:])


shapes = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(shapes, min_size=1, max_size=4), dtype=st.sampled_from(list(TORCH_DTYPES)))
def test_round_trip_preserves_tensors_bit_for_bit(
    shapes: list[tuple[int, ...]], dtype: str
) -> None:
    tensors = [
        torch.randint(-1000, 1000, s).to(TORCH_DTYPES[dtype])
        if dtype == "int64"
        else torch.randn(s).to(TORCH_DTYPES[dtype])
        for s in shapes
    ]
    encoded = [to_wire(t) for t in tensors]
    frame = encode_frame(
        ForwardRequest(uid="ffn.1.2", tensors=[m for m, _ in encoded]), [b for _, b in encoded]
    )
    header, wire_tensors = decode(frame)
    assert header.uid == "ffn.1.2"
    for original, wt in zip(tensors, wire_tensors, strict=True):
        back = from_wire(wt)
        assert back.dtype == original.dtype
        assert torch.equal(back, original)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=256))
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        decode(data)
    except (MalformedFrame, FrameTooLarge, UnsupportedVersion):
        pass


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(min_value=0, max_value=200))
def test_truncated_frames_are_refused(cut: int) -> None:
    t = torch.randn(4, 8)
    meta, data = to_wire(t)
    frame = encode_frame(ForwardRequest(uid="ffn.0.0", tensors=[meta]), [data])
    truncated = frame[: min(cut, len(frame) - 1)]
    with pytest.raises((MalformedFrame, FrameTooLarge)):
        decode(truncated)


def test_oversized_header_and_body_are_refused_before_allocation() -> None:
    huge_header = PREFIX.pack(b"VD", 1, 0, 10 << 20, 0)
    with pytest.raises(FrameTooLarge, match="header"):
        parse_prefix(huge_header, **CAPS)
    huge_body = PREFIX.pack(b"VD", 1, 0, 10, 1 << 40)
    with pytest.raises(FrameTooLarge, match="body"):
        parse_prefix(huge_body, **CAPS)


def test_bad_magic_version_and_flags() -> None:
    with pytest.raises(MalformedFrame, match="magic"):
        parse_prefix(PREFIX.pack(b"XX", 1, 0, 10, 0), **CAPS)
    with pytest.raises(UnsupportedVersion):
        parse_prefix(PREFIX.pack(b"VD", 9, 0, 10, 0), **CAPS)
    with pytest.raises(MalformedFrame, match="flags"):
        parse_prefix(PREFIX.pack(b"VD", 1, 1, 10, 0), **CAPS)


def _frame_with_header(header: object, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return PREFIX.pack(b"VD", 1, 0, len(raw), len(body)) + raw + body


@pytest.mark.parametrize(
    "header",
    [
        {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [2]}], "extra": 1},
        {"uid": "../etc/passwd", "tensors": []},
        {"uid": "ffn.0.0", "tensors": [{"dtype": "object", "shape": [2]}]},
        {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [-1]}]},
        {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [1] * 9}]},
        {"uid": "ffn.0.0"},
        [],
    ],
)
def test_headers_that_do_not_match_the_model_are_malformed(header: object) -> None:
    with pytest.raises(MalformedFrame):
        decode(_frame_with_header(header, b"\0" * 8))


def test_not_json_header_is_malformed() -> None:
    frame = PREFIX.pack(b"VD", 1, 0, 4, 0) + b"\xff\xfe{]"
    with pytest.raises(MalformedFrame):
        decode(frame)


def test_body_size_must_match_the_header() -> None:
    header = {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [4]}]}
    with pytest.raises(MalformedFrame, match="16 bytes"):
        decode(_frame_with_header(header, b"\0" * 12))


def test_schema_checks_dtype_shape_and_batch() -> None:
    schema = [TensorSchema(dtype="float32", shape=(None, 8))]
    ok = [TensorMeta(dtype="float32", shape=(3, 8))]
    assert check_against_schema(ok, schema, max_samples=4) == 3
    with pytest.raises(BadDtype):
        check_against_schema([TensorMeta(dtype="float16", shape=(3, 8))], schema, max_samples=4)
    with pytest.raises(BadShape):
        check_against_schema([TensorMeta(dtype="float32", shape=(3, 9))], schema, max_samples=4)
    with pytest.raises(BadShape):
        check_against_schema([TensorMeta(dtype="float32", shape=(3, 8, 1))], schema, max_samples=4)
    with pytest.raises(BadShape, match="expected 1 tensors"):
        check_against_schema(ok * 2, schema, max_samples=4)
    with pytest.raises(BadShape, match="empty"):
        check_against_schema([TensorMeta(dtype="float32", shape=(0, 8))], schema, max_samples=4)
    with pytest.raises(FrameTooLarge):
        check_against_schema([TensorMeta(dtype="float32", shape=(5, 8))], schema, max_samples=4)


def test_a_sequence_longer_than_the_cap_is_refused() -> None:
    """A transformer expert's sequence dimension is open in its schema; only the body
    cap bounded it, and attention costs its square."""
    schema = [TensorSchema(dtype="float32", shape=(None, None, 8))]

    def check(batch: int, length: int) -> int:
        meta = [TensorMeta(dtype="float32", shape=(batch, length, 8))]
        return check_against_schema(meta, schema, max_samples=4, max_sequence=16)

    assert check(4, 16) == 4
    with pytest.raises(FrameTooLarge, match="sequence of 17"):
        check(1, 17)
    with pytest.raises(FrameTooLarge, match="sequence of 1048576"):
        check(1, 1 << 20)


def test_prefix_layout_is_little_endian_and_16_bytes() -> None:
    frame = encode_frame(ForwardRequest(uid="ffn.0.0", tensors=[]))
    assert frame[:2] == b"VD"
    assert frame[2] == 1
    assert frame[3] == 0
    header_len, body_len = struct.unpack("<IQ", frame[4:16])
    assert body_len == 0
    assert header_len == len(frame) - 16


@pytest.mark.parametrize(
    "header",
    [
        {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [2, "64"]}]},
        {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [2, 64.0]}]},
        {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [2, 64]}], "retain": "yes"},
        {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [2, 64]}], "retain": 1},
    ],
    ids=["string-dim", "float-dim", "string-flag", "int-flag"],
)
def test_headers_are_strict_about_types(header: dict[str, object]) -> None:
    """Another implementation may read "64" or "yes" differently: they are refused, not
    coerced."""
    with pytest.raises(MalformedFrame):
        decode_header(ForwardRequest, json.dumps(header).encode())
    good = {"uid": "ffn.0.0", "tensors": [{"dtype": "float32", "shape": [2, 64]}], "retain": True}
    assert decode_header(ForwardRequest, json.dumps(good).encode()).retain is True


VAST_EMPTY = (0, *(2**31,) * 7)  # no values; strides past int64


def test_a_shape_torch_cannot_make_is_malformed_even_of_no_bytes() -> None:
    """(0, 2**31, ..., 2**31) takes no bytes and passed every size check; torch.empty
    then raised its own RuntimeError (strides overflow) out of a trainer's step."""
    lie = TensorMeta.model_construct(dtype="float32", shape=VAST_EMPTY)
    frame = encode_frame(ForwardRequest.model_construct(uid="ffn.0.0", tensors=[lie]))
    with pytest.raises(MalformedFrame, match="more values than any tensor"):
        decode(frame)
    # an empty batch of an honest width stays a tensor
    empty = split_body([TensorMeta(dtype="float32", shape=(0, 512))], memoryview(b""))[0]
    assert from_wire(empty).shape == (0, 512)
    # a descriptor made without the wire's checks: MalformedFrame, never torch's error
    with pytest.raises(MalformedFrame, match="shape"):
        from_wire(split_body([lie], memoryview(b""))[0])
