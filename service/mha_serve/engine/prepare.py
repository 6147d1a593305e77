"""Accepting a request (Engine.prepare): every check that needs no compute, so that a bad
request is refused before it queues, the response's size among them; and the batch key of an
accepted one. Part of Engine (engine.py), kept in a file of its own."""

from __future__ import annotations

import math

from mha_serve.engine.checks import array_absmax
from mha_serve.engine.errors import InvalidRequest, TooLarge
from mha_serve.engine.requests import UNATTENDED, AttendRequest, CallState
from mha_serve.engine.session_api import checked_session_id
from mha_serve.engine.types import DTYPES, HostedModel, Prepared, tensor_of

# Room left in a response for everything that is not tensor data.
RESPONSE_OVERHEAD_BYTES = 64 * 1024
# The batch key of a session step without a head mask (batch_key): most steps'.
PLAIN_STEP_KEY = ("session", None)


# How an Attend narrows weights over the limit (AnalyzeHeads, which reads every head and
# row, says otherwise: engine/heads.py).
NARROW_WEIGHTS = (
    "narrow the request: fewer heads (weights.heads), a range of query rows "
    "(weights.query_start/query_end), or float16/bfloat16 weights (weights.dtype)"
)


class Preparing:
    """Engine's acceptance of a request (mixed into it; its state is Engine's: models,
    sessions, max_response_bytes)."""

    def prepare(self, request: AttendRequest, state: CallState = UNATTENDED) -> Prepared:
        """Every check that needs no compute, so a bad request is refused before it queues;
        the engine's record of the call (its tensor, bounds and batch key) once accepted.
        state: what the caller's side tracks of the call (deadline, cancellation, claim). A
        session step that leaves the model empty computes on its session's (Prepared.hosted)."""
        model = request.model
        if not model and request.session_id is not None:
            model = self.sessions.model_of(checked_session_id(request.session_id))
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
            chunk = cfg.chunk_size  # (Llama 4's chunked layers: served up to one chunk)
            why = "" if chunk is None else f" (its attention_chunk_size is {chunk})"
            raise InvalidRequest(
                f"seq_len {seq_len} exceeds model {spec.name!r} max_seq_len {spec.max_seq_len}{why}; split the input"
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

    def output_fits(self, out_bytes: int) -> bool:
        """Whether a response with out_bytes of output fits the response limit, with the room
        kept for its other fields."""
        return out_bytes + RESPONSE_OVERHEAD_BYTES <= self.max_response_bytes

    def _check_response_size(self, hosted: HostedModel, call: AttendRequest, num_keys: int) -> None:
        batch, seq_len, embed_dim = call.inputs.shape
        out_dtype = DTYPES[call.output_dtype or call.inputs.dtype]
        out_bytes = batch * seq_len * embed_dim * out_dtype.itemsize
        if not self.output_fits(out_bytes):
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
                f"is {_mib(limit)}; {NARROW_WEIGHTS}"
            )

    @staticmethod
    def batch_key(hosted: HostedModel, call: AttendRequest) -> tuple:
        """Calls with equal keys can share one forward pass (same masking and head gates)."""
        if call.session_id is not None:  # session steps batch with each other (always causal)
            return PLAIN_STEP_KEY if call.head_mask is None else ("session", call.head_mask)
        causal = hosted.spec.attention.causal if call.causal is None else call.causal
        return (causal, call.head_mask)


def _mib(num_bytes: int) -> str:
    """Human-readable size: '512.0 MiB', '8.0 KiB'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"
