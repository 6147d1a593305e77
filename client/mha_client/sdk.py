"""Python SDK for mha-serve: `Client` (blocking) and `AsyncClient` (asyncio) with the same methods.

Both speak mha.v1 over gRPC and turn every failed call into `MhaServeError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.channel import ChannelSecurity, open_channel
from mha_client.errors import MhaServeError
from mha_client.tensors import dtype_enum, dtype_name, from_proto, to_proto

if TYPE_CHECKING:
    from mha_client.sessions import AsyncSession, Session

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
# wait_ready sleeps this long between health answers that are not yet SERVING.
WAIT_READY_POLL_S = 0.1

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
    """The AttendRequest for `attend`; ValueError for arguments that cannot work.

    x: (L, E) or (B, L, E) floats. lengths: real length per sequence (the rest is padding).
    causal: None takes the model's default. weights: return attention weights, narrowed by
    heads (query head indices, None for all), query_range ((start, end) rows, end None for
    all) and weights_dtype. head_mask: one gate per query head (0 prunes it). output_dtype /
    input_dtype: "float32", "float16" or "bfloat16" (None: same as input / as x's dtype).
    session_id: a session step (model may then be ""): x's tokens are appended to it.
    """
    arr = np.asarray(x)
    if arr.ndim not in (2, 3):
        raise ValueError(
            f"x has shape {arr.shape}; expected (seq_len, embed_dim) or (batch, seq_len, embed_dim)"
        )
    if not weights and (heads is not None or query_range is not None or weights_dtype):
        raise ValueError("heads, query_range and weights_dtype select weights: pass weights=True")
    req = pb.AttendRequest(
        model=model, input=to_proto(arr, input_dtype), session_id=session_id or ""
    )
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
                raise ValueError(
                    f"query_range {query_range} is empty or negative; pass (start, end) with "
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


def parse_attend_response(
    resp: pb.AttendResponse, squeeze: bool, round_trip_ms: float
) -> AttendResult:
    """Decode an AttendResponse; squeeze drops the batch axis for a 2-D input."""
    output = from_proto(resp.output)
    weights = from_proto(resp.attention_weights) if resp.HasField("attention_weights") else None
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
        weight_heads=list(resp.weight_heads),
        weight_query_start=resp.weight_query_start,
        timing=Timing(t.queue_ms, t.compute_ms, t.total_ms, t.batch_size, round_trip_ms),
        model=resp.model,
        session=SessionInfo.from_proto(resp.session) if resp.HasField("session") else None,
    )


def channel_options(
    max_message_bytes: int, options: Sequence[tuple[str, Any]] | None
) -> list[tuple[str, Any]]:
    """Channel arguments: message limits, quick reconnects, then the caller's overrides."""
    merged: dict[str, Any] = {
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        # gRPC's default reconnect backoff grows to 120 s, so a client started before its
        # server would notice the server minutes late; attention servers restart often.
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 2000,
    }
    merged.update(dict(options or ()))
    return list(merged.items())


def _health_stubs() -> tuple[Any, Any]:
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        raise ImportError(
            "health checks need the grpcio-health-checking package: "
            "pip install grpcio-health-checking"
        ) from None
    return health_pb2, health_pb2_grpc


def _still_starting(err: MhaServeError) -> bool:
    return err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _not_ready(target: str, timeout: float, last: str) -> TimeoutError:
    return TimeoutError(
        f"mha-serve at {target} was not SERVING within {timeout:g} s (last answer: {last}); "
        f"check that the server is running there and read its log"
    )


class Client:
    """Blocking client. `with Client("host:port") as c: c.attend("model", x)`."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout  # default deadline in seconds per call; None waits forever
        opts = channel_options(max_message_bytes, options)
        self._channel = open_channel(
            target, opts, aio=False, credentials=credentials, security=security
        )
        self._stub = pb_grpc.AttentionServiceStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any, timeout: float | None, **kw: Any) -> Any:
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, **kw)
        except grpc.RpcError as err:
            raise MhaServeError.from_rpc_error(err, self.target) from err

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        resp = self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [ModelInfo.from_proto(m) for m in resp.models]

    def model_info(self, name: str, *, timeout: float | None = None) -> ModelInfo:
        resp = self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(name=name), timeout)
        return ModelInfo.from_proto(resp)

    def attend(
        self,
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
        timeout: float | None = None,
    ) -> AttendResult:
        """Run attention over x (L, E) or (B, L, E); arguments as in build_attend_request."""
        req = build_attend_request(
            model,
            x,
            lengths=lengths,
            causal=causal,
            weights=weights,
            heads=heads,
            query_range=query_range,
            weights_dtype=weights_dtype,
            head_mask=head_mask,
            output_dtype=output_dtype,
            input_dtype=input_dtype,
        )
        start = time.perf_counter()
        resp = self._call(self._stub.Attend, req, timeout)
        round_trip_ms = (time.perf_counter() - start) * 1e3
        return parse_attend_response(resp, np.ndim(x) == 2, round_trip_ms)

    def create_session(
        self,
        model: str,
        *,
        max_len: int | None = None,
        ttl_s: float | None = None,
        timeout: float | None = None,
    ) -> Session:
        """A new KV-cache session on model (max_len None: the model's; ttl_s None: the server's)."""
        from mha_client.sessions import Session

        req = pb.CreateSessionRequest(model=model, max_len=max_len or 0, ttl_s=ttl_s or 0.0)
        return Session(
            self, SessionInfo.from_proto(self._call(self._stub.CreateSession, req, timeout))
        )

    def session(self, session_id: str) -> Session:
        """A handle on an existing session (nothing is sent until it is used)."""
        from mha_client.sessions import Session

        return Session(self, SessionInfo(session_id, "", 0, 0, 0.0, 0, 0))

    def health(
        self, service: str = "", *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> str:
        """The grpc.health.v1 status name of service ("" is the whole server), e.g. "SERVING"."""
        health_pb2, health_pb2_grpc = _health_stubs()
        stub = health_pb2_grpc.HealthStub(self._channel)
        req = health_pb2.HealthCheckRequest(service=service)
        resp = self._call(stub.Check, req, timeout, wait_for_ready=wait_for_ready)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float, service: str = "") -> None:
        """Block until health says SERVING; TimeoutError after timeout seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                last = self.health(service, timeout=remaining, wait_for_ready=True)
                if last == "SERVING":
                    return
            except MhaServeError as err:
                if not _still_starting(err):
                    raise
                last = str(err)
            time.sleep(min(WAIT_READY_POLL_S, max(0.0, deadline - time.monotonic())))
        raise _not_ready(self.target, timeout, last)


class AsyncClient:
    """asyncio client. `async with AsyncClient("host:port") as c: await c.attend("model", x)`."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        opts = channel_options(max_message_bytes, options)
        self._channel = open_channel(
            target, opts, aio=True, credentials=credentials, security=security
        )
        self._stub = pb_grpc.AttentionServiceStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Any, request: Any, timeout: float | None, **kw: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout if timeout is None else timeout, **kw)
        except grpc.RpcError as err:
            raise MhaServeError.from_rpc_error(err, self.target) from err

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        resp = await self._call(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [ModelInfo.from_proto(m) for m in resp.models]

    async def model_info(self, name: str, *, timeout: float | None = None) -> ModelInfo:
        req = pb.GetModelInfoRequest(name=name)
        return ModelInfo.from_proto(await self._call(self._stub.GetModelInfo, req, timeout))

    async def attend(
        self,
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
        timeout: float | None = None,
    ) -> AttendResult:
        """Run attention over x (L, E) or (B, L, E); arguments as in build_attend_request."""
        req = build_attend_request(
            model,
            x,
            lengths=lengths,
            causal=causal,
            weights=weights,
            heads=heads,
            query_range=query_range,
            weights_dtype=weights_dtype,
            head_mask=head_mask,
            output_dtype=output_dtype,
            input_dtype=input_dtype,
        )
        start = time.perf_counter()
        resp = await self._call(self._stub.Attend, req, timeout)
        round_trip_ms = (time.perf_counter() - start) * 1e3
        return parse_attend_response(resp, np.ndim(x) == 2, round_trip_ms)

    async def create_session(
        self,
        model: str,
        *,
        max_len: int | None = None,
        ttl_s: float | None = None,
        timeout: float | None = None,
    ) -> AsyncSession:
        """A new KV-cache session on model (max_len None: the model's; ttl_s None: the server's)."""
        from mha_client.sessions import AsyncSession

        req = pb.CreateSessionRequest(model=model, max_len=max_len or 0, ttl_s=ttl_s or 0.0)
        info = await self._call(self._stub.CreateSession, req, timeout)
        return AsyncSession(self, SessionInfo.from_proto(info))

    def session(self, session_id: str) -> AsyncSession:
        """A handle on an existing session (nothing is sent until it is used)."""
        from mha_client.sessions import AsyncSession

        return AsyncSession(self, SessionInfo(session_id, "", 0, 0, 0.0, 0, 0))

    async def health(
        self, service: str = "", *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> str:
        """The grpc.health.v1 status name of service ("" is the whole server), e.g. "SERVING"."""
        health_pb2, health_pb2_grpc = _health_stubs()
        stub = health_pb2_grpc.HealthStub(self._channel)
        req = health_pb2.HealthCheckRequest(service=service)
        resp = await self._call(stub.Check, req, timeout, wait_for_ready=wait_for_ready)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_ready(self, timeout: float, service: str = "") -> None:
        """Wait until health says SERVING; TimeoutError after timeout seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                last = await self.health(service, timeout=remaining, wait_for_ready=True)
                if last == "SERVING":
                    return
            except MhaServeError as err:
                if not _still_starting(err):
                    raise
                last = str(err)
            await asyncio.sleep(min(WAIT_READY_POLL_S, max(0.0, deadline - time.monotonic())))
        raise _not_ready(self.target, timeout, last)
