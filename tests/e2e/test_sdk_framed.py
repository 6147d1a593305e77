"""The SDK's framed codec against the real server (issue 16): Attend and session steps sent and
read framed (a large tensor, one payload copy) give bitwise the results of messages (protobuf
both ways, through the generated stubs), for every dtype, rank, weights or none, unary and
streamed, sync and async; errors keep their status and message."""

from __future__ import annotations

import numpy as np
import pytest

from mha_client import messages
from mha_client.errors import MhaServeError
from mha_client.messages import build_attend_request, parse_attend_response
from mha_client.sdk import AsyncClient, Client

NEVER = 1 << 62  # a FRAME_BYTES no message reaches: every request and reply a message
PATHS = {"framed": 0, "messages": NEVER}
DTYPES = ["float32", "float16", "bfloat16"]
# (batch or None for one 2-D sequence, tokens): 2 KiB (below FRAME_BYTES) and 256 KiB of float32
SHAPES = [(None, 1), (2, 64), (None, 128)]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as c:
        yield c


@pytest.fixture
def spy(monkeypatch):
    """Counts the framed encodes and decodes the SDK makes."""
    counts = {"encode": 0, "decode": 0}
    encode, parse = messages.encode_attend_request, messages.parse_attend_response

    def counted_encode(*args, **kw):
        counts["encode"] += 1
        return encode(*args, **kw)

    def counted_parse(resp, *args):
        counts["decode"] += isinstance(resp, bytes)
        return parse(resp, *args)

    monkeypatch.setattr(messages, "encode_attend_request", counted_encode)
    monkeypatch.setattr(messages, "parse_attend_response", counted_parse)
    return counts


def use(monkeypatch, path: str) -> None:
    monkeypatch.setattr(messages, "FRAME_BYTES", PATHS[path])


def x_of(shape: tuple[int | None, int], seed: int = 0, dtype=np.float32) -> np.ndarray:
    batch, tokens = shape
    dims = (tokens, 512) if batch is None else (batch, tokens, 512)
    return np.random.default_rng(seed).standard_normal(dims).astype(dtype)


def same(a: np.ndarray | None, b: np.ndarray | None) -> None:
    """Bitwise equal: dtype, shape and every byte."""
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def same_result(got, want) -> None:
    same(got.output, want.output)
    same(got.weights, want.weights)
    assert (got.weight_heads, got.weight_query_start) == (
        want.weight_heads,
        want.weight_query_start,
    )
    assert got.model == want.model
    assert (got.timing.batch_size, got.session) == (want.timing.batch_size, want.session)


def by_messages(stub, model: str, x: np.ndarray, **options):
    """The reference: the generated stub (protobuf serializes and parses both ways)."""
    reply = stub.Attend(build_attend_request(model, x, **options), timeout=60)
    return parse_attend_response(reply, x.ndim == 2, 0.0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [False, True])
def test_attend_is_bitwise_the_message_path(
    client, stub, monkeypatch, spy, path, shape, dtype, weights
):
    x = x_of(shape, seed=len(dtype) + shape[1])
    options = {"input_dtype": dtype, "output_dtype": dtype, "causal": True}
    if weights:
        options.update(weights=True, weights_dtype=dtype, heads=[0, 5], query_range=(0, None))
    want = by_messages(stub, "gqa", x, **options)
    use(monkeypatch, path)
    got = client.attend("gqa", x, **options)
    same_result(got, want)
    assert spy["encode"] == spy["decode"] == (path == "framed")


@pytest.mark.parametrize("shape", SHAPES)
def test_float16_arrays_and_the_default_threshold(client, stub, spy, shape):
    x = x_of(shape, seed=3, dtype=np.float16)
    got = client.attend("mha", x, weights=True)
    same_result(got, by_messages(stub, "mha", x, weights=True))
    assert got.output.dtype == np.float16
    assert spy["encode"] == spy["decode"] == (x.nbytes >= messages.FRAME_BYTES)


def steps(session_or_stream, xs: list[np.ndarray], **options) -> list:
    return [session_or_stream.step(x, **options) for x in xs]


def step_inputs(dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    # a 96-token prompt (192 KiB: framed) then single tokens (messages)
    return [rng.standard_normal((96, 512)).astype(dtype)] + [
        rng.standard_normal((1, 1, 512)).astype(dtype) for _ in range(3)
    ]


def session_results(client, monkeypatch, path: str, streamed: bool, **options) -> list:
    use(monkeypatch, path)
    with client.create_session("mqa", ttl_s=60) as s:
        if not streamed:
            return steps(s, step_inputs(), **options)
        with s.stream() as stream:
            return steps(stream, step_inputs(), **options)


@pytest.mark.parametrize("streamed", [False, True])
def test_session_steps_framed_equal_messages(client, monkeypatch, streamed):
    options = {"weights": True, "input_dtype": "bfloat16", "output_dtype": "float16"}
    framed = session_results(client, monkeypatch, "framed", streamed, **options)
    plain = session_results(client, monkeypatch, "messages", streamed, **options)
    for got, want in zip(framed, plain, strict=True):
        same(got.output, want.output)
        same(got.weights, want.weights)
        assert got.session.num_tokens == want.session.num_tokens
    assert [r.session.num_tokens for r in framed] == [96, 97, 98, 99]


async def async_session_results(target: str, monkeypatch, path: str, streamed: bool) -> list:
    use(monkeypatch, path)
    async with AsyncClient(target) as c, await c.create_session("gqa", ttl_s=60) as s:
        xs = step_inputs(np.float16)
        if not streamed:
            return [await s.step(x, weights=True) for x in xs]
        async with s.stream() as stream:
            return [await stream.step(x, weights=True) for x in xs]


@pytest.mark.parametrize("streamed", [False, True])
async def test_async_session_steps_framed_equal_messages(server, monkeypatch, streamed):
    framed = await async_session_results(server.target, monkeypatch, "framed", streamed)
    plain = await async_session_results(server.target, monkeypatch, "messages", streamed)
    for got, want in zip(framed, plain, strict=True):
        same(got.output, want.output)
        same(got.weights, want.weights)
    assert framed[0].output.shape == (96, 512) and framed[-1].output.shape == (1, 1, 512)


def error_of(fn) -> tuple:
    with pytest.raises(MhaServeError) as err:
        fn()
    return err.value.code, err.value.details


def streamed_step(c, x):
    with c.session("no-such-session").stream() as stream:
        stream.step(x[0])


BAD = {
    "wrong embed_dim": lambda c, x: c.attend("mha", x[..., :256]),
    "unknown model": lambda c, x: c.attend("nope", x),
    "NaN input": lambda c, x: c.attend("mha", np.where(np.arange(512) == 7, np.nan, x)),
    "bad lengths": lambda c, x: c.attend("mha", x, lengths=[0, 999]),
    "unknown session": lambda c, x: c.session("no-such-session").step(x[0]),
    "unknown session, streamed": streamed_step,
}


@pytest.mark.parametrize("case", BAD)
def test_errors_keep_their_status_and_message(client, monkeypatch, case):
    x = x_of((2, 64), seed=4)
    use(monkeypatch, "framed")
    framed = error_of(lambda: BAD[case](client, x))
    use(monkeypatch, "messages")
    assert error_of(lambda: BAD[case](client, x)) == framed
