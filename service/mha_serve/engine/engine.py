"""Owns the hosted attention models and runs one request on them; synchronous, no gRPC.
Engine's acceptance of a request is in prepare.py, its compute in compute.py, its session
calls in session_api.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from mha_serve.engine.compute import Computing
from mha_serve.engine.errors import ModelNotFound
from mha_serve.engine.prepare import Preparing
from mha_serve.engine.requests import AttendRequest
from mha_serve.engine.session_api import SessionAPI
from mha_serve.engine.sessions import Sessions
from mha_serve.engine.types import DTYPES, HostedModel, ModelSpec, array_of
from mha_serve.model import MultiHeadAttention, init_weights, load_checkpoint
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import is_hf_directory

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, the CPU otherwise."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} was asked for but CUDA is not available; use 'auto' or 'cpu'"
        )
    return device


def choose_attention_kernels(device: torch.device, *, cudnn: bool) -> None:
    """On CUDA, whether scaled_dot_product_attention may pick cuDNN's kernel (process-wide:
    torch's backend switch). cuDNN builds an execution plan for every new shape: 35-50 ms
    of host time on an H200 (torch 2.11, cuDNN 9.19; docs/benchmarks-gpu.md), and a
    session's keys grow by one each step, so nearly every decode step and every prompt of
    a new length would pay it. Off (the default), attention runs flash or memory-efficient
    kernels, which need no plan. A CPU device leaves the switch as it is."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on the CPU and bfloat16 (float16 without bf16 support) on CUDA."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class Engine(Preparing, Computing, SessionAPI):
    """The models of one server process. `prepare` accepts a request (every check that needs
    no compute), `run_batch` computes requests of one batch key together; `attend` is both
    for one request."""

    def __init__(
        self,
        specs: list[ModelSpec],
        *,
        device: torch.device | str,
        dtype: torch.dtype | str,
        max_response_bytes: int,
        evict_idle_sessions: bool = False,
        session_ttl_s: float | None = None,
        session_id_prefix: str = "",
        max_sessions_per_client: int = 0,
        max_cache_bytes_per_client: int = 0,
        clock: Callable[[], float] = time.monotonic,
        spill_dir: str = "",
        spill_bytes: int = 0,
        batched_attention: bool | None = None,
        cudnn_attention: bool = False,
        static_decode: str = "off",
        flash_decode: bool = False,
    ) -> None:
        """device and dtype: torch's, or their names as the config has them ("auto", "cpu",
        "cuda:1"; "auto", "float32", ...: resolve_device, resolve_dtype);
        batched_attention: Sessions' (None: batched on CUDA, per session on the CPU);
        flash_decode: Sessions' (batched decode steps read K/V in place, CUDA);
        cudnn_attention: let attention on CUDA run cuDNN's kernel (choose_attention_kernels);
        static_decode: how plain decode steps run, Sessions' ("graphs": CUDA graphs, for
        models on CUDA);
        session_id_prefix starts every session id (a Ray Serve replica's own id); clock:
        the sessions' idle time and TTL (seconds; tests give a fake one)."""
        if not specs:
            raise ValueError("no models configured: add at least one [[models]] table")
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        if isinstance(device, str):
            device = resolve_device(device)
        if isinstance(dtype, str):
            dtype = resolve_dtype(dtype, device)
        self.max_response_bytes = max_response_bytes
        choose_attention_kernels(device, cudnn=cudnn_attention)
        self.models: dict[str, HostedModel] = {}
        for spec in specs:
            self.models[spec.name] = self._load(spec, device, dtype)
        self.sessions = Sessions(
            self.models,
            evict=evict_idle_sessions,
            default_ttl_s=session_ttl_s,
            clock=clock,
            id_prefix=session_id_prefix,
            max_sessions_per_client=max_sessions_per_client,
            max_cache_bytes_per_client=max_cache_bytes_per_client,
            spill_dir=spill_dir,
            spill_bytes=spill_bytes,
            batched_attention=batched_attention,
            static_decode=static_decode,
            flash_decode=flash_decode,
        )
        if static_decode == "graphs" and device.type != "cuda":
            log.warning(
                "decode_graphs is on but the models are on %s: CUDA graphs need CUDA, so "
                "decode steps run as any step",
                device,
            )

    @staticmethod
    def _load(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> HostedModel:
        if spec.checkpoint and is_hf_directory(spec.checkpoint):
            module, _ = load_hf_layer(spec.checkpoint, spec.layer, device=device, dtype=dtype)
            if module.config != spec.attention:
                raise ValueError(
                    f"model {spec.name!r}: {spec.checkpoint} layer {spec.layer} is "
                    f"{module.config}, but the spec says {spec.attention}; leave the attention "
                    "keys out of a Hugging Face model's [[models]] table"
                )
        elif spec.checkpoint:
            try:
                module = load_checkpoint(
                    spec.checkpoint, config=spec.attention, device=device, dtype=dtype
                )
            except (FileNotFoundError, ValueError) as e:  # which model's, when several load
                raise type(e)(f"model {spec.name!r}: {e}") from e
        else:
            module = MultiHeadAttention(spec.attention, device=device, dtype=dtype)
            init_weights(module, spec.seed)
        module.eval().requires_grad_(False)
        source = spec.checkpoint or f"seed {spec.seed}"
        if spec.layer is not None:
            source += f" layer {spec.layer}"
        log.info(
            "loaded model %s (%s, %s) on %s %s",
            spec.name,
            spec.attention.variant,
            source,
            device,
            str(dtype).removeprefix("torch."),
        )
        return HostedModel(spec, module, device, dtype)

    def decodes_now(self, model: str) -> bool:
        """Whether decode_now may take plain decode steps of the model's sessions: not
        where the static decode (decode_graphs) takes them (Sessions.decodes_fixed); a
        model it does not support (MLA, a q/k norm, an output gate) or a CPU under graphs
        keeps decode_now."""
        return not self.sessions.decodes_fixed(self.get(model))

    def get(self, name: str) -> HostedModel:
        hosted = self.models.get(name)
        if hosted is None:
            raise ModelNotFound(
                f"model {name!r} is not served here; available: {', '.join(self.models)}"
            )
        return hosted

    def warmup(self) -> None:
        """One small forward per model (both paths), so the first request pays no lazy init."""
        for name, hosted in self.models.items():
            embed_dim = hosted.spec.attention.embed_dim
            x = array_of(torch.zeros(1, 4, embed_dim))
            self.attend(AttendRequest(model=name, inputs=x))
            self.attend(AttendRequest(model=name, inputs=x, need_weights=True, lengths=(3,)))
