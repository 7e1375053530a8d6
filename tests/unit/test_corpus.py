"""The corpus's held-out split: validation text is never training text, whatever the
source's files look like."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from volunteerd.errors import ConfigError
from volunteerd.train import load_corpus
from volunteerd.train.experiment import DataConfig


def write(folder: Path, sizes: list[int]) -> list[bytes]:
    texts = []
    for i, size in enumerate(sizes):
        text = bytes([ord("a") + i]) * size  # each file its own letter
        (folder / f"f{i:02d}.txt").write_bytes(text)
        texts.append(text)
    return texts


def letters(data: torch.Tensor) -> set[str]:
    return {chr(b) for b in bytes(data.numpy())} - {"\n"}


def test_every_nth_file_is_held_out(tmp_path: Path) -> None:
    write(tmp_path, [5_000] * 6)
    corpus = load_corpus(DataConfig(source=str(tmp_path), max_bytes=100_000, val_every=3))
    assert letters(corpus.val) == {"c", "f"}
    assert letters(corpus.train) == {"a", "b", "d", "e"}


def test_max_bytes_reached_before_a_held_out_file_holds_out_the_last_file_read(
    tmp_path: Path,
) -> None:
    # large first files under a small budget: the 10th file is never reached (Python
    # 3.12's standard library did this to a 60 kB corpus)
    write(tmp_path, [30_000, 40_000, 5_000, 5_000])
    corpus = load_corpus(DataConfig(source=str(tmp_path), max_bytes=60_000, val_every=10))
    assert letters(corpus.train) == {"a"}
    assert letters(corpus.val) == {"b"}
    assert corpus.files == 2


def test_a_single_file_is_split_by_bytes(tmp_path: Path) -> None:
    (tmp_path / "book.txt").write_bytes(bytes(range(256)) * 100)
    corpus = load_corpus(
        DataConfig(source=str(tmp_path / "book.txt"), max_bytes=1_000_000, val_every=4)
    )
    assert (len(corpus.train), len(corpus.val)) == (19_200, 6_400)
    assert bytes(corpus.train.numpy()) + bytes(corpus.val.numpy()) == bytes(range(256)) * 100


def test_too_little_text_is_refused(tmp_path: Path) -> None:
    write(tmp_path, [1_500])
    with pytest.raises(ConfigError, match="too little text"):
        load_corpus(DataConfig(source=str(tmp_path), max_bytes=10_000, val_every=10))


def test_max_bytes_reads_only_the_start_of_a_large_file(tmp_path: Path) -> None:
    # a 200 MB file under max_bytes = 100000 was read whole (2 GB of memory)
    book = tmp_path / "book.txt"
    book.write_bytes(bytes(range(256)) * 8_000)  # 2 MB
    corpus = load_corpus(DataConfig(source=str(book), max_bytes=100_000, val_every=4))
    assert (len(corpus.train), len(corpus.val)) == (75_000, 25_000)
    assert bytes(corpus.train.numpy()) + bytes(corpus.val.numpy()) == book.read_bytes()[:100_000]


def test_max_bytes_cuts_the_file_that_reaches_it(tmp_path: Path) -> None:
    write(tmp_path, [30_000, 40_000, 5_000, 5_000])
    corpus = load_corpus(DataConfig(source=str(tmp_path), max_bytes=50_000, val_every=10))
    assert (len(corpus.train), len(corpus.val)) == (30_000, 20_000)
    assert letters(corpus.val) == {"b"}
