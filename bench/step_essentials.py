"""A plain decode step in one process, no gRPC: mha-serve's whole path against the operations it
cannot do without, and the bare step, alternating in rounds (issue 25).

Three sides, each a step of the same session at the same context, in turn:
- *path*: what a served StreamSession step runs between gRPC's bytes: parse_attend_request,
  answer.settle over AttentionDoor.attend (to_call, AsyncEngine.attend, the one-call step,
  finish, the metrics), the reply serialized;
- *essential*: the same step's indispensable operations called directly, each timed: the
  parse and the engine's request, the session's claim, the input's tensor view and its one
  scan (NaN/Inf, and the overflow bounds' max |x|), the reservation, the bounds, the
  cache's views and the module's decode_one, the output's numpy view, the commit, the
  release, the outcome, the batch's and the call's metrics and the request counter, the
  reply's message, its model and timing, serialized;
- *bare*: overhead.BareStep, the limit's in-process step (plain torch, no cache pages).
What *path* costs over *essential* is the layering; what *essential* costs over *bare* is
the Python (and the libraries' entries: numpy, protobuf, prometheus_client) that serving a
step needs, each op paid cold after the forward has been through the caches.

    python bench/step_essentials.py [--model gqa] [--context 256] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from overhead import BareStep  # noqa: E402

from mha_client.api import attention_pb2 as pb  # noqa: E402
from mha_serve import metrics  # noqa: E402
from mha_serve.batching.batcher import BatchInfo  # noqa: E402
from mha_serve.config import ServerConfig  # noqa: E402
from mha_serve.engine.bounds import KeyBound, cleared, key_absmax  # noqa: E402
from mha_serve.engine.checks import array_absmax  # noqa: E402
from mha_serve.engine.requests import AttendOutcome  # noqa: E402
from mha_serve.engine.threads import ComputeThreads  # noqa: E402
from mha_serve.engine.types import array_of, tensor_of  # noqa: E402
from mha_serve.serving.async_engine import AsyncEngine  # noqa: E402
from mha_serve.serving.protocol import Timing  # noqa: E402
from mha_serve.transport.answer import settle  # noqa: E402
from mha_serve.transport.convert import (  # noqa: E402
    encode_result,
    parse_attend_request,
    stamp,
    to_call,
)
from mha_serve.transport.door import AttentionDoor  # noqa: E402
from mha_serve.transport.server import load_engine  # noqa: E402

STEPS = 64  # steps a round, ending at the context (the session truncated back between rounds)
OPS = [
    "parse, request", "claim", "input view", "input scan", "reserve", "bounds",
    "views, decode_one", "output view", "commit", "release", "outcome", "batch metrics",
    "call metrics", "in flight, counter", "reply message", "model, timing", "serialize",
]  # fmt: skip


# What the door reads of a call (transport/door.py ReadOnlyContext): no deadline, a peer.
CONTEXT = SimpleNamespace(
    time_remaining=lambda: None,
    peer=lambda: "ipv4:127.0.0.1:1",
    auth_context=dict,
    invocation_metadata=tuple,
    done=lambda: False,
)


async def measure(model: str, context: int, rounds: int) -> dict:
    torch.set_num_threads(1)  # (the event loop's thread, where such a step runs)
    compute = ComputeThreads(1, 1)
    loop = asyncio.get_running_loop()
    # On the CPU, as the bare step (a GPU's step is its host work: bench/step_layers.py there)
    cfg = ServerConfig(device="cpu")
    engine = await loop.run_in_executor(compute.main, load_engine, cfg)
    serving = AsyncEngine(engine, compute)
    door = AttentionDoor(max_request_bytes=1 << 26)
    door.attach(serving)
    hosted = engine.get(model)
    E = hosted.spec.attention.embed_dim
    sid = (await serving.create_session(model, None, None, "peer")).session_id
    rng = np.random.default_rng(0)
    first = context - STEPS  # the session's tokens before a round
    if first < 1:
        raise SystemExit(f"--context must exceed {STEPS}, the steps of a round")
    prompt = rng.standard_normal((first, E), dtype=np.float32) * 0.5

    def message(x: np.ndarray) -> pb.AttendRequest:
        tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
        return pb.AttendRequest(session_id=sid, input=tensor)

    await door.attend(message(prompt), CONTEXT)
    xs = [rng.standard_normal((1, E), dtype=np.float32) * 0.5 for _ in range(STEPS)]
    datas = [message(x).SerializeToString() for x in xs]
    count = metrics.request_counts("StreamSession", model, metrics.PROTOCOL_MHA_V1)
    observe = metrics.attend_observer(model)
    observe_batch = metrics.batch_observer(model, "fast")
    bare = BareStep(model, context)
    bare_x = [torch.from_numpy(x).view(1, 1, E) for x in xs]
    table, cache, module = engine.sessions.table, engine.sessions.cache(model), hosted.module
    ops: dict[str, list[float]] = {op: [] for op in OPS}

    def essential(data: bytes) -> bytes:
        pc = time.perf_counter
        t = [pc()]
        call, single = to_call(parse_attend_request(data).message)
        t.append(pc())
        engine.claim(sid, "peer")
        t.append(pc())
        x = tensor_of(call.inputs)
        t.append(pc())
        absmax = array_absmax(call.inputs, x)
        t.append(pc())
        r = table.reserve(sid, 1, claimed=True)
        t.append(pc())
        cached = key_absmax(r.engine_state)
        bound = cleared(hosted, cache.dtype, absmax, cached, 1.0)
        t.append(pc())
        with torch.inference_mode():
            views = cache.step_views(r.block_table, r.slots[0], r.start + 1)
            y = module.decode_one(x, *views)
        t.append(pc())
        out = array_of(y)
        t.append(pc())
        stats = table.commit(r, engine_state=KeyBound(max(cached, bound)))
        t.append(pc())
        engine.release(sid)
        t.append(pc())
        outcome = AttendOutcome(out, None, compute_ms=0.1, batch_size=1, session=stats)
        t.append(pc())
        observe_batch(BatchInfo(0.0, 1e-4, 1, 1))
        t.append(pc())
        observe(1, 1e-4, pc() - t[0], 0)
        t.append(pc())
        metrics.in_flight(1)
        metrics.in_flight(-1)
        count("OK")
        t.append(pc())
        reply = encode_result(outcome, single)
        t.append(pc())
        stamp(reply, model, Timing(0.1, 0.1, 0.2, 1, 0.0))
        t.append(pc())
        data = reply.SerializeToString()
        t.append(pc())
        for op, a, b in zip(OPS, t[:-1], t[1:], strict=True):
            ops[op].append(b - a)
        return data

    async def path(data: bytes) -> bytes:
        answer = await settle(
            "StreamSession",
            model,
            door.attend,
            parse_attend_request(data),
            CONTEXT,
            "peer",
            None,
            protocol=metrics.PROTOCOL_MHA_V1,
            in_flight=True,
            count=count,
        )
        if not hasattr(answer, "SerializeToString"):  # (Refused: the step's error)
            raise RuntimeError(f"a step was refused: {answer}")
        return answer.SerializeToString()

    sides: dict[str, list[float]] = {"path": [], "essential": [], "bare": []}
    for _ in range(rounds):
        for side, times in sides.items():
            await serving.truncate_session(sid, first)
            for i, data in enumerate(datas):
                start = time.perf_counter()
                if side == "path":
                    await path(data)
                elif side == "essential":
                    essential(data)
                else:
                    bare(bare_x[i], first + i)
                times.append(time.perf_counter() - start)
    await serving.close()
    compute.shutdown()
    return {
        "model": model,
        "context": context,
        "rounds": rounds,
        "steps_us": {k: statistics.median(v) * 1e6 for k, v in sides.items()},
        "ops_us": {k: statistics.median(v) * 1e6 for k, v in ops.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gqa", choices=["mha", "gqa", "mqa"])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    result = asyncio.run(measure(args.model, args.context, args.rounds))
    s = result["steps_us"]
    print(
        f"{args.model} decode steps at context {args.context}, {args.rounds} rounds of "
        f"{STEPS} (medians): bare {s['bare']:.0f} us; essential {s['essential']:.0f} "
        f"(+{s['essential'] - s['bare']:.0f} over bare); path {s['path']:.0f} "
        f"(+{s['path'] - s['bare']:.0f} over bare, +{s['path'] - s['essential']:.0f} over "
        "essential)"
    )
    for op, us in result["ops_us"].items():
        print(f"  {op:<20} {us:7.1f} us")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
