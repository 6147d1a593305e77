"""The frontend-workers link's own cost (`--frontend-workers N`: serving/link.py, host.py),
this checkout against another (the code before a change: a git worktree), side by side.

    python bench/link_hop.py                                  # this checkout alone
    python bench/link_hop.py --baseline-tree ../wt-before     # ~1 min

Two measures, each run in a process of its own per checkout, the checkouts alternating in
rounds (fastest round kept: what the code costs, not what the machine's other work adds):
1. codec: `link.pack` of a message and `link.read_frame` of its bytes, for a 16-token
   stateless compute call and its reply, and a one-token session step's call and reply, as
   the frontend and the engine send them (microseconds per message, and the frame's bytes);
2. engine: the engine process's CPU per call on the link's path, read from its rusage: a real
   `EngineHost` on a Unix socket answering 16-token compute calls from a fake engine that
   answers at once (no forward, no batcher), while a forked frontend keeps `--window` calls
   in flight and reads the replies' bytes. What is left is what the engine process pays per
   call for the link itself: reading and unpickling the call, a task, pickling and writing
   the reply.
Ratios are this checkout's over the baseline's. Nothing here is a CI gate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EMBED, TOKENS = 512, 16


def _messages() -> dict[str, tuple]:
    """The four messages as this checkout's link sends them."""
    import numpy as np

    from mha_serve.cache.types import SessionStats
    from mha_serve.engine.requests import Array, AttendOutcome, AttendRequest
    from mha_serve.serving import finish

    rng = np.random.default_rng(0)

    def array(tokens: int) -> Array:
        return Array(rng.standard_normal((1, tokens, EMBED), dtype=np.float32), "float32")

    request = AttendRequest("mha", array(TOKENS))
    step = AttendRequest("", array(1), session_id="s-0123456789abcdef")
    stats = SessionStats("s-0123456789abcdef", "gqa", 272, 17, 17 * 65536, 2048, 600.0, 0)
    out = AttendOutcome(array(TOKENS), None, (), 0, 0.41, 8, None)
    step_out = AttendOutcome(array(1), None, (), 0, 0.41, 8, stats)
    # A reply carries the Computed, or (once the frontend kept its request) all of it but that.
    reply = getattr(finish, "computed_reply", lambda c: c)
    kw = {"received": 1234.5, "deadline": 1240.5, "caller": None}
    return {
        "call": ("call", 12345, "compute", (request,), kw),
        "reply": ("ok", 12345, reply(finish.Computed(request, "mha", out, 0.12, 0.41, 0.0))),
        "step call": ("call", 12346, "compute", (step,), kw | {"caller": "ipv4:127.0.0.1"}),
        "step reply": ("ok", 12346, reply(finish.Computed(step, "gqa", step_out, 0.1, 0.3, 0.0))),
    }


async def _codec(n: int) -> dict[str, Any]:
    from mha_serve.serving import link

    me, peer = os.getpid(), os.getppid()
    out = {}
    for name, message in _messages().items():
        data = b"".join(bytes(p) for p in link.pack(message, me, peer))
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        back = await link.read_frame(reader)
        assert repr(back) == repr(message), (name, back, message)  # the same message back
        start = time.perf_counter()
        for _ in range(n):
            link.pack(message, me, peer)
        packed = time.perf_counter()
        reader = asyncio.StreamReader()
        for _ in range(n):
            reader.feed_data(data)
            await link.read_frame(reader)
        read = time.perf_counter()
        out[name] = {
            "bytes": len(data),
            "pack_us": (packed - start) / n * 1e6,
            "read_us": (read - packed) / n * 1e6,
        }
    return out


def _skip_frame(f: Any) -> None:
    """Reads one frame's bytes off a socket file, either head format (the body's length in
    the head, or each buffer's length after it)."""
    from mha_serve.serving import link

    if link._HEAD.size == 16:  # noqa: SLF001  (u32 pickle, u32 buffers, u64 body)
        _, _, total = struct.unpack("<IIQ", f.read(16))
        f.read(total)
        return
    size, count = struct.unpack("<II", f.read(8))
    lengths = struct.unpack(f"<{count}Q", f.read(8 * count)) if count else ()
    total = size
    for n in lengths:
        total += -total % 16 + n
    f.read(total)


def _frontend(path: str, calls: int, window: int, ready: Any) -> None:
    """The forked frontend: `window` calls in flight at a time, each reply's bytes read."""
    from mha_serve.serving import link

    call = _messages()["call"]
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    f = s.makefile("rb")
    _skip_frame(f)  # the hello
    frames = b"".join(
        b"".join(bytes(p) for p in link.pack(("call", r, *call[2:]), 0, 0))
        for r in range(1, window + 1)
    )
    ready.set()
    for _ in range(calls // window):
        s.sendall(frames)
        for _ in range(window):
            _skip_frame(f)
    s.close()


async def _engine(calls: int, window: int) -> dict[str, float]:
    import multiprocessing

    from mha_serve.serving.finish import Computed
    from mha_serve.serving.host import EngineHost

    reply = _messages()["reply"][2]
    outcome = reply[1] if isinstance(reply, tuple) else reply.outcome  # (computed_reply's)

    class Answers:  # the engine's interface as the host calls it: every compute at once
        max_response_bytes = 1 << 28

        def models(self) -> list:
            return []

        async def compute(self, request: Any, **_: Any) -> Computed:
            return Computed(request, "mha", outcome, 0.12, 0.41, 0.0)

    with tempfile.TemporaryDirectory(prefix="mha-link-") as d:
        path = str(Path(d) / "engine.sock")
        host = EngineHost(path)
        await host.start()
        host.ready(Answers())
        fork = multiprocessing.get_context("fork")
        ready = fork.Event()
        proc = fork.Process(target=_frontend, args=(path, calls, window, ready))
        proc.start()
        while not ready.is_set():
            await asyncio.sleep(0.01)
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        while proc.is_alive():
            await asyncio.sleep(0.02)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
        await host.close()
    if proc.exitcode != 0:
        raise RuntimeError(f"the bench's frontend exited {proc.exitcode}")
    n = calls // window * window
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return {
        "cpu_us": (user + system) / n * 1e6,
        "user_us": user / n * 1e6,
        "sys_us": system / n * 1e6,
        "wall_us": wall / n * 1e6,
    }


def child(args: argparse.Namespace) -> None:
    """One round in this process: both measures, as JSON on stdout."""
    result = {
        "codec": asyncio.run(_codec(args.messages)),
        "engine": asyncio.run(_engine(args.calls, args.window)),
    }
    print(json.dumps(result))


def run_round(tree: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(tree / d) for d in ("service", "client"))
    cmd = [sys.executable, __file__, "--child", "--messages", str(args.messages)]
    cmd += ["--calls", str(args.calls), "--window", str(args.window)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"a round failed ({tree or 'this checkout'}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fastest(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's fastest round (sizes are the same in every round)."""
    first = rounds[0]
    codec = {
        name: {
            "bytes": first["codec"][name]["bytes"],
            **{k: min(r["codec"][name][k] for r in rounds) for k in ("pack_us", "read_us")},
        }
        for name in first["codec"]
    }
    engine = {k: min(r["engine"][k] for r in rounds) for k in first["engine"]}
    return {"codec": codec, "engine": engine}


def table(sides: dict[str, dict[str, Any]]) -> str:
    names = list(sides)
    lines = ["codec, us per message (pack / read_frame) and the frame's bytes:"]
    head = "| message | " + " | ".join(f"{n}: bytes, pack / read" for n in names)
    ratio = len(names) == 2
    lines += [head + (" | pack, read: now / before |" if ratio else " |")]
    lines += ["|" + " --- |" * (len(names) + 1 + ratio)]
    for msg in sides[names[0]]["codec"]:
        cells = []
        for n in names:
            c = sides[n]["codec"][msg]
            cells.append(f"{c['bytes']} B, {c['pack_us']:.2f} / {c['read_us']:.2f}")
        if ratio:
            a, b = (sides[n]["codec"][msg] for n in names)
            cells.append(f"{a['pack_us'] / b['pack_us']:.2f}, {a['read_us'] / b['read_us']:.2f}")
        lines.append(f"| {msg} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "engine process on the link's path, us of CPU per call (user + sys), wall per call:",
    ]
    for n in names:
        e = sides[n]["engine"]
        lines.append(
            f"- {n}: {e['cpu_us']:.1f} (user {e['user_us']:.1f}, sys {e['sys_us']:.1f}), "
            f"wall {e['wall_us']:.1f}"
        )
    if ratio:
        a, b = (sides[n]["engine"]["cpu_us"] for n in names)
        lines.append(f"- now / before: {a / b:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-tree", type=Path, help="a checkout of the code before")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per checkout")
    p.add_argument("--messages", type=int, default=20000, help="codec: messages a round")
    p.add_argument("--calls", type=int, default=20000, help="engine: calls a round")
    p.add_argument("--window", type=int, default=32, help="engine: calls in flight")
    p.add_argument("--json-out", type=Path, help="the rounds and the table's figures")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.rounds < 1 or args.messages < 1 or args.window < 1 or args.calls < args.window:
        p.error("--rounds, --messages, --window >= 1 and --calls >= --window")
    trees: dict[str, Path | None] = {"now": None}
    if args.baseline_tree is not None:
        trees["before"] = args.baseline_tree.resolve()
    rounds: dict[str, list] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            rounds[name].append(run_round(trees[name], args))
    sides = {name: fastest(rs) for name, rs in rounds.items()}
    print(table(sides))
    if args.json_out is not None:
        results = {
            "command": " ".join(["python", "bench/link_hop.py", *(argv or sys.argv[1:])]),
            "loadavg": os.getloadavg(),
            "sides": sides,
            "rounds": rounds,
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
