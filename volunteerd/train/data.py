"""Text corpora as bytes, a held-out split, and batches of byte sequences.

The default corpus is the source of Python's own standard library: real text on every
machine that runs volunteerd, with no download. Files are read in a fixed order; every
``val_every``-th file is held out, so validation text is never seen in training. When no
such file was read (fewer files, or ``max_bytes`` reached first), the last file read is
held out instead, or the last ``1/val_every`` of a single file. No more than
``max_bytes`` is read: of the file that reaches it, only its start (bytes, never decoded,
so a cut inside a UTF-8 sequence costs one odd character and no error).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from volunteerd.errors import ConfigError
from volunteerd.train.experiment import DataConfig

__all__ = ["Corpus", "load_corpus"]

VOCAB = 256


@dataclass(frozen=True, slots=True)
class Corpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor
    files: int
    source: str

    def batch(
        self, split: str, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows: inputs [B, T] and next-byte targets [B, T] (int64)."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        window = data[idx].long()
        return window[:, :-1], window[:, 1:]

    def unigram_loss(self) -> float:
        """Cross-entropy (nats) of the validation text under the training text's byte
        frequencies: what a model that ignores context scores."""
        counts = torch.bincount(self.train.long(), minlength=VOCAB).double() + 1
        logp = (counts / counts.sum()).log()
        return float(-logp[self.val.long()].mean())


def _files(source: str) -> list[Path]:
    if source == "python-stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return sorted(
            p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
        )
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in {".py", ".txt", ".md"}
        )
    raise ConfigError(f"data.source = {source!r}: no such file or folder")


def _read_start(path: Path, limit: int) -> bytes:
    """The first ``limit`` bytes of ``path``, or all of a shorter file. Never more: a
    200 MB file under ``max_bytes = 100000`` was read whole (2 GB of memory). Asked for
    no more than the file holds, since ``read(n)`` reserves ``n`` bytes before reading."""
    with path.open("rb") as file:
        return file.read(min(limit, os.fstat(file.fileno()).st_size))


def _bytes(parts: list[bytes]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)


def load_corpus(config: DataConfig) -> Corpus:
    files = _files(config.source)
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for i, path in enumerate(files):
        try:
            text = _read_start(path, config.max_bytes - total)
        except OSError:
            continue
        (val if i % config.val_every == config.val_every - 1 else train).append(text)
        total += len(text)
        if total >= config.max_bytes:
            break
    if train and not val:
        # The text ran out, or max_bytes was reached, before the first held-out file
        # (a single file; a few large ones, as in Python 3.12's standard library under
        # a small max_bytes): hold out the last file read, or the end of the only one.
        if len(train) > 1:
            val.append(train.pop())
        else:
            (text,) = train
            cut = len(text) - len(text) // config.val_every
            train, val = [text[:cut]], [text[cut:]]
    if not train or not val:
        raise ConfigError(f"data.source = {config.source!r}: too little text to split")
    corpus = Corpus(_bytes(train), _bytes(val), len(train) + len(val), config.source)
    if min(len(corpus.train), len(corpus.val)) < 1024:
        raise ConfigError(f"data.source = {config.source!r}: too little text")
    return corpus
