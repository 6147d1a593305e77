"""The engine's torch-side types: a hosted model, the engine's record of an accepted call,
and Arrays (engine/requests.py) as tensors and back without a copy."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from mha_serve.engine.requests import Array, AttendRequest, CallState, ModelView
from mha_serve.model import MultiHeadAttention
from mha_serve.spec import (  # re-exported: the engine's callers name them from here
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_MAX_WEIGHTS_BYTES,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    MiB,
    ModelSpec,
)

__all__ = [
    "DEFAULT_KV_BLOCK_SIZE",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MAX_SEQ_LEN",
    "DEFAULT_MAX_WEIGHTS_BYTES",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "HostedModel",
    "MiB",
    "ModelSpec",
    "Prepared",
    "array_of",
    "on_host",
    "output_dtype",
    "repeat_heads",
    "tensor_of",
]

# Compute dtypes by the names the config uses ("auto" aside): the server's dtype, and a
# model's kv_cache_dtype.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DTYPE_NAME = {dtype: name for name, dtype in DTYPES.items()}
# A request's Array may be a view of the (immutable) bytes it came in, which nothing writes
# to: torch's warning about wrapping read-only memory is filtered once.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)


@dataclass
class HostedModel:
    """A loaded model: its spec, its module (eval, no grad) and where it computes."""

    spec: ModelSpec
    module: MultiHeadAttention
    device: torch.device
    dtype: torch.dtype
    # Read on every step (Engine.runs_inline), so computed once: whether it computes on the
    # CPU, and the bytes of K and V one key holds in its dtype.
    on_cpu: bool = field(init=False)
    kv_bytes_per_key: int = field(init=False)
    # Read on every decode step (Engine.decode_now): the shape of one token's input.
    one_token: tuple[int, int, int] = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.spec.attention
        self.on_cpu = self.device.type == "cpu"
        self.kv_bytes_per_key = 2 * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        self.one_token = (1, 1, cfg.embed_dim)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def view(self) -> ModelView:
        """What a front door reads of it (no module, no torch)."""
        return ModelView(self.spec, str(self.device), DTYPE_NAME[self.dtype], self.num_parameters)


@dataclass(eq=False, slots=True)
class Prepared:
    """A request the engine accepted (Engine.prepare): the request, the caller's state, and
    what its forward needs, computed once. The engine's own record of the call; nothing
    writes to it after prepare."""

    request: AttendRequest
    state: CallState
    hosted: HostedModel
    inputs: torch.Tensor  # request.inputs as a CPU tensor over the same memory, (B, L, E)
    # max |input|: bounds the step's q, k, v and output, so a step needs no check of its
    # own while they are far from overflow (mha_serve.model.overflow).
    input_absmax: float
    key: tuple  # requests of equal keys can share one forward (Engine.batch_key)
    num_keys: int  # keys each query attends to at validation (a session's past + its tokens)


def tensor_of(a: Array) -> torch.Tensor:
    """The Array's memory as a CPU tensor (no copy); never written."""
    x = torch.from_numpy(a.data)
    return x.view(torch.bfloat16) if a.dtype == "bfloat16" else x


def array_of(t: torch.Tensor) -> Array:
    """A CPU tensor as an Array over the same memory (a copy only if not contiguous)."""
    if t.requires_grad:  # (numpy() runs its own detach otherwise: no second op)
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return Array(t.view(torch.int16).numpy(), "bfloat16")
    return Array(t.numpy(), DTYPE_NAME[t.dtype])


def output_dtype(request: AttendRequest) -> torch.dtype:
    """The dtype a call's output is sent in: the one it asks for, else its input's."""
    return DTYPES[request.output_dtype or request.inputs.dtype]


def on_host(output: torch.Tensor, dtypes: list[torch.dtype]) -> torch.Tensor:
    """A batch's output on the host in one copy, so a device is waited for once per batch
    rather than once per call; converted first when every call asks for the same dtype
    (one conversion, not one per call; a conversion rounds alike on any device). Calls
    then slice it; one that asks for another dtype converts its slice."""
    if len(set(dtypes)) == 1 and dtypes[0] != output.dtype:
        output = output.to(dtypes[0])
    return output if output.is_cpu else output.cpu()


def repeat_heads(weights: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """Weights computed once per distinct head (sorted(set(heads)), dim 1) -> one slice per
    entry of heads, so listing a head many times never multiplies the work."""
    unique = sorted(set(heads))
    if unique == heads:
        return weights
    return weights[:, [unique.index(h) for h in heads]]
