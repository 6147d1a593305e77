"""A streamed decode step as the Python SDK takes it, against the same step as raw bytes:
what the SDK itself adds to a step, and (with --baseline-tree) the SDK of another checkout
against this one's, alternating in rounds against one server (this checkout's).

Each side is a client process of its own (its tree's mha_client first on its path) that
opens a session on the server, sends its prompt, then streams --steps one-token steps and
reports each step's round trip: *sdk* through `AsyncSession.stream().step` (the request
built from the array, the reply read into an AttendResult), *sync* through the sync SDK's
`Session.stream().step` (gRPC's sync streams hand each request to a thread of their own),
*raw* through a bare bidi
stream of the same requests serialized before the clock starts, the reply left as bytes
(bench/overhead.py's *served* column). sdk - raw is the SDK's own work per step, paid cold
after each wait for the wire.

    python bench/sdk_step.py [--baseline-tree BEFORE] [--rounds 6] [--steps 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from served_bench import OPTIONS, machine, start_served, timed_stream  # noqa: E402

EMBED = 512  # the built-in models'
ROWS = [("gqa", 256), ("mqa", 1024), ("mha", 256)]
WARMUP = 8  # steps of each run left out (the stream's and the process's first)


def _sync_client(target: str, model: str, context: int, steps: int) -> list[float]:
    """The sync SDK's run (Session.stream().step): step times, seconds."""
    import time

    import numpy as np

    from mha_client.sdk import Client

    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((context - steps, EMBED), dtype=np.float32)
    tokens = rng.standard_normal((steps, 1, EMBED), dtype=np.float32)
    times: list[float] = []
    with Client(target) as client:
        session = client.create_session(model)
        session.step(prompt)
        with session.stream() as stream:
            for t in tokens:
                start = time.perf_counter()
                stream.step(t)
                times.append(time.perf_counter() - start)
        session.close()
    return times


async def _client(target: str, model: str, context: int, steps: int, raw: bool) -> list[float]:
    """One side's run (in a process of its own): step times, seconds."""
    import time

    import grpc
    import numpy as np

    from mha_client.messages import step_request
    from mha_client.sdk import AsyncClient

    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((context - steps, EMBED), dtype=np.float32)
    tokens = rng.standard_normal((steps, 1, EMBED), dtype=np.float32)
    times: list[float] = []
    async with AsyncClient(target) as client:
        session = await client.create_session(model)
        await session.step(prompt)
        if raw:
            payloads = [step_request(session.id, t, {}).SerializeToString() for t in tokens]
            async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
                times = await timed_stream(channel, payloads)
        else:
            async with session.stream() as stream:
                for t in tokens:
                    start = time.perf_counter()
                    await stream.step(t)
                    times.append(time.perf_counter() - start)
        await session.close()
    return times


def side_run(tree: Path, target: str, model: str, context: int, steps: int, kind: str) -> list:
    """A side's run in a client process with `tree`'s client code first on its path; kind:
    raw, sdk (async) or sync."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "client"), str(ROOT)])}
    argv = [sys.executable, __file__, "--client", target, model, str(context), str(steps)]
    run = subprocess.run(
        [*argv, "--kind", kind], env=env, capture_output=True, text=True, timeout=300
    )
    if run.returncode != 0:
        raise RuntimeError(f"the client of {tree} failed:\n{run.stdout}{run.stderr}")
    return json.loads(run.stdout)[WARMUP:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", type=Path, help="also this checkout's SDK, alternating")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=128, help="decode steps per run")
    ap.add_argument(
        "--rows", default=",".join(f"{m}:{c}" for m, c in ROWS), help="model:context,..."
    )
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="sdk", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:  # a side's process
        target, model, context, steps = args.client
        if args.kind == "sync":
            times = _sync_client(target, model, int(context), int(steps))
        else:
            times = asyncio.run(
                _client(target, model, int(context), int(steps), args.kind == "raw")
            )
        print(json.dumps(times))
        return 0
    rows = [(m, int(c)) for m, c in (r.split(":") for r in args.rows.split(","))]
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must exceed the {WARMUP} left out of each run")
    for _, context in rows:
        if context <= args.steps:
            raise SystemExit(f"context {context} must exceed --steps {args.steps}")
    here = ROOT.parent
    sides = {"raw": (here, "raw"), "sdk": (here, "sdk"), "sync": (here, "sync")}
    if args.baseline_tree is not None:
        sides["sdk before"] = (args.baseline_tree.resolve(), "sdk")
    from mha_client.sdk import Client

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, target = start_served(Path(tmp), "served")
        try:
            with Client(target) as c:
                c.wait_ready(240)
            for model, context in rows:
                samples: dict[str, list[float]] = {name: [] for name in sides}
                for r in range(args.rounds):
                    order = list(sides) if r % 2 == 0 else list(reversed(sides))
                    for name in order:
                        tree, kind = sides[name]
                        samples[name] += side_run(tree, target, model, context, args.steps, kind)
                us = {name: statistics.median(t) * 1e6 for name, t in samples.items()}
                row = {"model": model, "context": context, "median_us": us}
                line = (
                    f"{model} context {context}: raw {us['raw']:.0f} us, sdk {us['sdk']:.0f} "
                    f"(the SDK's own: {us['sdk'] - us['raw']:+.0f} us a step); sync SDK "
                    f"{us['sync']:.0f} ({us['sync'] - us['raw']:+.0f})"
                )
                if "sdk before" in us:
                    row["sdk_over_before"] = us["sdk"] / us["sdk before"]
                    line += (
                        f"; sdk before {us['sdk before']:.0f} ({us['sdk before'] - us['raw']:+.0f}"
                        f"): sdk / before = {row['sdk_over_before']:.3f}"
                    )
                print(line, flush=True)
                results.append(row)
        finally:
            proc.terminate()
            proc.wait(60)
    if args.json_out:
        report = {
            "command": "python bench/sdk_step.py " + " ".join(argv or sys.argv[1:]),
            "machine": machine(),
            "rounds": args.rounds,
            "steps": args.steps,
            "rows": results,
        }
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
