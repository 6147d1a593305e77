"""The Open Inference Protocol's methods of AttentionReplica (inference.GRPCInferenceService),
answered through the standalone server's door (transport/oip/door.py).

Stateless calls are answered where Ray's proxy sent them. A Triton sequence lives in the
session its start made on one replica; SequenceDirectory (one for the application) keeps
which session each sequence steps, written after its start and removed after its end or
when its session is gone. A step is routed to its session's replica by the proxy, which
looks the sequence up for ModelInfer (proxy.py); a ModelStreamInfer message, whose stream
went to one replica, is looked up here and forwarded when its session lives elsewhere: the
one hop kept, and only where a sequence must be looked up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

from mha_client.api import attention_pb2 as mha_pb
from mha_serve.ray_app.context import CallContext, Caller, Reply
from mha_serve.ray_app.direct import wants_direct
from mha_serve.ray_app.forward import (
    UpToLimit,
    calls,
    end_stream,
    forward,
    message,
    own_request_id,
    too_large,
    unary_answer,
)
from mha_serve.ray_app.ids import replica_of
from mha_serve.ray_app.moves import UntilStopping
from mha_serve.ray_app.proxy import SESSION_KEY
from mha_serve.ray_app.router import liveness
from mha_serve.transport.answer import Refused
from mha_serve.transport.oip.door import InferenceDoor
from mha_serve.transport.oip.stream import pipelined, sequence_key, stream_error

STEPS = ("ModelInfer", "ModelStreamInfer")  # the methods that may step a sequence


class InferenceMethods:
    """inference.GRPCInferenceService on AttentionReplica (a base of it)."""

    def __init__(self, door: InferenceDoor, directory: Any, deployment: str, app: str) -> None:
        self.oip = door
        self._directory = directory
        self._deployment = (deployment, app)
        self._peers: Any = None  # this deployment's handle: made on first use (in a call)
        self.direct: Any = None  # the replica's DirectServer (direct.py), when on
        self.max_request_bytes = 0  # the replica's max_receive_message_bytes (0: no check)

    async def ServerLive(self, request: Any, grpc_context: Any) -> Any:
        return await self._oip_unary("ServerLive", request, grpc_context)

    async def ServerReady(self, request: Any, grpc_context: Any) -> Any:
        return await self._oip_unary("ServerReady", request, grpc_context)

    async def ModelReady(self, request: Any, grpc_context: Any) -> Any:
        return await self._oip_unary("ModelReady", request, grpc_context)

    async def ServerMetadata(self, request: Any, grpc_context: Any) -> Any:
        return await self._oip_unary("ServerMetadata", request, grpc_context)

    async def ModelMetadata(self, request: Any, grpc_context: Any) -> Any:
        return await self._oip_unary("ModelMetadata", request, grpc_context)

    async def ModelConfig(self, request: Any, grpc_context: Any) -> Any:
        return await self._oip_unary("ModelConfig", request, grpc_context)

    async def ModelInfer(self, request: Any, grpc_context: Any) -> Any:
        return await self._oip_unary("ModelInfer", request, grpc_context)

    async def ModelStreamInfer(self, requests: Any, grpc_context: Any) -> AsyncIterator[Any]:
        """One reply per request, in order; requests compute concurrently, a sequence's one
        after another (stream.py, as the standalone server); an error answers its request
        with error_message and the stream goes on. Over a direct stream when the proxy takes
        the offer (direct.py), else through Ray."""
        caller = Caller.of(grpc_context)
        if self.direct is not None and wants_direct(grpc_context):
            answer = functools.partial(self._direct_infer, caller=caller)
            async for item in self.direct.offer(answer, grpc_context):
                yield item
            return
        async for reply in self._direct_infer(requests, None, caller):
            if isinstance(reply, Reply):  # the replica is stopping: reopen
                yield end_stream(grpc_context, reply)
                return
            yield message(reply)

    async def _direct_infer(
        self, requests: AsyncIterator[Any], context: Any, caller: Caller
    ) -> AsyncIterator[Any]:
        """The stream's replies; once Ray is stopping this replica, it ends after the
        messages in flight, UNAVAILABLE (reopened, its sequences go on where they moved)."""
        answer = functools.partial(self._stream_one, caller=caller)
        limited = UpToLimit(requests, self.max_request_bytes)
        until = UntilStopping(limited, self.stopping)
        async for reply in pipelined(until, answer, key=sequence_key):
            yield reply
        ended = limited.refused or (self.reopen() if until.cut else None)
        if ended is not None:
            if context is not None:
                await context.abort(ended.code, ended.details)
            yield ended

    async def _stream_one(self, request: Any, caller: Caller) -> Any:
        own_request_id()  # this message's handle calls run beside the others' (pipelined)
        reply = await self._routed("ModelStreamInfer", request, caller)
        if reply.code is None:
            return reply.response
        return stream_error(request, reply.details)

    async def _oip_unary(self, method: str, request: Any, grpc_context: Any) -> Any:
        caller = Caller.of(grpc_context)
        # The session the proxy looked the step's sequence up in and routed it by (proxy.py)
        session_id = next((v for k, v in caller.metadata if k == SESSION_KEY), "")
        reply = too_large(request, self.max_request_bytes)
        if reply is None:
            reply = await self._routed(method, request, caller, routed_by=session_id)
        return unary_answer(grpc_context, reply)

    # --- through a handle --------------------------------------------------------------

    async def infer(
        self, method: str, request: Any, caller: Caller | str = "", session_id: str = ""
    ) -> Reply:
        """One call or ModelStreamInfer message answered here (the reply's response is the
        message's, error_message included); session_id: the session its sequence steps, when
        another replica forwards a step here. The reply says which session the sequence
        steps afterwards."""
        caller = Caller(peer=caller) if isinstance(caller, str) else caller
        if method not in self.oip.unary_methods and method != "ModelStreamInfer":
            raise ValueError(
                f"{method!r} is not one of {sorted(self.oip.unary_methods)} or ModelStreamInfer"
            )
        found = self.oip.sequence_key(request, CallContext(caller))
        what = "" if found is None else found[0].describe(request.model_name)
        gone = self._gone(method, session_id, what) if what else None
        if gone is not None:
            reply = await gone
            if method == "ModelStreamInfer":
                return Reply(response=stream_error(request, reply.details))
            return reply
        return await self._here(method, request, caller)

    async def _here(self, method: str, request: Any, caller: Caller) -> Reply:
        context = CallContext(caller)
        if method == "ModelStreamInfer":
            reply = Reply(response=await self.oip.stream_one(request, context))
        else:
            result = await self.oip.unary(method, request, context)
            reply = (
                Reply(code=result.code, details=result.details)
                if isinstance(result, Refused)
                else Reply(result)
            )
        if method in STEPS:
            reply.sequence_session = await self.oip.sequence_session(request, context)
        return reply

    async def _routed(
        self, method: str, request: Any, caller: Caller, routed_by: str = ""
    ) -> Reply:
        """A call answered here, or a sequence's step where its session lives. routed_by:
        the session the proxy looked the step up in and routed it by ("": look it up here);
        the router sends it elsewhere than that session's replica only once it is gone."""
        found = self.oip.sequence_key(request, CallContext(caller)) if method in STEPS else None
        if found is None:  # stateless, or answered by the door (bad controls, bad bytes)
            return await self._here(method, request, caller)
        sequence, key = found
        if sequence.start:
            reply = await self._here(method, request, caller)
            # Refused before it began (bad input): the sequence before it, if any, goes on,
            # as on the standalone server; begun (and maybe ended): it replaces that one.
            if reply.sequence_session is not None or not _failed(reply):
                previous = await self._call_directory("start", key, reply.sequence_session)
                if previous is not None and previous != reply.sequence_session:
                    await self._close_quietly(previous, caller)
            return reply
        session_id = routed_by or await self._call_directory("get", key) or ""
        what = sequence.describe(request.model_name)
        if routed_by and not self._held_here(routed_by):
            reply = await self._gone(method, routed_by, what)
        elif self._held_here(session_id):
            # Here, or in no directory: the door steps it, or answers Triton's START message.
            reply = await self._here(method, request, caller)
        else:
            reply = await forward(
                calls(self._peer_handle(), "infer").options(session_id=session_id),
                method,
                request,
                caller,
                session_id,
                session_id=session_id,
                what=what,
                alive=liveness(self._peer_handle()),
            )
        if reply.code is not None and method == "ModelStreamInfer":
            reply = Reply(response=stream_error(request, reply.details))
        if session_id and reply.sequence_session != session_id:  # ended, or its session gone
            await self._call_directory("end", key, session_id)
        return reply

    async def _call_directory(self, method: str, *args: Any) -> Any:
        return await calls(self._directory, method).remote(*args)

    def _peer_handle(self) -> Any:
        """This deployment's handle, for a step or a close on the replica holding a session."""
        if self._peers is None:
            from ray import serve

            self._peers = serve.get_deployment_handle(*self._deployment)
        return self._peers

    async def _close_quietly(self, session_id: str, caller: Caller) -> None:
        """Closes a session a new start replaced (gone already: fine)."""
        if replica_of(session_id) == self.replica_id:
            return  # the door's start closed it: the engine keeps sequences too
        request = mha_pb.CloseSessionRequest(session_id=session_id)
        with contextlib.suppress(Exception):
            await forward(
                calls(self._peer_handle(), "call").options(session_id=session_id),
                "CloseSession",
                request,
                caller,
            )


def _failed(reply: Reply) -> bool:
    return reply.code is not None or bool(getattr(reply.response, "error_message", ""))
