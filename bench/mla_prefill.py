"""A multi-head latent attention layer's prompt, expanded as served, against the absorbed form
and transformers' module, side by side in one run; and where the expanded form starts to pay
(docs/models.md "Multi-head latent attention").

The layer of bench/mla_decode.py (a DeepSeek-shaped layer scaled down to 2 CPU cores: embed
1024, 16 heads, C 256, R 32, N 64, V 64, q_lora_rank 384, float32, written as a Hugging Face
DeepseekV3 checkpoint). Prompts of --prompts tokens (512, 1024, 2048), each a new session's
first step (Engine.attend, as a front door calls it), three ways:

- expanded: the engine as it serves them (mla.expands picks the expanded form: every head
  decompressed from the latents, HF's attention itself; the cache still gets the latents);
- absorbed: the same engine, the expanded form off (every step absorbed into MQA over R + C
  dims, as every MLA step ran before);
- hf: transformers' DeepseekV3Attention of the same checkpoint (SDPA), a fresh DynamicCache,
  called directly (no serving at all).

The sweep: a step of each --sweep-rows rows after each --sweep-cached count of cached keys (a
session prefilled to it, the step timed, then truncated back), both forms forced, and which
one mla.expands picks. Sides alternate within a round, so all see the same machine; medians.

    python bench/mla_prefill.py [--prompts 512,1024,2048] [--rounds 5]
        [--sweep-rows 16,32,64,128,192,256,384] [--sweep-cached 0,512,2048] [--threads N]
        [--json-out bench/results/mla_prefill.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mla_decode import PREFILL_CHUNK, checkpoint, cpu_model, hf_attention, hf_step  # noqa: E402

from mha_serve.engine import AttendRequest, Engine, array_of  # noqa: E402
from mha_serve.engine import prompts as engine_prompts  # noqa: E402
from mha_serve.engine.types import MiB, ModelSpec, tensor_of  # noqa: E402
from mha_serve.model import mla  # noqa: E402
from mha_serve.model.hf_config import read_hf_layer  # noqa: E402

SIDES = ("expanded", "absorbed", "hf")


@contextlib.contextmanager
def form(which: str | None):
    """Every step expanded ("expanded"), absorbed ("absorbed"), or as mla.expands picks
    (None): patched where the stateless forward and the sessions read it."""
    if which is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patch())
        pick = lambda config, rows, cached_keys: which == "expanded"  # noqa: E731
        patch(mla, "expands", pick)
        patch(engine_prompts, "expands", pick)
        yield


@contextlib.contextmanager
def _patch():
    real = []

    def patch(owner, name, value):
        real.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(real):
            setattr(owner, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="512,1024,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sweep-rows", default="16,32,64,128,192,256,384")
    parser.add_argument("--sweep-cached", default="0,512,2048")
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
    args.prompts = [int(n) for n in args.prompts.split(",")]
    args.sweep_rows = [int(n) for n in args.sweep_rows.split(",") if n]
    args.sweep_cached = [int(n) for n in args.sweep_cached.split(",") if n]
    if args.threads:
        torch.set_num_threads(args.threads)
    width = args.rope_dim + args.kv_lora_rank
    longest = max(args.prompts + [c + max(args.sweep_rows, default=0) for c in args.sweep_cached])
    args.contexts = [longest]  # (mla_decode.checkpoint's max_position_embeddings)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        checkpoint(args, directory)
        config = read_hf_layer(directory, 0).attention
        spec = ModelSpec(
            "mla",
            config,
            checkpoint=str(directory),
            layer=0,
            max_seq_len=longest + PREFILL_CHUNK,
            kv_cache_bytes=4 * longest * width * 4,  # K alone, float32, ample
        )
        engine = Engine(
            [spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=64 * MiB
        )
        attention, base = hf_attention(directory)
    with torch.inference_mode():
        rows = [prompt_row(args, engine, attention, base, n) for n in args.prompts]
        sweep = [
            sweep_row(args, engine, rows_, cached)
            for cached in args.sweep_cached
            for rows_ in args.sweep_rows
        ]
    print(
        f"MLA E {args.embed_dim}, H {args.heads}, C {args.kv_lora_rank}, R {args.rope_dim}, N "
        f"{args.nope_dim}, V {args.v_head_dim}, q_lora {args.q_lora_rank}, float32; a session's "
        f"prompt, ms = median of {args.rounds} rounds, {torch.get_num_threads()} torch threads"
    )
    print("prompt  expanded  absorbed      hf | exp/abs  exp/hf | max|exp-hf| max|abs-hf|")
    for r in rows:
        ms = r["prompt_ms"]
        print(
            f"{r['prompt']:6d} {ms['expanded']:9.1f} {ms['absorbed']:9.1f} {ms['hf']:7.1f} | "
            f"{r['ratio_expanded_absorbed']:7.2f} {r['ratio_expanded_hf']:7.2f} | "
            f"{r['max_abs_diff_expanded_hf']:.1e}     {r['max_abs_diff_absorbed_hf']:.1e}"
        )
    if sweep:
        print("a step of T rows after P cached keys, both forms forced; ms = median")
        print("     P     T  expanded  absorbed  exp/abs  mla.expands")
        for s in sweep:
            print(
                f"{s['cached']:6d} {s['rows']:5d} {s['step_ms']['expanded']:9.2f} "
                f"{s['step_ms']['absorbed']:9.2f} {s['ratio']:8.2f}  {s['picked']}"
            )
    if args.json_out:
        machine = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads()}
        out = {"args": vars(args), "machine": machine, "rows": rows, "sweep": sweep}
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json_out}")


def prompt_row(args, engine: Engine, attention, base, n: int) -> dict:
    """One prompt length: each side's time to answer a new session's first n tokens."""
    from transformers import DynamicCache

    prompt = torch.randn(1, n, args.embed_dim, generator=torch.Generator().manual_seed(n))
    wire = array_of(prompt)
    assert mla.expands(engine.get("mla").spec.attention, n, 0), "the rule must pick expanded"

    def served(which: str | None) -> torch.Tensor:
        sid = engine.create_session("mla").session_id
        with form(which):
            out = engine.attend(AttendRequest("mla", wire, session_id=sid)).output
        engine.close_session(sid)
        return tensor_of(out)

    def hf() -> torch.Tensor:
        return hf_step(attention, base, DynamicCache(config=base.config), prompt, 0)

    sides = {"expanded": lambda: served(None), "absorbed": lambda: served("absorbed"), "hf": hf}
    expansions = []  # (the warm-up round's: which side ran expanded)
    with _patch() as patch:
        real = mla.expand_keys
        patch(mla, "expand_keys", lambda *a: expansions.append(1) or real(*a))
        answers = {}
        for name, side in sides.items():  # (a warm-up round each)
            before = len(expansions)
            answers[name] = side()
            assert (len(expansions) > before) == (name == "expanded"), name
    times: dict[str, list[float]] = {name: [] for name in SIDES}
    for _ in range(args.rounds):
        for name, side in sides.items():
            start = time.perf_counter()
            side()
            times[name].append((time.perf_counter() - start) * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}

    def diff(a: str) -> float:
        return float((answers[a] - answers["hf"]).abs().max())

    return {
        "prompt": n,
        "prompt_ms": ms,
        "prompt_ms_rounds": times,
        "ratio_expanded_absorbed": ms["expanded"] / ms["absorbed"],
        "ratio_expanded_hf": ms["expanded"] / ms["hf"],
        "ratio_absorbed_hf": ms["absorbed"] / ms["hf"],
        "max_abs_diff_expanded_hf": diff("expanded"),
        "max_abs_diff_absorbed_hf": diff("absorbed"),
        "hf_output_absmax": float(answers["hf"].abs().max()),
    }


def sweep_row(args, engine: Engine, rows: int, cached: int) -> dict:
    """A step of `rows` tokens after `cached` keys, each form forced, timed in rounds."""
    g = torch.Generator().manual_seed(rows * 7919 + cached)
    context = torch.randn(1, cached, args.embed_dim, generator=g)
    step = array_of(torch.randn(1, rows, args.embed_dim, generator=g))
    sid = engine.create_session("mla").session_id
    for start in range(0, cached, PREFILL_CHUNK):
        chunk = context[:, start : start + PREFILL_CHUNK]
        engine.attend(AttendRequest("mla", array_of(chunk), session_id=sid))

    def timed(which: str) -> float:
        with form(which):
            start = time.perf_counter()
            engine.attend(AttendRequest("mla", step, session_id=sid))
            ms = (time.perf_counter() - start) * 1e3
        engine.truncate_session(sid, cached)
        return ms

    for which in ("expanded", "absorbed"):  # (a warm-up each)
        timed(which)
    times: dict[str, list[float]] = {"expanded": [], "absorbed": []}
    for _ in range(args.rounds):
        for which in times:
            times[which].append(timed(which))
    engine.close_session(sid)
    ms = {name: statistics.median(t) for name, t in times.items()}
    picked = mla.expands(engine.get("mla").spec.attention, rows, cached)
    return {
        "cached": cached,
        "rows": rows,
        "step_ms": ms,
        "step_ms_rounds": times,
        "ratio": ms["expanded"] / ms["absorbed"],
        "picked": "expanded" if picked else "absorbed",
    }


if __name__ == "__main__":
    main()
