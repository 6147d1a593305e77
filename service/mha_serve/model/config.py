"""Shape of one attention module: MHA, GQA and MQA are the same config with a
different num_kv_heads. Checked once at construction so nothing downstream re-checks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

Variant = Literal["mha", "gqa", "mqa"]

_BOOL_FIELDS = ("bias", "causal")


@dataclass(frozen=True)
class AttentionConfig:
    embed_dim: int  # E: width of input and output embeddings
    num_heads: int  # H: query heads
    num_kv_heads: int | None = None  # KVH: None -> num_heads (MHA); 1 -> MQA; a divisor of H -> GQA
    head_dim: int | None = None  # D: None -> embed_dim // num_heads
    bias: bool = True  # bias on the QKV and output projections
    causal: bool = False  # default masking for requests that do not say

    def __post_init__(self) -> None:
        # Values often come from TOML or safetensors metadata, so check types
        # too: bool is an int subclass and "8" is not 8.
        for name in ("embed_dim", "num_heads"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"{name} must be a bool (true/false), got {value!r} of type "
                    f"{type(value).__name__}"
                )

        if self.head_dim is None:
            if self.embed_dim % self.num_heads != 0:
                raise ValueError(
                    f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}; "
                    "set head_dim explicitly or change embed_dim"
                )
            object.__setattr__(self, "head_dim", self.embed_dim // self.num_heads)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)

        kvh, h = self.num_kv_heads, self.num_heads
        if kvh > h or h % kvh != 0:
            raise ValueError(
                f"num_kv_heads {kvh} must divide num_heads {h} "
                f"(1 = MQA, {h} = MHA, or a divisor for GQA)"
            )

    @property
    def variant(self) -> Variant:
        # num_heads == 1 is both "MHA" and "MQA"; call it MHA (no sharing happens).
        if self.num_kv_heads == self.num_heads:
            return "mha"
        return "mqa" if self.num_kv_heads == 1 else "gqa"

    @property
    def group_size(self) -> int:
        """Query heads that share one kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_dim(self) -> int:
        """Output width of the fused QKV projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def to_dict(self) -> dict[str, int | bool]:
        """Every field, resolved (no None), so the dict is the config on its own."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionConfig:
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"unknown attention config key(s) {unknown}; valid keys are {valid}")
        missing = [name for name in ("embed_dim", "num_heads") if name not in d]
        if missing:
            raise ValueError(f"attention config is missing required key(s) {missing}")
        return cls(**d)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
