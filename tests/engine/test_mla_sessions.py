"""Sessions of multi-head latent attention over a cache that stores K alone (its values are
its keys: KVCache.values_are_keys), against the stateless answer and, bit for bit, against
an engine whose cache keeps V apart (the layout before): steps token by token and batched,
forks, truncation, a sliding window, a narrower cache dtype, spill and restore, a restart
adopting files of either layout, moves between engines; and the same budget holding twice
the tokens."""

from __future__ import annotations

import pytest
import torch

from mha_serve.cache import SessionFull
from mha_serve.cache.record import FORMAT, FORMAT_KEYS, read_header
from mha_serve.engine import Engine, ModelSpec
from mha_serve.model import AttentionConfig
from tests.engine_calls import attend, req, run_batch

E, BLOCK = 64, 4
MLA = {"kv_lora_rank": 24, "rope_dim": 8, "nope_dim": 12, "v_head_dim": 10, "q_lora_rank": 20}
BYTES_PER_TOKEN = (8 + 24) * 4  # R + C float32 values, K alone
BLOCKS = 12  # of the cache that stores K alone (the one that keeps V apart: 6)
ATOL = 1e-5


def spec(window: int | None = None, kv_cache_dtype: str = "auto") -> ModelSpec:
    cfg = AttentionConfig(
        E, 4, rope={"theta": 100.0, "interleaved": True}, mla=MLA, sliding_window=window
    )
    return ModelSpec(
        "mla",
        cfg,
        seed=11,
        kv_cache_bytes=BLOCKS * BLOCK * BYTES_PER_TOKEN,
        kv_block_size=BLOCK,
        kv_cache_dtype=kv_cache_dtype,
    )


def engine(s: ModelSpec | None = None, *, spill_dir: str = "", apart: bool = False) -> Engine:
    """An engine serving s; apart: its cache keeps V apart (values_are_keys off)."""
    with pytest.MonkeyPatch.context() as patch:
        if apart:
            patch.setattr(AttentionConfig, "values_are_keys", property(lambda self: False))
        e = Engine(
            [s or spec()],
            device=torch.device("cpu"),
            dtype=torch.float32,
            max_response_bytes=2**24,
            spill_dir=spill_dir,
            spill_bytes=1 << 22 if spill_dir else 0,
        )
    assert e.sessions.cache("mla").values_are_keys is not apart
    return e


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, E, generator=torch.Generator().manual_seed(seed))


class Twin:
    """One session on each of two engines, stepped alike: the answers must be identical."""

    def __init__(self, shared: Engine, apart: Engine, ids: list[str] | None = None) -> None:
        self.engines = (shared, apart)
        self.ids = ids or [e.create_session("mla").session_id for e in self.engines]
        self.history = torch.zeros(1, 0, E)

    def fork(self) -> Twin:
        ids = [
            e.fork_session(sid).session_id for e, sid in zip(self.engines, self.ids, strict=True)
        ]
        child = Twin(*self.engines, ids)
        child.history = self.history
        return child

    def step(self, x: torch.Tensor, what: str) -> torch.Tensor:
        got, want = (
            attend(e, req("mla", x, session_id=sid)).output
            for e, sid in zip(self.engines, self.ids, strict=True)
        )
        assert torch.equal(got, want), f"{what}: K alone differs from K and V apart"
        self.history = torch.cat([self.history, x], dim=1)
        stateless = attend(self.engines[0], req("mla", self.history, causal=True)).output
        diff = (got - stateless[:, -x.shape[1] :]).abs().max()
        assert diff < ATOL, f"{what}: {diff:.2e} from the stateless answer"
        return got


def test_the_same_budget_holds_twice_the_tokens():
    shared, apart = engine(), engine(apart=True)
    cache = shared.sessions.cache("mla")
    assert (
        cache.bytes_per_token == BYTES_PER_TOKEN == apart.sessions.cache("mla").bytes_per_token // 2
    )
    assert cache.num_blocks == BLOCKS == 2 * apart.sessions.cache("mla").num_blocks
    info = shared.cache_info("mla")
    assert info.bytes_per_token == BYTES_PER_TOKEN and info.num_blocks == BLOCKS
    long = tokens(BLOCKS * BLOCK, seed=1)  # the whole cache's tokens
    s = shared.create_session("mla").session_id
    assert attend(shared, req("mla", long, session_id=s)).session.num_tokens == BLOCKS * BLOCK
    assert shared.get_session(s).bytes_held == BLOCKS * BLOCK * BYTES_PER_TOKEN
    a = apart.create_session("mla").session_id
    with pytest.raises(SessionFull, match="6 blocks of 4 tokens"):
        attend(apart, req("mla", long, session_id=a))


def test_steps_token_by_token_and_batched_equal_a_cache_of_k_and_v():
    """A prefill, decode steps, a chunk; then two sessions' decode steps in one batch
    (gathered and padded): bit for bit the answers of the cache that keeps V apart."""
    shared, apart = engine(), engine(apart=True)
    twin = Twin(shared, apart)
    for i, n in enumerate((5, 1, 1, 3, 1)):
        twin.step(tokens(n, seed=10 + i), f"step {i}")
    other = Twin(shared, apart)
    other.step(tokens(2, seed=20), "other's prefill")
    for r in range(2):
        xs = [tokens(1, seed=30 + 2 * r + j) for j in range(2)]
        outs = []
        for e, sids in zip((shared, apart), zip(twin.ids, other.ids, strict=True), strict=True):
            reqs = [req("mla", x, session_id=sid) for x, sid in zip(xs, sids, strict=True)]
            outs.append([o.output for o in run_batch(e, e.get("mla"), reqs)])
        for j, (got, want) in enumerate(zip(*outs, strict=True)):
            assert torch.equal(got, want), f"batch round {r} row {j}"
        twin.history = torch.cat([twin.history, xs[0]], dim=1)
        other.history = torch.cat([other.history, xs[1]], dim=1)
    twin.step(tokens(1, seed=40), "after the batches")


def test_forks_and_truncation_equal_a_cache_of_k_and_v():
    shared, apart = engine(), engine(apart=True)
    parent = Twin(shared, apart)
    parent.step(tokens(7, seed=50), "parent's prefill")
    child = parent.fork()
    parent.step(tokens(2, seed=51), "parent after the fork")  # its shared partial block copied
    child.step(tokens(1, seed=52), "child after the fork")
    for e, sid in zip(child.engines, child.ids, strict=True):
        assert e.truncate_session(sid, 3).num_tokens == 3
    child.history = child.history[:, :3]
    child.step(tokens(2, seed=53), "child after a truncate")
    parent.step(tokens(1, seed=54), "parent untouched by its child")


def test_a_sliding_window_session_frees_its_blocks_and_answers_as_k_and_v():
    shared, apart = engine(spec(window=6)), engine(spec(window=6), apart=True)
    twin = Twin(shared, apart)
    for i in range(12):
        twin.step(tokens(1 if i else 3, seed=60 + i), f"windowed step {i}")
    sid = twin.ids[0]
    stats = shared.get_session(sid)
    assert stats.first_position > 0 and stats.num_blocks <= 3  # the older blocks freed


def test_a_narrower_cache_dtype_stores_k_once_rounded_as_k_and_v_apart():
    s = spec(kv_cache_dtype="bfloat16")
    shared, apart = engine(s), engine(s, apart=True)
    assert shared.sessions.cache("mla").bytes_per_token == BYTES_PER_TOKEN // 2
    sids = [e.create_session("mla").session_id for e in (shared, apart)]
    for i, n in enumerate((6, 1, 2)):
        x = tokens(n, seed=70 + i)
        got, want = (
            attend(e, req("mla", x, session_id=sid)).output
            for e, sid in zip((shared, apart), sids, strict=True)
        )
        assert torch.equal(got, want), f"bfloat16 cache, step {i}"


def _file(e: Engine, sid: str):
    return e.sessions.table.spill.store.path_for(sid)


def test_spill_and_restore_write_k_once_and_answer_as_before(tmp_path):
    """Spilled between steps (K alone in the file: about half the bytes of the layout
    before), brought back by the next step, which answers as the cache that never spilled."""
    shared = engine(spill_dir=str(tmp_path / "shared"))
    apart = engine(spill_dir=str(tmp_path / "apart"), apart=True)
    twin = Twin(shared, apart)
    for i, n in enumerate((9, 1, 4)):
        if i:
            sizes = []
            for e, sid in zip(twin.engines, twin.ids, strict=True):
                assert e.spill_idle() == [sid]
                data = _file(e, sid).read_bytes()
                sizes.append(len(data))
                form = FORMAT_KEYS if e is shared else FORMAT
                assert read_header(data, "f").values_are_keys is (e is shared)
                assert form.encode() in data[:4096]
            held = twin.history.shape[1] * BYTES_PER_TOKEN
            assert abs(sizes[1] - sizes[0] - held) < 200, sizes  # V's bytes, headers aside
        twin.step(tokens(n, seed=80 + i), f"step {i} (restored)" if i else "prefill")


@pytest.mark.parametrize("writer_apart", [False, True], ids=["k-alone", "older-layout"])
def test_a_restart_adopts_files_of_either_layout(tmp_path, writer_apart):
    """A shutdown's files read by a new engine storing K alone, the file written by it, or
    by a server whose cache kept V apart (format /1, k and v): the next steps equal the
    session's on an engine that never stopped."""
    first = engine(spill_dir=str(tmp_path / "spill"), apart=writer_apart)
    sid = first.create_session("mla").session_id
    x = tokens(10, seed=90)
    attend(first, req("mla", x, session_id=sid))
    assert first.spill_idle() == [sid]
    first.close_spill()
    second = engine(spill_dir=str(tmp_path / "spill"))
    adopted, refused = second.adopt_spilled()
    assert adopted == [sid] and refused == []
    reference = engine()
    r = reference.create_session("mla").session_id
    attend(reference, req("mla", x, session_id=r))
    for i in range(2):
        y = tokens(1 + i, seed=91 + i)
        got = attend(second, req("mla", y, session_id=sid)).output
        assert torch.equal(got, attend(reference, req("mla", y, session_id=r)).output), i
    # back in the spill tier, it is written K alone, whatever it came as
    second.spill_idle()
    assert read_header(_file(second, sid).read_bytes(), "f").values_are_keys


@pytest.mark.parametrize("sender_apart", [False, True], ids=["k-alone", "older-layout"])
def test_a_session_moved_in_answers_as_at_home(sender_apart):
    home = engine(apart=sender_apart)
    sid = home.create_session("mla").session_id
    x = tokens(7, seed=100)
    attend(home, req("mla", x, session_id=sid))
    data = home.pack_session(sid)
    away = engine()
    assert away.receive_session(data).num_tokens == 7
    home.session_moved(sid, "away")
    reference = engine()
    r = reference.create_session("mla").session_id
    attend(reference, req("mla", x, session_id=r))
    y = tokens(2, seed=101)
    got = attend(away, req("mla", y, session_id=sid)).output
    assert torch.equal(got, attend(reference, req("mla", y, session_id=r)).output)
