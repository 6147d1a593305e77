"""The SDK's values and wire forms: decoded replies (ModelInfo, SessionInfo, AttendResult) and
the AttendRequest a call sends, shared by the blocking and the asyncio clients."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
from google.protobuf.message import DecodeError

from mha_client.api import attention_pb2 as pb
from mha_client.errors import InvalidArgumentError, ReplyError
from mha_client.tensors import (
    WIRE_NUMPY,
    array_field,
    dtype_enum,
    dtype_name,
    fill_proto,
    from_proto,
    parse_with_tensors,
    tensor_field_head,
)


class AttendOptions(TypedDict, total=False):
    """The keyword options of an Attend call or a session step (build_attend_request)."""

    lengths: Sequence[int] | None
    causal: bool | None
    weights: bool
    heads: Sequence[int] | None
    query_range: tuple[int, int | None] | None
    weights_dtype: str | None
    head_mask: Sequence[float] | None
    output_dtype: str | None
    input_dtype: str | None


# AttendOptions' names: what an Attend or a step takes besides its array.
OPTION_NAMES = frozenset(AttendOptions.__optional_keys__)


def check_options(options: dict[str, Any], what: str) -> None:
    """InvalidArgumentError for an option that is not one of AttendOptions' (it would reach
    build_attend_request as a TypeError naming that function): what, the call's name."""
    unknown = sorted(k for k in options if k not in OPTION_NAMES)
    if unknown:
        raise InvalidArgumentError(
            f"unknown option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} for "
            f"{what}; the options are {', '.join(sorted(OPTION_NAMES))}"
        )


_VARIANTS = {pb.VARIANT_MHA: "mha", pb.VARIANT_GQA: "gqa", pb.VARIANT_MQA: "mqa"}


@dataclass(frozen=True)
class KVCacheInfo:
    """A model's KV cache for sessions, as of the ListModels call."""

    budget_bytes: int
    block_size: int  # tokens per block
    bytes_per_token: int  # 2 (K, V) x num_kv_heads x head_dim x itemsize(dtype)
    num_blocks: int
    num_blocks_used: int
    num_sessions: int
    evict_idle_sessions: bool
    dtype: str  # stored K/V: the model's dtype unless the model sets kv_cache_dtype

    @classmethod
    def from_proto(cls, c: pb.KVCacheInfo) -> KVCacheInfo:
        return cls(
            budget_bytes=c.budget_bytes,
            block_size=c.block_size,
            bytes_per_token=c.bytes_per_token,
            num_blocks=c.num_blocks,
            num_blocks_used=c.num_blocks_used,
            num_sessions=c.num_sessions,
            evict_idle_sessions=c.evict_idle_sessions,
            dtype=dtype_name(c.dtype),
        )


@dataclass(frozen=True)
class ModelInfo:
    """One hosted model: its shape, defaults and the server's limits for it."""

    name: str
    variant: str  # "mha", "gqa" or "mqa" ("unspecified" from a server that did not say)
    embed_dim: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads / num_kv_heads query heads share one
    head_dim: int
    bias: bool
    causal_default: bool  # what a request with causal unset gets
    dtype: str  # compute dtype of the weights: "float32", "float16" or "bfloat16"
    device: str  # e.g. "cpu", "cuda:0"
    max_seq_len: int
    max_batch_size: int
    max_weights_bytes: int  # attention weights returned per request
    max_request_bytes: int
    max_response_bytes: int
    num_parameters: int
    kv_cache: KVCacheInfo | None = None  # None: the model serves no sessions

    @classmethod
    def from_proto(cls, m: pb.ModelInfo) -> ModelInfo:
        return cls(
            name=m.name,
            variant=_VARIANTS.get(m.variant, "unspecified"),
            embed_dim=m.embed_dim,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            bias=m.bias,
            causal_default=m.causal_default,
            dtype=dtype_name(m.dtype),
            device=m.device,
            max_seq_len=m.limits.max_seq_len,
            max_batch_size=m.limits.max_batch_size,
            max_weights_bytes=m.limits.max_weights_bytes,
            max_request_bytes=m.limits.max_request_bytes,
            max_response_bytes=m.limits.max_response_bytes,
            num_parameters=m.num_parameters,
            kv_cache=KVCacheInfo.from_proto(m.kv_cache) if m.HasField("kv_cache") else None,
        )


@dataclass(frozen=True)
class Timing:
    """Server-side timings of one Attend call plus the round trip the SDK measured."""

    queue_ms: float
    compute_ms: float
    total_ms: float
    batch_size: int  # sequences in the forward pass that ran this request
    round_trip_ms: float  # client side: request sent to response received
    # A session step whose session the server had spilled to disk and brought back first:
    # the time that took (also in queue_ms); 0 otherwise.
    restore_ms: float = 0.0


@dataclass(frozen=True)
class SessionInfo:
    """A KV-cache session as the server holds it."""

    session_id: str
    model: str
    num_tokens: int  # tokens cached
    max_len: int  # tokens it may hold
    ttl_s: float  # idle seconds before it expires; 0: never
    num_blocks: int  # cache blocks held (a prefix shared by forks counts in each)
    bytes_held: int

    @classmethod
    def from_proto(cls, s: pb.SessionInfo) -> SessionInfo:
        return cls(
            s.session_id, s.model, s.num_tokens, s.max_len, s.ttl_s, s.num_blocks, s.bytes_held
        )


@dataclass
class AttendResult:
    """What Attend returned, with tensors decoded and the input's rank kept."""

    # Decoded arrays are read-only views of the reply bytes; .copy() one to modify it.
    output: np.ndarray  # (B, L, E) or (L, E); float32 or float16 (bfloat16 arrives as float32)
    weights: np.ndarray | None  # (B, h, R, S) or (h, R, S); None unless weights were asked
    weight_heads: list[int] = field(default_factory=list)  # query head of each weights slice
    weight_query_start: int = 0  # query row of weights[..., 0, :]
    timing: Timing | None = None
    model: str = ""
    session: SessionInfo | None = None  # after a session step: the session's new state


def build_attend_request(
    model: str,
    x: np.ndarray,
    *,
    lengths: Sequence[int] | None = None,
    causal: bool | None = None,
    weights: bool = False,
    heads: Sequence[int] | None = None,
    query_range: tuple[int, int | None] | None = None,
    weights_dtype: str | None = None,
    head_mask: Sequence[float] | None = None,
    output_dtype: str | None = None,
    input_dtype: str | None = None,
    session_id: str | None = None,
) -> pb.AttendRequest:
    """The AttendRequest for `attend`; InvalidArgumentError (an MhaServeError and a ValueError)
    for arguments that cannot work, before anything is sent.

    x: (L, E) or (B, L, E) floats. lengths: real length per sequence (the rest is padding).
    causal: None takes the model's default. weights: return attention weights, narrowed by
    heads (query head indices, None for all), query_range ((start, end) rows, end None for
    all) and weights_dtype. head_mask: one gate per query head (0 prunes it). output_dtype /
    input_dtype: "float32", "float16" or "bfloat16" (None: same as input / as x's dtype).
    session_id: a session step (model may then be ""): x's tokens are appended to it.
    """
    arr = np.asarray(x)
    _check_step_shape(arr, session_id)
    if arr.ndim not in (2, 3):
        raise InvalidArgumentError(
            f"x has shape {arr.shape}; expected (seq_len, embed_dim) or (batch, seq_len, embed_dim)"
        )
    if not weights and (heads is not None or query_range is not None or weights_dtype):
        raise InvalidArgumentError(
            "heads, query_range and weights_dtype select weights: pass weights=True"
        )
    req = pb.AttendRequest(model=model, session_id=session_id or "")
    fill_proto(req.input, arr, input_dtype)  # in place: a nested pb.Tensor costs 3 copies more
    if lengths is not None:
        req.lengths.extend(int(n) for n in lengths)
    if causal is not None:
        req.causal = bool(causal)
    if weights:
        req.weights.enabled = True
        if heads is not None:
            req.weights.heads.extend(int(h) for h in heads)
        if query_range is not None:
            start, end = query_range
            if start < 0 or (end is not None and end <= start):
                wrong = f"starts at {start}, before row 0" if start < 0 else "is empty"
                raise InvalidArgumentError(
                    f"query_range {query_range} {wrong}; pass (start, end) with "
                    f"0 <= start < end, or (start, None) for rows to the end"
                )
            req.weights.query_start = int(start)
            req.weights.query_end = 0 if end is None else int(end)  # 0 means "to the end"
        if weights_dtype:
            req.weights.dtype = dtype_enum(weights_dtype)
    if head_mask is not None:
        req.head_mask.extend(float(g) for g in head_mask)
    if output_dtype:
        req.output_dtype = dtype_enum(output_dtype)
    return req


# The AttendResponse fields that hold tensors, by field number.
_RESPONSE_TENSORS = {2: "output", 3: "attention_weights"}
# Requests and replies with this many bytes go framed (one payload copy to encode, none to
# decode); below it protobuf's C code is quicker and a copy of a few KiB is nothing (a 1-token
# step: 5 us built vs 13 us framed, replies 13 vs 25 us; at 128 KiB a built request is 270 us
# vs 20 framed). The server frames at the same size (mha_serve.transport.convert).
FRAME_BYTES = 1 << 16


def _check_step_shape(arr: np.ndarray, session_id: str | None) -> None:
    """A session step's x holds one sequence (the server refuses other shapes, and its
    refusal ends a stream's call)."""
    if session_id and (arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[0] != 1)):
        raise InvalidArgumentError(
            f"x has shape {arr.shape}; a session step takes one sequence, (tokens, "
            "embed_dim) or (1, tokens, embed_dim)"
        )


def encode_attend_request(model: str, x: np.ndarray, **options: Any) -> bytes:
    """build_attend_request's request, serialized with one copy of x's bytes (protobuf's
    way costs five): for a channel method sending bytes as they are (no request_serializer)."""
    arr = np.asarray(x)
    _check_step_shape(arr, options.get("session_id"))  # (naming x's shape, not the probe's)
    # Checks all but x's bytes on an empty slice; a wrong rank whole, for build's error to
    # name x's shape (and a 0-d x to raise InvalidArgumentError, not IndexError).
    probe = arr[..., :0] if arr.ndim in (2, 3) else arr
    head = build_attend_request(model, probe, **options)
    head.ClearField("input")
    tensor = array_field(2, arr, options.get("input_dtype"))
    return b"".join([head.SerializeToString(), *tensor])


def attend_request_bytes(model: str, x: np.ndarray, **options: Any) -> bytes:
    """build_attend_request's request serialized, as the SDK sends it (its Attend and
    StreamSession methods have no request_serializer): framed when x is large; a plain one
    (plain_request) as its cached head and x's bytes."""
    if not options:
        plain = plain_request(model, "", x)
        if plain is not None:
            return plain
    arr = np.asarray(x)
    if arr.nbytes >= FRAME_BYTES:
        return encode_attend_request(model, arr, **options)
    return build_attend_request(model, arr, **options).SerializeToString()


def read_attend_reply(data: bytes, squeeze: bool, round_trip_ms: float) -> AttendResult:
    """An AttendResponse as the SDK receives it (bytes: no response_deserializer): a large
    one's arrays are views of data, a small one is parsed by protobuf whole. ReplyError when
    it cannot be read (the caller sets its target)."""
    try:
        if len(data) >= FRAME_BYTES:
            return parse_attend_response(data, squeeze, round_trip_ms)
        return parse_attend_response(pb.AttendResponse.FromString(data), squeeze, round_trip_ms)
    except (ValueError, DecodeError) as e:  # protobuf's parse, framing, a tensor's dtype/shape
        raise ReplyError(f"{type(e).__name__}: {e}") from e


def parse_attend_response(
    resp: pb.AttendResponse | bytes, squeeze: bool, round_trip_ms: float
) -> AttendResult:
    """Decode an AttendResponse, or its serialized bytes as received (a method without a
    response_deserializer): then the arrays are views of those bytes, never copied.
    squeeze drops the batch axis for a 2-D input."""
    payloads: dict[str, Any] = {}
    if isinstance(resp, bytes | bytearray | memoryview):
        resp, payloads = parse_with_tensors(resp, pb.AttendResponse, _RESPONSE_TENSORS)
    output = from_proto(resp.output, payloads.get("output"))
    weights, heads, query_start = None, [], 0
    if resp.HasField("attention_weights"):  # (most replies: none, nor their heads and rows)
        weights = from_proto(resp.attention_weights, payloads.get("attention_weights"))
        heads, query_start = list(resp.weight_heads), resp.weight_query_start
    if squeeze:
        # The server keeps the input's rank for output; weights may still carry a batch of 1.
        if output.ndim == 3:
            output = output[0]
        if weights is not None and weights.ndim == 4:
            weights = weights[0]
    t = resp.timing
    return AttendResult(
        output=output,
        weights=weights,
        weight_heads=heads,
        weight_query_start=query_start,
        timing=Timing(
            t.queue_ms, t.compute_ms, t.total_ms, t.batch_size, round_trip_ms, t.restore_ms
        ),
        model=resp.model,
        session=SessionInfo.from_proto(resp.session) if resp.HasField("session") else None,
    )


def check_keep(num_tokens: int) -> None:
    """A TruncateSession count the request can carry: an int in [0, 2**64)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidArgumentError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if num_tokens >= 2**64:  # TruncateSessionRequest.num_tokens is a uint64
        raise InvalidArgumentError(
            f"num_tokens {num_tokens} is past any session's length (the request holds < 2**64)"
        )


def step_request(session_id: str, x: np.ndarray, options: dict[str, Any]) -> pb.AttendRequest:
    """A session step: x's tokens appended to session_id (the model is the session's)."""
    return build_attend_request("", x, session_id=session_id, **options)


def step_request_bytes(session_id: str, x: np.ndarray, options: dict[str, Any]) -> bytes:
    """step_request serialized as the SDK sends it (attend_request_bytes)."""
    if not options:
        plain = plain_request("", session_id, x)
        if plain is not None:
            return plain
    else:
        check_options(options, "a session step")
    return attend_request_bytes("", x, session_id=session_id, **options)


def plain_request(model: str, session_id: str, x: Any) -> bytes | None:
    """The serialized request of an Attend or a session step without options, when x is a
    C-contiguous (L, E) or (B, L, E) (a step's: (1, L, E)) float32 or float16 array in the
    wire's byte order below FRAME_BYTES (a decode step, most often): its model's and
    session's fields and its input's head (made once per model, session and shape) joined
    to x's bytes. The same message, parsed (tests/client/test_step_bytes.py), in two calls
    where protobuf's way takes some twenty, each cold after the wait for the last reply.
    None for any other x."""
    if type(x) is np.ndarray and x.flags.c_contiguous:
        enum = _PLAIN_DTYPES.get(x.dtype)
        ndim = x.ndim
        if (
            enum is not None
            and (ndim == 2 or (ndim == 3 and (x.shape[0] == 1 or not session_id)))
            and 0 < x.nbytes < FRAME_BYTES
        ):
            return _plain_head(model, session_id, enum, x.shape, x.nbytes) + x.tobytes()
    return None


# The arrays a plain request sends as they are: the wire's float dtypes in its byte order
# (bfloat16 has no numpy dtype of its own: it travels as bits, which a caller never hands in).
_PLAIN_DTYPES = {dt: enum for enum, dt in WIRE_NUMPY.items() if dt.kind == "f"}


@functools.lru_cache(maxsize=1024)
def _plain_head(
    model: str, session_id: str, enum: int, shape: tuple[int, ...], nbytes: int
) -> bytes:
    """A plain request up to its input's bytes: the model's and session_id's fields, then
    input's (fields in any order make the same message)."""
    fields = pb.AttendRequest(model=model, session_id=session_id).SerializeToString()
    return fields + tensor_field_head(2, enum, shape, nbytes)
