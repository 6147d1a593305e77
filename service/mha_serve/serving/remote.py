"""The engine in another process: what a frontend worker serves from (RemoteEngine) and the
engine process's end of it (EngineHost), one Unix socket per frontend.

A frontend worker (transport/workers.py) runs gRPC, protobuf and the codec; the engine
process runs the one AsyncEngine (batches, KV caches, sessions). RemoteEngine has the
AsyncEngine's interface, so the servicers are the same code over either. What crosses:

- a call is (op, args) pickled, its tensors not: each rides beside the pickle as raw
  bytes (smaller than SHM_BYTES: one copy into the socket, one out) or through a file in
  shared memory (/dev/shm) that the sender writes once and the receiver maps, unlinks and
  wraps as a tensor without copying (torch.from_numpy over the mapping);
- the reply is the engine's AttendResult or session stats the same way; the frontend
  encodes it and counts the request metrics itself (async_engine.finish);
- cancellation: a frontend whose caller went away sends ("cancel", id) and the engine
  cancels that call's task, as if the caller were local (a session step is rolled back);
- a frontend that disconnects has all its calls cancelled; an engine that goes away fails
  every pending call UNAVAILABLE and sets RemoteEngine.lost.

Frame: u32 pickle length, u32 buffer count, u64 length per buffer, the pickle, then each
buffer at a 16-byte aligned offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import io
import itertools
import logging
import mmap
import os
import pickle
import secrets
import socket
import struct
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from mha_serve.cache import SessionStats
from mha_serve.engine import (
    AttendCall,
    AttendResult,
    HostedModel,
    ModelNotFound,
    TooLarge,
)
from mha_serve.engine.types import CacheInfo
from mha_serve.serving.async_engine import (
    EXPECTED,
    AsyncEngine,
    Computed,
    Timing,
    Unavailable,
    finish,
    offload,
)
from mha_serve.serving.sequences import SequenceKey
from mha_serve.spec import ModelSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

# Tensors this large go through shared memory; below it a mapping costs more than a copy
# through the socket (a fresh mapping faults in every page it touches).
SHM_BYTES = 1 << 20
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHM_PREFIX = "mha-serve-"
ALIGN = 16
_HEAD = struct.Struct("<II")
_ENGINE_OPS = (
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


@dataclass(frozen=True)
class ModelView:
    """What a frontend knows of a hosted model: HostedModel less its module."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    num_parameters: int


@dataclass(frozen=True)
class Hello:
    """The engine's first message to a frontend, once its models are warm."""

    models: list[ModelView]
    max_response_bytes: int


# --- frames ------------------------------------------------------------------------------

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}
# Received tensors are views of the frame's (immutable) bytes, which nothing writes to, as
# transport/tensors.py's of the wire's: torch's warning about them is filtered once.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat uint8 array (no copy when it is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _tensor_over(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over buffer's bytes, no copy (numpy's view is cheaper than torch.frombuffer)."""
    if dtype in _NUMPY:
        x = torch.from_numpy(np.frombuffer(buffer, dtype=_NUMPY[dtype]).reshape(shape))
        return x.view(dtype) if dtype == torch.bfloat16 else x
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


class _Shm:
    """Shared-memory files: SHM_PREFIX, the engine's pid, the frontend's pid (the two ends of
    the link it crosses), then a random part no other local user can guess. The engine
    removes a frontend's leftovers when its link ends, and everything of its own at exit."""

    @staticmethod
    def write(data: np.ndarray, engine: int, frontend: int) -> str:
        name = f"{SHM_PREFIX}{engine}-{frontend}-{secrets.token_hex(8)}"
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:  # no inode left, no file descriptor left, a name taken
            raise _no_room(data.nbytes, e) from None
        try:
            try:  # claimed up front: a full /dev/shm is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, data.nbytes)
                mapped = mmap.mmap(fd, data.nbytes)
            except OSError as e:
                raise _no_room(data.nbytes, e) from None
            with mapped:
                view = np.frombuffer(mapped, dtype=np.uint8)
                view[:] = data  # the one copy
                del view
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return name

    @staticmethod
    def take(name: str, nbytes: int) -> mmap.mmap:
        """Maps a file another process wrote and unlinks it: the mapping outlives the name."""
        path = SHM_DIR / name
        if "/" in name or not name.startswith(SHM_PREFIX):
            raise ValueError(f"not a shared-memory tensor of mha-serve: {name!r}")
        fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
            os.unlink(path)

    @staticmethod
    def unlink(name: str) -> None:
        with contextlib.suppress(OSError):
            (SHM_DIR / name).unlink()

    @staticmethod
    def clean(engine: int, frontend: int | None = None) -> int:
        """Removes the files nobody took: of one frontend's link, or all of an engine's."""
        pattern = f"{SHM_PREFIX}{engine}-" + ("*" if frontend is None else f"{frontend}-*")
        removed = 0
        for path in SHM_DIR.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
        return removed


def _no_room(nbytes: int, e: OSError) -> TooLarge:
    return TooLarge(
        f"no room in {SHM_DIR} for a {nbytes}-byte tensor between the frontend and engine "
        f"processes ({e.strerror}); give {SHM_DIR} more space (docs/operations.md, frontend "
        "workers) or send smaller requests"
    )


# The link the message being packed crosses (engine pid, frontend pid), and the shared-memory
# files written for it so far (removed again if the message fails to pack). Set by pack;
# pickling runs on one thread at a time per process (see pack).
_link = threading.local()


def _reduce_tensor(t: torch.Tensor) -> tuple:
    """How a tensor pickles here: its bytes out of band (protocol 5: no copy into the
    pickle), or through shared memory when large."""
    data = _as_bytes(t)
    shape = tuple(t.shape)
    if data.nbytes >= SHM_BYTES:
        name = _Shm.write(data, *_link.ends)
        _link.written.append(name)
        return _from_shm, (name, data.nbytes, t.dtype, shape)
    return _from_bytes, (pickle.PickleBuffer(data), t.dtype, shape)


def _from_bytes(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if len(memoryview(buffer)) == 0:
        return torch.empty(shape, dtype=dtype)
    return _tensor_over(buffer, dtype, shape)


def _from_shm(name: str, nbytes: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return _tensor_over(_Shm.take(name, nbytes), dtype, shape)


class _Pickler(pickle.Pickler):
    # Looked up by exact type in C: no Python call for the other objects of a message.
    dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}


def _pad(n: int) -> int:
    return -n % ALIGN


def pack(message: Any, engine: int, frontend: int) -> list[Any]:
    """A message's frame as parts to write (tensors' bytes are referenced, not copied), for
    the link between engine and frontend (pids: its shared-memory files' names). Thread-safe:
    a large message is packed on a worker thread."""
    out_of_band: list[pickle.PickleBuffer] = []
    meta = io.BytesIO()
    _link.ends, _link.written = (engine, frontend), []
    try:
        _Pickler(meta, protocol=5, buffer_callback=out_of_band.append).dump(message)
    except BaseException:
        for name in _link.written:  # a later tensor found no room: the earlier ones go
            _Shm.unlink(name)
        raise
    finally:
        _link.written = []
    pickled = meta.getvalue()
    buffers = [b.raw() for b in out_of_band]
    lengths = [b.nbytes for b in buffers]
    head = _HEAD.pack(len(pickled), len(buffers)) + struct.pack(f"<{len(lengths)}Q", *lengths)
    parts = [head, pickled]
    offset = len(pickled)
    for b in buffers:
        parts.append(bytes(_pad(offset)))
        offset += _pad(offset)
        parts.append(b)
        offset += b.nbytes
    return parts


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message, its tensors restored; IncompleteReadError when the peer is gone."""
    size, count = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    lengths = struct.unpack(f"<{count}Q", await reader.readexactly(8 * count)) if count else ()
    total = size
    for n in lengths:
        total += _pad(total) + n
    body = memoryview(await reader.readexactly(total))
    buffers, offset = [], size
    for n in lengths:
        offset += _pad(offset)
        buffers.append(body[offset : offset + n])
        offset += n
    return pickle.loads(body[:size], buffers=buffers)


def _error_state(e: BaseException) -> tuple[type, tuple, dict]:
    """An exception as (class, args, attributes): rebuilt without calling its __init__,
    whose signature may not take its args back (pickle's default would)."""
    state = {k: v for k, v in vars(e).items() if not k.startswith("__")}
    try:
        pickle.dumps((type(e), e.args, state))
    except Exception:  # something in it does not pickle: keep its type's name and text
        return RuntimeError, (f"{type(e).__name__}: {e}",), {}
    return type(e), e.args, state


def _rebuild_error(cls: type, args: tuple, state: dict) -> BaseException:
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


# --- the engine process's end --------------------------------------------------------------


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
        frontend = _peer_pid(writer)
        try:
            await self._ready.wait()
            serving = self.serving
            hosted = serving.models()
            hello = Hello(
                [ModelView(h.spec, h.device, h.dtype, h.num_parameters) for h in hosted],
                serving.max_response_bytes,
            )
            writer.writelines(pack(("hello", 0, hello), os.getpid(), frontend))
            while True:
                message = await read_frame(reader)
                kind, rid = message[0], message[1]
                if kind == "call":
                    task = asyncio.create_task(
                        self._call(rid, message[2], message[3], writer, frontend)
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
            writer.close()
            _Shm.clean(os.getpid(), frontend)  # replies it never took
            self._connections.discard(me)

    async def _call(
        self, rid: int, op: str, args: tuple, writer: asyncio.StreamWriter, frontend: int
    ) -> None:
        serving = self.serving
        nbytes = 0
        try:
            if op not in _ENGINE_OPS:
                raise ValueError(f"no engine operation {op!r}")
            if op == "compute":
                call, received, deadline = args
                computed = await serving.compute(call, received=received, deadline=deadline)
                value: Any = (computed, call.model)
                nbytes = computed.result.output.nbytes
                if computed.result.weights is not None:
                    nbytes += computed.result.weights.nbytes
            else:
                value = await getattr(serving, op)(*args)
            reply = ("ok", rid, value)
        except asyncio.CancelledError:
            return  # the caller is gone; nobody waits for an answer
        except EXPECTED as e:
            reply = ("error", rid, _error_state(e))
        except Exception as e:  # the frontend answers INTERNAL; the traceback is here
            log.exception("engine operation %s failed", op)
            reply = ("error", rid, _error_state(e))
        me = os.getpid()
        try:  # a large answer is copied into shared memory off this loop (every frontend's)
            parts = await offload(pack, reply, me, frontend, nbytes=nbytes)
        except Exception as e:  # no room for its tensors, or worse: the caller gets why
            if not isinstance(e, EXPECTED):
                log.exception("engine operation %s: its answer could not be sent", op)
            parts = pack(("error", rid, _error_state(e)), me, frontend)
        try:
            if writer.is_closing():
                raise ConnectionResetError
            writer.writelines(parts)
            await writer.drain()
        except ConnectionError:  # the frontend left meanwhile: nobody takes its files
            _Shm.clean(me, frontend)


def _peer_pid(writer: asyncio.StreamWriter) -> int:
    """The process at the other end of a Unix socket (SO_PEERCRED)."""
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


# --- a frontend's end ----------------------------------------------------------------------


class RemoteEngine:
    """The AsyncEngine of another process, for a frontend worker's servicers: the same
    coroutines, each a round trip; model descriptions are kept here (they never change)."""

    lanes: dict = {}  # noqa: RUF012 - no lanes here; the engine process has them

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
                    future.set_exception(_rebuild_error(*value))
        except (asyncio.IncompleteReadError, ConnectionError):
            if not self._closing:
                log.error("the engine process closed its link")
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

    async def _call(self, op: str, *args: Any, nbytes: int = 0) -> Any:
        """One operation of the engine's, answered; nbytes: its tensors' size (a large
        request is copied into shared memory off the event loop)."""
        if self.lost.is_set():
            raise Unavailable("the engine process is gone; retry")
        rid = next(self._ids)
        parts = await offload(self._pack, ("call", rid, op, args), nbytes=nbytes)
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

    # --- the AsyncEngine's interface -----------------------------------------------------

    def model_label(self, name: str) -> str:
        return name if name in self._models else "unknown"

    async def session_label(self, session_id: str) -> str:
        return await self._call("session_label", session_id)

    async def attend(
        self,
        call: AttendCall,
        encode: Callable[[AttendResult], T],
        *,
        received: float,
        deadline: float | None,
    ) -> tuple[T, Timing]:
        computed: Computed
        computed, call.model = await self._call(
            "compute", call, received, deadline, nbytes=call.inputs.nbytes
        )
        return await finish(call, computed, encode, received)

    async def analyze_heads(self, call: AttendCall, include_weights: bool) -> tuple[Any, float]:
        return await self._call("analyze_heads", call, include_weights)

    async def sequence_session(self, key: SequenceKey) -> str | None:
        return await self._call("sequence_session", key)

    async def start_sequence(self, key: SequenceKey, model: str, owner: str) -> str:
        return await self._call("start_sequence", key, model, owner)

    async def end_sequence(self, key: SequenceKey, session_id: str, *, close: bool) -> None:
        await self._call("end_sequence", key, session_id, close)

    async def create_session(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats:
        return await self._call("create_session", model, max_len, ttl_s, owner)

    async def get_session(self, session_id: str) -> SessionStats:
        return await self._call("get_session", session_id)

    async def fork_session(self, session_id: str, ttl_s: float | None) -> SessionStats:
        return await self._call("fork_session", session_id, ttl_s)

    async def truncate_session(self, session_id: str, num_tokens: int) -> SessionStats:
        return await self._call("truncate_session", session_id, num_tokens)

    async def close_session(self, session_id: str) -> None:
        await self._call("close_session", session_id)

    async def cache_info(self, model: str) -> CacheInfo | None:
        return await self._call("cache_info", model)

    def models(self) -> list[HostedModel]:
        return list(self._models.values())  # ModelViews: what the servicers read of them

    def model(self, name: str) -> HostedModel:
        view = self._models.get(name)
        if view is None:  # the engine's own message (Engine.get)
            raise ModelNotFound(
                f"model {name!r} is not served here; available: {', '.join(self._models)}"
            )
        return view


def clean_shared_memory(engine_pid: int) -> int:
    """Removes shared-memory tensors left by peers that died before taking them."""
    return _Shm.clean(engine_pid)
