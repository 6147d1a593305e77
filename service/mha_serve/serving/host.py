"""The engine process's end of the frontend workers' link (serving/link.py has the frames,
serving/remote.py the frontend's end): EngineHost serves the one AsyncEngine to every
frontend, each over a Unix socket of its own.

- a call is (op, args, kwargs); the reply the engine's answer, or its error rebuilt in the
  frontend;
- a compute answers the Computed call but its request, which the frontend holds (its
  outcome's arrays beside the pickle, or in shared memory when large); the frontend
  encodes it and counts the request metrics itself;
- cancellation: a frontend whose caller went away sends ("cancel", id) and the engine
  cancels that call's task, as if the caller were local (a session step is rolled back);
- a frontend that disconnects has all its calls cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mha_serve.engine import TooLarge
from mha_serve.serving.async_engine import AsyncEngine
from mha_serve.serving.finish import computed_reply
from mha_serve.serving.link import Hello, Shm, error_state, pack, pack_off_loop, read_frame
from mha_serve.serving.protocol import EXPECTED

log = logging.getLogger(__name__)

# An answer whose tensors find no room in shared memory crosses in the frame itself up to
# this size (its copies then run on the engine's event loop, which every frontend shares).
SOCKET_FALLBACK_BYTES = 16 << 20

# What a frontend may ask of the engine: the EngineClient's coroutines (compute is attend
# without the encoding, which the frontend does).
ENGINE_OPS = (
    "compute",
    "analyze_heads",
    "create_session",
    "get_session",
    "fork_session",
    "truncate_session",
    "close_session",
    "cache_info",
    "session_label",
    "sequence_session",
    "start_sequence",
    "end_sequence",
)


class EngineHost:
    """Serves the one AsyncEngine to frontend workers over a Unix socket. It accepts at
    once; a frontend's first message, Hello, waits until `ready` (the models are warm)."""

    def __init__(self, path: str | Path, on_message: Callable[[Any], None] | None = None) -> None:
        """on_message: gets what a frontend reports that is no call (e.g. its listening)."""
        self.path = str(path)
        self.on_message = on_message
        self.serving: AsyncEngine | None = None
        self._ready = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    def ready(self, serving: AsyncEngine) -> None:
        self.serving = serving
        self._ready.set()

    async def close(self) -> None:
        """Stops accepting and ends every connection (their calls are cancelled)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        self._connections.add(me)
        calls: dict[int, asyncio.Task] = {}
        outbox = _Outbox(writer)
        frontend = _peer_pid(writer)
        try:
            await self._ready.wait()
            serving = self.serving
            hello = Hello(serving.models(), serving.max_response_bytes)
            writer.writelines(pack(("hello", 0, hello), os.getpid(), frontend))
            while True:
                message = await read_frame(reader)
                kind, rid = message[0], message[1]
                if kind == "call":
                    task = asyncio.create_task(
                        self._call(rid, message[2], message[3], message[4], outbox, frontend)
                    )
                    calls[rid] = task
                    task.add_done_callback(lambda _, r=rid: calls.pop(r, None))
                elif kind == "cancel":
                    task = calls.get(rid)
                    if task is not None:
                        task.cancel()
                elif self.on_message is not None:
                    self.on_message(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the frontend is gone (or stopping): its calls go with it
        except asyncio.CancelledError:
            pass  # close(): asyncio's server callback must not see the cancellation
        finally:
            for task in list(calls.values()):
                task.cancel()
            await asyncio.gather(*calls.values(), return_exceptions=True)
            outbox.flush()  # (answers given before the end still leave)
            writer.close()
            Shm.clean(os.getpid(), frontend)  # replies it never took
            self._connections.discard(me)

    async def _call(
        self,
        rid: int,
        op: str,
        args: tuple,
        kwargs: dict[str, Any],
        outbox: _Outbox,
        frontend: int,
    ) -> None:
        serving = self.serving
        nbytes = 0
        try:
            if op not in ENGINE_OPS:
                raise ValueError(f"no engine operation {op!r}")
            if op == "compute":
                computed = await serving.compute(*args, **kwargs)
                outcome = computed.outcome
                nbytes = outcome.output.nbytes
                if outcome.weights is not None:
                    nbytes += outcome.weights.nbytes
                value: Any = computed_reply(computed)
            else:
                value = await getattr(serving, op)(*args, **kwargs)
            reply = ("ok", rid, value)
        except asyncio.CancelledError:
            return  # the caller is gone; nobody waits for an answer
        except EXPECTED as e:
            reply = ("error", rid, error_state(e))
        except Exception as e:  # the frontend answers INTERNAL; the traceback is here
            log.exception("engine operation %s failed", op)
            reply = ("error", rid, error_state(e))
        me = os.getpid()
        try:  # a large answer is copied into shared memory off this loop (every frontend's)
            parts = await pack_off_loop(reply, me, frontend, nbytes)
        except TooLarge as e:  # no room in shared memory for its tensors
            parts = self._without_shm(op, rid, reply, me, frontend, nbytes, e, args)
        except Exception as e:  # worse: the caller gets why
            if not isinstance(e, EXPECTED):
                log.exception("engine operation %s: its answer could not be sent", op)
            parts = pack(("error", rid, error_state(e)), me, frontend)
        if not outbox.put(parts):  # the frontend left meanwhile: nobody takes its files
            Shm.clean(me, frontend)

    @staticmethod
    def _without_shm(
        op: str, rid: int, reply: tuple, me: int, frontend: int, nbytes: int, e: TooLarge, args
    ) -> list[Any]:
        """An answer whose tensors found no room in shared memory: in the frame itself up
        to SOCKET_FALLBACK_BYTES (a session step is kept by now: an error would tell its
        caller it was not; its copies run on this loop, so larger ones are not sent so),
        else the error, saying that a session step was kept."""
        if nbytes <= SOCKET_FALLBACK_BYTES:
            log.warning("engine operation %s: its answer goes through the socket: %s", op, e)
            try:
                return pack(reply, me, frontend, shm=False)
            except Exception as failed:  # (never leave the caller waiting)
                log.exception("engine operation %s: its answer could not be sent", op)
                return pack(("error", rid, error_state(failed)), me, frontend)
        request = args[0] if op == "compute" and args else None
        if getattr(request, "session_id", None):
            e = TooLarge(
                f"{e}; this session step was kept (its session holds its tokens), but its "
                f"{nbytes}-byte answer could not reach the frontend: do not send it again "
                "(GetSession shows the session)"
            )
        return pack(("error", rid, error_state(e)), me, frontend)


class _Outbox:
    """A connection's replies: the first of a turn of the event loop written at once, those
    that follow it in that turn (the rest of a batch's answers) together when it ends: two
    sends a batch, not one each, and no reply waits for another call's compute (a lone call
    computed on the loop's thread, batching/inline.py) but the one after it. (No drain: a reply
    waiting for room in the socket held nothing back but its own task.)"""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.parts: list | None = None  # None: no reply written this turn

    def put(self, parts: list) -> bool:
        """False when the connection is closing (the parts are dropped)."""
        if self.writer.is_closing():
            return False
        if self.parts is None:
            self.writer.writelines(parts)
            self.parts = []
            asyncio.get_running_loop().call_soon(self.flush)
        else:
            self.parts += parts
        return True

    def flush(self) -> None:
        parts, self.parts = self.parts, None
        if parts and not self.writer.is_closing():
            self.writer.writelines(parts)


def _peer_pid(writer: asyncio.StreamWriter) -> int:
    """The process at the other end of a Unix socket (SO_PEERCRED)."""
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def clean_shared_memory(engine_pid: int) -> int:
    """Removes shared-memory arrays left by peers that died before taking them."""
    return Shm.clean(engine_pid)
