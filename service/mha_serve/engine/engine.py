"""Owns the hosted attention models and runs one request on them; synchronous, no gRPC."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from mha_serve.cache import SessionSpilled, SessionStats, SpillInfo
from mha_serve.engine.bounds import cleared, gate_absmax
from mha_serve.engine.checks import array_absmax, require_finite, scores_overflow_error
from mha_serve.engine.errors import InvalidRequest, ModelNotFound, TooLarge
from mha_serve.engine.requests import (
    UNATTENDED,
    AttendOutcome,
    AttendRequest,
    CacheInfo,
    CallState,
)
from mha_serve.engine.sessions import Sessions
from mha_serve.engine.types import (
    DTYPE_NAME,
    DTYPES,
    HostedModel,
    ModelSpec,
    Prepared,
    array_of,
    on_host,
    output_dtype,
    repeat_heads,
    tensor_of,
)
from mha_serve.model import MultiHeadAttention, init_weights, load_checkpoint
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import is_hf_directory
from mha_serve.model.overflow import weight_bounds

log = logging.getLogger(__name__)
T = TypeVar("T")

# Room left in a response for everything that is not tensor data.
RESPONSE_OVERHEAD_BYTES = 64 * 1024
# A request this small runs on the event loop's thread when its lane is idle (Engine.
# runs_inline, batching/batcher.py): at most this many tokens, attending (on the CPU) to at
# most INLINE_MAX_KV_BYTES of keys' K/V. Larger work keeps the compute thread and its torch
# threads.
INLINE_MAX_TOKENS = 16
# A call on a spilled session brings it back, then runs; spilled again before it ran (another
# session needed the room), it tries this many times in all.
RESTORE_TRIES = 3
INLINE_MAX_KV_BYTES = 4 << 20


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


class Engine:
    """The models of one server process. `prepare` accepts a request (every check that needs
    no compute), `run_batch` computes requests of one batch key together; `attend` is both
    for one request."""

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
        spill_dir: str = "",
        spill_bytes: int = 0,
        batched_attention: bool | None = None,
        cudnn_attention: bool = False,
        static_decode: str = "off",
        flash_decode: bool = False,
    ) -> None:
        """batched_attention: Sessions' (None: batched on CUDA, per session on the CPU);
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

    def prepare(self, request: AttendRequest, state: CallState = UNATTENDED) -> Prepared:
        """Every check that needs no compute, so a bad request is refused before it queues;
        the engine's record of the call (its tensor, bounds and batch key) once accepted.
        state: what the caller's side tracks of the call (deadline, cancellation, claim). A
        session step that leaves the model empty computes on its session's (Prepared.hosted)."""
        model = request.model
        if not model and request.session_id is not None:
            model = self.sessions.model_of(_session_id(request.session_id))
        hosted = self.get(model)
        spec, cfg = hosted.spec, hosted.spec.attention
        inputs = request.inputs
        shape = list(inputs.shape)
        if len(shape) != 3:
            raise InvalidRequest(
                f"input must be (batch, seq_len, embed_dim) or (seq_len, embed_dim); got shape {shape}"
            )
        batch, seq_len, embed_dim = shape
        if batch == 0 or seq_len == 0:
            raise InvalidRequest(f"input is empty (shape {shape}); send at least one token")
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
        output_dtype = request.output_dtype or inputs.dtype
        if not (
            inputs.dtype in DTYPES and request.weights_dtype in DTYPES and output_dtype in DTYPES
        ):
            for what, name in (
                ("input dtype", inputs.dtype),
                ("weights dtype", request.weights_dtype),
                ("output dtype", output_dtype),
            ):
                if name not in DTYPES:
                    raise InvalidRequest(f"{what} {name} is not one of float32, float16, bfloat16")
        lengths = request.lengths
        if lengths is not None:
            if len(lengths) != batch:
                raise InvalidRequest(
                    f"lengths has {len(lengths)} entries for a batch of {batch}; give one per sequence or none"
                )
            bad = [(i, n) for i, n in enumerate(lengths) if not 1 <= n <= seq_len]
            if bad:
                i, n = bad[0]
                raise InvalidRequest(
                    f"lengths[{i}] = {n} is out of range: each length must be in 1..{seq_len} (the padded seq_len)"
                )
        head_mask = request.head_mask
        if head_mask is not None and len(head_mask) != cfg.num_heads:
            raise InvalidRequest(
                f"head_mask has {len(head_mask)} values; model {spec.name!r} has {cfg.num_heads} heads"
            )
        if head_mask is not None and not all(v == v and abs(v) != math.inf for v in head_mask):
            raise InvalidRequest("head_mask contains NaN or Inf")
        tensor = tensor_of(inputs)
        input_absmax = array_absmax(inputs, tensor)  # one pass: the finiteness check, bounds
        if not input_absmax < math.inf:
            raise InvalidRequest("input contains NaN or Inf values; send finite embeddings")
        num_keys = seq_len
        if request.session_id is not None:  # keys: what the session holds, plus the new tokens
            num_keys += self.sessions.validate_step(hosted, request)
        self._check_response_size(hosted, request, num_keys)
        return Prepared(
            request,
            state,
            hosted,
            tensor,
            input_absmax,
            self.batch_key(hosted, request),
            num_keys,
        )

    def _check_response_size(self, hosted: HostedModel, call: AttendRequest, num_keys: int) -> None:
        batch, seq_len, embed_dim = call.inputs.shape
        out_dtype = DTYPES[call.output_dtype or call.inputs.dtype]
        out_bytes = batch * seq_len * embed_dim * out_dtype.itemsize
        if out_bytes + RESPONSE_OVERHEAD_BYTES > self.max_response_bytes:
            room = self.max_response_bytes - RESPONSE_OVERHEAD_BYTES
            narrower = (
                "ask for output_dtype float16 or bfloat16, " if out_dtype.itemsize > 2 else ""
            )
            fewer = (
                "send fewer tokens per step"
                if call.session_id
                else "send fewer or shorter sequences per request"
            )
            raise TooLarge(
                f"the output alone is {_mib(out_bytes)} ({batch} x {seq_len} x {embed_dim} "
                f"{str(out_dtype).removeprefix('torch.')}) but responses are limited to "
                f"{_mib(self.max_response_bytes)}, of which {_mib(RESPONSE_OVERHEAD_BYTES)} is "
                f"kept for the reply's other fields: at most {_mib(max(room, 0))} of output; "
                f"{fewer}, {narrower}or raise the server's --max-send-message-bytes"
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
        itemsize = DTYPES[call.weights_dtype].itemsize
        size = batch * len(heads) * rows * num_keys * itemsize
        limit = min(
            hosted.spec.max_weights_bytes,
            self.max_response_bytes - out_bytes - RESPONSE_OVERHEAD_BYTES,
        )
        if size > limit:
            raise TooLarge(
                f"attention weights would be {_mib(size)} (batch {batch} x {len(heads)} heads x "
                f"{rows} query rows x {num_keys} keys x {itemsize} bytes) but the limit "
                f"is {_mib(limit)}; narrow the request: fewer heads (weights.heads), a range of query "
                f"rows (weights.query_start/query_end), or float16/bfloat16 weights (weights.dtype)"
            )

    def attend(self, request: AttendRequest, state: CallState = UNATTENDED) -> AttendOutcome:
        """Prepares, then computes one request; raises RequestError subclasses for bad calls.
        A spilled session is brought back first."""
        if request.session_id:
            sid = request.session_id
            return self.live(sid, None, lambda: self.run(self.prepare(request, state)))
        return self.run(self.prepare(request, state))

    def run(self, p: Prepared) -> AttendOutcome:
        """The forward pass of one prepared request."""
        (outcome,) = self.run_batch(p.hosted, [p])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _run_one(self, p: Prepared) -> AttendOutcome:
        """A stateless request alone: its forward, its weights when asked."""
        hosted, call = p.hosted, p.request
        start = time.perf_counter()
        batch, seq_len, _ = call.inputs.shape
        x = p.inputs.to(hosted.device, hosted.dtype, non_blocking=True)
        lengths = None  # a list: the module checks it on the host (a device tensor would sync)
        if call.lengths is not None and any(n != seq_len for n in call.lengths):
            lengths = list(call.lengths)
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
                check_overflow=not _proven(hosted, [p]),
            )
            output = out.output.to(DTYPES[call.output_dtype or call.inputs.dtype])
            # Contiguous on the compute thread: encoding then runs no torch copy elsewhere.
            output = output.cpu().contiguous()
            weights = None
            if out.weights is not None:
                weights = repeat_heads(out.weights, heads).to(DTYPES[call.weights_dtype])
                weights = weights.cpu().contiguous()
            if out.overflow.rows():  # read with the output, never before the forward ends
                raise scores_overflow_error(hosted.dtype)
            require_finite(output, "output")
            if weights is not None:
                require_finite(weights, "attention weights")
        return AttendOutcome(
            output=array_of(output),
            weights=None if weights is None else array_of(weights),
            weight_heads=tuple(heads) if call.need_weights else (),
            weight_query_start=call.query_start if call.need_weights else 0,
            compute_ms=(time.perf_counter() - start) * 1e3,
            batch_size=batch,
        )

    @staticmethod
    def runs_inline(p: Prepared) -> bool:
        """Whether a prepared request is small enough to run on the event loop's thread,
        single-threaded, when its lane is idle: no weights, few tokens, a short context."""
        batch, seq_len, _ = p.inputs.shape
        if p.request.need_weights or batch * seq_len > INLINE_MAX_TOKENS:
            return False
        hosted = p.hosted
        if not hosted.on_cpu:
            # The kernels run on the device: the loop's thread only launches them and waits
            # for the output (tens of microseconds at any context), which costs less than
            # the two thread crossings it saves.
            return True
        return batch * p.num_keys * hosted.kv_bytes_per_key <= INLINE_MAX_KV_BYTES

    @staticmethod
    def batch_key(hosted: HostedModel, call: AttendRequest) -> tuple:
        """Calls with equal keys can share one forward pass (same masking and head gates)."""
        if call.session_id is not None:  # session steps batch with each other (always causal)
            return ("session", call.head_mask)
        causal = hosted.spec.attention.causal if call.causal is None else call.causal
        return (causal, call.head_mask)

    def run_batch(
        self, hosted: HostedModel, batch: list[Prepared]
    ) -> list[AttendOutcome | Exception]:
        """Prepared requests of one model with equal `key` as one padded forward (requests
        for weights come one at a time). Sequences are padded to the longest; the model
        masks padding, so each outcome equals the request run alone
        (tests/engine/test_batching.py)."""
        if batch[0].request.session_id is not None:
            return self.sessions.run_steps(hosted, batch, self._check_response_size)
        if len(batch) == 1:
            try:
                return [self._run_one(batch[0])]
            except InvalidRequest as e:
                return [e]
        assert not any(p.request.need_weights for p in batch), "weights calls run one by one"
        start = time.perf_counter()
        longest = max(p.inputs.shape[1] for p in batch)
        total = sum(p.inputs.shape[0] for p in batch)
        embed_dim = hosted.spec.attention.embed_dim
        # Uninitialised padding is fine: the model zeroes padded positions before projecting.
        x = torch.empty(total, longest, embed_dim, device=hosted.device, dtype=hosted.dtype)
        lengths: list[int] = []
        row = 0
        for p in batch:
            n, seq_len, _ = p.inputs.shape
            x[row : row + n, :seq_len].copy_(p.inputs, non_blocking=True)
            lengths += p.request.lengths if p.request.lengths is not None else [seq_len] * n
            row += n
        padded = any(n != longest for n in lengths)
        lengths_t = lengths if padded else None  # checked on the host by the module
        first = batch[0].request
        head_mask = None
        if first.head_mask is not None:
            head_mask = torch.tensor(first.head_mask, dtype=hosted.dtype, device=hosted.device)
        with torch.inference_mode():
            forward = hosted.module(
                x,
                lengths=lengths_t,
                causal=first.causal,
                head_mask=head_mask,
                check_overflow=not _proven(hosted, batch),
            )
            dtypes = [output_dtype(p.request) for p in batch]
            host = on_host(forward.output, dtypes)  # one copy for the batch
            outputs = []
            row = 0
            for p, dtype in zip(batch, dtypes, strict=True):
                n, seq_len, _ = p.inputs.shape
                out = host[row : row + n, :seq_len]
                outputs.append(out.to(dtype).contiguous())  # the copies we send
                row += n
            overflow = set(forward.overflow.rows())  # read with the outputs
        results: list[AttendOutcome | Exception] = []
        compute_ms = (time.perf_counter() - start) * 1e3
        row = 0
        for p, output in zip(batch, outputs, strict=True):
            n = p.inputs.shape[0]
            try:
                if overflow.intersection(range(row, row + n)):
                    raise scores_overflow_error(hosted.dtype)
                require_finite(output, "output")
                results.append(
                    AttendOutcome(array_of(output), None, compute_ms=compute_ms, batch_size=total)
                )
            except InvalidRequest as e:  # only this call's caller hears of it
                results.append(e)
            row += n
        return results

    # --- sessions: the one API every front door calls (through Sessions alone) ----------

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
        return self.sessions.create(model, max_len, ttl_s, owner)

    # Every call on a session takes `owner`, the caller's identity: a session made by an
    # identified client (cache.types.IDENTIFIED) answers it alone, NOT_FOUND to others as
    # for an id never made; None skips the check (the engine's own calls). A spilled session
    # is brought back first (live()).

    def get_session(self, session_id: str, owner: str | None = None) -> SessionStats:
        sid = _session_id(session_id)
        return self.live(sid, owner, lambda: self.sessions.stats(sid, owner))

    def session_model(self, session_id: str) -> str:
        """The model of a session, live or spilled (SessionNotFound says why there is none)."""
        return self.sessions.model_of(_session_id(session_id))

    def fork_session(
        self, session_id: str, ttl_s: float | None = None, owner: str | None = None
    ) -> SessionStats:
        """A new session sharing the parent's tokens (copy-on-write); ttl_s None: the parent's."""
        sid = _session_id(session_id)
        return self.live(sid, owner, lambda: self.sessions.fork(sid, ttl_s, owner))

    def truncate_session(
        self, session_id: str, num_tokens: int, owner: str | None = None
    ) -> SessionStats:
        sid = _session_id(session_id)
        return self.live(sid, owner, lambda: self.sessions.truncate(sid, num_tokens, owner))

    def close_session(self, session_id: str, owner: str | None = None) -> None:
        self.sessions.close(_session_id(session_id), owner)  # a spilled one's file just goes

    def live(self, session_id: str, owner: str | None, call: Callable[[], T]) -> T:
        """call(), bringing the session back from the spill tier first when it is there
        (restore_session: the file read here; AsyncEngine does it off the event loop)."""
        for _ in range(RESTORE_TRIES):
            try:
                return call()
            except SessionSpilled:  # (spilled again meanwhile, to make room: once more)
                self.restore_session(session_id, owner)
        return call()

    def is_spilled(self, session_id: str) -> bool:
        """Whether the session is in the spill tier (its next call brings it back)."""
        return bool(session_id) and self.sessions.table.spilled(session_id) is not None

    def restore_session(self, session_id: str, owner: str | None = None) -> float:
        """Brings a spilled session back; seconds it took (0: it was not spilled)."""
        return self.sessions.restore(_session_id(session_id), owner)

    def spill_idle(self) -> list[str]:
        """Every idle session written to the spill tier (at shutdown, once drained)."""
        return self.sessions.spill_idle()

    def adopt_spilled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """At start: the sessions the spill directory holds, taken over (their ids, and the
        files refused with why)."""
        return self.sessions.adopt_spilled()

    def close_spill(self) -> None:
        self.sessions.close_spill()

    def spill_info(self) -> SpillInfo:
        """The spill tier's sessions, bytes and budget; zeros without one."""
        return self.sessions.table.spill_info()

    @property
    def spills(self) -> bool:
        """Whether a spill tier is set (session_spill_dir)."""
        return self.sessions.table.spill is not None

    # --- moves: a session leaves this engine whole for another's (a Ray replica stopping) --

    def session_ids(self) -> list[str]:
        """Every session held, live or spilled, the least recently used first."""
        return self.sessions.table.session_ids()

    def pack_session(self, session_id: str) -> bytes:
        """The session as one record's bytes (a spill file's form) for receive_session on
        another engine with the same model; it stays here until session_moved. SessionBusy
        while a call holds it."""
        return self.sessions.table.pack(_session_id(session_id))

    def session_moved(self, session_id: str, where: str) -> None:
        """The session was received elsewhere: freed here; its later calls here are told
        NOT_FOUND saying it moved to `where`."""
        self.sessions.table.moved_out(_session_id(session_id), where)

    def receive_session(self, data: bytes, source: str = "a moved session") -> SessionStats:
        """Adopts a session packed by another engine, under its id, owner, limits and idle
        time: into the KV cache (making room as a step does), else the spill tier. BadRecord
        (not a session of a model served here, saying why), SessionExists, SessionNotFound
        (expired meanwhile), CacheExhausted / SpillFull (no room)."""
        return self.sessions.table.receive(data, source)

    def on_session_spill(self, hook: Callable[[str, int, str], None]) -> None:
        """hook(model, bytes, reason) each time a session is spilled ("room", "shutdown")."""
        self.sessions.table.on_spill = hook

    def expire_sessions(self) -> list[str]:
        """Frees idle sessions past their TTL (lookups also expire them lazily)."""
        return self.sessions.expire()

    def on_session_end(self, hook: Callable[[str], None]) -> None:
        """hook(reason) each time a session ends: "closed", "expired" or "evicted"."""
        self.sessions.on_end(hook)

    def claim(self, session_id: str, owner: str | None = None) -> None:
        """Claims a session for one step from its receipt to its answer (release it then:
        Sessions.claim); SessionSpilled when it is in the spill tier (restore_session it
        first). Plain calls, not a context manager: a few microseconds less on every step."""
        self.sessions.claim(_session_id(session_id), owner)

    def release(self, session_id: str) -> None:
        """The step claim() claimed is answered, or failed."""
        self.sessions.release(session_id)

    def stepping(self, session_id: str, owner: str | None = None):
        """claim, as a context manager (Sessions.stepping)."""
        return self.sessions.stepping(_session_id(session_id), owner)

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
            num_blocks_used=self.sessions.num_blocks_used(model),
            num_sessions=self.sessions.num_sessions(model),
            evict_idle_sessions=self.sessions.evicts,
            dtype=DTYPE_NAME[cache.dtype],
            num_blocks_out_of_window=self.sessions.num_blocks_out_of_window(model),
        )

    def warmup(self) -> None:
        """One small forward per model (both paths), so the first request pays no lazy init."""
        for name, hosted in self.models.items():
            embed_dim = hosted.spec.attention.embed_dim
            x = array_of(torch.zeros(1, 4, embed_dim))
            self.attend(AttendRequest(model=name, inputs=x))
            self.attend(AttendRequest(model=name, inputs=x, need_weights=True, lengths=(3,)))


def _proven(hosted: HostedModel, batch: list[Prepared]) -> bool:
    """Whether every request's max |input| proves its forward cannot overflow (so the model
    takes no maxima to check it): engine/bounds.py."""
    gate = gate_absmax(batch[0].request.head_mask)
    wb = weight_bounds(hosted.module)  # once for the batch
    return all(
        cleared(hosted, hosted.dtype, p.input_absmax, 0.0, gate, wb) is not None for p in batch
    )


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
