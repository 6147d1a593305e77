"""The frames of the frontend workers' link (serving/link.py): every message the two ends
send comes back equal (records by their fields, arrays inline, in shared memory, empty or
strided, errors rebuilt), and a frame that is not one of pack's fails clearly. No socket:
frames are read from a StreamReader fed by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
from dataclasses import dataclass

import numpy as np
import pytest

from mha_serve.cache import SessionNotFound, SessionStats
from mha_serve.config import default_models
from mha_serve.engine import InvalidRequest, requests
from mha_serve.engine.requests import Array, AttendOutcome, AttendRequest
from mha_serve.serving import link
from mha_serve.serving.finish import Computed, computed_reply

ME = os.getpid()


def _frame(message) -> bytes:
    return b"".join(bytes(part) for part in link.pack(message, ME, ME))


def _read(data: bytes, eof: bool = False):
    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await link.read_frame(reader)

    return asyncio.run(main())


def _same(got, want, where: str = "message") -> None:
    """Equal, arrays by dtype, shape and bytes (== on an array is elementwise)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert np.array_equal(got, want), where
    elif dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            name = field.name
            _same(getattr(got, name), getattr(want, name), f"{where}.{name}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _same(got[key], want[key], f"{where}[{key!r}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _array(*shape: int, dtype: str = "float32", seed: int = 0) -> Array:
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}[dtype]
    data = np.random.default_rng(seed).standard_normal(shape).astype(np_dtype)
    return Array(data, dtype)  # (bfloat16: int16 bits, as the wire carries them)


STATS = SessionStats("s-1", "mqa", 24, 2, 2 * 4096, 64, 30.0, 0)
REQUEST = AttendRequest("mha", _array(2, 16, 512, seed=1))
EVERY_FIELD = AttendRequest(
    "gqa",
    _array(2, 5, 512, dtype="bfloat16", seed=2),
    lengths=(5, 3),
    causal=True,
    need_weights=True,
    weight_heads=(3, 1),
    query_start=1,
    query_end=4,
    weights_dtype="float16",
    head_mask=(1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5),
    output_dtype="float32",
    session_id="s-1",
)
OUTCOME = AttendOutcome(
    _array(2, 5, 512, seed=3), _array(2, 2, 3, 5, seed=4), (3, 1), 1, 0.5, 2, STATS
)
CACHE = requests.CacheInfo(1 << 20, 16, 4096, 65536, 16, 3, 2, True, "float32", 1)
HEADS = requests.HeadReport(
    [0.1] * 8,
    [0.5] * 8,
    [0.01] * 8,
    [requests.PruningLevel(1, 3, 0.02, [1.0] * 7 + [0.0])],
    None,
    1.5,
)
GONE = SessionNotFound("s-9", "closed", "session 's-9' was closed")
LARGE = _array(1, 700, 512, seed=5)  # 1.4 MB: through shared memory

MESSAGES = {
    "hello": (
        "hello",
        0,
        link.Hello([requests.ModelView(default_models()[0], "cpu", "float32", 7)], 99),
    ),
    "call": ("call", 1, "compute", (REQUEST,), {"received": 1.5, "deadline": None, "caller": None}),
    "call, every field": (
        "call",
        2,
        "compute",
        (EVERY_FIELD,),
        {"received": 2.0, "deadline": 9.5, "caller": "me"},
    ),
    "reply": ("ok", 1, computed_reply(Computed(REQUEST, "mha", OUTCOME, 0.1, 0.2, 0.3))),
    "reply, no weights, no session": (
        "ok",
        3,
        ("mha", AttendOutcome(_array(1, 1, 512), None), 0.0, 0.0, 0.0),
    ),
    "empty arrays": ("call", 4, "compute", (AttendRequest("mha", _array(0, 16, 512)),), {}),
    "shared memory": ("call", 5, "compute", (AttendRequest("mha", LARGE),), {}),
    "session stats": ("ok", 6, STATS),
    "cache info": ("ok", 7, CACHE),
    "no cache": ("ok", 8, None),
    "head report": ("ok", 9, dataclasses.replace(HEADS, weights=_array(8, 4, 4))),
    "error": ("error", 10, link.error_state(GONE)),
    "cancel": ("cancel", 11),
    "listening": ("listening", 12, 50051),
}


@pytest.mark.parametrize("name", MESSAGES)
def test_every_message_comes_back_equal(name):
    message = MESSAGES[name]
    _same(_read(_frame(message)), message)
    assert not list(link.SHM_DIR.glob(f"{link.SHM_PREFIX}{ME}-{ME}-*"))  # taken, unlinked


def test_an_error_is_rebuilt_with_its_class_message_and_attributes():
    sent = GONE
    kind, rid, state = _read(_frame(("error", 1, link.error_state(sent))))
    got = link.rebuild_error(*state)
    assert type(got) is SessionNotFound and str(got) == str(sent)
    assert got.session_id == "s-9" and got.reason == "closed"
    got = link.rebuild_error(*_read(_frame(link.error_state(InvalidRequest("NaN at 3"))))[:3])
    assert type(got) is InvalidRequest and str(got) == "NaN at 3"


def test_arrays_keep_dtype_shape_and_bytes_however_they_travel():
    strided = np.arange(48, dtype=np.float32).reshape(4, 12)[:, ::3]  # not contiguous
    arrays = [
        _array(3, 7, dtype="float16"),
        _array(1, 9, 512, dtype="bfloat16"),
        Array(strided, "float32"),
        _array(0, 0, 512),
        LARGE,
    ]
    got = _read(_frame(("ok", 1, (arrays, strided, np.empty((0,), np.float32)))))
    _same(got, ("ok", 1, (arrays, strided, np.empty((0,), np.float32))))
    assert not got[2][0][0].data.flags.writeable  # a view of the received frame


def test_frames_read_back_to_back_from_one_stream():
    messages = list(MESSAGES.values())

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(_frame(m) for m in messages))
        return [await link.read_frame(reader) for _ in messages]

    for got, want in zip(asyncio.run(main()), messages, strict=True):
        _same(got, want)


def test_a_frame_whose_parts_disagree_with_its_head_fails_clearly():
    frame = bytearray(_frame(MESSAGES["call"]))
    size, count, total = link._HEAD.unpack_from(frame)
    for head in ((size, count + 1, total), (size + 16, count, total), (size, count, total - 8)):
        bad = link._HEAD.pack(*head) + frame[link._HEAD.size : link._HEAD.size + head[2]]
        with pytest.raises(ValueError, match="malformed frame on the engine link"):
            _read(bad)


def test_a_cut_frame_is_the_peer_gone_and_a_corrupt_pickle_an_unpickling_error():
    frame = _frame(MESSAGES["call"])
    with pytest.raises(asyncio.IncompleteReadError):
        _read(frame[:-1], eof=True)
    body = b"\x00" * 32
    with pytest.raises(pickle.UnpicklingError):
        _read(link._HEAD.pack(len(body), 0, len(body)) + body)


def test_records_cross_by_their_fields_not_dataclass_state():
    for cls in link.RECORDS:
        assert cls in link._Pickler.dispatch_table, cls.__name__
    # the call's pickle names no dataclasses' __setstate__ and is smaller than by default
    assert b"_dataclass" not in _frame(MESSAGES["call"])


def test_a_record_that_its_fields_do_not_rebuild_is_refused():
    @dataclass(frozen=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            assert self.n >= 0

    @dataclass
    class Derived:
        n: int
        twice: int = dataclasses.field(init=False, default=0)

    @dataclass
    class KeywordOnly:
        n: int
        m: int = dataclasses.field(kw_only=True, default=0)

    @dataclass
    class WithInitVar:
        n: int
        scale: dataclasses.InitVar[int] = 1

    for cls in (Checked, Derived, KeywordOnly, WithInitVar):
        with pytest.raises(TypeError, match="not rebuilt by its fields alone"):
            link._by_fields(cls)
