"""The frames between a frontend worker and the engine process (serving/remote.py is the
frontend's end, serving/host.py the engine's): one Unix socket per frontend, no torch.

A message is pickled, its arrays not: each rides beside the pickle as raw bytes (smaller
than SHM_BYTES: one copy into the socket, one out) or through a file in shared memory
(/dev/shm) that the sender writes once and the receiver maps, unlinks and wraps as an
array without copying (numpy over the mapping).

The records a call carries (requests, outcomes, session stats) pickle as their class and a
tuple of their fields (_by_fields), not through dataclasses' own __getstate__/__setstate__,
whose Python loops cost more than the rest of a small message's pickling.

Frame: u32 pickle length, u32 buffer count, u64 body length; the body: u64 length per
buffer, the pickle, then each buffer at a 16-byte aligned offset (from the body's start).
A frame is thus two reads: its head, then its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import dataclasses
import inspect
import io
import mmap
import operator
import os
import pickle
import secrets
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mha_serve.cache.types import SessionStats
from mha_serve.engine.errors import TooLarge
from mha_serve.engine.requests import (
    Array,
    AttendOutcome,
    AttendRequest,
    CacheInfo,
    HeadReport,
    ModelView,
    PruningLevel,
)
from mha_serve.serving.finish import OFFLOAD_BYTES

# Arrays this large go through shared memory; below it a mapping costs more than a copy
# through the socket (a fresh mapping faults in every page it touches).
SHM_BYTES = 1 << 20
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHM_PREFIX = "mha-serve-"
ALIGN = 16
_HEAD = struct.Struct("<IIQ")  # pickle length, buffer count, body length


@dataclass(frozen=True)
class Hello:
    """The engine's first message to a frontend, once its models are warm."""

    models: list[ModelView]
    max_response_bytes: int


# --- frames ------------------------------------------------------------------------------


class Shm:
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
# files written for it so far (removed again if the message fails to pack). Set by pack,
# which keeps each thread's pickler here too (a large message is packed on a worker thread).
_link = threading.local()


def _reduce_array(a: np.ndarray) -> tuple:
    """How an array pickles here: its bytes out of band (protocol 5: no copy into the
    pickle), or through shared memory when large."""
    data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if data.nbytes >= SHM_BYTES and _link.shm:
        name = Shm.write(data, *_link.ends)
        _link.written.append(name)
        return _from_shm, (name, data.nbytes, a.dtype.str, a.shape)
    return _from_bytes, (pickle.PickleBuffer(data), a.dtype.str, a.shape)


def _from_bytes(buffer: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    # (one call over the buffer; an empty array's buffer is empty too)
    return np.ndarray(shape, dtype, buffer)


def _from_shm(name: str, nbytes: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(Shm.take(name, nbytes), dtype=dtype).reshape(shape)


def _reduce_host_array(a: Array) -> tuple:
    """An Array whose bytes ride beside the pickle: rebuilt by one call (_array_from_bytes)
    instead of an ndarray's reduce inside the Array's. Large or strided: as any array."""
    data = a.data
    if data.nbytes >= SHM_BYTES or not data.flags.c_contiguous:
        return Array, (data, a.dtype)
    return _array_from_bytes, (pickle.PickleBuffer(data), data.dtype.str, data.shape, a.dtype)


def _array_from_bytes(buffer: Any, np_dtype: str, shape: tuple[int, ...], dtype: str) -> Array:
    return Array(np.ndarray(shape, np_dtype, buffer), dtype)


def _by_fields(cls: type) -> Callable[[Any], tuple]:
    """How a record of the link pickles: its class and its fields' values (attrgetter: read
    in C), rebuilt by its __init__. Its dataclass must take every field in __init__ and do
    nothing else there."""
    fields = dataclasses.fields(cls)
    # __init__ must take exactly the fields, in order, positionally (not an InitVar more, a
    # keyword-only field, or a field it leaves out), and do nothing else
    params = list(inspect.signature(cls).parameters.values())
    positional = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    same = [p.name for p in params] == [f.name for f in fields]
    if hasattr(cls, "__post_init__") or not (positional and same):
        raise TypeError(f"{cls.__name__} is not rebuilt by its fields alone; leave it out here")
    get = operator.attrgetter(*(f.name for f in fields))
    if len(fields) == 1:
        return lambda obj: (cls, (get(obj),))
    return lambda obj: (cls, get(obj))


# The records of the calls and answers that cross the link often (the rest, rare: as pickle
# does by default).
RECORDS = (AttendRequest, AttendOutcome, SessionStats, CacheInfo, HeadReport, PruningLevel)


class _Pickler(pickle.Pickler):
    # Looked up by exact type in C: no Python call for the other objects of a message.
    dispatch_table = {
        **copyreg.dispatch_table,
        np.ndarray: _reduce_array,
        Array: _reduce_host_array,
        **{cls: _by_fields(cls) for cls in RECORDS},
    }


def _pad(n: int) -> int:
    return -n % ALIGN


def pack(
    message: Any,
    engine: int,
    frontend: int,
    files: list[str] | None = None,
    *,
    shm: bool = True,
) -> list[Any]:
    """A message's frame as parts to write (arrays' bytes are referenced, not copied), for
    the link between engine and frontend (pids: its shared-memory files' names). Thread-safe:
    a large message is packed on a worker thread (pack_off_loop). files: where to note the
    shared-memory files the frame names. shm False: every array's bytes in the frame itself
    (an answer that found no room in SHM_DIR: slower, but it arrives)."""
    try:
        pickler, meta, out_of_band = _link.pickler
    except AttributeError:  # this thread's first message: its pickler, kept (~1 us a message)
        meta, out_of_band = io.BytesIO(), []
        pickler = _Pickler(meta, protocol=5, buffer_callback=out_of_band.append)
        _link.pickler = pickler, meta, out_of_band
    _link.ends, _link.written, _link.shm = (engine, frontend), [], shm
    try:
        pickler.dump(message)
        pickled = meta.getvalue()
        buffers = [b.raw() for b in out_of_band]
        if files is not None:
            files += _link.written
    except BaseException:
        for name in _link.written:  # a later tensor found no room: the earlier ones go
            Shm.unlink(name)
        raise
    finally:  # nothing of this message stays referenced here
        _link.written = []
        pickler.clear_memo()
        meta.seek(0)
        meta.truncate()
        out_of_band.clear()
    count = len(buffers)
    table = struct.pack(f"<{count}Q", *(b.nbytes for b in buffers)) if count else b""
    parts = [b"", table, pickled]
    offset = len(table) + len(pickled)
    for b in buffers:
        pad = _pad(offset)
        if pad:
            parts.append(bytes(pad))
        parts.append(b)
        offset += pad + b.nbytes
    parts[0] = _HEAD.pack(len(pickled), count, offset)
    return parts


async def pack_off_loop(message: Any, engine: int, frontend: int, nbytes: int) -> list[Any]:
    """pack, here for a message whose arrays hold fewer than OFFLOAD_BYTES (nbytes), on a
    worker thread for a larger one (as finish.offload). A caller cancelled meanwhile leaves no
    shared-memory file behind: the thread packs on, and the files it wrote, which no frame
    will carry, are removed when it ends."""
    if nbytes < OFFLOAD_BYTES:
        return pack(message, engine, frontend)
    files: list[str] = []
    packing = asyncio.ensure_future(asyncio.to_thread(pack, message, engine, frontend, files))
    try:
        return await asyncio.shield(packing)
    except asyncio.CancelledError:
        packing.add_done_callback(lambda done: _unsent(done, files))
        raise


def _unsent(packing: asyncio.Future, files: list[str]) -> None:
    """A frame packed for a caller gone meanwhile: its files go (a failed pack left none;
    its error is nobody's to raise)."""
    if not packing.cancelled():
        packing.exception()
    for name in files:
        Shm.unlink(name)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message, its arrays restored; IncompleteReadError when the peer is gone,
    ValueError for a frame that is not one of pack's."""
    size, count, total = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    body = memoryview(await reader.readexactly(total))
    offset = 8 * count
    end = offset + size
    buffers = []
    if count and end <= total:
        for n in struct.unpack_from(f"<{count}Q", body):
            end += _pad(end)
            buffers.append(body[end : end + n])
            end += n
    if end != total:
        raise ValueError(
            f"malformed frame on the engine link: its head says {total} bytes, its parts "
            f"{end} (a peer of another version, or a corrupt stream)"
        )
    return pickle.loads(body[offset : offset + size], buffers=buffers)


def error_state(e: BaseException) -> tuple[type, tuple, dict]:
    """An exception as (class, args, attributes): rebuilt without calling its __init__,
    whose signature may not take its args back (pickle's default would)."""
    state = {k: v for k, v in vars(e).items() if not k.startswith("__")}
    try:
        pickle.dumps((type(e), e.args, state))
    except Exception:  # something in it does not pickle: keep its type's name and text
        return RuntimeError, (f"{type(e).__name__}: {e}",), {}
    return type(e), e.args, state


def rebuild_error(cls: type, args: tuple, state: dict) -> BaseException:
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e
