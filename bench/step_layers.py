"""Where a served decode step's time goes, layer by layer, in real time (issue 25).

A sampling profiler distorts a step of a millisecond (py-spy's own CPU on these cores,
cProfile's cost per call: a step of ~500 Python calls took 1.3x its time under it). This
instead starts mha-serve with a perf_counter wrapper around each layer of the call's path
(door -> serving -> lanes -> engine -> sessions -> module, and the codecs beside them: a
wrapper costs about a microsecond), streams decode steps at it from this process and prints
each layer's median inclusive time and what it spends itself (inclusive less its timed
children). Layers the code does not have (an older checkout) are left out.

    python bench/step_layers.py [--model gqa] [--context 256] [--steps 200] [--rounds 5]
    python bench/step_layers.py --baseline-tree ../wt-before   # the code before, same run
    python bench/step_layers.py --variant busy=--busy-poll-us=300  # this code with flags too

The in-process bare step (bench/overhead.py BareStep) is measured beside it: what the
engine's forward cannot do without, in a tight loop (as overhead.py's limit takes it) and
each after a wait of about an echo's round trip (as a served step comes).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GAP_S = 0.0003  # the bare step once more, each after this wait (about an echo's round trip)
sys.path.insert(0, str(ROOT / "bench"))

# (label, module, attribute path, parent label(s), users): the call's path, outermost first.
# A module-level function is also replaced where `users` import it by name. Two functions
# under one label are one layer. A layer under two parents (a tuple, the lanes' path's
# first) is the same code called from either: it counts under the last of them that ran
# (the streamed steps of one run take one path), and the table shows it under the last. A
# parent the code does not have (an older checkout) gives its timed children to its own.
LAYERS: list[tuple[str, str, str, str | tuple[str, ...] | None, tuple[str, ...]]] = [
    ("parse request", "mha_serve.transport.convert", "parse_attend_request", None, ()),
    ("settle (status, metrics)", "mha_serve.transport.answer", "settle", None, ("mha_serve.transport.door",)),
    ("door.attend", "mha_serve.transport.door", "AttentionDoor.attend", "settle (status, metrics)", ()),
    ("to_call", "mha_serve.transport.convert", "to_call", "door.attend", ("mha_serve.transport.door",)),
    ("serving.attend", "mha_serve.serving.async_engine", "AsyncEngine.attend", "door.attend", ()),
    # A plain decode step that finds its lane idle, in one call (AsyncEngine._step_now; an
    # older checkout takes the lanes' path below for it)
    ("step now", "mha_serve.serving.async_engine", "AsyncEngine._step_now", "serving.attend", ()),
    ("lane idle? (alone_now)", "mha_serve.batching.batcher", "Batcher.alone_now", "step now", ()),
    ("session claim", "mha_serve.cache.sessions", "SessionTable.claim", ("serving.attend", "step now"), ()),
    ("session release", "mha_serve.cache.sessions", "SessionTable.release", ("serving.attend", "step now"), ()),
    ("engine.decode_now", "mha_serve.engine.engine", "Engine.decode_now", "step now", ()),
    ("sessions.decode_now", "mha_serve.engine.sessions", "Sessions.decode_now", "engine.decode_now", ()),
    ("lane counts it (ran_alone)", "mha_serve.batching.batcher", "Batcher.ran_alone", "step now", ()),
    # The lanes' path: any other step, and a decode step before (a --baseline-tree)
    ("engine.prepare", "mha_serve.engine.engine", "Engine.prepare", "serving.attend", ()),
    ("lanes.submit", "mha_serve.batching.batcher", "Batcher.submit", "serving.attend", ()),
    ("engine.run_batch", "mha_serve.engine.engine", "Engine.run_batch", "lanes.submit", ()),
    # A lone step (Sessions._run_alone: the streamed steps here each find their lane idle;
    # a step it leaves to a batch's path shows in engine.run_batch's own time)
    ("lone step", "mha_serve.engine.sessions", "Sessions._run_alone", "engine.run_batch", ()),
    ("reserve", "mha_serve.cache.sessions", "SessionTable.reserve", ("lone step", "sessions.decode_now"), ()),
    # the step on its reservation, either path's (Sessions._step_reserved)
    ("step on its reservation", "mha_serve.engine.sessions", "Sessions._step_reserved", ("lone step", "sessions.decode_now"), ()),
    ("overflow bounds", "mha_serve.engine.lone_step", "cleared", "step on its reservation", ()),
    ("overflow bounds", "mha_serve.engine.sessions", "cleared", "step on its reservation", ()),  # (before the split)
    # A decode step of a plain config: the cache's views and the module's one call (before
    # them, project, append, read and attend_step, which now run for a prompt's tokens)
    ("cache.step_views", "mha_serve.cache.kv_cache", "KVCache.step_views", "step on its reservation", ()),
    ("module.decode_one", "mha_serve.model.attention", "MultiHeadAttention.decode_one", "step on its reservation", ()),
    ("commit", "mha_serve.cache.sessions", "SessionTable.commit", "step on its reservation", ()),
    # where the lone step looks array_of up: its own module, and settle's step_outputs (an
    # output to convert first); engine/sessions.py in a --baseline-tree from before the split
    ("output's numpy view", "mha_serve.engine.lone_step", "array_of", "step on its reservation", ()),
    ("output's numpy view", "mha_serve.engine.settle", "array_of", "step on its reservation", ()),
    ("output's numpy view", "mha_serve.engine.sessions", "array_of", "step on its reservation", ()),
    # prepare's parts: the input's one scan (NaN/Inf, and the bounds' max |x|), its tensor
    # view, the session's checks and the response's size; where prepare looks the scan and
    # the view up: engine/prepare.py, engine/engine.py in a --baseline-tree from before its
    # split; engine/compute.py for Engine.decode_now's
    ("max |input| scan", "mha_serve.engine.prepare", "array_absmax", ("engine.prepare", "engine.decode_now"), ()),
    ("max |input| scan", "mha_serve.engine.compute", "array_absmax", ("engine.prepare", "engine.decode_now"), ()),
    ("max |input| scan", "mha_serve.engine.checks", "array_absmax", ("engine.prepare", "engine.decode_now"), ("mha_serve.engine.engine",)),
    ("input tensor view", "mha_serve.engine.prepare", "tensor_of", ("engine.prepare", "engine.decode_now"), ()),
    ("input tensor view", "mha_serve.engine.compute", "tensor_of", ("engine.prepare", "engine.decode_now"), ()),
    ("input tensor view", "mha_serve.engine.types", "tensor_of", ("engine.prepare", "engine.decode_now"), ("mha_serve.engine.engine",)),
    ("session checks", "mha_serve.engine.sessions", "Sessions.validate_step", "engine.prepare", ()),
    ("response size", "mha_serve.engine.engine", "Engine._check_response_size", "engine.prepare", ()),
    ("finish", "mha_serve.serving.finish", "finish", "serving.attend", ("mha_serve.serving.async_engine",)),
    ("finish", "mha_serve.serving.finish", "finish_here", "serving.attend", ("mha_serve.serving.async_engine",)),
    ("encode reply", "mha_serve.transport.convert", "encode_result", "finish", ("mha_serve.transport.door",)),
]  # fmt: skip
# What a plain streamed decode step of this checkout passes through (the table's layers
# that its path has: tests/bench/test_step_layers_bench.py).
STEP_PATH = [
    "parse request", "settle (status, metrics)", "door.attend", "to_call", "serving.attend",
    "step now", "lane idle? (alone_now)", "session claim", "session release",
    "engine.decode_now", "max |input| scan", "input tensor view", "sessions.decode_now",
    "reserve", "step on its reservation", "overflow bounds", "cache.step_views",
    "module.decode_one", "commit", "output's numpy view", "lane counts it (ran_alone)",
    "finish", "encode reply",
]  # fmt: skip


def parents_of(parent: str | tuple[str, ...] | None) -> tuple[str | None, ...]:
    return parent if isinstance(parent, tuple) else (parent,)


def _install(times: dict[str, list[float]]) -> list[str]:
    """Wraps each layer that exists; the labels installed."""
    installed = []
    for label, module_name, path, _, users in LAYERS:
        try:
            module = importlib.import_module(module_name)
            *owners, name = path.split(".")
            owner: Any = module
            for o in owners:
                owner = getattr(owner, o)
            fn = getattr(owner, name)
        except (ImportError, AttributeError):
            continue
        record = times[label].append
        if inspect.iscoroutinefunction(fn):

            async def timed(*a, __fn=fn, __record=record, **k):
                t = time.perf_counter()
                try:
                    return await __fn(*a, **k)
                finally:
                    __record(time.perf_counter() - t)
        else:

            def timed(*a, __fn=fn, __record=record, **k):
                t = time.perf_counter()
                try:
                    return __fn(*a, **k)
                finally:
                    __record(time.perf_counter() - t)

        setattr(owner, name, functools.wraps(fn)(timed))
        for user in users:
            setattr(importlib.import_module(user), name, getattr(owner, name))
        if label not in installed:
            installed.append(label)
    if "parse request" in installed:  # the servicer's parsers were bound at import
        from mha_serve.transport import convert, servicer

        parse = convert.parse_attend_request
        servicer.AttentionServicer.request_parsers = {"Attend": parse, "StreamSession": parse}
    return installed


def serve_timed(out: str, argv: list[str]) -> int:
    """The server with its layers timed: SIGUSR1 clears the times, SIGUSR2 writes them."""
    times: dict[str, list[float]] = defaultdict(list)
    installed = _install(times)

    def clear(*_: Any) -> None:
        for v in times.values():
            v.clear()

    def dump(*_: Any) -> None:
        data = {k: [x * 1e6 for x in times[k]] for k in installed}
        Path(out).write_text(json.dumps(data))

    signal.signal(signal.SIGUSR1, clear)
    signal.signal(signal.SIGUSR2, dump)
    from mha_serve.transport.main import main

    return main(argv)


async def stream_steps(target: str, model: str, context: int, steps: int, rounds: int) -> float:
    """Streamed steps ending at `context`, `rounds` times from context - steps; median
    round trip, microseconds."""
    import grpc
    import numpy as np
    from overhead import EMBED
    from served_bench import OPTIONS, timed_stream

    from mha_client.messages import step_request
    from mha_client.sdk import AsyncClient

    rng = np.random.default_rng(0)
    client = AsyncClient(target)
    session = await client.create_session(model)
    start = context - steps
    await session.step(rng.standard_normal((start, EMBED), dtype=np.float32))
    tokens = rng.standard_normal((steps, 1, EMBED), dtype=np.float32)
    payloads = [step_request(session.id, t, {}).SerializeToString() for t in tokens]
    channel = grpc.aio.insecure_channel(target, options=OPTIONS)
    trips = []
    try:
        for _ in range(rounds):
            await session.truncate(start)
            trips += await timed_stream(channel, payloads)
        await session.close()
    finally:
        await client.close()
        await channel.close()
    return statistics.median(trips) * 1e6


def bare_us(model: str, context: int, steps: int, gap_s: float = 0.0) -> float:
    """The in-process bare step (overhead.BareStep), one torch thread; median, us. gap_s: a
    wait before each step, as a server's step comes after one for its message (the core
    idles, or runs others, and the step finds its caches colder than in a tight loop)."""
    import numpy as np
    import torch
    from overhead import EMBED, BareStep

    torch.set_num_threads(1)
    bare = BareStep(model, context)
    xs = torch.from_numpy(np.random.default_rng(1).standard_normal((steps, 1, 1, EMBED)))
    xs = xs.float()
    times = []
    for _ in range(3):
        for i in range(steps):
            if gap_s:
                time.sleep(gap_s)
            t = time.perf_counter()
            bare(xs[i], context - steps + i)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def measure(
    name: str, tree: Path | None, args: argparse.Namespace, tmp: Path, flags: tuple[str, ...] = ()
) -> dict:
    from served_bench import free_port

    from mha_client.sdk import Client

    port, out = free_port(), tmp / f"{name}.json"
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(tree / d) for d in ("service", "client"))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-timed", str(out), "--"]
        + ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"]
        + ["--log-level", "WARNING", *flags],
        stdout=(tmp / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    target = f"127.0.0.1:{port}"
    try:
        with Client(target) as c:
            c.wait_ready(180)
        asyncio.run(stream_steps(target, args.model, args.context, args.steps, 1))  # warm
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        p50 = asyncio.run(stream_steps(target, args.model, args.context, args.steps, args.rounds))
        proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        layers = json.loads(out.read_text())
    finally:
        proc.terminate()
        proc.wait(30)
    # The layers the decode steps took: at least one call for every other step (a round's
    # prompt, which takes the lanes' path, is one call per round)
    least = max(1, args.steps * args.rounds // 2)
    return {
        "round_trip_us": p50,
        "layers": {k: statistics.median(v) for k, v in layers.items() if len(v) >= least},
    }


def report(runs: dict[str, dict], bare: float, bare_gap: float, gap_s: float) -> None:
    names = list(runs)
    print(f"{'layer (median us: inclusive / self)':<34}" + "".join(f" | {n:>17}" for n in names))
    print(f"{'round trip (client, p50)':<34}" + "".join(
        f" | {runs[n]['round_trip_us']:17.0f}" for n in names
    ))  # fmt: skip
    parents = {label: parents_of(parent) for label, _, _, parent, _ in LAYERS}
    depth: dict[str, int] = {}
    for label, (*_, last) in parents.items():
        depth[label] = 0 if last is None else depth[last] + 1

    def timed_below(label: str, layers: dict[str, float]) -> float:
        """The time of label's timed children (each under the last of its parents that ran);
        a child the code does not have gives its own."""
        total = 0.0
        for child, of in parents.items():
            ran = [p for p in of if p in layers] or list(of)
            if ran[-1] != label:
                continue
            total += layers[child] if child in layers else timed_below(child, layers)
        return total

    for label in depth:  # (in order, once each)
        cells = []
        for n in names:
            layers = runs[n]["layers"]
            if label not in layers:
                cells.append(f" | {'-':>17}")
                continue
            own = layers[label] - timed_below(label, layers)
            cells.append(f" | {layers[label]:8.1f} / {own:6.1f}")
        print(f"{'  ' * depth[label] + label:<34}" + "".join(cells))
    print(
        f"in-process bare step (overhead.BareStep): {bare:.0f} us in a tight loop, "
        f"{bare_gap:.0f} us each after a {gap_s * 1e3:g} ms wait"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-timed"]:
        return serve_timed(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gqa", choices=["mha", "gqa", "mqa"])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline-tree", type=Path, help="a checkout of the code before")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAG[,FLAG]",
        help="this code once more, started with these server flags (e.g. busy=--busy-poll-us=300)",
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="mha-layers-") as d:
        sides = [("now", None, ())]
        if args.baseline_tree:
            sides.append(("before", args.baseline_tree, ()))
        for v in args.variant:
            name, _, flags = v.partition("=")
            if not name or name in {s[0] for s in sides}:
                p.error(f"--variant {v!r}: name it, other than now, before or another variant")
            sides.append((name, None, tuple(f for f in flags.split(",") if f)))
        for name, tree, flags in sides:
            runs[name] = measure(name, tree, args, Path(d), flags)
    bare = bare_us(args.model, args.context, args.steps)
    bare_gap = bare_us(args.model, args.context, args.steps, GAP_S)
    print(
        f"{args.model} decode steps at context {args.context}, {args.rounds} rounds of "
        f"{args.steps}, load average {os.getloadavg()[0]:.2f}"
    )
    report(runs, bare, bare_gap, GAP_S)
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "args": sys.argv[1:],
                    "bare_us": bare,
                    "bare_after_wait_us": bare_gap,
                    "wait_s": GAP_S,
                    "runs": runs,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
