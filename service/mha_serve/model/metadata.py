"""The attention config our checkpoints carry in their safetensors metadata: written by
weights.save_checkpoint, read back there and, without torch, by the config file (so a
[[models]] table naming one of our files needs no attention keys of its own)."""

from __future__ import annotations

import json
import struct
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import AttentionConfig

# Config fields stored as JSON tables (the rest as plain strings).
TABLE_FIELDS = ("rope", "qk_norm", "mla", "query_scale")
# A safetensors file starts with the header's length (u64, little-endian), then its JSON.
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def to_metadata(config: AttentionConfig) -> dict[str, str]:
    """str -> str safetensors metadata of every field of the config that is set."""
    return {
        k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in config.to_dict().items()
    }


def config_from_metadata(metadata: dict[str, str], path: Path | str) -> AttentionConfig | None:
    """Config from our str -> str metadata; None when the file carries none."""
    names = {f.name for f in fields(AttentionConfig)}
    raw = {k: v for k, v in metadata.items() if k in names}
    if not raw:
        return None
    try:
        return AttentionConfig.from_dict(
            {k: _parse_value(v, json_value=k in TABLE_FIELDS) for k, v in raw.items()}
        )
    except ValueError as e:
        raise ValueError(f"{path} metadata holds an invalid attention config {raw}: {e}") from e


def read_config(path: Path | str) -> AttentionConfig | None:
    """The config in a safetensors file's metadata (None: it carries none), read from its
    header alone: no tensor is loaded, no torch imported."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER_BYTES:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {path} does not exist") from None
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return config_from_metadata(metadata or {}, path)


def _parse_value(s: str, *, json_value: bool = False) -> Any:
    low = s.strip().lower()
    if json_value and low != "none":
        try:
            return json.loads(
                s
            )  # a table (rope, qk_norm, mla, query_scale), written by save_checkpoint
        except json.JSONDecodeError:
            return s  # AttentionConfig rejects it with the field's name
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for parse in (int, float):
        try:
            return parse(s)
        except ValueError:
            pass
    return s  # AttentionConfig rejects it with the field's name
