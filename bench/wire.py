"""Wire cost: MB/s of the tensor codec (client numpy, server torch) and of whole-message
protobuf encode/decode, for 1 MB and 16 MB payloads, with each step's cost in memcpys.

"copies" is the step's time divided by one memcpy of the payload on this machine: ~1 means
the step copies the payload once, ~0 that it is a view.

    python bench/wire.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mha_client.api import attention_pb2 as pb
from mha_client.tensors import from_proto as np_from_proto
from mha_client.tensors import to_proto as np_to_proto
from mha_serve.transport.tensors import from_proto as torch_from_proto
from mha_serve.transport.tensors import to_proto as torch_to_proto

MiB = 2**20
EMBED_DIM = 512
# (label, shape): float32 (B, L, 512) payloads of exactly 1 MiB and 16 MiB.
PAYLOADS = (("1 MB", (1, 512, EMBED_DIM)), ("16 MB", (16, 512, EMBED_DIM)))
MIN_TIME_S = 0.5
# A repeated-float field (what the wire contract forbids), timed on 1 MB only: this many
# times slower is what raw bytes avoid.
REPEATED_FLOAT_MAX_BYTES = MiB


def best_time(fn: Callable[[], Any], min_time_s: float) -> float:
    """Best of repeated calls (seconds): the cost without scheduler noise."""
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < min_time_s:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def steps(x: np.ndarray) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) of every step a payload goes through, plus reference points."""
    xt = torch.from_numpy(x.copy())
    tensor = np_to_proto(x)
    request = pb.AttendRequest(model="mha", input=tensor)
    request_bytes = request.SerializeToString()
    parsed = pb.AttendRequest.FromString(request_bytes)
    return [
        ("memcpy (reference: one copy)", lambda: x.copy()),
        ("client encode numpy -> Tensor (mha_client.tensors.to_proto)", lambda: np_to_proto(x)),
        (
            "client decode Tensor -> numpy (mha_client.tensors.from_proto)",
            lambda: np_from_proto(parsed.input),
        ),
        (
            "server decode Tensor -> torch (transport.tensors.from_proto)",
            lambda: torch_from_proto(parsed.input),
        ),
        ("server encode torch -> Tensor (transport.tensors.to_proto)", lambda: torch_to_proto(xt)),
        ("message encode AttendRequest.SerializeToString", request.SerializeToString),
        (
            "message decode AttendRequest.FromString",
            lambda: pb.AttendRequest.FromString(request_bytes),
        ),
        ("field access Tensor.data (protobuf hands out a bytes copy)", lambda: parsed.input.data),
    ]


def measure(min_time_s: float = MIN_TIME_S) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {"payloads": {}}
    for label, shape in PAYLOADS:
        x = rng.standard_normal(shape, dtype=np.float32)
        nbytes = x.nbytes
        rows = []
        memcpy_s = None
        for name, fn in steps(x):
            s = best_time(fn, min_time_s)
            memcpy_s = memcpy_s or s
            rows.append(
                {"step": name, "ms": s * 1e3, "mb_per_s": nbytes / MiB / s, "copies": s / memcpy_s}
            )
        if nbytes <= REPEATED_FLOAT_MAX_BYTES:
            flat = x.ravel()
            s = best_time(lambda f=flat: np.asarray(f.tolist(), dtype=np.float32), min_time_s)
            rows.append(
                {
                    "step": "for comparison: floats via Python list (repeated float)",
                    "ms": s * 1e3,
                    "mb_per_s": nbytes / MiB / s,
                    "copies": s / memcpy_s,
                }
            )
        results["payloads"][label] = {"bytes": nbytes, "shape": list(shape), "steps": rows}
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = []
    for label, r in results["payloads"].items():
        lines.append(f"{label} payload (float32 {tuple(r['shape'])}, {r['bytes']} bytes)")
        for row in r["steps"]:
            lines.append(
                f"  {row['step']:<66} {row['ms']:9.3f} ms {row['mb_per_s']:9.0f} MB/s "
                f"{row['copies']:6.2f} copies"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-time", type=float, default=MIN_TIME_S, help="seconds per step")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    results = measure(args.min_time)
    print(format_table(results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
