"""The attention module (MHA, GQA, MQA as one class) and its weights; imports only torch."""

from .attention import AttentionOutput, MultiHeadAttention
from .config import AttentionConfig
from .weights import (
    from_torch_mha,
    init_weights,
    load_checkpoint,
    save_checkpoint,
    torch_mha_state_dict_to_ours,
)

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
