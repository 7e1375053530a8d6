from __future__ import annotations

import pytest

from volunteerd.uids import expand_pattern, is_valid_key, is_valid_uid, split_uid, uid_prefixes


def test_grid_pattern_expands_in_grid_order() -> None:
    assert expand_pattern("ffn.[0:2].[0:3]") == [
        "ffn.0.0", "ffn.0.1", "ffn.0.2", "ffn.1.0", "ffn.1.1", "ffn.1.2",
    ]  # fmt: skip
    assert expand_pattern("ffn.1.[9:11], attn.0") == ["attn.0", "ffn.1.9", "ffn.1.10"]


@pytest.mark.parametrize(
    "pattern",
    ["ffn", "FFN.1", "ffn.[2:1]", "ffn.x", "ffn.[0:2", "ffn.1.2.3.4.5", "ffn.[0:99999999]"],
)
def test_bad_patterns_say_what_is_wrong(pattern: str) -> None:
    with pytest.raises(ValueError, match="pattern"):
        expand_pattern(pattern)


def test_prefixes_and_validity() -> None:
    assert uid_prefixes("ffn.3.17") == ["ffn.", "ffn.3.", "ffn.3.17"]
    assert split_uid("ffn.3.17") == ("ffn", (3, 17))
    assert is_valid_uid("ffn.0")
    assert not is_valid_uid("ffn.")
    assert not is_valid_uid("ffn.01")
    assert is_valid_key("ffn.")
    assert is_valid_key("ffn.3.")
    assert not is_valid_key("ffn")
    assert not is_valid_uid("a" * 70 + ".1")
    # "$" matched before a trailing newline: such a uid or key passed as valid
    assert not is_valid_uid("ffn.0.0\n")
    assert not is_valid_key("ffn.\n")
    with pytest.raises(ValueError, match="not a valid expert uid"):
        split_uid("ffn.3.17\n")
