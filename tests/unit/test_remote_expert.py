"""RemoteExpert believes a server's ``info`` only as far as it can: an expert takes and
gives floating point, whatever the server says."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from volunteerd.errors import BadDtype
from volunteerd.moe import RemoteExpert
from volunteerd.net import PeerAddress, Verb
from volunteerd.wire import ExpertInfo, TensorSchema

UID = "ffn.0"


class _Node:
    """What RemoteExpert needs of a BackgroundNode: ``run``, here answering ``info``
    with ``described`` and remembering every verb asked."""

    def __init__(self, described: ExpertInfo) -> None:
        self.described = described
        self.verbs: list[Verb] = []
        self.node = SimpleNamespace(rpc=SimpleNamespace(call=object()))

    def run(self, _fn: Any, _peer: PeerAddress, verb: Verb, *_: Any) -> tuple[Any, list[Any]]:
        self.verbs.append(verb)
        assert verb is Verb.INFO, "nothing but info may be sent"
        return self.described, []


def _info(inputs: str, outputs: str) -> ExpertInfo:
    return ExpertInfo(
        uid=UID,
        expert_type="ffn",
        hidden_dim=8,
        inputs=[TensorSchema(dtype=inputs, shape=(None, 8))],  # type: ignore[arg-type]
        outputs=[TensorSchema(dtype=outputs, shape=(None, 8))],  # type: ignore[arg-type]
        max_batch_size=64,
    )


@pytest.mark.parametrize(("inputs", "outputs"), [("int64", "int64"), ("float32", "int64")])
def test_an_info_that_names_integers_is_refused_before_anything_is_sent(
    inputs: str, outputs: str
) -> None:
    # Such an info made the trainer cast its float inputs to int64 and accept an answer
    # of -2**63: the answer was checked against the very dtypes the server named.
    node = _Node(_info(inputs, outputs))
    expert = RemoteExpert(UID, PeerAddress("12D3KooWLiar", ()), node)  # type: ignore[arg-type]
    with pytest.raises(BadDtype, match=f"{UID} at .*floating point"):
        expert(torch.randn(4, 8))
    assert node.verbs == [Verb.INFO]


def test_an_info_in_floating_point_is_taken() -> None:
    node = _Node(_info("bfloat16", "float32"))
    expert = RemoteExpert(UID, PeerAddress("12D3KooWHonest", ()), node)  # type: ignore[arg-type]
    assert expert.info.inputs[0].dtype == "bfloat16"
