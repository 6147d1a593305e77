"""The attention module (MHA, GQA, MQA as one class) and its weights; imports only torch.

The torch-using names load on first use (PEP 562), so that `mha_serve.model.config` (the
AttentionConfig a config file describes) can be read without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import AttentionConfig

# name -> submodule that defines it
_LAZY = {
    "AttentionOutput": "output",
    "MultiHeadAttention": "attention",
    "from_torch_mha": "weights",
    "init_weights": "weights",
    "load_checkpoint": "weights",
    "save_checkpoint": "weights",
    "torch_mha_state_dict_to_ours": "weights",
}

if TYPE_CHECKING:
    from .attention import MultiHeadAttention
    from .output import AttentionOutput
    from .weights import (
        from_torch_mha,
        init_weights,
        load_checkpoint,
        save_checkpoint,
        torch_mha_state_dict_to_ours,
    )


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AttentionConfig",
    "AttentionOutput",
    "MultiHeadAttention",
    "from_torch_mha",
    "init_weights",
    "load_checkpoint",
    "save_checkpoint",
    "torch_mha_state_dict_to_ours",
]
