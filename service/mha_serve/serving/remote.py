"""A frontend worker's end of the link to the engine process (transport/workers.py): the
RemoteEngine, an EngineClient whose every call is a round trip over a Unix socket
(serving/link.py has the frames, serving/host.py the engine's end). No torch here: a
frontend runs gRPC, protobuf and the codec, and holds only requests and outcomes.

- cancellation: a caller that goes away sends ("cancel", id) and the engine cancels that
  call's task, as if the caller were local (a session step is rolled back);
- an engine that goes away fails every pending call UNAVAILABLE and sets `lost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mha_serve.cache.types import SessionStats
from mha_serve.engine.errors import ModelNotFound
from mha_serve.engine.requests import (
    AttendOutcome,
    AttendRequest,
    CacheInfo,
    HeadReport,
    ModelView,
)
from mha_serve.serving.finish import Computed, finish
from mha_serve.serving.link import Hello, pack, pack_off_loop, read_frame, rebuild_error
from mha_serve.serving.protocol import Served, Unavailable
from mha_serve.serving.sequences import SequenceKey

log = logging.getLogger(__name__)
T = TypeVar("T")


class RemoteEngine:
    """The EngineClient of the engine process, for a frontend worker's servicers: the same
    coroutines, each a round trip; model descriptions are kept here (they never change)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hello: Hello):
        self._reader, self._writer = reader, writer
        self._models = {m.spec.name: m for m in hello.models}
        self.max_response_bytes = hello.max_response_bytes
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.lost = asyncio.Event()  # set when the engine process went away
        self._closing = False
        self._engine_pid = 0  # set by connect: shared-memory names carry it
        self._receiver = asyncio.create_task(self._receive(), name="engine-replies")

    @classmethod
    async def connect(cls, path: str | Path, *, engine_pid: int) -> RemoteEngine:
        """Connects to the engine process and waits for its Hello (its models warm)."""
        reader, writer = await asyncio.open_unix_connection(str(path))
        kind, _, hello = await read_frame(reader)
        if kind != "hello":
            raise RuntimeError(f"engine process sent {kind!r} before its hello")
        remote = cls(reader, writer, hello)
        remote._engine_pid = engine_pid
        return remote

    def start(self) -> None:
        """The engine process sweeps the sessions; nothing to start here."""

    async def close(self) -> None:
        """Ends the connection; calls still waiting get UNAVAILABLE."""
        self._closing = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._receiver
        self._fail_pending("the frontend is closing its link to the engine process")

    def notify(self, message: tuple) -> None:
        """A message for the engine process that wants no answer (e.g. 'listening')."""
        if not self._writer.is_closing():
            self._writer.writelines(self._pack(message))

    async def _receive(self) -> None:
        try:
            while True:
                kind, rid, value = await read_frame(self._reader)
                future = self._pending.pop(rid, None)
                if future is None or future.done():
                    continue  # its caller was cancelled meanwhile
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(rebuild_error(*value))
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self._closing:
                log.error("the engine process closed its link")
        except Exception:  # a frame it cannot read (corrupt; a reply's file removed as the
            # engine's end closed): whose answer it was is unknown, so the link ends
            log.exception("a frame from the engine process could not be read; the link ends")
        finally:
            self.lost.set()
            self._fail_pending("the engine process is gone; retry")

    def _fail_pending(self, why: str) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable(why))
        self._pending.clear()

    def _pack(self, message: Any) -> list[Any]:
        return pack(message, self._engine_pid, os.getpid())

    async def _call(self, op: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """One operation of the engine's, answered; nbytes: its arrays' size (a large
        request is copied into shared memory off the event loop)."""
        if self.lost.is_set():
            raise Unavailable("the engine process is gone; retry")
        rid = next(self._ids)
        message = ("call", rid, op, args, kwargs)
        parts = await pack_off_loop(message, self._engine_pid, os.getpid(), nbytes)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            self._writer.writelines(parts)
            await self._writer.drain()
            return await future
        except ConnectionError:  # the engine went away while the request was on its way
            raise Unavailable("the engine process is gone; retry") from None
        except asyncio.CancelledError:  # (awaiting it cancelled the future too)
            answered = future.done() and not future.cancelled()
            if not answered and not self._writer.is_closing():
                self._writer.writelines(self._pack(("cancel", rid)))
            raise
        finally:
            self._pending.pop(rid, None)

    # --- the EngineClient --------------------------------------------------------------

    def model_label(self, name: str) -> str:
        return name if name in self._models else "unknown"

    async def session_label(self, session_id: str) -> str:
        return await self._call("session_label", session_id)

    async def attend(
        self,
        request: AttendRequest,
        encode: Callable[[AttendOutcome], T],
        *,
        received: float,
        deadline: float | None,
        caller: str | None = None,
    ) -> Served[T]:
        reply = await self._call(
            "compute",
            request,
            received=received,
            deadline=deadline,
            caller=caller,
            nbytes=request.inputs.nbytes,
        )
        return await finish(Computed(request, *reply), encode, received)  # (computed_reply)

    async def analyze_heads(self, request: AttendRequest, include_weights: bool) -> HeadReport:
        return await self._call("analyze_heads", request, include_weights)

    async def sequence_session(self, key: SequenceKey) -> str | None:
        return await self._call("sequence_session", key)

    async def start_sequence(self, key: SequenceKey, model: str, owner: str) -> str:
        return await self._call("start_sequence", key, model, owner)

    async def end_sequence(self, key: SequenceKey, session_id: str, *, close: bool) -> None:
        await self._call("end_sequence", key, session_id, close=close)

    async def create_session(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats:
        return await self._call("create_session", model, max_len, ttl_s, owner)

    async def get_session(self, session_id: str, caller: str | None = None) -> SessionStats:
        return await self._call("get_session", session_id, caller)

    async def fork_session(
        self, session_id: str, ttl_s: float | None, caller: str | None = None
    ) -> SessionStats:
        return await self._call("fork_session", session_id, ttl_s, caller)

    async def truncate_session(
        self, session_id: str, num_tokens: int, caller: str | None = None
    ) -> SessionStats:
        return await self._call("truncate_session", session_id, num_tokens, caller)

    async def close_session(self, session_id: str, caller: str | None = None) -> None:
        await self._call("close_session", session_id, caller)

    async def cache_info(self, model: str) -> CacheInfo | None:
        return await self._call("cache_info", model)

    def models(self) -> list[ModelView]:
        return list(self._models.values())

    def model(self, name: str) -> ModelView:
        view = self._models.get(name)
        if view is None:  # the engine's own message (Engine.get)
            raise ModelNotFound(
                f"model {name!r} is not served here; available: {', '.join(self._models)}"
            )
        return view
