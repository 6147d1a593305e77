"""A batch of decode steps three (on CUDA four) ways, on the same sessions of one engine:
StaticDecode eager (engine/graphs.py: fixed shapes, one host-to-device copy), today's
batched step (project, cache append, engine/attend.py batched, the overflow maxima), and
today's per-session path (the same with one attention kernel per session); on CUDA also
StaticDecode replaying CUDA graphs. Alternating rounds, medians of per-step wall time. Each
timed step ends reading its output and maxima back to the host, as the engine does.

    python bench/static_decode.py [--sessions 64] [--contexts 256,1024] [--model gqa]
    python bench/static_decode.py --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from mha_serve.config import default_models
from mha_serve.engine import Engine, resolve_dtype
from mha_serve.engine.attend import attend_steps
from mha_serve.engine.graphs import StaticDecode
from mha_serve.model.overflow import row_absmax_tensor


def today(hosted, cache, x, reservations, batched: bool):
    """Sessions._forward's ops for a batch of decode steps (no bounds shortcut)."""
    rotary = hosted.spec.attention.rope is not None
    positions = None
    if rotary:
        positions = torch.tensor([r.start for r in reservations], device=x.device)[:, None]
    q, k, v = hosted.module.project(x, positions)
    cache.append(k, v, [r.slots for r in reservations])
    maxima = row_absmax_tensor(q, k, v)
    B = len(reservations)
    out = attend_steps(hosted.module, cache, q, reservations, [1] * B, batched=batched).output
    return out, torch.cat([maxima, row_absmax_tensor(out)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--model", default="gqa", choices=[m.name for m in default_models()])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype("auto", device)
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts)
    specs = [
        dataclasses.replace(s, kv_cache_bytes=2 * args.sessions * longest * 2048)
        for s in default_models()
        if s.name == args.model
    ]
    engine = Engine(specs, device=device, dtype=dtype, max_response_bytes=2**30)
    g = torch.Generator().manual_seed(0)
    print(
        f"{args.model} on {device} ({dtype}), {args.sessions} sessions, {torch.get_num_threads()} threads"
    )
    for context in contexts:
        measure(engine, args, context, g)


def measure(engine: Engine, args: argparse.Namespace, context: int, g: torch.Generator) -> None:
    """args.sessions sessions of context - 1 cached tokens, one step each, timed each way."""
    hosted, cache = engine.get(args.model), engine.sessions.cache(args.model)
    table = engine.sessions.table
    ids = [engine.sessions.create(args.model, None, None).session_id for _ in range(args.sessions)]
    shape = (cache.num_kv_heads, context - 1, cache.head_dim)
    k, v = (torch.randn(shape, generator=g).to(hosted.dtype) for _ in "kv")
    for sid in ids:  # context - 1 cached tokens each, the step adds one
        (r,) = table.reserve_many([(sid, context - 1)])
        cache.load(r.block_table, 0, 0, k, v)
        table.commit(r)
    E = hosted.spec.attention.embed_dim
    x = torch.randn(args.sessions, 1, E, generator=g).to(hosted.device, hosted.dtype)
    reservations = table.reserve_many([(sid, 1) for sid in ids])
    static = StaticDecode(hosted, cache)
    sides: dict[str, Callable[[], object]] = {
        "static eager": lambda: _read(*_pair(static.step(x, reservations))),
        "batched (today)": lambda: _read(*today(hosted, cache, x, reservations, True)),
        "per session (today)": lambda: _read(*today(hosted, cache, x, reservations, False)),
    }
    if hosted.device.type == "cuda":
        graphs = StaticDecode(hosted, cache, graph=True)
        sides["static graph"] = lambda: _read(*_pair(graphs.step(x, reservations)))
    times: dict[str, list[float]] = {name: [] for name in sides}
    with torch.inference_mode():
        for rnd in range(args.rounds + 1):  # round 0 warms up (and captures)
            for name, fn in sides.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                if rnd:
                    times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["batched (today)"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"context {context:5d}  {name:20s} {med * 1e3:8.3f} ms/step  {base / med:5.2f}x of batched"
        )
    for r in reservations:
        table.rollback(r)
    for sid in ids:
        engine.sessions.close(sid)


def _pair(result) -> tuple[torch.Tensor, torch.Tensor]:
    return result.output, result.maxima


def _read(out: torch.Tensor, maxima: torch.Tensor) -> None:
    out.cpu()
    maxima.tolist()


if __name__ == "__main__":
    main()
