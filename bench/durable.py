"""Durable sessions (issue 24): what spilling a session and bringing it back cost, against
rebuilding it by sending its tokens again; and what a restart adds, by number of sessions.
Side by side in one run, in the engine (no gRPC), one torch thread.

    python bench/durable.py                 # ~1 min: stdout and bench/results/durable.json
    python bench/durable.py --quick

1. Per session of `mha` (the built-in 512-wide model, float32) at 256 and 4096 tokens:
   the spill (its K/V written to the spill directory), the restore (read, checked, back in
   the cache), against recomputing the prefix: an Attend over its tokens (causal), and a
   new session prefilled with them (what a client whose session was lost does).
2. Restart: writing k sessions at SIGTERM (spill_idle) and adopting them at start (their
   headers read; the tensors wait for each session's next call), for k = 10, 100, 1000
   sessions of 256 tokens of `gqa`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def engine(spill_dir: str, spill_bytes: int = 1 << 34):
    from mha_serve.config import default_models
    from mha_serve.engine import Engine

    return Engine(
        default_models(),
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=1 << 30,
        spill_dir=spill_dir,
        spill_bytes=spill_bytes,
    )


def per_session(length: int, rounds: int) -> dict:
    from mha_serve.engine import AttendRequest, array_of

    with tempfile.TemporaryDirectory(prefix="mha-durable-") as d:
        e = engine(d)
        x = array_of(torch.randn(1, length, 512, generator=torch.Generator().manual_seed(0)))
        spill, restore, attend, prefill = [], [], [], []
        for _ in range(rounds):
            sid = e.create_session("mha").session_id
            e.attend(AttendRequest("mha", x, session_id=sid))
            t = time.perf_counter()
            assert e.spill_idle() == [sid]
            spill.append(time.perf_counter() - t)
            restore.append(e.restore_session(sid))
            e.close_session(sid)
            t = time.perf_counter()
            e.attend(AttendRequest("mha", x, causal=True))
            attend.append(time.perf_counter() - t)
            sid = e.create_session("mha").session_id
            t = time.perf_counter()
            e.attend(AttendRequest("mha", x, session_id=sid))
            prefill.append(time.perf_counter() - t)
            e.close_session(sid)
        nbytes = 2 * length * 8 * 64 * 4  # K and V, 8 heads of 64, float32
        e.close_spill()
    ms = {
        k: statistics.median(v) * 1e3
        for k, v in (
            ("spill", spill),
            ("restore", restore),
            ("attend", attend),
            ("prefill", prefill),
        )
    }
    row = {
        "model": "mha",
        "tokens": length,
        "kv_bytes": nbytes,
        **{f"{k}_ms": v for k, v in ms.items()},
    }
    row["restore_over_prefill"] = ms["restore"] / ms["prefill"]
    row["restore_over_attend"] = ms["restore"] / ms["attend"]
    print(
        f"mha {length:5d} tokens ({nbytes / 2**20:.1f} MiB of K/V): spill {ms['spill']:.2f} ms, "
        f"restore {ms['restore']:.2f} ms | recompute: Attend {ms['attend']:.2f} ms, prefill "
        f"{ms['prefill']:.2f} ms | restore / prefill {row['restore_over_prefill']:.2f}",
        flush=True,
    )
    return row


def restart(counts: list[int]) -> list[dict]:
    from mha_serve.engine import AttendRequest, array_of

    x = array_of(torch.randn(1, 256, 512, generator=torch.Generator().manual_seed(1)))
    rows = []
    for k in counts:
        with tempfile.TemporaryDirectory(prefix="mha-durable-") as d:
            first = engine(d)
            for _ in range(k):
                sid = first.create_session("gqa").session_id
                first.attend(AttendRequest("gqa", x, session_id=sid))
            t = time.perf_counter()
            written = first.spill_idle()
            write_s = time.perf_counter() - t
            first.close_spill()
            second = engine(d)
            t = time.perf_counter()
            adopted, refused = second.adopt_spilled()
            adopt_s = time.perf_counter() - t
            # (sessions past the cache's 128 MiB were spilled already, to make room)
            assert len(adopted) == k and not refused
            t = time.perf_counter()
            second.restore_session(adopted[0])
            first_restore_s = time.perf_counter() - t
            disk = sum(p.stat().st_size for p in Path(d).glob("*.session"))
            second.close_spill()
        row = {
            "sessions": k,
            "written_at_sigterm": len(written),
            "disk_bytes": disk,
            "write_at_sigterm_s": write_s,
            "adopt_at_start_s": adopt_s,
            "first_restore_ms": first_restore_s * 1e3,
        }
        rows.append(row)
        print(
            f"restart with {k:4d} gqa sessions of 256 tokens ({disk / 2**20:.0f} MiB on disk): "
            f"{len(written)} written at SIGTERM in {write_s:.2f} s (the rest spilled already), "
            f"all adopted at start in {adopt_s * 1e3:.1f} ms, "
            f"the first one's next call restores it in {first_restore_s * 1e3:.2f} ms",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "durable.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 3 if args.quick else 7
    counts = [10, 100] if args.quick else [10, 100, 1000]
    results = {
        "command": " ".join(["python", "bench/durable.py", *(argv or sys.argv[1:])]),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "per_session": [per_session(n, rounds) for n in (256, 4096)],
        "restart": restart(counts),
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
