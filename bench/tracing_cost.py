"""What tracing (--tracing-endpoint) costs a decode step: the same streamed single-token steps
through mha-serve with tracing off, and on with every step recorded (each message carries a
sampled traceparent), in alternating rounds of one run, and the ratio. The spans go to an
OTLP/HTTP receiver in a process of its own (a collector's stand-in: it decodes nothing).

    python bench/tracing_cost.py [--rounds 4] [--steps 200] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served_bench import OPTIONS, BytesStream, free_port, machine, start_served  # noqa: E402

from mha_client.api import attention_pb2 as pb  # noqa: E402
from mha_client.tensors import to_proto  # noqa: E402

RECEIVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


async def wait_ready(target: str) -> None:
    deadline = time.monotonic() + 120
    async with grpc.aio.insecure_channel(target) as channel:
        while time.monotonic() < deadline:
            try:
                await channel.unary_unary("/mha.v1.AttentionService/ListModels")(b"", timeout=2)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)
    raise TimeoutError(f"{target} never served")


async def steps(target: str, count: int, traced: bool) -> list[float]:
    """count single-token steps of a new session, each awaiting its reply: seconds each."""
    async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
        create = channel.unary_unary(
            "/mha.v1.AttentionService/CreateSession",
            request_serializer=pb.CreateSessionRequest.SerializeToString,
            response_deserializer=pb.SessionInfo.FromString,
        )
        session = await create(pb.CreateSessionRequest(model="gqa"))
        header = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        stream = BytesStream(channel, metadata=(("traceparent", header),) if traced else None)
        x = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
        payload = pb.AttendRequest(session_id=session.session_id, input=to_proto(x))
        data, times = payload.SerializeToString(), []
        for _ in range(count):
            t = time.perf_counter()
            await stream.round_trip(data)
            times.append(time.perf_counter() - t)
        await stream.close()
        close = channel.unary_unary("/mha.v1.AttentionService/CloseSession")
        await close(pb.CloseSessionRequest(session_id=session.session_id).SerializeToString())
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tracing-bench-"))
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    off, off_target = start_served(tmp, "off")
    on, on_target = start_served(tmp, "on", extra=["--tracing-endpoint", endpoint])
    try:
        asyncio.run(wait_ready(off_target))
        asyncio.run(wait_ready(on_target))
        medians: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for name, target in (("off", off_target), ("on", on_target)):
                times = asyncio.run(steps(target, args.steps, traced=name == "on"))
                medians[name].append(statistics.median(times[10:]) * 1e3)
    finally:
        for proc in (off, on, receiver):
            proc.terminate()
            proc.wait(30)
    off_ms, on_ms = statistics.median(medians["off"]), statistics.median(medians["on"])
    result = {
        "machine": machine(),
        "rounds": args.rounds,
        "steps": args.steps,
        "step_ms_off": off_ms,
        "step_ms_on": on_ms,
        "per_round_ms": medians,
        "added_us": (on_ms - off_ms) * 1e3,
        "ratio": on_ms / off_ms,
    }
    print(
        f"decode step (gqa, streamed): tracing off {off_ms:.3f} ms, on {on_ms:.3f} ms "
        f"(every step recorded): +{result['added_us']:.0f} us, ratio {result['ratio']:.2f}"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
