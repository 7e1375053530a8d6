"""Argument types shared by the benchmark scripts (imported from this folder, which is
on ``sys.path`` when a script in it runs)."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """``--sizes 16,128``: a comma-separated list of positive integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"positive integers only: {text!r}")
    return values
