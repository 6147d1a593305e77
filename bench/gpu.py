"""GPU benchmarks (issue 25), each figure a ratio measured side by side in one run on this
machine's CUDA device.

    python bench/gpu.py            # ~4 min: docs/benchmarks-gpu.md, bench/results/gpu.json
    python bench/gpu.py --quick    # ~1.5 min smoke run, fewer points
    python bench/gpu.py --from-json bench/results/gpu.json   # redraw the page only
    python bench/gpu.py --from-json R.json --suite-json S.json  # with another suite run's summary

Without a CUDA device it says why and exits 0, writing nothing. `make gpu` runs it after the
test suite on CUDA (bench/gpu_target.sh).

1. Roofline: a device-to-device copy (bytes read + written), beside the datasheet figure.
2. Decode K/V-read bandwidth at context 4096, bfloat16, the built-in models, 1..64 sessions:
   the engine's attention as it runs a batch (engine/attend.py: K/V gathered into padded
   groups, one kernel each), beside the per-session path (`attend_cached`, one kernel per
   session over in-place cache views) eager and replayed from a CUDA graph, and one kernel
   over contiguous K/V, each as a share of the roofline (target >= 50%); and 64 sessions at
   unequal contexts (RAGGED): per session, the engine's groups, all in one padded group.
3. CUDA graphs for the decode step (project, K/V write, attend_cached, wo) against eager at
   the model level: back-to-back steps for 1 and 64 sessions at contexts 256 and 4096, and
   one step taken alone from host memory and back (what a lone served step pays).
4. Stateless throughput by batch and length: a real mha-serve (its CUDA defaults, bfloat16)
   under a closed loop of clients against the module in-process (input copied from host
   memory, output back) and against a gRPC echo of the same bytes.
5. 64 sessions decoding together vs one at a time through the server (bench/sessions.py).
6. One session's streamed decode step through the server against its limit: the in-process
   step (eager; graphed beside it) plus an echo round trip of the same bytes.
7. Attention at a new key length each call (a growing session's step), by kernel: cuDNN plans
   every new shape (why the engine switches it off on CUDA), flash and memory-efficient do
   not; cuDNN over keys padded to a bucket shares its plans.
8. The server's GPU switches against its defaults, alternating: flash decode on
   (--flash-decode true) and decode steps from CUDA graphs (--decode-graphs true), each
   on stateless requests batched into changing sizes, 64 sessions decoding together, and one
   session's step alone, from contexts new every round.

Every part runs with the engine's choice of attention kernels (engine.choose_attention_kernels:
cuDNN off), as the server does; section 7 forces each kernel in turn.

Sections 1-3 and 7 run bench/gpu_kernels.py's pieces, 4-6 and 8 are bench/gpu_served.py's; the
page is
bench/gpu_report.py's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_report import write_report  # noqa: E402
from gpu_served import KV_CONTEXT, MODELS, served  # noqa: E402

TARGETS = {"kv_read_share_min": 0.5}
# Section 7's rows: (kernel, sessions, mask, bucket)
NEW_LENGTHS = [
    ("engine", 1, False, 1),
    ("engine", 64, True, 1),
    ("cudnn", 1, False, 1),
    ("cudnn", 64, True, 1),
    ("cudnn", 1, True, 256),
    ("cudnn", 64, True, 256),
    ("flash", 1, False, 1),
    ("efficient", 1, False, 1),
    ("efficient", 64, True, 1),
]
# Section 2's ragged batch: 8 sessions at the full context among 56 at an eighth of it.
RAGGED = [KV_CONTEXT] * 8 + [KV_CONTEXT // 8] * 56


def cuda_missing() -> str | None:
    """Why this machine cannot run the benchmarks, None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return f"torch {torch.__version__} ({build}) sees no CUDA device"
    return None


def device_info(device) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "l2_bytes": getattr(props, "L2_cache_size", 0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


# ----- 1-3: the model level ---------------------------------------------------------------


def kernels(device, quick: bool, info: dict[str, Any]) -> dict[str, Any]:
    import torch
    from gpu_kernels import (
        attempt,
        copy_bandwidth,
        datasheet_gbs,
        kv_row,
        load_module,
        new_length_row,
        ragged_row,
        step_row,
    )

    copy = copy_bandwidth(device, (256 if quick else 1024) << 20)
    sheet = datasheet_gbs(info["name"])
    print(
        f"roofline: device-to-device copy {copy / 1e9:.0f} GB/s (read + written); datasheet "
        f"{sheet or '?'} GB/s for {info['name']}",
        flush=True,
    )
    pool = 4 * (info["l2_bytes"] or 64 << 20)  # each pass over the sessions: 4x the L2 cache
    out: dict[str, Any] = {
        "copy_gbs": copy / 1e9,
        "datasheet_gbs": sheet,
        "kv": [],
        "ragged": [],
        "graphs": [],
        "new_lengths": [],
    }
    steps = 20 if quick else 50
    with torch.inference_mode():
        for name in MODELS:
            module = load_module(name, device, torch.bfloat16)
            measures = [
                partial(kv_row, module, batch, KV_CONTEXT, pool=pool, roofline=copy)
                for batch in ((1, 64) if quick else (1, 16, 64))
            ] + [partial(ragged_row, module, RAGGED, pool=pool, roofline=copy)]
            measures += [
                partial(step_row, module, batch, context, pool=pool, steps=steps)
                for context in (256, KV_CONTEXT)
                for batch in (1, 64)
            ]
            tables = {kv_row: "kv", ragged_row: "ragged", step_row: "graphs"}
            for measure in measures:
                row = guarded(name, measure)
                table = tables[measure.func]
                out[table].append(row)
                print(describe(table, row), flush=True)
            del module, measures
            torch.cuda.empty_cache()
        for kernel, batch, mask, bucket in NEW_LENGTHS:
            holder: dict[str, Any] = {}
            measure = partial(new_length_row, device, kernel, batch, mask=mask, bucket=bucket)
            row = attempt(holder, "row", measure) or {
                "kernel": kernel,
                "batch": batch,
                "mask": mask,
                "bucket": bucket,
                "errors": holder["errors"],
            }
            out["new_lengths"].append(row)
            print(describe("new_lengths", row), flush=True)
    return out


def describe(table: str, row: dict[str, Any]) -> str:
    """A row of section 2, 3 or 7 as one line of output."""
    if table == "new_lengths":
        line = (
            f"new key length each call, {row['kernel']:9s} x{row['batch']:2d} mask "
            f"{'yes' if row['mask'] else 'no ':3s} bucket {row['bucket']:3d}: median "
            f"{us(row.get('median_s'))}, worst {us(row.get('worst_s'))}, first "
            f"{us(row.get('first_s'))}"
        )
        return line + "".join(f" [{k}: {e}]" for k, e in row.get("errors", {}).items())
    head = f"{row['model']} x{row['batch']:2d} at {row['context']:4d}"
    size = (row.get("kv_bytes") or 0) / 2**20
    if table == "kv":
        line = (
            f"kv read {head}: {size:6.1f} MiB | engine (batched) {cell(row, 'engine')} | per "
            f"session {cell(row, 'eager')} | graph {cell(row, 'graph')} | one kernel "
            f"{cell(row, 'batched')}"
        )
    elif table == "ragged":
        line = (
            f"kv read {head}, ragged: {size:6.1f} MiB | per session {cell(row, 'eager')} | "
            f"engine's groups {cell(row, 'engine')} | one group {cell(row, 'one_group')}"
        )
    else:
        line = (
            f"decode step {head}: eager {us(row.get('eager_s'))}, graph "
            f"{us(row.get('graph_s'))}: {ratio(row.get('speedup'))}"
        )
        if row["batch"] == 1:
            line += (
                f" | alone, host to host: eager {us(row.get('lone_eager_s'))}, graph "
                f"{us(row.get('lone_graph_s'))}"
            )
    return line + "".join(f" [{k}: {e}]" for k, e in row.get("errors", {}).items())


def guarded(model: str, measure: partial) -> dict[str, Any]:
    """measure()'s table row, or the row with only its error when measuring it failed."""
    from gpu_kernels import attempt

    holder: dict[str, Any] = {}
    row = attempt(holder, "row", measure) or {"errors": holder["errors"]}
    if measure.func.__name__ == "ragged_row":
        batch, context = len(measure.args[1]), max(measure.args[1])
    else:
        batch, context = measure.args[1:3]
    return {**row, "model": model, "batch": batch, "context": context}


def us(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{seconds * 1e6:.1f} us"


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def cell(row: dict[str, Any], k: str) -> str:
    share = row.get(f"{k}_share")
    return us(row.get(f"{k}_s")) + ("" if share is None else f" {share:.1%} of roofline")


def row_errors(results: dict[str, Any]) -> dict[str, str]:
    """Every measurement that failed in a row of a table, named by its row."""
    return {
        f"{table} {row['model']} x{row['batch']} at {row['context']}: {key}": error
        for table in ("kv", "ragged", "graphs")
        for row in results.get(table) or []
        for key, error in row.get("errors", {}).items()
    }


def join_lone(results: dict[str, Any]) -> None:
    """Section 6's rows get their in-process limit from section 3 (the same context)."""
    graphs = results.get("graphs") or []
    alone = {(r["model"], r["context"]): r for r in graphs if r["batch"] == 1}
    for row in results.get("lone") or []:
        k = alone.get((row["model"], row["context"]), {})
        eager, graph = k.get("lone_eager_s"), k.get("lone_graph_s")
        if eager is None:
            continue
        row["inprocess_s"], row["inprocess_graph_s"] = eager, graph
        row["limit_s"] = eager + row["echo_s"]
        row["ratio"] = row["served_s"] / row["limit_s"]
        line = (
            f"lone step {row['model']} at {row['context']}: served {row['served_s'] * 1e6:.0f} us "
            f"| in-process {eager * 1e6:.0f} + echo {row['echo_s'] * 1e6:.0f} = "
            f"{row['limit_s'] * 1e6:.0f} us | ratio {row['ratio']:.2f}"
        )
        if graph is not None:
            row["graph_saving_share"] = (eager - graph) / row["served_s"]
            line += f" | a graph would save {row['graph_saving_share']:.1%} of the served step"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer points and shorter loads")
    p.add_argument("--rounds", type=int, help="alternating rounds of the served parts (2)")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--suite-json", type=Path, help="bench/gpu_suite.py's summary, for the page")
    p.add_argument("--docs", type=Path, default=ROOT / "docs")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "gpu.json")
    p.add_argument("--from-json", type=Path, help="redraw the page from a run, no measuring")
    args = p.parse_args(argv)
    if args.from_json:  # with --suite-json: that suite run's summary replaces the run's own
        results = json.loads(args.from_json.read_text())
        if args.suite_json:
            results["suite"] = json.loads(args.suite_json.read_text())
            args.json_out.write_text(json.dumps(results, indent=2) + "\n")
        write_report(results, args.docs, TARGETS)
        return 0
    why = cuda_missing()
    if why:
        print(
            f"bench/gpu.py: skipped: {why}; nothing measured or written (make gpu runs it on "
            "a machine with a GPU)"
        )
        return 0
    import torch
    from gpu_kernels import attempt

    from mha_serve.engine import choose_attention_kernels

    device = torch.device(args.device)
    if device.index is None:  # set_device and the generators want the index
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    choose_attention_kernels(device, cudnn=False)  # as the server does (--cudnn-attention off)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": " ".join(
            ["python", "bench/gpu.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_info(device),
        "quick": args.quick,
    }
    # Each part records what failed and the run goes on: one GPU run yields every figure it can.
    parts = attempt(results, "kernels", lambda: kernels(device, args.quick, results["device"]))
    with tempfile.TemporaryDirectory(prefix="mha-gpu-") as d:
        rounds = args.rounds or (1 if args.quick else 2)
        served_parts = attempt(
            results, "served", lambda: served(Path(d), device, args.quick, rounds)
        )
    errors = results.pop("errors", {})
    for part in (parts, served_parts):
        part = dict(part or {})
        errors |= part.pop("errors", {})
        results |= part
    del results["kernels"], results["served"]
    results["errors"] = errors | row_errors(results)
    join_lone(results)
    if args.suite_json and args.suite_json.exists():
        results["suite"] = json.loads(args.suite_json.read_text())
    results["elapsed_s"] = time.perf_counter() - started
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    page = write_report(results, args.docs, TARGETS)
    print(f"wrote {args.json_out} and {page}")
    for key, error in results["errors"].items():
        print(f"FAILED: {key}: {error}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
