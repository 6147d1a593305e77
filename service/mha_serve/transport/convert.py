"""mha.v1 messages <-> engine calls and results (no I/O, no status codes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mha_client.api import attention_pb2 as pb
from mha_client.tensors import parse_with_tensors
from mha_serve.cache.types import SessionStats
from mha_serve.engine.errors import InvalidRequest
from mha_serve.engine.requests import (
    NUMPY_DTYPES,
    Array,
    AttendOutcome,
    AttendRequest,
    CacheInfo,
    ModelView,
)
from mha_serve.serving.protocol import Timing
from mha_serve.transport.tensors import (
    PROTO_DTYPES,
    checked,
    dtype_name,
    fill_proto,
    tensor_frames,
)

VARIANTS = {"mha": pb.VARIANT_MHA, "gqa": pb.VARIANT_GQA, "mqa": pb.VARIANT_MQA}
# Requests this large are parsed with their input's bytes left where gRPC put them, and
# replies with this many tensor bytes are framed by hand (one payload copy each way instead
# of protobuf's three and five). Below it protobuf's C code beats framing in Python (a
# 1-token reply: 17 us as a message, 33 us framed, here) and a copy of a few KiB is nothing.
FRAME_BYTES = 1 << 16


@dataclass(slots=True)  # (never written: not frozen, whose __init__ costs ~3x, every message)
class Received:
    """An AttendRequest as parsed off the wire: input_data is input.data's bytes (a view of
    the received message) or None when they are in the message. The servicer answers a
    Received with framed bytes (encode_frames), a bare message with a message."""

    message: pb.AttendRequest
    input_data: Any = None


def parse_attend_request(data: bytes) -> Received:
    """An AttendRequest's bytes as received: input.data stays a view of them when large."""
    if len(data) < FRAME_BYTES:
        return Received(pb.AttendRequest.FromString(data))
    message, payloads = parse_with_tensors(data, pb.AttendRequest, {2: "input"})
    return Received(message, payloads.get("input"))


def to_call(request: pb.AttendRequest, input_data: Any = None) -> tuple[AttendRequest, bool]:
    """The engine's request for a message, and whether the input was a single 2-D sequence.
    input_data: input.data's bytes when parsing kept them out of the message (Received).
    A session step may leave the model empty: the engine sets its session's."""
    model, session_id = request.model, request.session_id
    if not model and not session_id:
        raise InvalidRequest("model is empty; name one of the models ListModels returns")
    if not request.HasField("input"):
        raise InvalidRequest("input is missing; send a (batch, seq_len, embed_dim) tensor")
    data, dtype, shape = checked(request.input, "input", input_data)
    single = len(shape) == 2
    # checked() matched the bytes to the shape: the view is made here, not by
    # Array.frombuffer, which would check them again.
    x = Array(np.ndarray([1, *shape] if single else shape, NUMPY_DTYPES[dtype], data), dtype)
    # (L, E) -> (1, L, E) above. Only the fields a request sets are passed (most steps set
    # none); tuple() of an empty repeated field costs as much as of a full one.
    lengths = request.lengths
    head_mask = request.head_mask
    output_dtype = request.output_dtype
    options: dict[str, Any] = {}
    if lengths:
        options["lengths"] = tuple(lengths)
    if request.HasField("causal"):
        options["causal"] = request.causal
    if head_mask:
        options["head_mask"] = tuple(head_mask)
    if output_dtype:
        options["output_dtype"] = dtype_name(output_dtype, "output_dtype")
    if request.HasField("weights"):  # a request that asks no weights (most) sets none
        options.update(_weights(request.weights))
    return AttendRequest(model, x, session_id=session_id or None, **options), single


def _weights(weights: pb.WeightsRequest) -> dict[str, Any]:
    """AttendRequest's fields for the weights a request asks."""
    if not weights.enabled:
        if weights.heads or weights.query_start or weights.query_end or weights.dtype:
            raise InvalidRequest(
                "weights.heads/query_start/query_end/dtype are set but weights.enabled is "
                "false; set weights.enabled to get attention weights"
            )
        return {}
    return {
        "need_weights": True,
        "weight_heads": tuple(weights.heads) or None,
        "query_start": weights.query_start,
        "query_end": weights.query_end,
        "weights_dtype": dtype_name(weights.dtype, "weights.dtype", default="float32"),
    }


def encode_result(result: AttendOutcome, single: bool) -> pb.AttendResponse:
    """Output and weights into a response message, two copies each (tobytes and protobuf's);
    encode_frames makes one. Filled in place: a nested message built apart is copied in."""
    response = pb.AttendResponse()
    fill_proto(response.output, result.output, single=single)
    if result.weights is not None:
        fill_proto(response.attention_weights, result.weights, single=single)
    if result.weight_heads:
        response.weight_heads.extend(result.weight_heads)
    if result.weight_query_start:
        response.weight_query_start = result.weight_query_start
    if result.session is not None:
        fill_session(response.session, result.session)
    return response


def stamp(response: pb.AttendResponse, model: str, timing: Timing) -> None:
    """The model and timing fields of an answered Attend, in place."""
    response.model = model
    t = response.timing
    t.queue_ms = timing.queue_ms
    t.compute_ms = timing.compute_ms
    t.total_ms = timing.total_ms
    t.batch_size = timing.batch_size
    if timing.restore_ms:  # (0 is proto3's unset: most calls restore nothing)
        t.restore_ms = timing.restore_ms


def encode_reply(result: AttendOutcome, single: bool) -> pb.AttendResponse | Frames:
    """Frames when the tensors are large (FRAME_BYTES), a message otherwise."""
    nbytes = result.output.nbytes + (0 if result.weights is None else result.weights.nbytes)
    if nbytes >= FRAME_BYTES:
        return encode_frames(result, single)
    return encode_result(result, single)


@dataclass(frozen=True, slots=True)
class Frames:
    """A serialized AttendResponse in parts that refer to the result's tensors: join() is the
    one copy of their bytes. Fields appended later (model, timing) add to the message."""

    parts: list[Any]
    nbytes: int  # tensor bytes referenced

    def join(self, *tail: bytes) -> bytes:
        return b"".join([*self.parts, *tail])


def encode_frames(result: AttendOutcome, single: bool) -> Frames:
    """encode_result's response as Frames: no copy of output or weights until join()."""
    head = pb.AttendResponse(
        weight_heads=result.weight_heads, weight_query_start=result.weight_query_start
    )
    if result.session is not None:
        fill_session(head.session, result.session)
    output = result.output[0] if single else result.output
    parts = [head.SerializeToString(), *tensor_frames(2, output)]
    nbytes = output.nbytes
    if result.weights is not None:
        weights = result.weights[0] if single else result.weights
        parts += tensor_frames(3, weights)
        nbytes += weights.nbytes
    return Frames(parts, nbytes)


def session_info(stats: SessionStats) -> pb.SessionInfo:
    info = pb.SessionInfo()
    fill_session(info, stats)
    return info


def fill_session(info: pb.SessionInfo, stats: SessionStats) -> None:
    """session_info into a message's SessionInfo field in place."""
    info.session_id = stats.session_id
    info.model = stats.model
    info.num_tokens = stats.num_tokens
    info.num_blocks = stats.num_blocks
    info.bytes_held = stats.bytes_held
    if stats.max_len:  # (None and 0 are proto3's unset: a fresh message has them so)
        info.max_len = stats.max_len
    if stats.ttl_s:
        info.ttl_s = stats.ttl_s


def model_info(
    hosted: ModelView,
    cache: CacheInfo | None,
    max_request_bytes: int,
    max_response_bytes: int,
) -> pb.ModelInfo:
    spec, cfg = hosted.spec, hosted.spec.attention
    info = pb.ModelInfo(
        name=spec.name,
        variant=VARIANTS[cfg.variant],
        embed_dim=cfg.embed_dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        bias=cfg.bias,
        causal_default=cfg.causal,
        dtype=PROTO_DTYPES[hosted.dtype],
        device=hosted.device,
        limits=pb.ModelLimits(
            max_seq_len=spec.max_seq_len,
            max_batch_size=spec.max_batch_size,
            max_weights_bytes=spec.max_weights_bytes,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
        ),
        num_parameters=hosted.num_parameters,
    )
    if cache is not None:
        info.kv_cache.CopyFrom(
            pb.KVCacheInfo(
                budget_bytes=cache.budget_bytes,
                block_size=cache.block_size,
                bytes_per_token=cache.bytes_per_token,
                num_blocks=cache.num_blocks,
                num_blocks_used=cache.num_blocks_used,
                num_sessions=cache.num_sessions,
                evict_idle_sessions=cache.evict_idle_sessions,
                dtype=PROTO_DTYPES[cache.dtype],
            )
        )
    return info
