"""The engine's session steps against transformers' own incremental path (its attention
module fed chunk by chunk with a DynamicCache, which keeps a sliding layer's last window - 1
tokens only): equal outputs, and the engine's cached K and V equal transformers' cache (its
last positions, for a sliding layer), K stored already rotated (RoPE at absolute
positions)."""

from __future__ import annotations

import pytest
import torch

from mha_serve.engine import Engine
from mha_serve.engine.types import ModelSpec
from mha_serve.model.hf_config import read_hf_layer
from tests.engine_calls import req, run
from tests.models_hf.reference import SERVED, load_reference, reference_decode

ATOL = RTOL = 1e-5  # fp32 against fp32: |ours - theirs| <= ATOL + RTOL * |theirs|
CUTS = [0, 9, 10, 11, 12, 20, 21, 22]  # a prefill, decode steps, a chunk, past the windows


@pytest.mark.parametrize("name", list(SERVED))
def test_steps_and_cache_equal_transformers_incremental_decode(hf_dirs, name):
    checkpoint, layer = SERVED[name]
    directory = hf_dirs[checkpoint]
    spec = ModelSpec(
        name, read_hf_layer(directory, layer).attention, checkpoint=str(directory), layer=layer
    )
    engine = Engine(
        [spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**24
    )
    hosted = engine.get(name)
    base = load_reference(checkpoint, directory)
    x = torch.randn(
        1, CUTS[-1], spec.attention.embed_dim, generator=torch.Generator().manual_seed(4)
    )
    want, cache = reference_decode(checkpoint, base, layer, x, CUTS)
    sid = engine.create_session(name).session_id
    for (a, b), w in zip(zip(CUTS, CUTS[1:], strict=False), want, strict=True):
        got = run(engine, hosted, req(name, x[:, a:b], session_id=sid)).output
        diff = (got - w).abs()
        assert (diff <= ATOL + RTOL * w.abs()).all(), (
            f"{name} step [{a}, {b}): max {diff.max():.3e}, mean {diff.mean():.3e}"
        )
    session = engine.sessions.table.get(sid)
    cache_ = engine.sessions.cache(name)
    kept = session.first_block * cache_.block_size  # a window's older blocks are freed
    k, v = cache_.read(
        session.block_table, session.num_tokens, start=kept, first_block=session.first_block
    )
    their = cache.layers[layer]
    pairs = (("K", k, their.keys), ("V", v, their.values))
    if spec.attention.mla is not None:  # (theirs: the normed latent as keys, the rotated
        R = spec.attention.mla.rope_dim  # shared key as values; ours: [rotated; latent] as
        rotated = k[..., :R]  # both, the rotated pairs in place where theirs come by halves)
        rope = spec.attention.rope  # (Kimi Linear's: none, its R dims unrotated)
        if rope is not None and rope.interleaved and checkpoint != "deepseek_v2":
            rotated = torch.cat([rotated[..., 0::2], rotated[..., 1::2]], dim=-1)
        assert v is k, f"{name}: MLA's cached V is its K, stored once and read as both"
        pairs = (("latent", k[..., R:], their.keys), ("rotated key", rotated, their.values))
    for what, ours, theirs in pairs:
        assert theirs.shape[2] == CUTS[-1] or getattr(their, "is_sliding", False)
        if spec.attention.sliding_window and theirs.shape[2] > ours.shape[2]:
            # (MiniMax's windowed full_attention layers: transformers keeps every token, we
            # the window's blocks)
            theirs = theirs[:, :, theirs.shape[2] - ours.shape[2] :]
        ours = ours[:, :, ours.shape[2] - theirs.shape[2] :]  # a sliding layer's last ones
        if theirs.shape[1] != ours.shape[1]:  # (Falcon's GQA caches its KV heads broadcast
            ours = ours.repeat_interleave(theirs.shape[1] // ours.shape[1], dim=1)  # to all H)
        diff = (ours - theirs).abs()
        assert ours.shape == theirs.shape and diff.max() < ATOL, (
            f"{name} cached {what}: max {diff.max():.3e}, mean {diff.mean():.3e}"
        )
