"""Checks of MultiHeadAttention's arguments at its boundary, each error saying what was
wrong with the numbers: shapes, dtypes, devices, heads, lengths, query ranges, cache reads."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from .config import AttentionConfig


def check_sinks(sinks: torch.Tensor | None, source: str) -> None:
    """A model's attention sinks as loaded, in its dtype: each is a logit in its head's
    softmax, and one that is not finite (NaN, Inf, or past a float16 model's range) would
    make the head's every output NaN."""
    if sinks is not None and not bool(sinks.isfinite().all()):
        raise ValueError(
            f"{source} holds NaN or Inf as {str(sinks.dtype).removeprefix('torch.')} "
            f"({sinks.tolist()}): each sink is a logit in its head's softmax, and one that is "
            "not finite makes the head's every output NaN; serve it in a wider dtype if it "
            "is finite in the checkpoint"
        )


def check_queries(config: AttentionConfig, q: torch.Tensor) -> tuple[int, int, int, int]:
    H, D = config.num_heads, config.head_dim
    if isinstance(q, torch.Tensor):  # (every step: the shape read once, no tuple built)
        shape = q.shape
        if len(shape) == 4 and shape[1] == H and shape[3] == D and shape[0] and shape[2]:
            return shape
    shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or (q.shape[1], q.shape[3]) != (H, D):
        raise ValueError(f"q must be (batch, num_heads={H}, new_len, head_dim={D}), got {shape}")
    raise ValueError(f"q must have batch >= 1 and new_len >= 1, got {shape}")


def check_cached(
    config: AttentionConfig,
    b: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    new: int,
    first: int,
    T: int,
    q: torch.Tensor,
) -> None:
    # (runs per sequence per step: the passing case first, in one expression)
    W = config.sliding_window
    if (
        not 1 <= new <= T
        or past < 0
        or not 0 <= first <= (0 if W is None else max(0, past + 1 - W))
    ):
        _check_step(config, b, past, new, first, T)  # raises, saying which
    want = (1, config.num_kv_heads, past + new - first, config.head_dim)
    device = q.device
    if (
        isinstance(keys, torch.Tensor)
        and isinstance(values, torch.Tensor)
        and keys.shape == want
        and values.shape == want
        and keys.device == device
        and values.device == device
        and keys.is_floating_point()
        and values.is_floating_point()
    ):
        return
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.shape != want:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"sequence {b}: {name} must be (1, num_kv_heads, past + new - first, "
                f"head_dim) = {want} for {past} + {new} positions read from position {first}, "
                f"got {shape}"
            )
        if t.device != device or not t.is_floating_point():
            raise ValueError(
                f"sequence {b}: {name} is {t.dtype} on {t.device}; q is {q.dtype} on {device}"
            )


def check_padded(
    config: AttentionConfig,
    keys: torch.Tensor,
    values: torch.Tensor,
    past_lengths: Sequence[int],
    new_lengths: Sequence[int],
    first_keys: Sequence[int],
    q: torch.Tensor,
) -> None:
    """attend_padded's arguments: q (B, H, T, D); keys, values (B, KVH, S, D) each holding
    sequence b's past + new - first keys first."""
    B, _, T, _ = q.shape
    KVH, D = config.num_kv_heads, config.head_dim
    if not len(past_lengths) == len(new_lengths) == len(first_keys) == B:
        raise ValueError(
            f"q has batch {B} but past_lengths, new_lengths and first_keys have "
            f"{len(past_lengths)}, {len(new_lengths)} and {len(first_keys)} entries"
        )
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[:2] != (B, KVH):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (batch={B}, {KVH}, keys, {D}), got {shape}")
        if t.shape[3] != D or t.shape != keys.shape:
            raise ValueError(f"{name} must be (batch={B}, {KVH}, keys, {D}), got {tuple(t.shape)}")
        if t.device != q.device or not t.is_floating_point():
            raise ValueError(f"{name} is {t.dtype} on {t.device}; q is {q.dtype} on {q.device}")
    S = keys.shape[2]
    W = config.sliding_window
    for b, (past, new, first) in enumerate(zip(past_lengths, new_lengths, first_keys, strict=True)):
        # (runs per sequence per step: the passing case first, in one expression)
        if (
            1 <= new <= T
            and past >= 0
            and 0 <= first <= (0 if W is None else max(0, past + 1 - W))
            and past + new - first <= S
        ):
            continue
        _check_step(config, b, past, new, first, T)
        if past + new - first > S:
            raise ValueError(
                f"sequence {b}: {past + new - first} keys (positions {first}..{past + new - 1}) "
                f"do not fit keys' {S} columns"
            )


def _check_step(config: AttentionConfig, b: int, past: int, new: int, first: int, T: int) -> None:
    W = config.sliding_window
    if not 1 <= new <= T or past < 0:
        raise ValueError(
            f"sequence {b}: new_lengths must be in [1, new_len={T}] and past_lengths >= 0, "
            f"got new {new} and past {past}"
        )
    # Every key the step's first token sees must be there: all of them without a window.
    earliest = 0 if W is None else max(0, past + 1 - W)
    if not 0 <= first <= earliest:
        raise ValueError(
            f"sequence {b}: first_keys must be in [0, {earliest}] (the first position the "
            f"step's first token sees, window {W}), got {first}"
        )


def check_input(config: AttentionConfig, weight: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    E = config.embed_dim
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be (batch, seq_len, embed_dim={E}), got {shape}")
    B, L, E_x = x.shape
    if E_x != E:
        raise ValueError(
            f"x has embed_dim {E_x} (shape {tuple(x.shape)}) but the model's embed_dim is {E}"
        )
    if B == 0 or L == 0:
        raise ValueError(f"x must have batch >= 1 and seq_len >= 1, got {tuple(x.shape)}")
    w = weight
    if x.dtype != w.dtype:
        raise ValueError(
            f"x has dtype {x.dtype} but the model holds {w.dtype}; pass x.to({w.dtype})"
        )
    if x.device != w.device:
        raise ValueError(
            f"x is on {x.device} but the model is on {w.device}; pass x.to('{w.device}')"
        )
    return B, L


def check_heads(config: AttentionConfig, weight_heads: Sequence[int] | None) -> list[int]:
    H = config.num_heads
    if weight_heads is None:
        return list(range(H))
    heads = [operator.index(h) for h in weight_heads]
    if not heads:
        raise ValueError("weight_heads is empty; pass None for all heads")
    bad = [h for h in heads if not 0 <= h < H]
    if bad:
        raise ValueError(
            f"weight_heads {heads} has head(s) {bad} out of range; "
            f"num_heads is {H}, so valid heads are 0..{H - 1}"
        )
    return heads


def check_head_mask(
    config: AttentionConfig, head_mask: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor | None:
    if head_mask is None:
        return None
    H = config.num_heads
    gate = torch.as_tensor(head_mask)
    if gate.shape != (H,):
        raise ValueError(
            f"head_mask must have shape (num_heads,) = ({H},), got {tuple(gate.shape)}"
        )
    if not gate.is_floating_point():
        raise ValueError(f"head_mask must be a float tensor, got {gate.dtype}")
    return gate.to(device=x.device, dtype=x.dtype)


def check_out_gate(
    config: AttentionConfig, out_gate: torch.Tensor | None, B: int, L: int, y: torch.Tensor
) -> None:
    """A merge's output gate: given exactly when the config has one (a gated model merged
    without it would answer wrongly, not fail), (B, L, H*D) on y's device."""
    if out_gate is None or not config.output_gate:
        have = "has an" if config.output_gate else "has no"
        raise ValueError(
            f"the model {have} output gate (output_gate {config.output_gate}), but "
            f"out_gate is {'None' if out_gate is None else 'given'}: pass "
            "out_gate=module.output_gate(x) of the same tokens x, and only then"
        )
    want = (B, L, config.gate_width)
    if not isinstance(out_gate, torch.Tensor) or tuple(out_gate.shape) != want:
        shape = tuple(out_gate.shape) if isinstance(out_gate, torch.Tensor) else out_gate
        raise ValueError(f"out_gate must be (batch, new_len, gate_width) = {want}, got {shape}")
    if out_gate.device != y.device:
        raise ValueError(f"out_gate is on {out_gate.device}; the queries are on {y.device}")


def valid_positions(
    lengths: torch.Tensor | Sequence[int] | None, B: int, L: int, device: torch.device
) -> torch.Tensor | None:
    """(B, L) bool, True at real positions; None when no sequence is padded."""
    if lengths is None:
        return None
    lengths, lo = _check_lengths(lengths, "lengths", B, 1, L, "seq_len")
    if lo == L:
        return None
    return torch.arange(L, device=device) < lengths.to(device)[:, None]  # (B, L)


def _check_lengths(
    lengths: torch.Tensor | Sequence[int], name: str, B: int, lo_min: int, hi_max: int, what: str
) -> tuple[torch.Tensor, int]:
    """lengths as a (B,) integer tensor in [lo_min, hi_max], and its minimum."""
    lengths = torch.as_tensor(lengths)
    if lengths.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"{name} must be an integer (int64) tensor, got {lengths.dtype}")
    if lengths.shape != (B,):
        raise ValueError(f"{name} must have shape (batch,) = ({B},), got {tuple(lengths.shape)}")
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < lo_min or hi > hi_max:
        raise ValueError(
            f"{name} must be in [{lo_min}, {what}={hi_max}], got min {lo} and max {hi}: "
            f"{lengths.tolist()}"
        )
    return lengths, lo


def check_query_range(query_range: tuple[int, int] | None, L: int) -> tuple[int, int]:
    if query_range is None:
        return 0, L
    try:
        start, end = (operator.index(i) for i in query_range)
    except (TypeError, ValueError):
        raise ValueError(
            f"query_range must be a pair of ints (start, end), got {query_range!r}"
        ) from None
    if not 0 <= start < end <= L:
        raise ValueError(
            f"query_range ({start}, {end}) is empty or out of bounds; "
            f"need 0 <= start < end <= seq_len {L}"
        )
    return start, end
