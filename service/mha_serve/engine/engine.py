"""Owns the hosted attention models and runs one request on them; synchronous, no gRPC."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from mha_serve.cache import SessionStats
from mha_serve.engine.errors import (
    InvalidRequest,
    ModelNotFound,
    TooLarge,
    absmax,
    require_finite,
    scores_overflow_error,
)
from mha_serve.engine.sessions import Sessions
from mha_serve.engine.types import (
    DTYPES,
    AttendCall,
    AttendResult,
    CacheInfo,
    HostedModel,
    ModelSpec,
    repeat_heads,
)
from mha_serve.model import MultiHeadAttention, init_weights, load_checkpoint
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import is_hf_directory

log = logging.getLogger(__name__)

WIRE_DTYPES = tuple(DTYPES.values())
# Room left in a response for everything that is not tensor data.
RESPONSE_OVERHEAD_BYTES = 64 * 1024


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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is float32 on the CPU and bfloat16 (float16 without bf16 support) on CUDA."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class Engine:
    """The models of one server process; `attend` runs one call to completion."""

    def __init__(
        self,
        specs: list[ModelSpec],
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_response_bytes: int,
        evict_idle_sessions: bool = False,
        session_ttl_s: float | None = None,
        session_id_prefix: str = "",
        max_sessions_per_client: int = 0,
        max_cache_bytes_per_client: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """session_id_prefix starts every session id (a Ray Serve replica's own id); clock:
        the sessions' idle time and TTL (seconds; tests give a fake one)."""
        if not specs:
            raise ValueError("no models configured: add at least one [[models]] table")
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        self.max_response_bytes = max_response_bytes
        self.models: dict[str, HostedModel] = {}
        for spec in specs:
            self.models[spec.name] = self._load(spec, device, dtype)
        self.sessions = Sessions(
            self.models, evict=evict_idle_sessions, default_ttl_s=session_ttl_s, clock=clock
        )
        self.sessions.table.id_prefix = session_id_prefix
        self.sessions.table.set_client_limits(
            max_sessions=max_sessions_per_client, max_bytes=max_cache_bytes_per_client
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
            module = load_checkpoint(
                spec.checkpoint, config=spec.attention, device=device, dtype=dtype
            )
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

    def get(self, name: str) -> HostedModel:
        hosted = self.models.get(name)
        if hosted is None:
            raise ModelNotFound(
                f"model {name!r} is not served here; available: {', '.join(self.models)}"
            )
        return hosted

    def validate(self, call: AttendCall) -> HostedModel:
        """Every check that needs no compute, so a bad request is refused before it queues."""
        hosted = self.get(call.model)
        spec, cfg = hosted.spec, hosted.spec.attention
        x = call.inputs
        if x.dim() != 3:
            raise InvalidRequest(
                f"input must be (batch, seq_len, embed_dim) or (seq_len, embed_dim); got shape {list(x.shape)}"
            )
        batch, seq_len, embed_dim = x.shape
        if batch == 0 or seq_len == 0:
            raise InvalidRequest(f"input is empty (shape {list(x.shape)}); send at least one token")
        if embed_dim != cfg.embed_dim:
            raise InvalidRequest(
                f"model {spec.name!r} expects embed_dim {cfg.embed_dim}, got {embed_dim}"
            )
        if seq_len > spec.max_seq_len:
            raise InvalidRequest(
                f"seq_len {seq_len} exceeds model {spec.name!r} max_seq_len {spec.max_seq_len}; split the input"
            )
        if batch > spec.max_batch_size:
            raise InvalidRequest(
                f"batch {batch} exceeds model {spec.name!r} max_batch_size {spec.max_batch_size}; send fewer sequences per request"
            )
        if x.dtype not in WIRE_DTYPES:
            raise InvalidRequest(f"input dtype {x.dtype} is not one of float32, float16, bfloat16")
        if call.lengths is not None:
            if len(call.lengths) != batch:
                raise InvalidRequest(
                    f"lengths has {len(call.lengths)} entries for a batch of {batch}; give one per sequence or none"
                )
            bad = [(i, n) for i, n in enumerate(call.lengths) if not 1 <= n <= seq_len]
            if bad:
                i, n = bad[0]
                raise InvalidRequest(
                    f"lengths[{i}] = {n} is out of range: each length must be in 1..{seq_len} (the padded seq_len)"
                )
        if call.head_mask is not None and len(call.head_mask) != cfg.num_heads:
            raise InvalidRequest(
                f"head_mask has {len(call.head_mask)} values; model {spec.name!r} has {cfg.num_heads} heads"
            )
        if call.head_mask is not None and not all(
            v == v and abs(v) != float("inf") for v in call.head_mask
        ):
            raise InvalidRequest("head_mask contains NaN or Inf")
        call.input_absmax = absmax(x)  # one pass: the finiteness check, and overflow bounds
        if not call.input_absmax < math.inf:
            raise InvalidRequest("input contains NaN or Inf values; send finite embeddings")
        num_keys = seq_len
        if call.session_id is not None:  # keys: everything the session holds, plus the new tokens
            num_keys += self.sessions.validate_step(hosted, call).num_tokens
        self._check_response_size(hosted, call, num_keys)
        return hosted

    def _check_response_size(self, hosted: HostedModel, call: AttendCall, num_keys: int) -> None:
        batch, seq_len, embed_dim = call.inputs.shape
        out_dtype = call.output_dtype or call.inputs.dtype
        out_bytes = batch * seq_len * embed_dim * out_dtype.itemsize
        if out_bytes + RESPONSE_OVERHEAD_BYTES > self.max_response_bytes:
            raise TooLarge(
                f"the output alone is {_mib(out_bytes)} but responses are limited to "
                f"{_mib(self.max_response_bytes)}; send fewer sequences per request"
            )
        if not call.need_weights:
            return
        num_heads = hosted.spec.attention.num_heads
        heads = call.heads(num_heads)
        bad = [h for h in heads if not 0 <= h < num_heads]
        if bad:
            raise InvalidRequest(
                f"weights head {bad[0]} is out of range: model {hosted.spec.name!r} has heads 0..{num_heads - 1}"
            )
        if not heads:
            raise InvalidRequest(
                "weights.heads is empty after selection; list at least one head or leave it empty for all"
            )
        start, end = call.query_start, call.query_end or seq_len
        if not 0 <= start < end <= seq_len:
            raise InvalidRequest(
                f"weights query rows [{call.query_start}, {call.query_end}) are not a non-empty range within seq_len {seq_len}"
            )
        rows = end - start
        size = batch * len(heads) * rows * num_keys * call.weights_dtype.itemsize
        limit = min(
            hosted.spec.max_weights_bytes,
            self.max_response_bytes - out_bytes - RESPONSE_OVERHEAD_BYTES,
        )
        if size > limit:
            raise TooLarge(
                f"attention weights would be {_mib(size)} (batch {batch} x {len(heads)} heads x "
                f"{rows} query rows x {num_keys} keys x {call.weights_dtype.itemsize} bytes) but the limit "
                f"is {_mib(limit)}; narrow the request: fewer heads (weights.heads), a range of query "
                f"rows (weights.query_start/query_end), or float16/bfloat16 weights (weights.dtype)"
            )

    def attend(self, call: AttendCall) -> AttendResult:
        """Validates, then runs the forward pass; raises RequestError subclasses for bad calls."""
        return self.run(self.validate(call), call)

    def run(self, hosted: HostedModel, call: AttendCall) -> AttendResult:
        """The forward pass of a call that `validate` accepted (returning `hosted`)."""
        if call.session_id is not None:
            (result,) = self.sessions.run_steps(hosted, [call], self._check_response_size)
            if isinstance(result, Exception):
                raise result
            return result
        start = time.perf_counter()
        batch, seq_len, _ = call.inputs.shape
        x = call.inputs.to(hosted.device, hosted.dtype, non_blocking=True)
        lengths = None
        if call.lengths is not None and any(n != seq_len for n in call.lengths):
            lengths = torch.tensor(call.lengths, dtype=torch.long, device=hosted.device)
        head_mask = None
        if call.head_mask is not None:
            head_mask = torch.tensor(call.head_mask, dtype=hosted.dtype, device=hosted.device)
        heads = call.heads(hosted.spec.attention.num_heads)
        query_end = call.query_end or seq_len
        with torch.inference_mode():
            out = hosted.module(
                x,
                lengths=lengths,
                causal=call.causal,
                need_weights=call.need_weights,
                weight_heads=sorted(set(heads)) if call.need_weights else None,
                query_range=(call.query_start, query_end) if call.need_weights else None,
                head_mask=head_mask,
            )
            if out.overflow:
                raise scores_overflow_error(hosted.dtype)
            output = require_finite(out.output.to(call.output_dtype or call.inputs.dtype), "output")
            weights = None
            if out.weights is not None:
                weights = repeat_heads(out.weights, heads).to(call.weights_dtype)
                weights = require_finite(weights, "attention weights")
            # Contiguous on the compute thread: encoding then runs no torch copy elsewhere.
            output = output.cpu().contiguous()
            weights = None if weights is None else weights.cpu().contiguous()
        return AttendResult(
            output=output,
            weights=weights,
            weight_heads=list(heads) if call.need_weights else [],
            weight_query_start=call.query_start if call.need_weights else 0,
            compute_ms=(time.perf_counter() - start) * 1e3,
            batch_size=batch,
        )

    @staticmethod
    def batch_key(hosted: HostedModel, call: AttendCall) -> tuple:
        """Calls with equal keys can share one forward pass (same masking and head gates)."""
        head_mask = tuple(call.head_mask) if call.head_mask is not None else None
        if call.session_id is not None:  # session steps batch with each other (always causal)
            return ("session", head_mask)
        causal = hosted.spec.attention.causal if call.causal is None else call.causal
        return (causal, head_mask)

    def run_batch(
        self, hosted: HostedModel, calls: list[AttendCall]
    ) -> list[AttendResult | Exception]:
        """Several validated calls with equal `batch_key` and no weights as one padded forward.

        Sequences are padded to the longest; the model masks padding, so each result equals
        the call run alone (tests/engine/test_batching.py).
        """
        if calls[0].session_id is not None:
            return self.sessions.run_steps(hosted, calls, self._check_response_size)
        if len(calls) == 1:
            try:
                return [self.run(hosted, calls[0])]
            except InvalidRequest as e:
                return [e]
        assert not any(c.need_weights for c in calls), "weights calls run one by one (run)"
        start = time.perf_counter()
        longest = max(c.inputs.shape[1] for c in calls)
        total = sum(c.inputs.shape[0] for c in calls)
        embed_dim = hosted.spec.attention.embed_dim
        # Uninitialised padding is fine: the model zeroes padded positions before projecting.
        x = torch.empty(total, longest, embed_dim, device=hosted.device, dtype=hosted.dtype)
        lengths: list[int] = []
        row = 0
        for c in calls:
            batch, seq_len, _ = c.inputs.shape
            x[row : row + batch, :seq_len].copy_(c.inputs, non_blocking=True)
            lengths += c.lengths if c.lengths is not None else [seq_len] * batch
            row += batch
        padded = any(n != longest for n in lengths)
        lengths_t = torch.tensor(lengths, device=hosted.device) if padded else None
        first = calls[0]
        head_mask = None
        if first.head_mask is not None:
            head_mask = torch.tensor(first.head_mask, dtype=hosted.dtype, device=hosted.device)
        with torch.inference_mode():
            forward = hosted.module(x, lengths=lengths_t, causal=first.causal, head_mask=head_mask)
        out, overflow = forward.output, set(forward.overflow)
        results, row = [], 0
        compute_ms = (time.perf_counter() - start) * 1e3
        for c in calls:
            batch, seq_len, _ = c.inputs.shape
            try:
                if overflow.intersection(range(row, row + batch)):
                    raise scores_overflow_error(hosted.dtype)
                output = out[row : row + batch, :seq_len].to(c.output_dtype or c.inputs.dtype)
                output = require_finite(output.cpu().contiguous(), "output")  # the copy we send
                results.append(AttendResult(output, None, compute_ms=compute_ms, batch_size=total))
            except InvalidRequest as e:  # only this call's caller hears of it
                results.append(e)
            row += batch
        return results

    # --- sessions: the one API every front door calls ----------------------------------

    def create_session(
        self,
        model: str,
        max_len: int | None = None,
        ttl_s: float | None = None,
        owner: str = "",
    ) -> SessionStats:
        """A new empty session of `model` (max_len None: the model's; ttl_s None: default);
        owner: the client whose per-client limits it counts against ("": none)."""
        if not model:
            raise InvalidRequest("model is empty; name one of the models ListModels returns")
        self.get(model)
        session = self.sessions.create(model, max_len, ttl_s, owner)
        return self.sessions.table.session_stats(session.id)

    def get_session(self, session_id: str) -> SessionStats:
        return self.sessions.table.session_stats(_session_id(session_id))

    def session_model(self, session_id: str) -> str:
        """The model of a live session (SessionNotFound says why there is none)."""
        return self.sessions.table.get(_session_id(session_id)).model

    def fork_session(self, session_id: str, ttl_s: float | None = None) -> SessionStats:
        """A new session sharing the parent's tokens (copy-on-write); ttl_s None: the parent's."""
        table = self.sessions.table
        return table.session_stats(table.fork(_session_id(session_id), ttl_s=ttl_s).id)

    def truncate_session(self, session_id: str, num_tokens: int) -> SessionStats:
        session = self.sessions.truncate(_session_id(session_id), num_tokens)
        return self.sessions.table.session_stats(session.id)

    def close_session(self, session_id: str) -> None:
        self.sessions.table.close(_session_id(session_id))

    def expire_sessions(self) -> list[str]:
        """Frees idle sessions past their TTL (lookups also expire them lazily)."""
        return self.sessions.table.expire()

    def on_session_end(self, hook) -> None:
        """hook(reason) each time a session ends: "closed", "expired" or "evicted"."""
        self.sessions.table.on_end = hook

    def stepping(self, session_id: str):
        """Claims a session for one step from its receipt to its answer (Sessions.stepping)."""
        return self.sessions.stepping(session_id)

    def cache_info(self, model: str) -> CacheInfo | None:
        """The model's KV cache, None when it serves no sessions."""
        cache = self.sessions.caches.get(model)
        if cache is None:
            return None
        return CacheInfo(
            budget_bytes=cache.budget_bytes,
            block_size=cache.block_size,
            bytes_per_token=cache.bytes_per_token,
            bytes_per_block=cache.bytes_per_block,
            num_blocks=cache.num_blocks,
            num_blocks_used=self.sessions.table.pool(model).num_used,
            num_sessions=self.sessions.num_sessions(model),
            evict_idle_sessions=self.sessions.table.evict,
            dtype=cache.dtype,
            num_blocks_out_of_window=self.sessions.table.num_blocks_out_of_window(model),
        )

    def warmup(self) -> None:
        """One small forward per model (both paths), so the first request pays no lazy init."""
        for name, hosted in self.models.items():
            embed_dim = hosted.spec.attention.embed_dim
            x = torch.zeros(1, 4, embed_dim)
            self.attend(AttendCall(model=name, inputs=x))
            self.attend(AttendCall(model=name, inputs=x, need_weights=True, lengths=[3]))


def _session_id(session_id: str) -> str:
    if not session_id:
        raise InvalidRequest("session_id is empty; CreateSession returns one")
    return session_id


def _mib(num_bytes: int) -> str:
    """Human-readable size: '512.0 MiB', '8.0 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"
