"""One session's decode step in the engine against the same step in bare torch ops.

Both run in this process on one torch thread, alternating in rounds so that both see the
same machine: the engine's step (`Engine.attend` of one AttendRequest with a session_id, as
a front door calls it: validation, reserve, project, overflow bounds, cache write and read,
attention, commit, the outcome's arrays) and the bare ops
it cannot do without (fused qkv projection, a copy into a preallocated contiguous K/V,
scaled_dot_product_attention over it with each KV head's query heads as its rows, the
output projection). The difference is the
engine's bookkeeping per step.

    python bench/engine_step.py [--context 256] [--model mha] [--rounds 7] [--steps 200]

With --sessions N it measures instead a batch of N sessions decoding together at each of
--contexts, attending per session (one kernel each over its cached K/V in place) against
batched (engine/attend.py: K/V gathered into padded groups, one kernel each), the same
sessions and the same engine, the two alternating in rounds; torch keeps its threads, as
the server's compute thread does (the engine's own switch picks one for small steps):

    python bench/engine_step.py --sessions 64 --model gqa --contexts 256,1024

--device cuda runs both on the GPU (bfloat16, as the server's 'auto'; each timed loop ends
with a device sync). --profile FILE adds, after the timing, torch.profiler over a few steps
of each side: per step, the torch ops each side calls (count and self CPU time, the top
ones), and on CUDA the runtime calls that stall the host (stream and device syncs, copies)
and the kernels launched, with the top kernels by device time (where a batch's 2.8 ms of
device time at 64 sessions goes: bench/gpu_notes.md), and on any device the torch ops that
would make a GPU's host wait (nonzero, .item(): SYNC_OPS). On a GPU a lone step's host work
is its cost, so the op count is the engine's bookkeeping there; `make gpu` runs it
(GPU_PARTS engine):

    python bench/engine_step.py --device cuda --context 4032 --profile out.json
    python bench/engine_step.py --device cuda --sessions 64 --contexts 4032 --profile out.json

--static-decode eager|graphs adds a third side to --sessions, and runs the engine's side of
one session so: plain decode steps through engine/graphs.py's StaticDecode, in fixed shapes
(eager), or replayed from CUDA graphs of them (graphs, CUDA only):

    python bench/engine_step.py --device cuda --sessions 64 --contexts 4032 --static-decode graphs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mha_serve.config import default_models
from mha_serve.engine import AttendRequest, Engine, array_of, resolve_device, resolve_dtype
from mha_serve.model.config import RopeConfig

PROFILE_STEPS = 20  # steps per side under the profiler
TOP_OPS = 15
# CUDA runtime calls that make the host wait for the device (a pipeline bubble each) or copy
HOST_STALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
# torch ops that make the host wait for a CUDA device, counted on any device (on the CPU they
# are the stalls a GPU would see): nonzero (boolean-mask indexing runs it), a scalar read back
# (.item(), int(t)), a tensor's truth (`if t:`)
SYNC_OPS = ("aten::nonzero", "aten::_local_scalar_dense", "aten::is_nonzero")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_side(step: Callable[[int], object], steps: int, device: torch.device) -> dict:
    """torch.profiler over `steps` calls of step(i): per step, the ops and runtime calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    step(0)  # warm: the profiler records steady steps only
    sync(device)
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        sync(device)
    rows = prof.key_averages()
    ops = [r for r in rows if r.key.startswith("aten::")]
    runtime = {r.key: r.count for r in rows}
    op_counts = {r.key: r.count for r in ops}

    def per_step(names: tuple[str, ...]) -> float:
        return sum(runtime.get(n, 0) for n in names) / steps

    top = sorted(ops, key=lambda r: r.self_cpu_time_total, reverse=True)[:TOP_OPS]
    # The kernels' own rows (an op's row counts its kernels' time again).
    kernels = [r for r in rows if r.device_type == DeviceType.CUDA]
    device_us = sum(r.self_device_time_total for r in kernels)
    top_kernels = sorted(kernels, key=lambda r: r.self_device_time_total, reverse=True)
    return {
        "steps": steps,
        "aten_ops_per_step": sum(r.count for r in ops) / steps,
        "aten_self_cpu_us_per_step": sum(r.self_cpu_time_total for r in ops) / steps,
        "host_stalls_per_step": per_step(HOST_STALLS),
        "sync_ops_per_step": sum(op_counts.get(n, 0) for n in SYNC_OPS) / steps,
        "copies_per_step": per_step(COPIES),
        "kernel_launches_per_step": per_step(LAUNCHES),
        "device_us_per_step": device_us / steps if device.type == "cuda" else None,
        "top_ops": [
            {
                "op": r.key,
                "calls_per_step": r.count / steps,
                "self_cpu_us_per_step": r.self_cpu_time_total / steps,
            }
            for r in top
        ],  # fmt: skip
        # Where the device's time goes (CUDA; none on the CPU): the kernels by their time
        "top_kernels": [
            {
                "kernel": r.key,
                "launches_per_step": r.count / steps,
                "device_us_per_step": r.self_device_time_total / steps,
            }
            for r in top_kernels[:TOP_OPS]
        ],  # fmt: skip
    }


def report_profiles(sides: dict[str, dict], path: Path, meta: dict) -> None:
    """Print the sides' profiles next to each other and write them as JSON."""
    names = list(sides)
    print("per step, under torch.profiler:" + "".join(f" | {n:>14}" for n in names))
    for key, label in (
        ("aten_ops_per_step", "torch ops"),
        ("aten_self_cpu_us_per_step", "their self CPU us"),
        ("kernel_launches_per_step", "kernel launches"),
        ("copies_per_step", "memcpy calls"),
        ("host_stalls_per_step", "host stalls (syncs)"),
        ("sync_ops_per_step", "torch ops that sync on CUDA"),
        ("device_us_per_step", "device time us"),
    ):
        cells = [sides[n][key] for n in names]
        if all(c is None for c in cells):
            continue
        print(f"  {label:<30}" + "".join(f" | {c:14.1f}" for c in cells))
    for n in names:
        print(f"  {n}: top torch ops by self CPU time (calls, us per step)")
        for r in sides[n]["top_ops"]:
            print(f"    {r['op']:<40} {r['calls_per_step']:6.1f} {r['self_cpu_us_per_step']:9.1f}")
        if sides[n]["top_kernels"]:
            print(f"  {n}: top kernels by device time (launches, us per step)")
            for r in sides[n]["top_kernels"]:
                name = r["kernel"] if len(r["kernel"]) <= 60 else r["kernel"][:57] + "..."
                print(
                    f"    {name:<60} {r['launches_per_step']:6.1f} {r['device_us_per_step']:9.1f}"
                )
    path.write_text(json.dumps({**meta, "profiles": sides}, indent=1))
    print(f"wrote {path}")


def engine_on(args, specs) -> Engine:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    return Engine(
        specs,
        device=device,
        dtype=dtype,
        max_response_bytes=2**28,
        static_decode=args.static_decode,
        flash_decode=getattr(args, "flash_decode", False),
    )


def bare_step(
    module,
    x: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    pos: int,
    freq: torch.Tensor | None = None,
):
    """x (1, 1, E); k_all, v_all (1, KVH, S, D) preallocated: the step's minimal torch ops
    (each KV head's query heads as the rows of one attention call: its fastest form on the
    CPU, bench/decode_attention.py). freq (D,): RoPE's frequencies, each twice; q and k then
    rotated at pos as transformers does (x cos + rotate_half(x) sin, angles in float32)."""
    c = module.config
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    qkv = F.linear(x, module.wqkv.weight, module.wqkv.bias)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    if freq is not None:
        angles = pos * freq  # (D,)
        qk = qkv[..., : (H + KVH) * D].view(1, H + KVH, D)
        half = D // 2
        cos, sin = angles.cos().to(qk.dtype), angles.sin().to(qk.dtype)  # (as project)
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], -1) * sin
        q, k = qk[:, :H], qk[:, H:]
    k_all[:, :, pos].copy_(k.reshape(1, KVH, D))
    v_all[:, :, pos].copy_(v.view(1, KVH, D))
    y = F.scaled_dot_product_attention(
        q.reshape(1, KVH, H // KVH, D), k_all[:, :, : pos + 1], v_all[:, :, : pos + 1]
    )  # (1, KVH, G, D): query head h = kv * G + g
    return F.linear(y.reshape(1, 1, H * D), module.wo.weight, module.wo.bias)


def batch_decode(args) -> None:
    """--sessions N: N sessions decoding together, per session against batched."""
    n, contexts = args.sessions, [int(c) for c in args.contexts.split(",")]
    steps = args.steps if args.steps_given else 10
    specs = [s for s in default_models() if s.name == args.model]
    per_token = 2 * specs[0].attention.num_kv_heads * specs[0].attention.head_dim * 4
    budget = 2 * n * (max(contexts) + steps + 16) * per_token  # room for every session
    specs = [dataclasses.replace(specs[0], kv_cache_bytes=budget)]
    engine = engine_on(args, specs)
    hosted = engine.get(args.model)
    profiles: dict[str, dict] = {}
    E = hosted.spec.attention.embed_dim
    static = args.static_decode
    # (label, batched attention, static_decode, flash decode): per session and batched as
    # any step, and the static and flash decode sides when asked (flash decode: where the
    # engine can run it; Sessions logs why not)
    flash = engine.sessions.flash_kernels.pop(args.model, None)
    sides = [("per session", False, "off", None), ("batched", True, "off", None)]
    if static != "off":
        sides.append((f"static {static}", True, static, None))
    if flash is not None:
        sides.append(("flash decode", True, "off", flash))
    g = torch.Generator().manual_seed(0)
    tokens = [array_of(torch.randn(1, 1, E, generator=g)) for _ in range(steps)]
    print(
        f"{args.model}, {n} sessions decoding together, {steps} steps a side a round, "
        f"{args.rounds} rounds, torch threads {torch.get_num_threads()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} before"
    )
    with torch.inference_mode():
        for context in contexts:
            ids = [engine.create_session(args.model).session_id for _ in range(n)]
            for sid in ids:
                prompt = torch.randn(1, context, E, generator=g)
                engine.attend(AttendRequest(args.model, array_of(prompt), session_id=sid))
            times: dict[str, list[float]] = {label: [] for label, *_ in sides}

            def side(batched: bool, mode: str, kernel) -> None:
                engine.sessions.batched_attention[args.model] = batched
                engine.sessions.static_decode = mode
                engine.sessions.flash_kernels.pop(args.model, None)
                if kernel is not None:
                    engine.sessions.flash_kernels[args.model] = kernel

            def step(t: int, ids=ids) -> None:
                calls = [AttendRequest(args.model, tokens[t % steps], session_id=s) for s in ids]
                outcomes = engine.run_batch(hosted, [engine.prepare(c) for c in calls])
                assert all(o.batch_size == n for o in outcomes), outcomes[0]

            for _ in range(args.rounds):
                for label, batched, mode, kernel in sides:
                    side(batched, mode, kernel)
                    start = time.perf_counter()
                    for t in range(steps):
                        step(t)
                    sync(hosted.device)
                    times[label].append((time.perf_counter() - start) / steps * 1e3)
                    for sid in ids:  # back to the context for the other side
                        engine.truncate_session(sid, context)
            if args.profile:
                for label, batched, mode, kernel in sides:
                    side(batched, mode, kernel)
                    name = f"{label} @{context}"
                    profiles[name] = profile_side(step, min(steps, PROFILE_STEPS), hosted.device)
                    for sid in ids:
                        engine.truncate_session(sid, context)
            for sid in ids:
                engine.close_session(sid)
            med = {label: statistics.median(t) for label, t in times.items()}
            each, batch = med["per session"], med["batched"]
            print(
                f"context {context}: per session {each:.2f} ms a step, batched {batch:.2f} ms "
                f"(median of rounds; fastest {min(times['per session']):.2f} vs "
                f"{min(times['batched']):.2f}): batched / per session = {batch / each:.2f}x time"
            )
            if flash is not None:
                print(
                    f"context {context}: flash decode {med['flash decode']:.2f} ms a step "
                    f"(fastest {min(times['flash decode']):.2f}): flash decode / batched = "
                    f"{med['flash decode'] / batch:.2f}x time"
                )
            if static != "off":
                label = f"static {static}"
                print(
                    f"context {context}: {label} {med[label]:.2f} ms a step (fastest "
                    f"{min(times[label]):.2f}): {label} / batched = {med[label] / batch:.2f}x time"
                )
                held = engine.sessions._static.get(args.model)
                if held is not None and static == "graphs":  # what the captures cost so far
                    decode = held[0]
                    print(
                        f"  graphs captured so far: {decode.captures}, "
                        f"{decode.capture_s * 1e3:.1f} ms in all, the longest "
                        f"{decode.longest_capture_s * 1e3:.1f} ms (a capture holds the "
                        "step's thread: the event loop's for a lone step run inline)"
                    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.profile:
        meta = {"model": args.model, "sessions": n, "device": str(hosted.device)}
        report_profiles(profiles, args.profile, {**meta, "dtype": str(hosted.dtype)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--model", default="mha", choices=["mha", "gqa", "mqa"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--steps", type=int, help="steps per round and side (200; 10 with --sessions)"
    )
    parser.add_argument("--sessions", type=int, default=0, help="N sessions decoding together")
    parser.add_argument("--contexts", default="256,1024", help="with --sessions")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument(
        "--dtype", default="auto", help="the models' dtype (auto: float32 on the CPU, bf16 on CUDA)"
    )
    parser.add_argument("--profile", type=Path, help="torch.profiler of each side, to this JSON")
    parser.add_argument(
        "--static-decode",
        default="off",
        choices=["off", "eager", "graphs"],
        help="plain decode steps through engine/graphs.py (a third side with --sessions)",
    )
    parser.add_argument(
        "--rope",
        action="store_true",
        help="the model with rotary position embeddings (theta 10000), as Llama-family "
        "layers have; the bare side rotates q and k too",
    )
    parser.add_argument(
        "--flash-decode",
        action="store_true",
        help="with --sessions, a side with flash decode (engine/attend.py; CUDA, bf16/fp16)",
    )
    args = parser.parse_args(argv)
    args.steps_given = args.steps is not None
    if args.sessions:
        batch_decode(args)
        return
    args.steps = args.steps or 200
    max_len = next(m.max_seq_len for m in default_models() if m.name == args.model)
    if args.context + args.steps > max_len:  # each round's session steps past its context
        parser.error(
            f"--context {args.context} with --steps {args.steps}: the steps would take the "
            f"session past {args.model}'s max_seq_len {max_len}; use --context at most "
            f"{max_len - args.steps}"
        )
    torch.set_num_threads(1)
    specs = default_models()
    if args.rope:
        specs = [
            dataclasses.replace(s, attention=dataclasses.replace(s.attention, rope=RopeConfig()))
            if s.name == args.model
            else s
            for s in specs
        ]
    engine = engine_on(args, specs)
    hosted = engine.get(args.model)
    module, device = hosted.module, hosted.device
    freq = module.rope_freq  # (D,) or None
    E = module.config.embed_dim
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, args.context, E, generator=g)
    tokens = torch.randn(args.steps, 1, 1, E, generator=g)
    token_arrays = [array_of(t) for t in tokens]  # as the wire gives them
    tokens = tokens.to(device, hosted.dtype)  # the bare side's on the device already
    c = module.config
    k_all = torch.zeros(
        1, c.num_kv_heads, args.context + args.steps, c.head_dim, device=device, dtype=hosted.dtype
    )
    v_all = torch.zeros_like(k_all)
    with torch.inference_mode():  # the prompt's own K/V, as the engine's cache holds them:
        # never uninitialised memory, whose leftover denormals or NaNs made the bare side's
        # attention run 2-15x slower in some processes and not others
        _, k_prompt, v_prompt = module.project(prompt.to(device, hosted.dtype))
        k_all[:, :, : args.context].copy_(k_prompt)
        v_all[:, :, : args.context].copy_(v_prompt)
    engine_us, bare_us = [], []
    with torch.inference_mode():
        for _ in range(args.rounds):
            sid = engine.create_session(args.model).session_id
            engine.attend(AttendRequest(args.model, array_of(prompt), session_id=sid))
            start = time.perf_counter()
            for t in range(args.steps):
                engine.attend(AttendRequest(args.model, token_arrays[t], session_id=sid))
            engine_us.append((time.perf_counter() - start) / args.steps * 1e6)
            engine.close_session(sid)
            start = time.perf_counter()
            for t in range(args.steps):
                bare_step(module, tokens[t], k_all, v_all, args.context + t, freq)
            sync(device)
            bare_us.append((time.perf_counter() - start) / args.steps * 1e6)
        if args.profile:
            n = min(args.steps, PROFILE_STEPS)
            sid = engine.create_session(args.model).session_id
            engine.attend(AttendRequest(args.model, array_of(prompt), session_id=sid))
            sides = {
                "engine": profile_side(
                    lambda t: engine.attend(
                        AttendRequest(args.model, token_arrays[t], session_id=sid)
                    ),
                    n,
                    device,
                ),
                "bare ops": profile_side(
                    lambda t: bare_step(module, tokens[t], k_all, v_all, args.context + t, freq),
                    n,
                    device,
                ),
            }
            engine.close_session(sid)
    e, b = statistics.median(engine_us), statistics.median(bare_us)
    # The fastest round of each side too: on a shared machine other work only ever adds
    # time, so the minimum is the steadiest estimate of what the code itself costs.
    e_min, b_min = min(engine_us), min(bare_us)
    print(
        f"{args.model}{' with RoPE' if args.rope else ''} context {args.context} on {device} "
        f"({hosted.dtype}), 1 torch thread, "
        f"{args.rounds} rounds x "
        f"{args.steps} steps: engine step {e:.0f} us, bare torch ops {b:.0f} us, overhead "
        f"{e - b:.0f} us ({e / b:.2f}x) median; fastest rounds {e_min:.0f} vs {b_min:.0f} us, "
        f"overhead {e_min - b_min:.0f} us"
    )
    if args.profile:
        meta = {"model": args.model, "context": args.context, "device": str(device)}
        report_profiles(sides, args.profile, {**meta, "engine_us": e, "bare_us": b})


if __name__ == "__main__":
    main()
