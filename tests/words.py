"""A small corpus of code words for trainer tests: enough text to train a tiny model on,
made the same way everywhere (seeded)."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["def", "class", "return", "import", "yield", "lambda", "with", "for", "in", "if"]


def write_words(folder: Path, files: int = 4, words: int = 2000) -> Path:
    """Write ``files`` text files of ``words`` seeded random words into ``folder``."""
    generator = torch.Generator().manual_seed(0)
    for i in range(files):
        picks = torch.randint(0, len(WORDS), (words,), generator=generator).tolist()
        (folder / f"part{i}.txt").write_text(" ".join(WORDS[j] for j in picks))
    return folder
