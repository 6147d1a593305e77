"""The frames between a frontend worker and the engine process (serving/remote.py is the
frontend's end, serving/host.py the engine's): one Unix socket per frontend, no torch.

A message is pickled, its arrays not: each rides beside the pickle as raw bytes (smaller
than SHM_BYTES: one copy into the socket, one out) or through a file in shared memory
(/dev/shm) that the sender writes once and the receiver maps, unlinks and wraps as an
array without copying (numpy over the mapping).

Frame: u32 pickle length, u32 buffer count, u64 length per buffer, the pickle, then each
buffer at a 16-byte aligned offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import io
import mmap
import os
import pickle
import secrets
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mha_serve.engine.errors import TooLarge
from mha_serve.engine.requests import ModelView

# Arrays this large go through shared memory; below it a mapping costs more than a copy
# through the socket (a fresh mapping faults in every page it touches).
SHM_BYTES = 1 << 20
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHM_PREFIX = "mha-serve-"
ALIGN = 16
_HEAD = struct.Struct("<II")


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
# files written for it so far (removed again if the message fails to pack). Set by pack;
# pickling runs on one thread at a time per process (see pack).
_link = threading.local()


def _reduce_array(a: np.ndarray) -> tuple:
    """How an array pickles here: its bytes out of band (protocol 5: no copy into the
    pickle), or through shared memory when large."""
    data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if data.nbytes >= SHM_BYTES:
        name = Shm.write(data, *_link.ends)
        _link.written.append(name)
        return _from_shm, (name, data.nbytes, a.dtype.str, a.shape)
    return _from_bytes, (pickle.PickleBuffer(data), a.dtype.str, a.shape)


def _from_bytes(buffer: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    if len(memoryview(buffer)) == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def _from_shm(name: str, nbytes: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(Shm.take(name, nbytes), dtype=dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    # Looked up by exact type in C: no Python call for the other objects of a message.
    dispatch_table = {**copyreg.dispatch_table, np.ndarray: _reduce_array}


def _pad(n: int) -> int:
    return -n % ALIGN


def pack(message: Any, engine: int, frontend: int) -> list[Any]:
    """A message's frame as parts to write (arrays' bytes are referenced, not copied), for
    the link between engine and frontend (pids: its shared-memory files' names). Thread-safe:
    a large message is packed on a worker thread."""
    out_of_band: list[pickle.PickleBuffer] = []
    meta = io.BytesIO()
    _link.ends, _link.written = (engine, frontend), []
    try:
        _Pickler(meta, protocol=5, buffer_callback=out_of_band.append).dump(message)
    except BaseException:
        for name in _link.written:  # a later tensor found no room: the earlier ones go
            Shm.unlink(name)
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
    """The next message, its arrays restored; IncompleteReadError when the peer is gone."""
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
