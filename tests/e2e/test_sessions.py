"""KV-cache sessions over gRPC: incremental equals full, streaming, forks, limits and errors."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb

EMBED = 512
ATOL = 1e-5  # float32: incremental steps vs one causal Attend over the whole sequence


def tensor(x: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(x.shape), data=x.tobytes())


def array(t: pb.Tensor) -> np.ndarray:
    return np.frombuffer(t.data, np.float32).reshape(list(t.shape))


def full(stub, model: str, x: np.ndarray, weights: bool = False) -> pb.AttendResponse:
    return stub.Attend(
        pb.AttendRequest(
            model=model, input=tensor(x), causal=True, weights=pb.WeightsRequest(enabled=weights)
        ),
        timeout=30,
    )


def create(stub, model: str, **kw) -> str:
    return stub.CreateSession(pb.CreateSessionRequest(model=model, **kw), timeout=10).session_id


@pytest.mark.parametrize("model", ["mha", "gqa", "mqa"])
def test_appending_in_random_chunks_equals_one_causal_attend(stub, model):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((45, EMBED), dtype=np.float32)
    ref = full(stub, model, x, weights=True)
    ref_out, ref_w = array(ref.output), array(ref.attention_weights)  # (45, E), (8, 45, 45)
    sid = create(stub, model)
    start = 0
    for size in (1, 7, 16, 2, 1, 18):  # crosses block boundaries (16 tokens) unevenly
        chunk = x[start : start + size]
        reply = stub.Attend(
            pb.AttendRequest(
                session_id=sid, input=tensor(chunk), weights=pb.WeightsRequest(enabled=True)
            ),
            timeout=30,
        )
        out, w = array(reply.output), array(reply.attention_weights)
        assert out.shape == (size, EMBED) and w.shape == (8, size, start + size)
        err = np.abs(out - ref_out[start : start + size]).max()
        assert err < ATOL, f"chunk at {start}: max abs error {err:.2e}"
        np.testing.assert_allclose(w, ref_w[:, start : start + size, : start + size], atol=ATOL)
        start += size
        assert reply.session.num_tokens == start and reply.session.model == model
    info = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=10)
    assert info.num_tokens == 45 and info.num_blocks == 3  # ceil(45 / 16)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_stream_decodes_token_by_token(stub):
    x = np.random.default_rng(1).standard_normal((24, EMBED), dtype=np.float32)
    ref = array(full(stub, "gqa", x).output)
    sid = create(stub, "gqa")

    def steps():
        yield pb.AttendRequest(session_id=sid, input=tensor(x[:8]))  # a prompt, then one by one
        for t in range(8, 24):
            yield pb.AttendRequest(input=tensor(x[t : t + 1]))  # session_id carries over

    replies = list(stub.StreamSession(steps(), timeout=60))
    got = np.concatenate([array(r.output) for r in replies])
    assert len(replies) == 17 and replies[-1].session.num_tokens == 24
    np.testing.assert_allclose(got, ref, atol=ATOL)


def test_bytes_per_token_proportional_to_kv_heads(stub):
    infos = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    per_token = {name: info.kv_cache.bytes_per_token for name, info in infos.items()}
    assert per_token == {"mha": 2 * 8 * 64 * 4, "gqa": 2 * 2 * 64 * 4, "mqa": 2 * 1 * 64 * 4}
    for info in infos.values():
        assert (
            info.kv_cache.bytes_per_token * info.kv_cache.block_size * info.kv_cache.num_blocks
            <= info.kv_cache.budget_bytes
        )


def test_fork_shares_the_prefix_and_diverges_without_touching_the_parent(stub):
    rng = np.random.default_rng(2)
    prefix = rng.standard_normal((20, EMBED), dtype=np.float32)  # ends inside block 2
    a, b = (rng.standard_normal((5, EMBED), dtype=np.float32) for _ in range(2))
    parent = create(stub, "mqa")
    stub.Attend(pb.AttendRequest(session_id=parent, input=tensor(prefix)), timeout=30)
    child = stub.ForkSession(pb.ForkSessionRequest(session_id=parent), timeout=10)
    assert child.num_tokens == 20 and child.session_id != parent
    got_child = array(
        stub.Attend(
            pb.AttendRequest(session_id=child.session_id, input=tensor(b)), timeout=30
        ).output
    )
    got_parent = array(
        stub.Attend(pb.AttendRequest(session_id=parent, input=tensor(a)), timeout=30).output
    )
    np.testing.assert_allclose(
        got_parent, array(full(stub, "mqa", np.concatenate([prefix, a])).output)[20:], atol=ATOL
    )
    np.testing.assert_allclose(
        got_child, array(full(stub, "mqa", np.concatenate([prefix, b])).output)[20:], atol=ATOL
    )


def test_closed_and_unknown_sessions_are_not_found(stub):
    sid = create(stub, "mha")
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    for call in (
        lambda: stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=10),
        lambda: stub.Attend(
            pb.AttendRequest(session_id=sid, input=tensor(np.zeros((1, EMBED), np.float32))),
            timeout=10,
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "closed" in err.value.details()


@pytest.mark.parametrize(
    ("request_", "code", "fragment"),
    [
        (
            dict(input=np.zeros((2, 3, EMBED), np.float32)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "one sequence",
        ),
        (dict(causal=False), grpc.StatusCode.INVALID_ARGUMENT, "session steps are causal"),
        (dict(model="gqa"), grpc.StatusCode.INVALID_ARGUMENT, "belongs to model 'mha'"),
        (
            dict(input=np.zeros((9, EMBED), np.float32)),
            grpc.StatusCode.OUT_OF_RANGE,
            "past its max_len 8",
        ),
    ],
)
def test_bad_steps(stub, request_, code, fragment):
    sid = create(stub, "mha", max_len=8)
    kw = {"input": np.zeros((2, EMBED), np.float32), **request_}
    request = pb.AttendRequest(session_id=sid, input=tensor(kw.pop("input")), **kw)
    with pytest.raises(grpc.RpcError) as err:
        stub.Attend(request, timeout=10)
    assert err.value.code() == code and fragment in err.value.details(), err.value.details()
    # The session is intact: a good step still works and counts only its own tokens.
    reply = stub.Attend(
        pb.AttendRequest(session_id=sid, input=tensor(np.ones((3, EMBED), np.float32))), timeout=10
    )
    assert reply.session.num_tokens == 3


def test_stream_needs_a_session(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.StreamSession(
                iter(
                    [pb.AttendRequest(model="mha", input=tensor(np.zeros((1, EMBED), np.float32)))]
                ),
                timeout=10,
            )
        )
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "needs session_id" in err.value.details()
    )


def test_create_errors(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateSession(pb.CreateSessionRequest(model="nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateSession(pb.CreateSessionRequest(model="mha", max_len=5000), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "4096" in err.value.details()


def test_a_stream_steps_one_session(stub):
    """Later messages may leave session_id empty; naming another session ends the stream."""
    first, other = create(stub, "mha"), create(stub, "mha")
    x = tensor(np.ones((1, EMBED), np.float32))
    replies = []
    with pytest.raises(grpc.RpcError) as err:
        for reply in stub.StreamSession(
            iter(
                [
                    pb.AttendRequest(session_id=first, input=x),
                    pb.AttendRequest(input=x),
                    pb.AttendRequest(session_id=first, input=x),
                    pb.AttendRequest(session_id=other, input=x),
                ]
            ),
            timeout=10,
        ):
            replies.append(reply)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one stream per session" in err.value.details() and other in err.value.details()
    assert [r.session.num_tokens for r in replies] == [1, 2, 3]
    assert stub.GetSession(pb.GetSessionRequest(session_id=other), timeout=10).num_tokens == 0


def test_an_empty_session_id_is_invalid(stub):
    for call in (
        lambda: stub.GetSession(pb.GetSessionRequest(), timeout=10),
        lambda: stub.ForkSession(pb.ForkSessionRequest(), timeout=10),
        lambda: stub.CloseSession(pb.CloseSessionRequest(), timeout=10),
        lambda: stub.TruncateSession(pb.TruncateSessionRequest(), timeout=10),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "session_id is empty" in err.value.details()


def test_creating_a_session_on_an_empty_model_name_is_invalid(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateSession(pb.CreateSessionRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model is empty" in err.value.details()


def test_step_replies_carry_the_sessions_limits(stub):
    """max_len and ttl_s come back with every step, not zeros (0 ttl_s reads as never)."""
    sid = create(stub, "gqa", max_len=40, ttl_s=25)
    reply = stub.Attend(
        pb.AttendRequest(session_id=sid, input=tensor(np.ones((2, EMBED), np.float32))),
        timeout=10,
    )
    assert (reply.session.max_len, reply.session.ttl_s) == (40, 25)
    fork = stub.ForkSession(pb.ForkSessionRequest(session_id=sid), timeout=10)
    assert (fork.max_len, fork.ttl_s, fork.num_tokens) == (40, 25, 2)
