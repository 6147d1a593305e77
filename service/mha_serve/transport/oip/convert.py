"""Open Inference Protocol messages <-> engine calls, results and model descriptions (no I/O).

A model has one input and two outputs (names below); mha.v1's request fields travel as request
parameters (PARAMETERS, with their types). docs/api.md ("Open Inference Protocol") has the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mha_client.api.inference import grpc_service_pb2 as pb
from mha_client.api.inference import model_config_pb2 as mc
from mha_serve.engine.errors import InvalidRequest
from mha_serve.engine.requests import AttendOutcome, AttendRequest, ModelView
from mha_serve.transport.oip.tensors import (
    CONFIG_TYPES,
    DATATYPES,
    NAMES,
    decode,
    encode,
    output_tensor,
    shape_text,
)

INPUT = "INPUT"  # (batch, seq_len, embed_dim) embeddings
OUTPUT = "OUTPUT"  # (batch, seq_len, embed_dim) contextualized embeddings
ATTENTION_WEIGHTS = "ATTENTION_WEIGHTS"  # (batch, heads, query rows, keys): only when asked
PLATFORM = "mha-serve"
VERSION = "1"  # models are not versioned: "" or "1" name the one version

# Request parameters: name -> (protocol parameter kinds accepted, what it is). Others (Triton's
# priority, a client's own) are ignored, as Triton ignores parameters no backend reads.
PARAMETERS = {
    "causal": ("bool", "causal mask; absent: the model's default"),
    "lengths": (
        "string",
        'real length of each sequence, comma-separated ("3,5"); absent: all seq_len',
    ),
    "weight_heads": ("string", "query heads of ATTENTION_WEIGHTS, comma-separated; absent: all"),
    "query_start": ("int64", "first query row of ATTENTION_WEIGHTS (default 0)"),
    "query_end": ("int64", "end (exclusive) of its query rows; 0 or absent: seq_len"),
    "weights_dtype": ("string", "FP32 (default), FP16 or BF16: the datatype of ATTENTION_WEIGHTS"),
    "head_mask": ("string", 'one multiplier per head, comma-separated ("1,0,1,1"); absent: none'),
    "output_dtype": ("string", "FP32, FP16 or BF16: the datatype of OUTPUT; absent: INPUT's"),
    "timeout": (
        "int64",
        "Triton's: microseconds the client waits; the earlier of it and the gRPC deadline holds",
    ),
    "sequence_id": (
        "int64, uint64 or string",
        "Triton's: the sequence (KV-cache session) this request steps",
    ),
    "sequence_start": ("bool", "Triton's: the first request of the sequence (creates its session)"),
    "sequence_end": ("bool", "Triton's: the last request (its session closes after this step)"),
}
_WEIGHT_OPTIONS = ("weight_heads", "query_start", "query_end", "weights_dtype")


def parameter(params: Any, name: str, model: str) -> bool | int | str | float | None:
    """A request parameter's value, None when absent; its kind checked against PARAMETERS."""
    if name not in params:
        return None
    kind = params[name].WhichOneof("parameter_choice")
    value = None if kind is None else getattr(params[name], kind)
    expected = PARAMETERS[name][0]
    ok = {
        "bool": kind == "bool_param",
        "int64": kind in ("int64_param", "uint64_param"),
        "string": kind == "string_param" or (name == "lengths" and kind == "int64_param"),
    }.get(expected, kind in ("int64_param", "uint64_param", "string_param"))
    if not ok:
        raise InvalidRequest(
            f"parameter '{name}' for model '{model}' must be {expected} ({PARAMETERS[name][1]}), "
            f"got {kind or 'no value'}"
        )
    return value


def _numbers(value: str | int, name: str, cast: Callable[[str], Any]) -> list:
    if isinstance(value, int):
        return [value]
    try:
        return [cast(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise InvalidRequest(
            f"parameter '{name}' is {value!r}: give comma-separated {cast.__name__}s"
        ) from None


def _dtype(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    if value not in DATATYPES:
        raise InvalidRequest(f"parameter '{name}' is {value!r}: use FP32, FP16 or BF16")
    return DATATYPES[value]


@dataclass(frozen=True)
class Outputs:
    """Which outputs a request asked for (an empty list: OUTPUT alone, weights cost compute)."""

    output: bool
    weights: bool


def requested_outputs(request: pb.ModelInferRequest, model: str) -> Outputs:
    names = [o.name for o in request.outputs]
    for name in names:
        if name not in (OUTPUT, ATTENTION_WEIGHTS):
            raise InvalidRequest(
                f"unexpected inference output '{name}' for model '{model}'; its outputs are "
                f"{OUTPUT} and {ATTENTION_WEIGHTS}"
            )
    if not names:
        return Outputs(output=True, weights=False)
    return Outputs(output=OUTPUT in names, weights=ATTENTION_WEIGHTS in names)


def to_call(request: pb.ModelInferRequest, hosted: ModelView) -> tuple[AttendRequest, Outputs]:
    """The engine's request for a ModelInfer (no session yet), and the outputs asked."""
    model, embed_dim = hosted.spec.name, hosted.spec.attention.embed_dim
    names = [t.name for t in request.inputs]
    if names != [INPUT]:
        extra = [n for n in names if n != INPUT]
        raise InvalidRequest(
            f"unexpected inference input '{extra[0]}' for model '{model}'; its one input is {INPUT}"
            if extra
            else f"expected 1 inputs but got {len(names)} inputs for model '{model}' (one {INPUT})"
        )
    if request.raw_input_contents and len(request.raw_input_contents) != 1:
        raise InvalidRequest(
            f"raw_input_contents has {len(request.raw_input_contents)} entries for 1 input "
            f"of model '{model}'"
        )
    tensor = request.inputs[0]
    if len(tensor.shape) != 3 or tensor.shape[2] != embed_dim:
        raise InvalidRequest(
            f"unexpected shape for input '{INPUT}' for model '{model}'. Expected "
            f"[-1,-1,{embed_dim}], got {shape_text(list(tensor.shape))}"
        )
    raw = request.raw_input_contents[0] if request.raw_input_contents else None
    x = decode(tensor, raw, model)  # (B, L, E)
    outputs = requested_outputs(request, model)
    params = request.parameters

    def get(name: str) -> Any:
        return parameter(params, name, model)

    if not outputs.weights:
        asked = [n for n in _WEIGHT_OPTIONS if n in params]
        if asked:
            raise InvalidRequest(
                f"parameter '{asked[0]}' is set but {ATTENTION_WEIGHTS} is not among the "
                "requested outputs; request it to get attention weights"
            )
    lengths, heads, mask = get("lengths"), get("weight_heads"), get("head_mask")
    call = AttendRequest(
        model=model,
        inputs=x,
        lengths=None if lengths is None else tuple(_numbers(lengths, "lengths", int)),
        causal=get("causal"),
        need_weights=outputs.weights,
        weight_heads=None if heads is None else tuple(_numbers(heads, "weight_heads", int)),
        query_start=get("query_start") or 0,
        query_end=get("query_end") or 0,
        weights_dtype=_dtype(get("weights_dtype"), "weights_dtype") or "float32",
        head_mask=None if mask is None else tuple(_numbers(mask, "head_mask", float)),
        output_dtype=_dtype(get("output_dtype"), "output_dtype"),
    )
    return call, outputs


def encode_response(
    result: AttendOutcome, outputs: Outputs, *, model: str, request_id: str
) -> pb.ModelInferResponse:
    """Raw outputs in the order OUTPUT, ATTENTION_WEIGHTS (those asked); the weights tensor
    says which heads and first query row it holds."""
    response = pb.ModelInferResponse(model_name=model, model_version=VERSION, id=request_id)
    if outputs.output:
        response.outputs.append(output_tensor(OUTPUT, result.output))
        response.raw_output_contents.append(encode(result.output))
    if outputs.weights and result.weights is not None:
        tensor = output_tensor(ATTENTION_WEIGHTS, result.weights)
        tensor.parameters["weight_heads"].string_param = ",".join(map(str, result.weight_heads))
        tensor.parameters["query_start"].int64_param = result.weight_query_start
        response.outputs.append(tensor)
        response.raw_output_contents.append(encode(result.weights))
    if result.session is not None:  # a sequence step: its session (mha.v1 sees it too)
        response.parameters["session_id"].string_param = result.session.session_id
        response.parameters["sequence_num_tokens"].int64_param = result.session.num_tokens
    return response


def model_metadata(hosted: ModelView) -> pb.ModelMetadataResponse:
    cfg = hosted.spec.attention
    meta = pb.ModelMetadataResponse.TensorMetadata
    dtype = NAMES[hosted.dtype]
    return pb.ModelMetadataResponse(
        name=hosted.spec.name,
        versions=[VERSION],
        platform=PLATFORM,
        inputs=[meta(name=INPUT, datatype=dtype, shape=[-1, -1, cfg.embed_dim])],
        outputs=[
            meta(name=OUTPUT, datatype=dtype, shape=[-1, -1, cfg.embed_dim]),
            meta(name=ATTENTION_WEIGHTS, datatype="FP32", shape=[-1, cfg.num_heads, -1, -1]),
        ],
    )


def model_config(hosted: ModelView, *, sessions: bool, session_ttl_s: float) -> mc.ModelConfig:
    """Triton's configuration of a model: tensors, scheduling, and in `parameters` the model's
    shape, the datatypes INPUT takes and each request parameter with its type."""
    spec, cfg = hosted.spec, hosted.spec.attention
    dtype = CONFIG_TYPES[hosted.dtype]
    config = mc.ModelConfig(
        name=spec.name,
        platform=PLATFORM,
        backend=PLATFORM,
        max_batch_size=0,  # the batch is the first dimension of INPUT itself
        input=[mc.ModelInput(name=INPUT, data_type=dtype, dims=[-1, -1, cfg.embed_dim])],
        output=[
            mc.ModelOutput(name=OUTPUT, data_type=dtype, dims=[-1, -1, cfg.embed_dim]),
            mc.ModelOutput(
                name=ATTENTION_WEIGHTS, data_type=mc.TYPE_FP32, dims=[-1, cfg.num_heads, -1, -1]
            ),
        ],
    )
    if sessions:
        config.sequence_batching.max_sequence_idle_microseconds = int(session_ttl_s * 1e6)
    else:
        config.dynamic_batching.max_queue_delay_microseconds = int(spec.max_queue_delay_ms * 1e3)
    described = {
        "variant": cfg.variant,
        "embed_dim": cfg.embed_dim,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "causal_default": str(cfg.causal).lower(),
        "max_seq_len": spec.max_seq_len,
        "max_batch_size": spec.max_batch_size,
        "input_datatypes": ",".join(DATATYPES),
        "sequences": str(sessions).lower(),
    }
    # The family's options, where the model has them (docs/models.md).
    if cfg.sliding_window is not None:
        described["sliding_window"] = cfg.sliding_window
    if cfg.qk_norm is not None:
        described["qk_norm"] = f"{cfg.qk_norm.scope}, eps {cfg.qk_norm.eps:g}"
        if cfg.qk_norm.after_rope:
            described["qk_norm"] += ", after rope"
        if not cfg.qk_norm.gain:
            described["qk_norm"] += ", no gain"
    if cfg.query_scale is not None:
        qs = cfg.query_scale
        described["query_scale"] = (
            f"beta {qs.beta:g}, floor_div {qs.floor_div:g}, offset {qs.offset}"
            + (", float32" if qs.float32 else "")
        )
    if cfg.chunk_size is not None:
        described["chunk_size"] = cfg.chunk_size
    if cfg.softcap is not None:
        described["softcap"] = f"{cfg.softcap:g}"
    if cfg.sinks:
        described["sinks"] = "true"
    if cfg.output_gate:  # (one value per head, or per dim of each head's output)
        described["output_gate"] = "true, per head" if cfg.output_gate_per_head else "true"
    if cfg.v_norm:
        described["v_norm"] = "true"
    if cfg.alibi:
        described["alibi"] = f"bias_max {cfg.alibi_bias_max:g}"
        if cfg.alibi_scale is not None:
            described["alibi"] += f", scale {cfg.alibi_scale:g}"
        if cfg.alibi_bfloat16:
            described["alibi"] += ", bfloat16"
    if cfg.mla is not None:
        m = cfg.mla
        described["mla"] = (
            f"kv_lora_rank {m.kv_lora_rank}, rope_dim {m.rope_dim}, nope_dim {m.nope_dim}, "
            f"v_head_dim {m.v_head_dim}, q_lora_rank {m.q_lora_rank}"
        )
    if cfg.rope is not None:
        rope = cfg.rope
        described["rope"] = (
            f"{rope.type}, theta {rope.theta:g}"
            + (", interleaved pairs" if rope.interleaved else "")
            + (", reversed" if rope.reverse else "")
            + (f", partial {rope.partial:g}" if rope.partial != 1 else "")
        )
    for name, (kind, what) in PARAMETERS.items():
        described[f"request.{name}"] = f"{kind}: {what}"
    for key, value in described.items():
        config.parameters[key].string_value = str(value)
    return config
