"""KV-cache sessions from the SDK: append tokens step by step, one call or one stream per step.

    with client.create_session("gqa") as s:        # closed on exit
        r = s.step(prompt)                          # (T, E): T tokens attend to all cached ones
        with s.stream() as stream:                  # a decode loop pays one stream, not a call
            for token in tokens:
                r = stream.step(token[None])        # r.session.num_tokens grows by one

Step options are those of build_attend_request (weights, heads, query_range, head_mask, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from mha_client.api import attention_pb2 as pb
from mha_client.errors import MhaServeError
from mha_client.sdk import AttendResult, SessionInfo, build_attend_request, parse_attend_response

if TYPE_CHECKING:
    from mha_client.sdk import AsyncClient, Client

_END = object()  # tells a stream's request iterator to finish


def _step_request(session_id: str, x: np.ndarray, options: dict[str, Any]) -> pb.AttendRequest:
    return build_attend_request("", x, session_id=session_id, **options)


class Session:
    """A session on the server (blocking). Use as a context manager to close it on exit."""

    def __init__(self, client: Client, info: SessionInfo) -> None:
        self._client = client
        self.info = info  # as of the last call that returned it

    @property
    def id(self) -> str:
        return self.info.session_id

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, x: np.ndarray, *, timeout: float | None = None, **options: Any) -> AttendResult:
        """Append x (T, E) or (1, T, E); its tokens attend to all cached tokens and themselves."""
        req = _step_request(self.id, x, options)
        start = time.perf_counter()
        resp = self._client._call(self._client._stub.Attend, req, timeout)
        result = parse_attend_response(resp, np.ndim(x) == 2, (time.perf_counter() - start) * 1e3)
        self.info = result.session or self.info
        return result

    def stream(self, *, timeout: float | None = None) -> SessionStream:
        """One bidirectional stream for many steps (timeout bounds the whole stream)."""
        return SessionStream(self, timeout)

    def refresh(self, *, timeout: float | None = None) -> SessionInfo:
        req = pb.GetSessionRequest(session_id=self.id)
        self.info = SessionInfo.from_proto(
            self._client._call(self._client._stub.GetSession, req, timeout)
        )
        return self.info

    def fork(self, *, ttl_s: float | None = None, timeout: float | None = None) -> Session:
        """A new session sharing this one's tokens (no copy until they diverge)."""
        req = pb.ForkSessionRequest(session_id=self.id, ttl_s=ttl_s or 0.0)
        info = self._client._call(self._client._stub.ForkSession, req, timeout)
        return Session(self._client, SessionInfo.from_proto(info))

    def close(self, *, timeout: float | None = None) -> None:
        """Frees the session's cache at once; closing a session that is already gone is a no-op."""
        try:
            req = pb.CloseSessionRequest(session_id=self.id)
            self._client._call(self._client._stub.CloseSession, req, timeout)
        except MhaServeError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                raise


class SessionStream:
    """Steps over one StreamSession call; each step waits for its reply (in order)."""

    def __init__(self, session: Session, timeout: float | None) -> None:
        self._session = session
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        client = session._client
        self._replies: Iterator[pb.AttendResponse] = client._stub.StreamSession(
            iter(self._requests.get, _END), timeout=client.timeout if timeout is None else timeout
        )

    def __enter__(self) -> SessionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, x: np.ndarray, **options: Any) -> AttendResult:
        start = time.perf_counter()
        self._requests.put(_step_request(self._session.id, x, options))
        try:
            resp = next(self._replies)
        except grpc.RpcError as err:
            raise MhaServeError.from_rpc_error(err, self._session._client.target) from err
        result = parse_attend_response(resp, np.ndim(x) == 2, (time.perf_counter() - start) * 1e3)
        self._session.info = result.session or self._session.info
        return result

    def close(self) -> None:
        self._requests.put(_END)
        with contextlib.suppress(grpc.RpcError):  # an error was already raised by step()
            for _ in self._replies:  # drain: the server ends the stream after the last request
                pass


class AsyncSession:
    """A session on the server (asyncio). `async with` closes it on exit."""

    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.session_id

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def step(
        self, x: np.ndarray, *, timeout: float | None = None, **options: Any
    ) -> AttendResult:
        req = _step_request(self.id, x, options)
        start = time.perf_counter()
        resp = await self._client._call(self._client._stub.Attend, req, timeout)
        result = parse_attend_response(resp, np.ndim(x) == 2, (time.perf_counter() - start) * 1e3)
        self.info = result.session or self.info
        return result

    def stream(self, *, timeout: float | None = None) -> AsyncSessionStream:
        return AsyncSessionStream(self, timeout)

    async def refresh(self, *, timeout: float | None = None) -> SessionInfo:
        req = pb.GetSessionRequest(session_id=self.id)
        info = await self._client._call(self._client._stub.GetSession, req, timeout)
        self.info = SessionInfo.from_proto(info)
        return self.info

    async def fork(
        self, *, ttl_s: float | None = None, timeout: float | None = None
    ) -> AsyncSession:
        req = pb.ForkSessionRequest(session_id=self.id, ttl_s=ttl_s or 0.0)
        info = await self._client._call(self._client._stub.ForkSession, req, timeout)
        return AsyncSession(self._client, SessionInfo.from_proto(info))

    async def close(self, *, timeout: float | None = None) -> None:
        try:
            req = pb.CloseSessionRequest(session_id=self.id)
            await self._client._call(self._client._stub.CloseSession, req, timeout)
        except MhaServeError as err:
            if err.code != grpc.StatusCode.NOT_FOUND:
                raise


class AsyncSessionStream:
    def __init__(self, session: AsyncSession, timeout: float | None) -> None:
        self._session = session
        client = session._client
        self._call = client._stub.StreamSession(
            timeout=client.timeout if timeout is None else timeout
        )

    async def __aenter__(self) -> AsyncSessionStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def step(self, x: np.ndarray, **options: Any) -> AttendResult:
        start = time.perf_counter()
        try:
            await self._call.write(_step_request(self._session.id, x, options))
            resp = await self._call.read()
        except grpc.RpcError as err:
            raise MhaServeError.from_rpc_error(err, self._session._client.target) from err
        if resp is grpc.aio.EOF:
            code = await self._call.code()
            details = await self._call.details()
            raise MhaServeError(code, details, self._session._client.target)
        result = parse_attend_response(resp, np.ndim(x) == 2, (time.perf_counter() - start) * 1e3)
        self._session.info = result.session or self._session.info
        return result

    async def close(self) -> None:
        await self._call.done_writing()
        with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
            await self._call.code()  # the server ends the stream after the last request
