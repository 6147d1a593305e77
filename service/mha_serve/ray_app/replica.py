"""AttentionReplica: one Ray Serve replica running the standalone server's engine, lanes and
servicers (mha.v1 and the Open Inference Protocol), answering the Ingress one call (or one
stream message) at a time.

Its engine starts every session id with this replica's id (ids.py), so SessionRouter sends
the session's later calls here. A call for a session whose id names another replica reached
here because that replica is gone: it answers NOT_FOUND saying so.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from mha_serve import metrics
from mha_serve.config import build_config
from mha_serve.engine.threads import ComputeThreads
from mha_serve.ray_app.context import CallContext, Caller, Reply
from mha_serve.ray_app.ids import replica_of, session_prefix
from mha_serve.serving import AsyncEngine
from mha_serve.transport.oip import InferenceServicer
from mha_serve.transport.oip.sequences import sequence_of
from mha_serve.transport.oip.stream import stream_error
from mha_serve.transport.server import load_engine
from mha_serve.transport.servicer import AttentionServicer

log = logging.getLogger(__name__)

# The unary mha.v1 methods a replica answers (the Ingress answers health itself and turns
# StreamSession into stream_step calls).
UNARY_METHODS = frozenset(
    {
        "Attend",
        "CreateSession",
        "GetSession",
        "ForkSession",
        "TruncateSession",
        "CloseSession",
        "ListModels",
        "GetModelInfo",
    }
)
# The Open Inference Protocol's unary methods (ModelStreamInfer: `infer`, one message a call).
OIP_METHODS = frozenset(
    {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelConfig",
        "ModelInfer",
    }
)


class AttentionReplica:
    """The engine behind its lanes and the mha.v1 servicer, in one Ray Serve replica."""

    async def __init__(
        self,
        config_file: str | None = None,
        overrides: dict[str, Any] | None = None,
        metrics_port: int = 0,
    ) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        cfg = build_config(config_file, dict(overrides or {}))
        self.compute = ComputeThreads(cfg.torch_threads, cfg.weights_torch_threads)
        loop = asyncio.get_running_loop()
        # Loaded and warmed on the compute thread, as the standalone server does (threads.py).
        engine = await loop.run_in_executor(
            self.compute.main,
            functools.partial(load_engine, cfg, session_id_prefix=session_prefix(self.replica_id)),
        )
        self.serving = AsyncEngine(engine, self.compute)
        self.serving.start()
        self.servicer = AttentionServicer(max_request_bytes=cfg.max_receive_message_bytes)
        self.servicer.attach(self.serving)
        self.oip = InferenceServicer(
            lambda: self.serving, ready=lambda: True, session_ttl_s=cfg.session_ttl_s
        )
        metrics.READY.set(1)
        if metrics_port:
            from mha_serve.ray_app.scrape import serve_replica_metrics

            port = metrics_port + context.rank.local_rank
            labels = {"replica": self.replica_id, "application": context.app_name}
            try:
                serve_replica_metrics(port, labels)
                log.info("replica %s: metrics on port %d", self.replica_id, port)
            except OSError as e:  # the port is taken: serve without metrics, say so loudly
                log.error(
                    "replica %s: no /metrics, port %d is taken (%s); give the app a "
                    "metrics_port whose next ports (one per replica on a node) are free",
                    self.replica_id,
                    port,
                    e,
                )
        log.info("replica %s SERVING models: %s", self.replica_id, ", ".join(engine.models))

    async def call(self, method: str, request: Any, caller: Caller | str = "") -> Reply:
        """One unary call (mha.v1 or the Open Inference Protocol), answered by its servicer."""
        if method in OIP_METHODS:
            return await self.infer(method, request, caller)
        if method not in UNARY_METHODS:
            raise ValueError(f"{method!r} is not one of {sorted(UNARY_METHODS | OIP_METHODS)}")
        gone = self._gone(method, getattr(request, "session_id", ""))
        if gone is not None:
            return gone
        context = CallContext(caller)
        return await _answered(context, lambda: getattr(self.servicer, method)(request, context))

    async def stream_step(self, request: Any, caller: Caller | str = "") -> Reply:
        """One message of a StreamSession (the Ingress fills in the stream's session_id),
        answered by the servicer's StreamSession: the same checks, metrics and codes."""
        gone = self._gone("StreamSession", getattr(request, "session_id", ""))
        if gone is not None:
            return gone
        context = CallContext(caller)
        return await _answered(
            context, lambda: _first(self.servicer.StreamSession, request, context)
        )

    async def infer(
        self, method: str, request: Any, caller: Caller | str = "", session_id: str = ""
    ) -> Reply:
        """One Open Inference Protocol call, or one ModelStreamInfer message (its reply,
        error_message included, is the response). session_id: the session the Ingress's
        SequenceDirectory holds for the request's sequence, when the call steps one. The
        reply says which session the sequence steps afterwards (SequenceDirectory keeps it)."""
        context = CallContext(caller)
        stream = method == "ModelStreamInfer"
        gone = self._gone(method, session_id, _sequence_text(request))
        if gone is not None:
            if stream:
                return Reply(response=stream_error(request, gone.details))
            return gone
        if stream:
            reply = await _answered(
                context, lambda: _first(self.oip.ModelStreamInfer, request, context)
            )
        elif method in OIP_METHODS:
            reply = await _answered(context, lambda: getattr(self.oip, method)(request, context))
        else:
            raise ValueError(f"{method!r} is not one of {sorted(OIP_METHODS)} or ModelStreamInfer")
        if method in ("ModelInfer", "ModelStreamInfer"):
            reply.sequence_session = await self.oip.sequence_session(request, context)
        return reply

    async def live_sessions(self, session_ids: list[str]) -> list[str]:
        """Those of session_ids that live here (SequenceDirectory prunes the rest)."""
        live = []
        for session_id in session_ids:
            try:
                await _value(self.serving.get_session(session_id))
            except Exception:  # gone, closed, expired, or not an id of ours
                continue
            live.append(session_id)
        return live

    async def cache_usage(self) -> dict[str, tuple[int, int]]:
        """(live sessions, KV blocks in use) per model with a cache: what tests and
        operators read to see a replica's cache end empty."""
        usage = {}
        for hosted in self.serving.models():
            info = await _value(self.serving.cache_info(hosted.spec.name))
            if info is not None:
                usage[hosted.spec.name] = (info.num_sessions, info.num_blocks_used)
        return usage

    def replica_id_of(self) -> str:
        return self.replica_id

    async def record_routing_stats(self) -> dict[str, int]:
        """Live sessions here, for the controller and routers (RunningReplica.routing_stats)."""
        return {"sessions": sum(n for n, _ in (await self.cache_usage()).values())}

    def _gone(self, method: str, session_id: str, what: str = "") -> Reply | None:
        """NOT_FOUND for a session that lived on another replica: the router sends a call
        here only when that replica is gone (dead or removed), and its cache with it.
        what: the session's name for the client (a Triton sequence), when not its id."""
        owner = replica_of(session_id) if session_id else None
        if owner is None or owner == self.replica_id:
            return None
        protocol = metrics.PROTOCOL_KSERVE_V2 if what else metrics.PROTOCOL_MHA_V1
        metrics.count_request(method, "unknown", grpc.StatusCode.NOT_FOUND.name, protocol)
        named = f"{what} (session {session_id!r})" if what else f"session {session_id!r}"
        again = "start it again with sequence_start" if what else "create a new session"
        return Reply(
            code=grpc.StatusCode.NOT_FOUND,
            details=(
                f"{named} is gone: it lived on Ray Serve replica {owner!r}, which is no "
                "longer running or is stopping (it died, or was scaled down or replaced), and "
                "its KV cache went with it; "
                f"{again} and send its tokens again"
            ),
        )


async def _answered(context: CallContext, call: Any) -> Reply:
    """The servicer's answer to one call, or the status it aborted with. A call whose
    deadline passed (the servicer then raises CancelledError, as grpcio would answer
    DEADLINE_EXCEEDED itself) answers DEADLINE_EXCEEDED; a real cancellation propagates."""
    try:
        return context.reply(await call())
    except grpc.aio.AbortError:
        return context.reply()
    except asyncio.CancelledError as e:
        task = asyncio.current_task()
        remaining = context.time_remaining()
        if (task is not None and task.cancelling()) or remaining is None or remaining > 0:
            raise
        why = f": {e.__cause__}" if e.__cause__ is not None else ""
        return Reply(code=grpc.StatusCode.DEADLINE_EXCEEDED, details=f"Deadline Exceeded{why}")


async def _first(stream: Any, request: Any, context: CallContext) -> Any:
    """The one reply of a stream method to a stream of one request."""
    return [r async for r in stream(_one(request), context)][0]


async def _one(request: Any) -> AsyncIterator[Any]:
    yield request


async def _value(result: Any) -> Any:
    """AsyncEngine's session and cache methods, whether they are coroutines or not."""
    return await result if inspect.isawaitable(result) else result


def _sequence_text(request: Any) -> str:
    """'sequence 7 to model 'mha'' for a request that steps a Triton sequence, else ''."""
    try:
        sequence = sequence_of(request.parameters)
    except Exception:  # malformed or invalid: answered by the servicer, not named here
        return ""
    return "" if sequence is None else sequence.describe(request.model_name)
