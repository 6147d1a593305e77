"""What mha-client prints: aligned tables and the attend summary (as a dict for --json, or text)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from mha_client.analysis import head_entropy, head_max_weight
from mha_client.sdk import AttendResult, ModelInfo

# (header, ModelInfo field) of each column of `mha-client models`.
MODEL_COLUMNS = (
    ("name", "name"),
    ("variant", "variant"),
    ("embed_dim", "embed_dim"),
    ("heads", "num_heads"),
    ("kv_heads", "num_kv_heads"),
    ("head_dim", "head_dim"),
    ("dtype", "dtype"),
    ("device", "device"),
    ("max_seq_len", "max_seq_len"),
    ("max_batch", "max_batch_size"),
)


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()
) -> str:
    """Columns padded to their widest cell; numeric columns and those in `right` right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    align_right = [
        i in right or (bool(rows) and all(isinstance(row[i], int | float) for row in rows))
        for i in range(len(headers))
    ]
    lines = []
    for row in cells:
        padded = [
            c.rjust(w) if r else c.ljust(w)
            for c, w, r in zip(row, widths, align_right, strict=True)
        ]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def format_fields(pairs: Sequence[tuple[str, Any]]) -> str:
    """`key  value` lines with the values aligned."""
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in pairs)


def models_table(models: Sequence[ModelInfo]) -> str:
    if not models:
        return "no models"
    rows = [[getattr(m, field) for _, field in MODEL_COLUMNS] for m in models]
    return format_table([header for header, _ in MODEL_COLUMNS], rows)


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None  # JSON has no NaN


def attend_summary(
    result: AttendResult,
    x: np.ndarray,
    lengths: np.ndarray,
    wire_dtype: str,
    files: dict[str, str] | None = None,
) -> dict[str, Any]:
    """JSON-ready summary of one attend call; per-head entropy counts only real rows and keys."""
    summary: dict[str, Any] = {
        "model": result.model,
        "input": {"shape": list(x.shape), "dtype": x.dtype.name, "wire_dtype": wire_dtype},
        "lengths": lengths.tolist(),
        "output": {"shape": list(result.output.shape), "dtype": result.output.dtype.name},
        "timing": asdict(result.timing) if result.timing else None,
    }
    if result.weights is not None:
        w4 = result.weights if result.weights.ndim == 4 else result.weights[None]  # (B, h, R, S)
        entropy = head_entropy(w4, lengths, result.weight_query_start)
        peak = head_max_weight(w4)
        summary["weights"] = {
            "shape": list(result.weights.shape),
            "dtype": result.weights.dtype.name,
            "query_start": result.weight_query_start,
            "heads": [
                {"head": h, "entropy_nats": _finite(e), "max_weight": _finite(m)}
                for h, e, m in zip(result.weight_heads, entropy, peak, strict=True)
            ],
        }
    summary["files"] = dict(files or {})
    return summary


def format_attend_summary(s: dict[str, Any]) -> str:
    """The text form of attend_summary: aligned fields, then a per-head table of weights."""
    t = s["timing"] or {}
    inp, out = s["input"], s["output"]
    pairs: list[tuple[str, Any]] = [
        ("model", s["model"]),
        ("input", f"{tuple(inp['shape'])} {inp['dtype']}, sent as {inp['wire_dtype']}"),
        ("lengths", ", ".join(map(str, s["lengths"]))),
        ("output", f"{tuple(out['shape'])} {out['dtype']}"),
        ("queue", f"{t.get('queue_ms', 0.0):9.2f} ms"),
        ("compute", f"{t.get('compute_ms', 0.0):9.2f} ms"),
        ("server total", f"{t.get('total_ms', 0.0):9.2f} ms"),
        ("round trip", f"{t.get('round_trip_ms', 0.0):9.2f} ms"),
        ("batch size", f"{t.get('batch_size', 0):9d}"),
    ]
    weights = s.get("weights")
    if weights:
        shape = tuple(weights["shape"])
        pairs.append(("weights", f"{shape} {weights['dtype']}, rows from {weights['query_start']}"))
    pairs += list(s["files"].items())
    text = format_fields(pairs)
    if weights:

        def num(v: float | None, spec: str) -> str:
            return "n/a" if v is None else format(v, spec)

        rows = [
            [h["head"], num(h["entropy_nats"], ".3f"), num(h["max_weight"], ".4f")]
            for h in weights["heads"]
        ]
        text += "\n\n" + format_table(["head", "mean entropy (nats)", "max weight"], rows, (1, 2))
    return text
