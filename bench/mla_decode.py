"""A multi-head latent attention layer's decode step, served, against what it would be
otherwise, side by side in one run (docs/models.md "Multi-head latent attention").

One DeepSeek-shaped layer (scaled down to fit 2 CPU cores; default embed_dim 1024, 16 heads,
kv_lora_rank C 256, rope_dim R 32, nope_dim N 64, v_head_dim V 64, q_lora_rank 384,
float32), written as a Hugging Face DeepseekV3 checkpoint and decoded four ways, each
session prefilled to the same context (256, 1024, 4096) with the same tokens:

- mla: the engine (Engine.attend of one session step, as a front door calls it) serving that
  layer: its overflow bounds (mla_bounds.LatentBounds) clear each step, which then runs
  alone (the lone-step path: no maxima, no exact check);
- mla_before: the same layer, the same engine, its bounds those of the commit before them
  (overflow.NO_BOUNDS for its module, patched in here: nothing clears, so each step is a
  measured batch of one, as every MLA step was then);
- mqa: an MQA layer of the same cache width (one kv head of R + C = 288 dims, embed_dim
  and heads the same, RoPE), served the same way: the attention MLA is absorbed into;
- hf: transformers' DeepseekV3Attention of the same checkpoint, its own DynamicCache, SDPA,
  called directly (no serving at all).

Each round every side decodes --steps tokens (the same tokens), then is cut back to the
context (truncate_session, DynamicCache.crop), so every step sees the context's keys;
sides alternate within a round, so all see the same machine. Median of the rounds.

    python bench/mla_decode.py [--contexts 256,1024,4096] [--steps 16] [--rounds 7]
        [--threads N] [--json-out bench/results/mla_decode.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mha_serve.engine import AttendRequest, Engine, array_of
from mha_serve.engine import bounds as engine_bounds
from mha_serve.engine import compute as engine_compute
from mha_serve.engine import forward as engine_forward
from mha_serve.engine.types import MiB, ModelSpec, tensor_of
from mha_serve.model import AttentionConfig
from mha_serve.model.hf_config import read_hf_layer
from mha_serve.model.overflow import NO_BOUNDS, weight_bounds

PREFILL_CHUNK = 512  # tokens per prefill step, every side
SIDES = ("mla", "mla_before", "mqa", "hf")


def checkpoint(args, directory: Path) -> None:
    """A one-layer DeepseekV3 model of the bench's shape, seeded, saved (safetensors)."""
    from transformers import DeepseekV3Config, DeepseekV3Model

    config = DeepseekV3Config(
        vocab_size=32,
        hidden_size=args.embed_dim,
        intermediate_size=64,
        num_hidden_layers=1,
        first_k_dense_replace=1,  # (its one layer dense: no experts to build)
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.q_lora_rank,
        qk_rope_head_dim=args.rope_dim,
        qk_nope_head_dim=args.nope_dim,
        v_head_dim=args.v_head_dim,
        max_position_embeddings=2 * max(args.contexts) + PREFILL_CHUNK,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    DeepseekV3Model(config).save_pretrained(directory)


def hf_attention(directory: Path):
    """(the layer's DeepseekV3Attention, the model) of the checkpoint, SDPA, float32."""
    from transformers import DeepseekV3Model

    base = DeepseekV3Model.from_pretrained(directory, attn_implementation="sdpa")
    return base.layers[0].self_attn.eval(), base.eval()


def hf_step(attention, base, cache, x: torch.Tensor, start: int) -> torch.Tensor:
    """x (1, n, E) at positions start.. through the attention with its cache; causal."""
    n = x.shape[1]
    pos = torch.arange(start, start + n)
    mask = None
    if n > 1:  # (one token sees every key: no mask)
        allowed = torch.arange(start + n)[None, :] <= pos[:, None]  # (n, start + n)
        mask = torch.zeros(1, 1, n, start + n).masked_fill(~allowed, torch.finfo(x.dtype).min)
    cos_sin = base.rotary_emb(x, pos[None])
    out, _ = attention(
        x,
        position_embeddings=cos_sin,
        attention_mask=mask,
        past_key_values=cache,
        cache_position=pos,
    )
    return out


@contextlib.contextmanager
def bounds_before(module):
    """The commit before LatentBounds: overflow.NO_BOUNDS for `module` (every step
    measured), the real bounds for any other. Patched where the engine reads them."""
    places = (engine_bounds, engine_forward, engine_compute)
    real = {place: place.weight_bounds for place in places}

    def before(m):
        return NO_BOUNDS if m is module else weight_bounds(m)

    for place in places:
        place.weight_bounds = before
    try:
        yield
    finally:
        for place, fn in real.items():
            place.weight_bounds = fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round and side")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--embed-dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-lora-rank", type=int, default=256)
    parser.add_argument("--rope-dim", type=int, default=32)
    parser.add_argument("--nope-dim", type=int, default=64)
    parser.add_argument("--v-head-dim", type=int, default=64)
    parser.add_argument("--q-lora-rank", type=int, default=384)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    E, width = args.embed_dim, args.rope_dim + args.kv_lora_rank
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        checkpoint(args, directory)
        mla = read_hf_layer(directory, 0).attention
        longest = max(args.contexts) + args.steps + PREFILL_CHUNK
        budget = 2 * longest * 2 * width * 4  # K and V of R + C, float32, twice over (ample)
        common = {"max_seq_len": longest, "kv_cache_bytes": budget}
        mqa = AttentionConfig(
            E, args.heads, 1, head_dim=width, bias=False, causal=True, rope=mla.rope
        )
        specs = [
            ModelSpec("mla", mla, checkpoint=str(directory), layer=0, **common),
            ModelSpec("mla_before", mla, checkpoint=str(directory), layer=0, **common),
            ModelSpec("mqa", mqa, seed=1, **common),
        ]
        engine = Engine(
            specs, device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=64 * MiB
        )
        attention, base = hf_attention(directory)
    before = engine.get("mla_before").module
    with torch.inference_mode(), bounds_before(before):
        rows = [run_context(args, engine, attention, base, n) for n in args.contexts]
        x_max = max(r["token_absmax"] for r in rows)
        # whether each side's bounds clear its steps (mla_before's: never)
        cleared = {
            name: engine_bounds.cleared(engine.get(name), torch.float32, x_max, 0.0, 1.0)
            is not None
            for name in SIDES[:3]
        }
    print(
        f"MLA E {E}, H {args.heads}, C {args.kv_lora_rank}, R {args.rope_dim}, N "
        f"{args.nope_dim}, V {args.v_head_dim}, q_lora {args.q_lora_rank}, float32 (one kv "
        f"head of {width}; mqa: 1 kv head of {width} too); decode step ms = median of "
        f"{args.rounds} rounds x {args.steps} steps, {torch.get_num_threads()} torch threads"
    )
    print(
        "context   mla  mla_before   mqa    hf | mla/before  mla/mqa  mla/hf | max|mla-hf| "
        "(of max|hf|)"
    )
    for r in rows:
        ms = r["step_ms"]
        print(
            f"{r['context']:7d} {ms['mla']:6.3f} {ms['mla_before']:8.3f} {ms['mqa']:7.3f} "
            f"{ms['hf']:6.3f} | {r['ratio_mla_before']:9.3f} {r['ratio_mla_mqa']:8.3f} "
            f"{r['ratio_mla_hf']:7.3f} | {r['max_abs_diff_hf']:.1e} ({r['hf_output_absmax']:.1e})"
        )
    if args.json_out:
        machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads()}
        out = {"args": vars(args), "machine": machine, "cleared": cleared, "rows": rows}
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json_out}")


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
        )


def run_context(args, engine: Engine, attention, base, n: int) -> dict:
    """One context: every side prefilled to n tokens, then the rounds of decode steps."""
    from transformers import DynamicCache

    E = args.embed_dim
    g = torch.Generator().manual_seed(n)
    prompt = torch.randn(1, n, E, generator=g)
    tokens = torch.randn(args.steps, 1, 1, E, generator=g)
    arrays = [array_of(t) for t in tokens]  # as the wire gives them
    sessions = {name: engine.create_session(name).session_id for name in SIDES[:3]}
    cache = DynamicCache(config=base.config)
    for start in range(0, n, PREFILL_CHUNK):
        chunk = prompt[:, start : start + PREFILL_CHUNK]
        for name, sid in sessions.items():
            engine.attend(AttendRequest(name, array_of(chunk), session_id=sid))
        hf_step(attention, base, cache, chunk, start)

    def served(name: str) -> list[torch.Tensor]:
        sid = sessions[name]
        outs = [engine.attend(AttendRequest(name, a, session_id=sid)).output for a in arrays]
        engine.truncate_session(sid, n)
        return [tensor_of(o) for o in outs]

    def hf() -> list[torch.Tensor]:
        outs = [hf_step(attention, base, cache, t, n + i) for i, t in enumerate(tokens)]
        cache.crop(-len(tokens))  # (this transformers: the tokens to drop, negative)
        return outs

    steps = {name: (lambda name=name: served(name)) for name in SIDES[:3]} | {"hf": hf}
    answers = {name: step() for name, step in steps.items()}  # (a warm-up round each)
    step_ms: dict[str, list[float]] = {name: [] for name in SIDES}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            step_ms[name].append((time.perf_counter() - start) / args.steps * 1e3)
    for sid in sessions.values():
        engine.close_session(sid)
    ms = {name: statistics.median(v) for name, v in step_ms.items()}

    def diff(a: str, b: str) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(answers[a], answers[b], strict=True))

    return {
        "context": n,
        "step_ms": ms,
        "step_ms_rounds": step_ms,
        "ratio_mla_before": ms["mla"] / ms["mla_before"],
        "ratio_mla_mqa": ms["mla"] / ms["mqa"],
        "ratio_mla_hf": ms["mla"] / ms["hf"],
        "max_abs_diff_hf": diff("mla", "hf"),
        "hf_output_absmax": max(float(y.abs().max()) for y in answers["hf"]),
        "max_abs_diff_before": diff("mla", "mla_before"),
        "token_absmax": float(tokens.abs().max()),
    }


if __name__ == "__main__":
    main()
