"""argparse types and the --input reader shared by the CLI's commands: the message says what
was expected."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

# What --input holds for an Attend (and `heads`); a session step's says "1" for the batch.
ATTEND_SHAPES = "a 2-D (seq_len, embed_dim) or 3-D (batch, seq_len, embed_dim)"
STEP_SHAPES = "a 2-D (tokens, embed_dim) or 3-D (1, tokens, embed_dim)"


class UsageError(Exception):
    """A command line that parsed but cannot work (exit status 2)."""


def read_input(path: Path, shapes: str = ATTEND_SHAPES) -> np.ndarray:
    """The floats of an --input .npy file; UsageError naming the file and what it should hold
    (shapes: its dimensions, in words) when it cannot be read or is not that."""
    try:
        x = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read --input {path}: {err}") from None
    if not isinstance(x, np.ndarray) or x.ndim not in (2, 3):
        shape = getattr(x, "shape", "an .npz archive")
        raise UsageError(f"--input {path} holds {shape}; expected {shapes} .npy array")
    if not np.issubdtype(x.dtype, np.floating):
        raise UsageError(f"--input {path} holds {x.dtype}; save it as float32 or float16")
    return x


def int_list(text: str) -> list[int]:
    """Parse "0,3" into [0, 3]."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers, e.g. 0,3"
        ) from None


def float_list(text: str) -> list[float]:
    """Parse "1,0,1" into [1.0, 0.0, 1.0]."""
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers, e.g. 1,0,1,1"
        ) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1, e.g. 0.01."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction from 0 to 1, e.g. 0.01")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value
