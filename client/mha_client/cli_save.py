"""`--save FILE` of the commands that print an attention result (`attend`, `session step`):
one suffix rule and one set of arrays, whichever command wrote the file."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mha_client.sdk import AttendResult

SAVE_HELP = ".npz: output, weights, weight_heads, lengths; .npy: output"


def save_path(text: str) -> Path:
    """--save's argparse type: an .npz or .npy name (numpy would add a suffix to any other)."""
    path = Path(text)
    if path.suffix not in (".npz", ".npy"):
        raise argparse.ArgumentTypeError(f"{text}: name an .npz (all arrays) or .npy (output) file")
    return path


def save_result(path: Path, result: AttendResult, lengths: np.ndarray) -> None:
    """.npy: the output alone; .npz: output, lengths and, with weights, weights, weight_heads
    and weight_query_start."""
    if path.suffix == ".npy":
        np.save(path, result.output)
        return
    arrays = {"output": result.output, "lengths": lengths}
    if result.weights is not None:
        arrays["weights"] = result.weights
        arrays["weight_heads"] = np.asarray(result.weight_heads, dtype=np.int32)
        arrays["weight_query_start"] = np.asarray(result.weight_query_start, dtype=np.int32)
    np.savez(path, **arrays)
