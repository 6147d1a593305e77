"""Flash decode (engine/attend.py, --flash-decode): a batch of decode steps reads each
session's K/V where it lies in the cache through flash attention's varlen kernel, rows whose
blocks are not consecutive as before; its answers equal the per-session path's.

The kernel runs only on CUDA. On the CPU the engine's side of it (which rows, the slots and
counts it hands the kernel, the output's heads and wo) runs against `reference_varlen`, a
plain statement of what the kernel is documented to compute; on CUDA the real kernel is held
to the same reference and the engine's answers to the per-session path's."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from mha_serve.cache import KVCache, Reservation
from mha_serve.engine import Engine
from mha_serve.engine.attend import attend_steps, flash_decode_unsupported, flash_varlen
from mha_serve.model import AttentionConfig, MultiHeadAttention
from tests.engine.test_attend import MLA_MODEL, MODELS, close, decode_together
from tests.helpers import config_of, suite_torch_device

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="flash attention's kernel needs CUDA"
)


def reference_varlen(q, k, v, cu_q, cu_k, used, max_k, scale):
    """What flash_varlen computes, plainly, in float64: row b's query (H, D) over rows
    cu_k[b] .. cu_k[b] + used[b] - 1 of k, v (N, KVH, D); query head h reads K/V head
    h // (H / KVH). Checks the engine's side of the call as the kernel would read it."""
    B, H, D = q.shape
    KVH = k.shape[1]
    assert cu_q.dtype == cu_k.dtype == used.dtype == torch.int32
    assert cu_q.tolist() == list(range(B + 1)) and cu_k.shape == (B + 1,)
    assert used.shape == (B,) and max_k == int(used.max())
    out = torch.empty(B, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        s, n = int(cu_k[b]), int(used[b])
        kb = k[s : s + n].double().repeat_interleave(H // KVH, dim=1)  # (n, H, D)
        vb = v[s : s + n].double().repeat_interleave(H // KVH, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), kb) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", p, vb)
    return out.to(q.dtype)


class Spy:
    """A kernel that counts the rows it was given, then runs `kernel`."""

    def __init__(self, kernel):
        self.kernel, self.rows = kernel, []

    def __call__(self, q, *args):
        self.rows.append(q.shape[0])
        return self.kernel(q, *args)


def flash_engine(flash, dtype=torch.float32, device=None) -> Engine:
    return Engine(
        MODELS,
        device=device or suite_torch_device(),
        dtype=dtype,
        max_response_bytes=2**28,
        batched_attention=True,
        flash_decode=flash,
    )


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "win"])
def test_in_place_equals_per_session_and_gathered(name):
    """Sessions at ragged lengths (one past its window), stepped together: read in place
    they answer as per session and as gathered; every decode round's rows went through the
    kernel (the first, ragged new lengths, cannot)."""
    plain = flash_engine(False)
    per_session = Engine(
        MODELS, device=suite_torch_device(), dtype=torch.float32, max_response_bytes=2**28
    )
    per_session.sessions.batched_attention = dict.fromkeys(per_session.models, False)
    spied = flash_engine(False)
    spy = Spy(reference_varlen)
    spied.sessions.flash_kernels[name] = spy
    rounds = 3
    got, _ = decode_together(spied, name, rounds=rounds)
    gathered, _ = decode_together(plain, name, rounds=rounds)
    want, _ = decode_together(per_session, name, rounds=rounds)
    assert sum(spy.rows) == 6 * rounds and len(spy.rows) >= rounds, spy.rows
    for r, (a_round, g_round, w_round) in enumerate(zip(got, gathered, want, strict=True)):
        for i, (a, g, w) in enumerate(zip(a_round, g_round, w_round, strict=True)):
            close(a, w, f"{name} round {r} session {i}: in place vs per session")
            close(a, g, f"{name} round {r} session {i}: in place vs gathered")


def test_mla_in_place_equals_per_session():
    """Multi-head latent attention read in place: the kernel attends over its one kv head of
    R + C (values = keys) like any MQA model's, and merge_heads takes the heads through W_uv
    (on a GPU its head_dim must fit the kernel: DeepSeek's 576 does not, and is declined)."""
    name = MLA_MODEL.name

    def engine(flash: bool) -> Engine:
        return Engine(
            [MLA_MODEL],
            device=suite_torch_device(),
            dtype=torch.float32,
            max_response_bytes=2**28,
            batched_attention=flash,
            flash_decode=False,
        )

    spied, per_session = engine(True), engine(False)
    spy = Spy(reference_varlen)
    spied.sessions.flash_kernels[name] = spy
    got, _ = decode_together(spied, name, rounds=2)
    want, _ = decode_together(per_session, name, rounds=2)
    assert sum(spy.rows) == 6 * 2, spy.rows
    for r, (g_round, w_round) in enumerate(zip(got, want, strict=True)):
        for i, (a, w) in enumerate(zip(g_round, w_round, strict=True)):
            close(a, w, f"mla round {r} session {i}: in place vs per session")
    big = AttentionConfig(
        64,
        4,
        rope={},
        mla={"kv_lora_rank": 512, "rope_dim": 64, "nope_dim": 128, "v_head_dim": 128},
    )
    why = flash_decode_unsupported(big, torch.device("cuda"), torch.bfloat16, torch.bfloat16)
    assert "head_dim a multiple of 8 up to 256 (it is 576)" in why


def _cache_with(config: AttentionConfig) -> KVCache:
    cache = KVCache.from_config(config, budget_bytes=64 * 4 * 2 * 2 * 16 * 4, block_size=4)
    g = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def test_rows_in_place_and_rows_copied_in_one_batch():
    """A batch of decode steps where some sessions' blocks are consecutive (read in place,
    two of them past the sliding window's start, one with its first blocks freed, one
    reserved from before its window) and some are not (gathered): every row equals its
    per-session answer, and only the consecutive rows reached the kernel."""
    config = AttentionConfig(64, 8, 2, sliding_window=11)
    module = MultiHeadAttention(config).eval()
    # (block table, first_block, read_start, past): step at position `past`
    sessions = [
        ((0, 1, 2), 0, 0, 9),  # consecutive, 10 keys
        ((7, 3, 4), 0, 0, 10),  # scattered, 11 keys
        ((10, 11, 12, 13), 2, 10, 20),  # blocks from position 8; reads 10..20 in place
        ((20, 21, 22, 23), 0, 0, 14),  # consecutive; reads its window, 4..14
        ((30, 5, 31, 32), 0, 0, 14),  # scattered, 15 keys
    ]
    cache = _cache_with(config)
    reservations = [
        Reservation(
            session_id=f"s{i}",
            model="m",
            start=past,
            num_tokens=1,
            block_table=table,
            slots=(table[past // 4 - first] * 4 + past % 4,),
            num_new_blocks=0,
            first_block=first,
            read_start=read_start,
        )
        for i, (table, first, read_start, past) in enumerate(sessions)
    ]
    q = torch.randn(len(sessions), 8, 1, 8, generator=torch.Generator().manual_seed(4))
    spy = Spy(reference_varlen)
    with torch.inference_mode():
        want = attend_steps(module, cache, q, reservations, [1] * 5, batched=False).output
        got = attend_steps(module, cache, q, reservations, [1] * 5, batched=True, flash=spy)
        all_in_place = attend_steps(
            module,
            cache,
            q[[0, 2, 3]],
            [reservations[i] for i in (0, 2, 3)],
            [1] * 3,
            batched=True,
            flash=spy,
        )
    assert spy.rows == [3, 3]
    close(got.output, want, "mixed batch vs per session")
    close(all_in_place.output, want[[0, 2, 3]], "all in place vs per session")


def test_a_kernel_that_fails_turns_flash_decode_off_and_the_step_still_answers(caplog):
    """The kernel raising (a torch that refuses its arguments, say): the step attends
    gathered and answers as per session, the model runs without flash decode from then on,
    and the log says why."""
    calls = []

    def refuses(q, *args):
        calls.append(q.shape[0])
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    engine = flash_engine(False)
    engine.sessions.flash_kernels["gqa"] = refuses
    per_session = flash_engine(False)
    per_session.sessions.batched_attention = dict.fromkeys(per_session.models, False)
    with caplog.at_level(logging.ERROR, logger="mha_serve.engine.forward"):
        got, _ = decode_together(engine, "gqa", rounds=2)
    want, _ = decode_together(per_session, "gqa", rounds=2)
    assert calls == [6] and "gqa" not in engine.sessions.flash_kernels
    said = [r.getMessage() for r in caplog.records]
    assert any("flash decode failed for model 'gqa'" in m and "Ampere" in m for m in said), said
    for r, (a_round, w_round) in enumerate(zip(got, want, strict=True)):
        for i, (a, w) in enumerate(zip(a_round, w_round, strict=True)):
            close(a, w, f"round {r} session {i}: after the kernel failed vs per session")


def test_a_head_mask_or_several_tokens_never_reach_the_kernel():
    engine = flash_engine(False)
    spy = Spy(reference_varlen)
    engine.sessions.flash_kernels["gqa"] = spy
    gate = (1.0, 0.0, 0.5, 1.0, 2.0, 1.0, 0.0, 1.0)
    decode_together(engine, "gqa", rounds=1, head_mask=gate)
    assert spy.rows == []


def test_why_a_model_cannot_run_flash_decode():
    cpu, cuda_dev = torch.device("cpu"), torch.device("cuda")
    c = AttentionConfig(512, 8, 2)
    bf = torch.bfloat16
    assert "float16 or bfloat16" in flash_decode_unsupported(c, cpu, torch.float32, torch.float32)
    assert "narrower" in flash_decode_unsupported(c, cpu, bf, torch.float8_e4m3fn)
    capped = AttentionConfig(512, 8, 2, softcap=30.0)
    assert "softcap" in flash_decode_unsupported(capped, cuda_dev, bf, bf)
    sinks = AttentionConfig(512, 8, 2, sinks=True)  # GPT-OSS: the exact kernel runs instead
    assert "sinks" in flash_decode_unsupported(sinks, cuda_dev, bf, bf)
    alibi = AttentionConfig(512, 8, 2, alibi=True)  # BLOOM: the explicit kernel runs instead
    assert "ALiBi" in flash_decode_unsupported(alibi, cuda_dev, bf, bf)
    odd = AttentionConfig(60, 6, 2)  # head_dim 10
    assert "multiple of 8" in flash_decode_unsupported(odd, cuda_dev, bf, bf)
    assert "needs CUDA" in flash_decode_unsupported(c, cpu, bf, bf)


def test_asked_for_where_it_cannot_run_it_says_why_and_gathers(caplog):
    with caplog.at_level(logging.WARNING, logger="mha_serve.engine.sessions"):
        engine = flash_engine(True, dtype=torch.float32, device=torch.device("cpu"))
    assert engine.sessions.flash_kernels == {}
    said = [r.getMessage() for r in caplog.records if "flash_decode is on" in r.getMessage()]
    assert len(said) == len(MODELS) and all("float16 or bfloat16" in m for m in said), said


def test_the_servers_setting_reaches_the_engine(monkeypatch):
    import mha_serve.transport.server as server_module

    assert config_of([]).flash_decode is False  # the default: off
    cfg = config_of(["--flash-decode", "true", "--device", "cpu"])
    assert cfg.flash_decode is True
    seen = []
    real = server_module.Engine

    def spy(*a, **kw):
        seen.append(kw.get("flash_decode"))
        return real(*a, **kw)

    monkeypatch.setattr(server_module, "Engine", spy)
    server_module.load_engine(cfg)
    assert seen == [True]


@cuda
def test_the_kernel_matches_the_reference_wherever_sessions_lie():
    """torch's flash varlen forward with seqused_k over the cache viewed token-major: each
    row reads from its own start, in any order (not cumulative), GQA and MHA, bfloat16."""
    device = torch.device("cuda")
    for H, KVH in ((8, 8), (8, 2), (8, 1)):
        g = torch.Generator().manual_seed(H + KVH)
        cache = KVCache(
            num_kv_heads=KVH,
            head_dim=64,
            budget_bytes=2 * KVH * 64 * 2 * 4096,
            block_size=16,
            dtype=torch.bfloat16,
            device=device,
        )
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        k, v = cache.by_token()
        starts, counts = [3000, 17, 1024, 2500], [1000, 1, 700, 33]
        meta = torch.tensor([*range(5), *starts, 0, *counts], dtype=torch.int32, device=device)
        q = torch.randn(4, H, 64, generator=g).to(device, torch.bfloat16)
        args = (q, k, v, meta[:5], meta[5:10], meta[10:], max(counts), 0.125)
        got, want = flash_varlen(*args).float(), reference_varlen(*args).float()
        ulp = 2.0 ** (math.floor(math.log2(float(want.abs().max()))) - 7)
        close(got, want, f"H {H} KVH {KVH}", atol=4 * ulp)


@cuda
def test_cuda_bfloat16_in_place_equals_per_session():
    """On CUDA with the real kernel, bfloat16: the engine's answers read in place equal the
    per-session path's within 4 units in the last place of the largest output."""
    device = torch.device("cuda")
    engine = flash_engine(True, dtype=torch.bfloat16, device=device)
    assert set(engine.sessions.flash_kernels) == {"mha", "gqa", "mqa", "win"}
    per_session = flash_engine(False, dtype=torch.bfloat16, device=device)
    per_session.sessions.batched_attention = dict.fromkeys(per_session.models, False)
    for name in ("mha", "gqa", "mqa", "win"):
        spy = Spy(flash_varlen)
        engine.sessions.flash_kernels[name] = spy
        got, _ = decode_together(engine, name, rounds=2)
        want, _ = decode_together(per_session, name, rounds=2)
        assert sum(spy.rows) == 12, spy.rows
        largest = max(float(b.float().abs().max()) for r in want for b in r)
        ulp = 2.0 ** (math.floor(math.log2(largest)) - 7)
        for r, (a_round, w_round) in enumerate(zip(got, want, strict=True)):
            for i, (a, w) in enumerate(zip(a_round, w_round, strict=True)):
                close(a.float(), w.float(), f"{name} round {r} session {i}", atol=4 * ulp)
