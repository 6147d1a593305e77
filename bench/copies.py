"""Payload copies of the tensor codec: how many payload-sized buffers each encode and decode
path writes, counted from the process's page faults (not timed).

Method: glibc is told to mmap every allocation of 256 KiB or more (mallopt) and numpy not to
ask for huge pages, so every fresh payload-sized buffer (bytes, numpy, torch, protobuf's arena,
gRPC's slices) costs one minor page fault per 4 KiB page when it is first written. Faults
during a call / pages of the payload = payload-sized buffers written = copies (a conversion,
bfloat16 to float32, counts too: it writes a buffer). A view costs none; reading costs none.
A copy into a buffer kept warm across calls would escape the count; none of these paths keeps
one (gRPC's counted below does not either). The settings stay for the process: run it alone.

    python bench/copies.py [--mib 16] [--round-trips] [--json-out FILE]

--round-trips also times the SDK's Attend round trips (now against its stubs before), side by
side in one run, before the allocator is set up for counting.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import resource
import statistics
import sys
from collections.abc import Callable
from typing import Any

PAGE = resource.getpagesize()
MMAP_THRESHOLD = 256 * 1024


def setup() -> None:
    """Every large allocation a fresh mmap; numpy without huge pages (one fault per 4 KiB)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also stops its dynamic growth)
    libc.mallopt(-1, MMAP_THRESHOLD)  # M_TRIM_THRESHOLD
    import numpy as np

    np._core.multiarray._set_madvise_hugepage(False)


def count(fn: Callable[[], Any], nbytes: int, reps: int = 3) -> float:
    """Payload-sized buffers written by fn() (median of reps calls, result dropped after)."""
    counts = []
    for _ in range(reps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = fn()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        del result
        counts.append((after - before) * PAGE / nbytes)
    return round(statistics.median(counts), 2)


def codec_paths(shape: tuple[int, ...] = (16, 512, 512)) -> list[dict[str, Any]]:
    """Every path, per dtype: (side, direction, path, copies). Excludes gRPC's own copy."""
    import numpy as np
    import torch

    from mha_client import ops
    from mha_client.api import attention_pb2 as pb
    from mha_client.messages import build_attend_request, parse_attend_response
    from mha_client.tensors import to_proto as np_to_proto
    from mha_serve.engine import AttendOutcome
    from mha_serve.engine.types import array_of
    from mha_serve.transport.convert import (
        encode_frames,
        encode_result,
        parse_attend_request,
    )
    from mha_serve.transport.tensors import from_proto, to_proto

    rows = []
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    for dtype in ("float32", "float16", "bfloat16"):
        tdtype = getattr(torch, dtype)
        out = array_of(torch.from_numpy(x).to(tdtype))
        result = AttendOutcome(output=out, weights=None)
        nbytes = out.nbytes
        request_bytes = build_attend_request("mha", x, input_dtype=dtype).SerializeToString()
        response_bytes = encode_result(result, single=False).SerializeToString()
        response = pb.AttendResponse.FromString(response_bytes)
        reader = ops.attend("mha", x[:, :1], {}).read  # how Client.attend reads a 3-D reply
        paths = [
            # server
            (
                "server",
                "decode",
                "protobuf: FromString, from_proto(input) (before issue 16)",
                lambda rb=request_bytes: from_proto(pb.AttendRequest.FromString(rb).input),
            ),
            (
                "server",
                "decode",
                "framed: parse_attend_request, from_proto(input, data) (now)",
                lambda rb=request_bytes: from_proto(
                    (r := parse_attend_request(rb)).message.input, "input", r.input_data
                ),
            ),
            (
                "server",
                "encode",
                "protobuf: AttendResponse(output=to_proto(y)).SerializeToString (before)",
                lambda o=out: pb.AttendResponse(output=to_proto(o)).SerializeToString(),
            ),
            (
                "server",
                "encode",
                "message: encode_result, SerializeToString (now: Ray replica, small replies)",
                lambda r=result: encode_result(r, single=False).SerializeToString(),
            ),
            (
                "server",
                "encode",
                "framed: encode_frames, join (now: gRPC server, replies >= 64 KiB)",
                lambda r=result: encode_frames(r, single=False).join(b""),
            ),
            # client: the SDK's rows run what Client.attend runs (ops.attend), less gRPC's copy
            (
                "client",
                "encode",
                "protobuf: AttendRequest(input=to_proto(x)).SerializeToString (before issue 16)",
                lambda d=dtype: pb.AttendRequest(
                    model="mha", input=np_to_proto(x, d)
                ).SerializeToString(),
            ),
            (
                "client",
                "encode",
                "message: build_attend_request, SerializeToString (the SDK's stubs before; "
                "the SDK now below 64 KiB)",
                lambda d=dtype: build_attend_request("mha", x, input_dtype=d).SerializeToString(),
            ),
            (
                "client",
                "encode",
                "framed: ops.attend(...).request, encode_attend_request (the SDK now)",
                lambda d=dtype: ops.attend("mha", x, {"input_dtype": d}).request,
            ),
            (
                "client",
                "decode",
                "message: FromString, parse_attend_response(message) (the SDK's stubs before; "
                "the SDK now below 64 KiB)",
                lambda rb=response_bytes: parse_attend_response(
                    pb.AttendResponse.FromString(rb), False, 0.0
                ),
            ),
            (
                "client",
                "decode",
                "framed: ops.attend(...).read(bytes), parse_attend_response(bytes) (the SDK now)",
                lambda rb=response_bytes, read=reader: read(rb, 0.0),
            ),
        ]
        if dtype == "float16":  # an array already in the wire dtype: no conversion
            x16 = x.astype(np.float16)
            paths.append(
                (
                    "client",
                    "encode",
                    "framed, float16 array: ops.attend(...).request, no conversion (the SDK now)",
                    lambda x16=x16: ops.attend("mha", x16, {}).request,
                )
            )
        del response
        for side, direction, path, fn in paths:
            rows.append(
                {
                    "dtype": dtype,
                    "side": side,
                    "direction": direction,
                    "path": path,
                    "payload_bytes": nbytes,
                    "copies": count(fn, nbytes),
                }
            )
    return rows


def grpc_copies(nbytes: int, reps: int = 3) -> dict[str, float]:
    """gRPC's own buffers for one message of nbytes each way over loopback (client and server
    in this process, bytes in and out, no protobuf): its send copy into slices, the kernel's
    receive into slices and the slices' copy into the bytes handed to Python."""
    import grpc

    big = bytes(nbytes)
    opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]

    async def run() -> dict[str, float]:
        server = grpc.aio.server(options=opts)

        async def take(request: bytes, context: Any) -> bytes:
            return b"k"

        async def give(request: bytes, context: Any) -> bytes:
            return big

        handlers = {
            "Take": grpc.unary_unary_rpc_method_handler(take),
            "Give": grpc.unary_unary_rpc_method_handler(give),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("c.C", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
            out: dict[str, list[float]] = {"request": [], "reply": []}
            for _ in range(reps + 1):  # the first call sets up the connection: not counted
                for name, method, payload in (("request", "Take", big), ("reply", "Give", b"g")):
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    reply = await channel.unary_unary(f"/c.C/{method}")(payload)
                    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    del reply
                    out[name].append((after - before) * PAGE / nbytes)
        await server.stop(None)
        return {k: round(statistics.median(v[1:]), 2) for k, v in out.items()}

    return asyncio.run(run())


ROUND_TRIP_SHAPES = {"1 token": (1, 512), "16 tokens": (16, 512), "1 MiB": (512, 512)}


def sdk_round_trips(mib: int = 16, reps: int = 20) -> list[dict[str, Any]]:
    """Timed, not counted: Client.attend (the SDK now) against the SDK before on the same
    channel (ops.attend as it was: build_attend_request, the generated stub's protobuf both
    ways, parse_attend_response),
    to a gRPC server in this process answering a prepared reply of x's size: the codec is the
    only difference. Medians of alternating calls, ms. Run before setup() (malloc's defaults)."""
    import time
    from concurrent import futures

    import grpc
    import numpy as np

    from mha_client import ops
    from mha_client.api import attention_pb2 as pb
    from mha_client.messages import build_attend_request, parse_attend_response
    from mha_client.sdk import Client
    from mha_client.tensors import fill_proto

    reply = [b""]
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: reply[0])
    service = grpc.method_handlers_generic_handler("mha.v1.AttentionService", {"Attend": handler})
    opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=opts)
    server.add_generic_rpc_handlers((service,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rng = np.random.default_rng(0)
    rows = []
    shapes = {**ROUND_TRIP_SHAPES, f"{mib} MiB": (mib, 512, 512)}
    with Client(f"127.0.0.1:{port}", timeout=60) as client:
        for label, shape in shapes.items():
            x = rng.standard_normal(shape, dtype=np.float32)
            response = pb.AttendResponse(model="m", timing=pb.Timing(batch_size=1))
            fill_proto(response.output, x)
            reply[0] = response.SerializeToString()
            squeeze = x.ndim == 2
            calls = {  # before: ops.attend as it was, through the same Client._run
                "before": lambda x=x, sq=squeeze: client._run(
                    ops.Rpc(
                        "Attend",
                        build_attend_request("m", x),
                        lambda r, ms: parse_attend_response(r, sq, ms),
                    )
                ),
                "now": lambda x=x: client.attend("m", x),
            }
            n = reps if x.nbytes >= 2**20 else reps * 10
            times: dict[str, list[float]] = {"before": [], "now": []}
            for i in range(n + 1):  # the first round warms both up: not counted
                for name in ("before", "now") if i % 2 else ("now", "before"):
                    start = time.perf_counter()
                    calls[name]()
                    times[name].append((time.perf_counter() - start) * 1e3)
            before, now = (statistics.median(times[k][1:]) for k in ("before", "now"))
            rows.append(
                {
                    "input": label,
                    "bytes": x.nbytes,
                    "calls": n,
                    "before_ms": round(before, 3),
                    "now_ms": round(now, 3),
                    "now_over_before": round(now / before, 2),
                }
            )
    server.stop(None)
    return rows


def measure(mib: int = 16) -> dict[str, Any]:
    setup()
    shape = (mib, 512, 512)  # float32 (B, 512, 512): mib MiB
    nbytes = mib * 2**20
    return {
        "method": "minor page faults x page size / payload bytes, large allocations mmapped",
        "shape": list(shape),
        "paths": codec_paths(shape),
        # gRPC core per message one way (send copy + kernel receive + copy to bytes):
        # beside the codec's, what a message costs in this process and its peer together.
        "grpc_loopback": grpc_copies(nbytes),
    }


def format_table(results: dict[str, Any]) -> str:
    lines = [f"payload copies ({results['method']}), shape {tuple(results['shape'])}"]
    for r in results["paths"]:
        lines.append(
            f"  {r['dtype']:<9} {r['side']:<7} {r['direction']:<7} {r['copies']:5.2f}  {r['path']}"
        )
    g = results["grpc_loopback"]
    lines.append(
        f"  gRPC core, one message over loopback (both ends, no codec): request {g['request']:.2f}"
        f", reply {g['reply']:.2f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=16, help="payload size (float32), MiB")
    p.add_argument(
        "--round-trips",
        action="store_true",
        help="also time Client.attend round trips, the SDK now against its stubs before",
    )
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    trips = sdk_round_trips(args.mib) if args.round_trips else None  # before setup()
    results = measure(args.mib)
    print(format_table(results))
    if trips is not None:
        results["sdk_round_trips"] = trips
        print("SDK round trips to an in-process server answering a reply of x's size (ms, medians)")
        for r in trips:
            print(
                f"  {r['input']:<10} before {r['before_ms']:8.3f}  now {r['now_ms']:8.3f}  "
                f"now/before {r['now_over_before']:.2f}  ({r['calls']} calls each)"
            )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
