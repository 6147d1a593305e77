"""A session as one file: the K/V of the tokens it holds, in the cache's dtype, and what the
engine keeps about it (length, model and a fingerprint of its weights, limits, idle time,
owner), written as safetensors whose metadata is the header below. Reading one checks it
whole against the model it is for, and refuses a bad or foreign file with a message that
says what is wrong; bounds are recomputed from the K/V, never taken from the file.

The spill tier (spill.py) writes and reads these; so do restarts and moves between Ray
replicas: one form for all three.

The format (the safetensors metadata's "format") names the layout: FORMAT holds tensors k
and v; FORMAT_KEYS holds k alone, for a model whose values are its keys (mla: the cache
stores K once). Both are read. A record of such a model written in the older layout (k and
v, written before the cache stored K once) still loads when its v equals its k, and is
refused, saying so, when it does not. A server that predates FORMAT_KEYS refuses such a file
by its format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .kv_cache import same_tensor

FORMAT = "mha-serve-session/1"  # tensors k and v
FORMAT_KEYS = "mha-serve-session/2"  # tensor k alone: the values are the keys
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HEADER_LEN = struct.Struct("<Q")
# A header is a few hundred bytes; one past this is no record of ours.
MAX_HEADER_BYTES = 1 << 16


class BadRecord(ValueError):
    """A session file that cannot be adopted: the message says what is wrong with it."""


@dataclass(frozen=True)
class SessionRecord:
    """What a session is, besides its K/V (the file's header)."""

    session_id: str
    model: str
    fingerprint: str  # the model's weights and shape (engine: model_fingerprint)
    num_tokens: int  # tokens the session counts
    first_position: int  # the first it holds (a sliding window dropped those before it)
    max_len: int | None
    ttl_s: float | None
    idle_s: float  # seconds since its last use, when written
    written_at: float  # time.time() when written: idle time goes on across a restart
    owner: str  # the client identity that created it ("": none)
    dtype: str  # the stored K/V's element type (the cache's), a key of DTYPES
    num_kv_heads: int
    head_dim: int
    checksum: str = ""  # sha256 of the K and V bytes, K's alone with values_are_keys (encode)
    sequence_id: int | str | None = None  # the sequence it steps (Session.sequence_id)
    # The file holds K alone: the model's values are its keys. Its format says so
    # (FORMAT_KEYS), never a header field.
    values_are_keys: bool = False

    @property
    def held(self) -> int:
        """Tokens whose K/V the file holds."""
        return self.num_tokens - self.first_position


@dataclass(frozen=True)
class Expected:
    """What a record must match to be adopted by a model's cache here."""

    model: str
    fingerprint: str
    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    max_len: int  # the model's max_seq_len: no session of it is longer
    max_bytes: int  # bytes the model's whole cache holds (K and V, or K alone)
    # tokens per block of that cache: a session comes back into whole blocks, so the first
    # position it holds (a sliding window freed those before) must start one
    block_size: int = 1
    # that cache stores K alone (KVCache.values_are_keys): its records hold K alone too
    values_are_keys: bool = False


def record_of(
    s, expected: Expected, *, first_position: int, idle_s: float, written_at: float
) -> SessionRecord:
    """The record of a session (the table's Session) of the model `expected` describes,
    holding K/V from first_position on, idle for idle_s seconds at written_at (wall time)."""
    return SessionRecord(
        session_id=s.id,
        model=s.model,
        fingerprint=expected.fingerprint,
        num_tokens=s.num_tokens,
        first_position=first_position,
        max_len=s.max_len,
        ttl_s=s.ttl_s,
        idle_s=max(0.0, idle_s),
        written_at=written_at,
        owner=s.owner,
        sequence_id=s.sequence_id,
        dtype=str(expected.dtype).removeprefix("torch."),
        num_kv_heads=expected.num_kv_heads,
        head_dim=expected.head_dim,
        values_are_keys=expected.values_are_keys,
    )


def encode(record: SessionRecord, k: torch.Tensor, v: torch.Tensor) -> bytes:
    """The file's bytes: k and v (KVH, held, D) on the CPU, contiguous, in record.dtype;
    k alone where record.values_are_keys (v must then be k itself: never a V dropped)."""
    if record.values_are_keys:
        if not same_tensor(k, v):
            raise ValueError(
                f"session {record.session_id!r}: its model's values are its keys and its "
                "record holds K alone, so v must be the k tensor itself, not a V of its own"
            )
        tensors = {"k": k.contiguous()}
    else:
        tensors = {"k": k.contiguous(), "v": v.contiguous()}
    checksum = _checksum(*tensors.values())  # k's bytes, then v's (a dict keeps its order)
    header = dataclasses.asdict(dataclasses.replace(record, checksum=checksum))
    del header["values_are_keys"]  # (the format says it)
    metadata = {
        "format": FORMAT_KEYS if record.values_are_keys else FORMAT,
        "session": json.dumps(header),
    }
    return save_tensors(tensors, metadata=metadata)


def read_header(data: bytes, source: str) -> SessionRecord:
    """The record a file's bytes describe (its tensors unread); BadRecord when it is none."""
    if len(data) < _HEADER_LEN.size:
        raise BadRecord(f"{source}: {len(data)} bytes is too short for a session file")
    (size,) = _HEADER_LEN.unpack_from(data)
    if size > MAX_HEADER_BYTES or _HEADER_LEN.size + size > len(data):
        raise BadRecord(f"{source}: truncated or not a session file (header of {size} bytes)")
    try:
        header = json.loads(data[_HEADER_LEN.size : _HEADER_LEN.size + size])
        metadata = header["__metadata__"]
        form = metadata.get("format")
        if form not in (FORMAT, FORMAT_KEYS):
            raise BadRecord(f"{source}: format {form!r}, not {FORMAT!r} or {FORMAT_KEYS!r}")
        fields = json.loads(metadata["session"])
        if "values_are_keys" in fields:  # (the format says it, never the header)
            raise BadRecord(f"{source}: a header field values_are_keys, which no record has")
        record = SessionRecord(**fields, values_are_keys=form == FORMAT_KEYS)
    except BadRecord:
        raise
    except Exception as e:  # not JSON, fields missing or extra
        raise BadRecord(f"{source}: not a session file of mha-serve ({type(e).__name__})") from None
    _check_fields(record, source)
    return record


def decode(
    data: bytes, source: str, expected: Expected
) -> tuple[SessionRecord, torch.Tensor, torch.Tensor]:
    """(record, k, v) of a file's bytes, checked whole against `expected`: header, model and
    fingerprint, shapes, dtype, checksum, finite values, sizes. BadRecord says what failed.
    Where expected.values_are_keys, v is k (one tensor) and the record says values_are_keys,
    a record of the older layout (k and v, equal) included."""
    record = read_header(data, source)
    check(record, expected, source)
    try:
        tensors = load_tensors(data)
    except Exception as e:  # safetensors refuses truncated or inconsistent bytes
        raise BadRecord(f"{source}: its tensors cannot be read ({e})") from None
    names = {"k"} if record.values_are_keys else {"k", "v"}
    if set(tensors) != names:
        what = "k alone (its format: values are keys)" if record.values_are_keys else "k and v"
        raise BadRecord(f"{source}: holds tensors {sorted(tensors)}, not {what}")
    k = tensors["k"]
    v = k if record.values_are_keys else tensors["v"]
    want = (record.num_kv_heads, record.held, record.head_dim)
    for name, t in tensors.items():
        if tuple(t.shape) != want or t.dtype != expected.dtype:
            raise BadRecord(
                f"{source}: {name} is {str(t.dtype).removeprefix('torch.')} "
                f"{list(t.shape)}; the session needs {record.dtype} {list(want)}"
            )
    if record.first_position % expected.block_size:
        raise BadRecord(
            f"{source}: a sliding-window session holding positions from "
            f"{record.first_position} on, not a multiple of kv_block_size "
            f"{expected.block_size} here (it was written with another kv_block_size): its "
            "first block cannot be rebuilt"
        )
    if _checksum(*((k,) if record.values_are_keys else (k, v))) != record.checksum:
        raise BadRecord(f"{source}: its K/V do not match their checksum (a damaged file)")
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise BadRecord(f"{source}: its K/V hold NaN or Inf values")
    if expected.values_are_keys and not record.values_are_keys:  # the older layout
        if not torch.equal(k, v):
            raise BadRecord(
                f"{source}: its values differ from its keys, but model {record.model!r}'s "
                "values are its keys (its cache stores K alone): not a session of it"
            )
        record, v = dataclasses.replace(record, values_are_keys=True), k
    return record, k, v


def check(record: SessionRecord, expected: Expected, source: str) -> None:
    """The header against the model here (the file's tensors unread)."""
    if record.model != expected.model:
        raise BadRecord(f"{source}: a session of model {record.model!r}, not {expected.model!r}")
    if record.fingerprint != expected.fingerprint:
        raise BadRecord(
            f"{source}: session of model {record.model!r} was written by a model with other "
            "weights or shape (its fingerprint differs): its keys and values mean nothing here"
        )
    dtype = str(expected.dtype).removeprefix("torch.")
    if (record.dtype, record.num_kv_heads, record.head_dim) != (
        dtype,
        expected.num_kv_heads,
        expected.head_dim,
    ):
        raise BadRecord(
            f"{source}: K/V of {record.num_kv_heads} heads x {record.head_dim} in "
            f"{record.dtype}; this cache holds {expected.num_kv_heads} x "
            f"{expected.head_dim} in {dtype}"
        )
    if record.num_tokens > expected.max_len:
        raise BadRecord(
            f"{source}: {record.num_tokens} tokens, past the max_seq_len {expected.max_len} "
            f"of model {record.model!r}"
        )
    if record.values_are_keys and not expected.values_are_keys:
        raise BadRecord(
            f"{source}: holds K alone ({FORMAT_KEYS}: its model's values are its keys), but "
            f"the cache of model {record.model!r} here stores K and V apart"
        )
    planes = 1 if expected.values_are_keys else 2  # what the cache here would hold
    nbytes = planes * record.held * record.num_kv_heads * record.head_dim * expected.dtype.itemsize
    if nbytes > expected.max_bytes:
        raise BadRecord(
            f"{source}: {nbytes} bytes of K/V, more than the whole KV cache of model "
            f"{record.model!r} holds ({expected.max_bytes})"
        )


def _check_fields(r: SessionRecord, source: str) -> None:
    ints = (r.num_tokens, r.first_position, r.num_kv_heads, r.head_dim)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
        raise BadRecord(f"{source}: lengths and shapes must be integers")
    if not (0 <= r.first_position <= r.num_tokens and r.num_kv_heads > 0 and r.head_dim > 0):
        raise BadRecord(
            f"{source}: holds positions {r.first_position}..{r.num_tokens - 1} of "
            f"{r.num_kv_heads} x {r.head_dim}: not a session's"
        )
    if r.max_len is not None and not (isinstance(r.max_len, int) and r.num_tokens <= r.max_len):
        raise BadRecord(f"{source}: {r.num_tokens} tokens past its max_len {r.max_len}")
    for name in ("idle_s", "written_at"):
        value = getattr(r, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise BadRecord(f"{source}: {name} {value!r} is not a time")
    if r.ttl_s is not None and not (isinstance(r.ttl_s, int | float) and r.ttl_s > 0):
        raise BadRecord(f"{source}: ttl_s {r.ttl_s!r} is not a duration")
    if r.dtype not in DTYPES:
        raise BadRecord(f"{source}: dtype {r.dtype!r} is not one of {', '.join(DTYPES)}")
    seq = r.sequence_id
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int | str) or not seq):
        raise BadRecord(f"{source}: sequence_id {seq!r} is not a sequence's id")
    if not isinstance(r.session_id, str) or not r.session_id or not isinstance(r.owner, str):
        raise BadRecord(f"{source}: no session id")


def _checksum(*tensors: torch.Tensor) -> str:
    """sha256 of k's bytes, then v's (where the file holds it)."""
    digest = hashlib.sha256()
    for t in tensors:
        raw = t.contiguous()
        raw = raw.view(torch.int16) if raw.dtype == torch.bfloat16 else raw  # numpy has no bf16
        digest.update(raw.numpy().reshape(-1).view("u1"))
    return digest.hexdigest()
