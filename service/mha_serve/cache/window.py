"""Sliding-window arithmetic of a session's blocks: which of them a future step can still
attend to. A query at position p sees keys p - window + 1 .. p, so once a session holds
num_tokens tokens, its next step (first token at num_tokens) sees nothing before position
num_tokens + 1 - window, and blocks wholly before that are freed for good. Pure ints."""

from __future__ import annotations


def read_start(past: int, window: int | None) -> int:
    """The first position a step after `past` cached tokens attends to (its first token's
    window); 0 without a window."""
    return 0 if window is None else max(0, past + 1 - window)


def first_needed_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first (logical) block a session of num_tokens tokens must keep: every block
    before it lies wholly before read_start(num_tokens, window)."""
    return read_start(num_tokens, window) // block_size


def shortest_truncate(first_block: int, window: int | None, block_size: int) -> int:
    """The fewest tokens (> 0) a session whose blocks start at logical block first_block
    can be truncated to and still see its next step's whole window (it can always go to
    0); 1 while it holds every block."""
    if first_block == 0 or window is None:
        return 1
    return first_block * block_size + window - 1
