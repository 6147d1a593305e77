"""The mha.v1.AttentionService servicer: proto <-> engine calls, engine errors -> status codes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import torch

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve import metrics
from mha_serve.batching import DeadlineExceeded, ModelLanes, QueueFull
from mha_serve.engine import (
    AttendCall,
    AttendResult,
    Engine,
    HostedModel,
    InvalidRequest,
    ModelNotFound,
    RequestError,
    TooLarge,
)
from mha_serve.transport.tensors import PROTO_DTYPES, from_proto, to_proto, torch_dtype

log = logging.getLogger(__name__)
T = TypeVar("T")


class Unimplemented(RequestError):
    """A field of the API that this server does not serve yet (UNIMPLEMENTED)."""


class Unavailable(RequestError):
    """The server cannot take requests now (UNAVAILABLE): warming up or draining."""


STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
VARIANTS = {"mha": pb.VARIANT_MHA, "gqa": pb.VARIANT_GQA, "mqa": pb.VARIANT_MQA}


def to_call(request: pb.AttendRequest) -> tuple[AttendCall, bool]:
    """The engine call for a request, and whether the input was a single 2-D sequence."""
    if request.session_id:
        raise Unimplemented("sessions (session_id) are not served yet; send stateless requests")
    if not request.model:
        raise InvalidRequest("model is empty; name one of the models ListModels returns")
    if not request.HasField("input"):
        raise InvalidRequest("input is missing; send a (batch, seq_len, embed_dim) tensor")
    x = from_proto(request.input, "input")
    single = x.dim() == 2
    if single:
        x = x.unsqueeze(0)  # (L, E) -> (1, L, E)
    weights = request.weights
    if not weights.enabled and (
        weights.heads or weights.query_start or weights.query_end or weights.dtype
    ):
        raise InvalidRequest(
            "weights.heads/query_start/query_end/dtype are set but weights.enabled is false; "
            "set weights.enabled to get attention weights"
        )
    call = AttendCall(
        model=request.model,
        inputs=x,
        lengths=list(request.lengths) or None,
        causal=request.causal if request.HasField("causal") else None,
        need_weights=weights.enabled,
        weight_heads=list(weights.heads) or None,
        query_start=weights.query_start,
        query_end=weights.query_end,
        weights_dtype=torch_dtype(weights.dtype, "weights.dtype", default=torch.float32),
        head_mask=list(request.head_mask) or None,
        output_dtype=torch_dtype(request.output_dtype, "output_dtype"),
    )
    return call, single


def model_info(
    hosted: HostedModel, max_request_bytes: int, max_response_bytes: int
) -> pb.ModelInfo:
    spec, cfg = hosted.spec, hosted.spec.attention
    return pb.ModelInfo(
        name=spec.name,
        variant=VARIANTS[cfg.variant],
        embed_dim=cfg.embed_dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        bias=cfg.bias,
        causal_default=cfg.causal,
        dtype=PROTO_DTYPES[hosted.dtype],
        device=str(hosted.device),
        limits=pb.ModelLimits(
            max_seq_len=spec.max_seq_len,
            max_batch_size=spec.max_batch_size,
            max_weights_bytes=spec.max_weights_bytes,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
        ),
        num_parameters=hosted.num_parameters,
    )


# Payloads above this are validated and encoded on a worker thread so that the event loop
# keeps answering health checks and other calls (a 64 MiB reply takes ~0.5 s to encode).
OFFLOAD_BYTES = 1 << 20


async def _offload(fn: Callable[..., T], *args: Any, nbytes: int) -> T:
    if nbytes < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _encode(result: AttendResult, single: bool) -> pb.AttendResponse:
    """Output and weights into a response, one copy each (no CopyFrom of a built message)."""
    weights = None
    if result.weights is not None:
        weights = to_proto(result.weights[0] if single else result.weights)
    return pb.AttendResponse(
        output=to_proto(result.output[0] if single else result.output),
        attention_weights=weights,
        weight_heads=result.weight_heads,
        weight_query_start=result.weight_query_start,
    )


class AttentionServicer(pb_grpc.AttentionServiceServicer):
    """Converts and delegates: requests queue in their model's lanes, which run the engine."""

    def __init__(self, *, max_request_bytes: int) -> None:
        self._engine: Engine | None = None  # set by the server once models are loaded and warm
        self._lanes: dict[str, ModelLanes] = {}
        self.max_request_bytes = max_request_bytes

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise Unavailable(
                "the server is still loading its models; retry when health reports SERVING"
            )
        return self._engine

    def attach(self, engine: Engine, lanes: dict[str, ModelLanes]) -> None:
        """Starts serving: the warm engine and one ModelLanes per hosted model."""
        self._lanes = lanes
        self._engine = engine

    def _model_label(self, name: str) -> str:
        """Metric label: the model name when hosted, so unknown names cannot grow the label set."""
        return name if self._engine is not None and name in self._engine.models else "unknown"

    async def Attend(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttendResponse:
        received = time.perf_counter()
        model = self._model_label(request.model)

        async def handle() -> pb.AttendResponse:
            call, single = to_call(request)
            # Validation scans the input (NaN/Inf): off the event loop when it is large.
            hosted = await _offload(self.engine.validate, call, nbytes=request.input.ByteSize())
            batch, seq_len, _ = call.inputs.shape
            remaining = context.time_remaining()
            submitted = time.perf_counter()
            result, info = await self._lanes[call.model].submit(
                call,
                need_weights=call.need_weights,
                sequences=batch,
                length=seq_len,
                key=self.engine.batch_key(hosted, call),
                deadline=None if remaining is None else time.monotonic() + remaining,
            )
            # Queue time includes decoding and validation before the request was queued.
            queue_ms = (submitted - received + info.queue_s) * 1e3
            reply_bytes = result.output.nbytes + (
                0 if result.weights is None else result.weights.nbytes
            )
            response = await _offload(_encode, result, single, nbytes=reply_bytes)
            response.model = call.model
            response.timing.CopyFrom(
                pb.Timing(
                    queue_ms=queue_ms,
                    compute_ms=info.compute_s * 1e3,
                    total_ms=(time.perf_counter() - received) * 1e3,
                    batch_size=info.batch_size,
                )
            )
            if result.weights is not None:
                metrics.WEIGHTS_BYTES.labels(model).inc(result.weights.nbytes)
            metrics.TOKENS.labels(model).inc(batch * seq_len)
            metrics.REQUEST_TOKENS.labels(model).observe(batch * seq_len)
            metrics.QUEUE_LATENCY.labels(model).observe(queue_ms / 1e3)
            metrics.REQUEST_LATENCY.labels(model).observe(time.perf_counter() - received)
            return response

        metrics.IN_FLIGHT.inc()
        try:
            return await self._answer("Attend", model, context, handle)
        finally:
            metrics.IN_FLIGHT.dec()

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        async def handle() -> pb.ListModelsResponse:
            return pb.ListModelsResponse(
                models=[self._info(h) for h in self.engine.models.values()]
            )

        return await self._answer("ListModels", "", context, handle)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        async def handle() -> pb.ModelInfo:
            return self._info(self.engine.get(request.name))

        model = self._model_label(request.name)
        return await self._answer("GetModelInfo", model, context, handle)

    def _info(self, hosted: HostedModel) -> pb.ModelInfo:
        return model_info(hosted, self.max_request_bytes, self.engine.max_response_bytes)

    async def _answer(
        self,
        method: str,
        model: str,
        context: grpc.aio.ServicerContext,
        handle: Callable[[], Awaitable[T]],
    ) -> T:
        """Runs a handler; request errors become their status, anything else INTERNAL."""
        code = grpc.StatusCode.OK
        try:
            return await handle()
        except (RequestError, QueueFull, DeadlineExceeded) as e:
            code = STATUS_OF.get(type(e), grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, str(e))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed on model %s", method, model)
            await context.abort(code, f"internal error in {method}: {type(e).__name__}: {e}")
        finally:
            metrics.REQUESTS.labels(method, model, code.name).inc()
