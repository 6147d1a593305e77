"""What every attention path of MultiHeadAttention returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .overflow import NO_OVERFLOW, NoOverflow, OverflowCheck


@dataclass
class AttentionOutput:
    output: torch.Tensor  # (B, L, E), rows at padded positions are 0
    weights: torch.Tensor | None  # (B, len(heads), R, S) float32; None unless need_weights
    # Which batch rows' attention scores (or values) overflow the compute dtype: their output
    # and weights are meaningless and must not be returned. Read it (.rows(), a device sync)
    # where the output is read: the forward itself never waits for the device (overflow.py).
    overflow: OverflowCheck | NoOverflow = NO_OVERFLOW
