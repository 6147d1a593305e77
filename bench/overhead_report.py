"""docs/benchmarks-overhead.md from bench/overhead.py's results (figures only from the run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NOTES = Path(__file__).resolve().parent / "overhead_notes.md"


def _mark(ok: bool) -> str:
    return "meets" if ok else "misses"


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    """row[key] formatted, or a dash where the run did not measure it (a run before the
    floor server)."""
    return "-" if row.get(key) is None else format(row[key], spec)


def _small_floor(row: dict[str, Any]) -> str:
    if row.get("floor_seq_per_s") is None:
        return "-"
    return (
        f"{row['floor_seq_per_s']:.0f} ({row['floor_inline_seq_per_s']:.0f}, "
        f"{row['floor_batched_seq_per_s']:.0f})"
    )


def _floor_paragraph(results: dict[str, Any]) -> list[str]:
    measured = any("floor_ms" in r for r in results["decode"]) or any(
        "floor_seq_per_s" in r for r in results["small"]
    )
    return [
        "Floor (`bench/floor_server.py`, in the same rounds): a minimal `grpc.aio` server in "
        "a process of its own with nothing of mha-serve in its path but the generated "
        "messages. Per step it parses the request (`AttendRequest.FromString`), takes the "
        "input's bytes as a numpy view into torch, runs the in-process step above on them "
        "(the same weights, a preallocated K/V of the context's length, one torch thread, "
        "inline on the event loop) and replies an `AttendResponse` (output, model, session, "
        "timing) by `SerializeToString`; per Attend it runs the module's forward, inline (one "
        "torch thread) or batched (one worker thread runs one forward for all queued, on "
        "every core; the better is kept). It is the least any one-process Python `grpc.aio` "
        "server can do for the same work: the limit adds two parts each measured warm and "
        "alone, the floor pays both per message in one process (cold caches, one event loop "
        "and the GIL between the wire and the compute). So floor/limit (floor/ceiling) is "
        "what the target's definition loses to the machine, and served/floor is what is "
        "mha-serve's own." + ("" if measured else " This run did not measure it (dashes)."),
        "",
    ]


def _decomposition(rows: list[dict[str, Any]]) -> list[str]:
    """Where a served step's time goes beyond the limit, from the same run's sides (a run
    with the spin side only)."""
    if not any("spin_ms" in r for r in rows):
        return []
    out = [
        "Where the served step's time goes beyond the limit, from the same rounds. Spin: the "
        "floor server's stream with the step replaced by a busy wait as long as the step "
        "takes in a tight loop (measured before the rounds) and a zero output: the same "
        "messages, parse and reply, the same time between them, without the step's memory "
        "traffic. So *waiting* (spin - echo - the wait) is what the time between the wire's "
        "messages costs the two processes (wake-ups, the client idle meanwhile); *the step "
        "in a server* (floor - spin) is what the step costs inside a server beyond its "
        "tight-loop time (its weights and K/V stream through the caches the wire's code "
        "uses, and the other way round) plus the message work; *mha-serve's own* is served - "
        "floor. Microseconds per step:",
        "",
        "| model | context | limit | waiting | the step in a server | mha-serve's own | served |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "spin_ms" not in r:
            continue
        waiting = (r["spin_ms"] - r["echo_ms"]) * 1e3 - r["spin_us"]
        step = (r["floor_ms"] - r["spin_ms"]) * 1e3 + r["spin_us"] - r["inprocess_ms"] * 1e3
        own = (r["served_ms"] - r["floor_ms"]) * 1e3
        out.append(
            f"| {r['model']} | {r['context']} | {r['limit_ms'] * 1e3:.0f} | {waiting:+.0f} "
            f"| {step:+.0f} | {own:+.0f} | {r['served_ms'] * 1e3:.0f} |"
        )
    out += [
        "",
        "(limit + waiting + the step in a server + mha-serve's own = served. The step's "
        "term compares the floor's step with the in-process median of the same rounds; the "
        "spin waited the median of a tight loop just before them.)",
        "",
    ]
    return out


def _load_note(start: float, cores: int) -> str:
    """What the load averages say of the run (the one-minute figures)."""
    busy = "other work on the machine, then or in the minute before" if start >= 0.5 else "little"
    return (
        f" (at the start {busy}; the end's counts the benchmark's own processes): on "
        f"{cores} shared cores every figure is noisy"
    )


def render(results: dict[str, Any], targets: dict[str, Any], notes: bool = True) -> str:
    m = results["machine"]
    s = results["settings"]
    out = [
        "# Serving overhead against the machine's limits (issues 16 and 25)",
        "",
        f"Generated by `{results['command']}` on {results['date']}: {m['cpu']}, {m['cores']} "
        f"cores, Python {m['python']}, no GPU. Load average at start "
        f"{m['loadavg_at_start'][0]:.1f}, at end {m['loadavg_at_end'][0]:.1f}"
        f"{_load_note(m['loadavg_at_start'][0], m['cores'])} (compare within one run only; "
        "the ratios are the point: each limit is measured in the same run, alternating with "
        "what it bounds). "
        f"{s['rounds']} alternating rounds, {s['steps']} steps per round and side, "
        f"{s['duration_s']:g} s per load point; {results['elapsed_s']:.0f} s in all.",
        "",
        *(
            [
                "*Before* columns: the same server running the code before "
                f"(`--baseline-tree {results['baseline_tree']}`), measured in the same rounds, "
                "alternating with the rest.",
                "",
            ]
            if results.get("baseline_tree")
            else []
        ),
        *(
            [f"Served servers started with `{' '.join(results['server_args'])}`.", ""]
            if results.get("server_args")
            else []
        ),
        *(
            [
                f"`--pin {results['pin']}`: every server's event loop (and gRPC's threads) "
                f"on CPU {results['pin']} (mha-serve's `--event-loop-cpu {results['pin']}`, "
                "its compute threads on every CPU; the echo and the floor alike), the "
                "decode steps' client and in-process step on the other CPUs; the small "
                "requests' clients and in-process forward unpinned.",
                "",
            ]
            if results.get("pin") is not None
            else []
        ),
        *(
            [
                f"Floor busy: the floor server (below) once more, its event loop polling "
                f"{results['floor_busy_poll_us']} us for its next event before it blocks "
                "(`bench/floor_server.py --busy-poll-us`, mha-serve's selector), decode steps "
                "only: what a `--busy-poll-us` variant's step is over (variant/floor busy).",
                "",
            ]
            if results.get("floor_busy_poll_us")
            else []
        ),
        *(
            [
                "Variant columns: this checkout's server with "
                + "; ".join(f"`{' '.join(f)}` ({n})" for n, f in results["variants"].items())
                + ", in the same rounds.",
                "",
            ]
            if results.get("variants")
            else []
        ),
        "## Decode step",
        "",
        "Served: a StreamSession step through a real mha-serve on loopback (request and reply "
        "as bytes, the reply's timing read for the server column). Limit: the same step in "
        "plain torch in the benchmark's process (one torch thread; fused qkv, a preallocated "
        "contiguous K/V, `scaled_dot_product_attention` with each KV head's query heads as its "
        "rows, wo) plus one round trip of a bare "
        "`grpc.aio` bidi echo of the same request bytes. SDK: the step through the generated "
        "stubs (`AsyncSession.stream().step`, messages both ways). Medians over all steps, "
        f"ms; target ratio <= {targets['decode_step_ratio_max']}.",
        "",
        *_floor_paragraph(results),
        "| model | context | served | in-process | echo | limit | **ratio** | floor "
        "| floor/limit | served/floor | SDK | SDK ratio | server receipt-to-reply |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    others = (["baseline"] if results.get("baseline_tree") else []) + list(
        results.get("variants") or {}
    )
    label = {"baseline": "before"}
    for other in others:
        out[-2] += f" {label.get(other, other)}: served | {label.get(other, other)}: ratio |"
        out[-1] += " ---: | ---: |"
    busy = results.get("floor_busy_poll_us") and any(
        "floor_busy_ms" in r for r in results["decode"]
    )
    if busy:  # the floor polling, and each variant over it (a polling variant's own part)
        out[-2] += " floor busy | floor busy/limit |" + "".join(
            f" {label.get(o, o)}/floor busy |" for o in others
        )
        out[-1] += " ---: | ---: |" + " ---: |" * len(others)
    worst = 0.0
    for r in results["decode"]:
        worst = max(worst, r["ratio"])
        out.append(
            f"| {r['model']} | {r['context']} | {r['served_ms']:.3f} | {r['inprocess_ms']:.3f} "
            f"| {r['echo_ms']:.3f} | {r['limit_ms']:.3f} | **{r['ratio']:.2f}** "
            f"| {_fmt(r, 'floor_ms', '.3f')} | {_fmt(r, 'floor_ratio', '.2f')} "
            f"| {_fmt(r, 'served_over_floor', '.2f')} | {r['sdk_ms']:.3f} | {r['sdk_ratio']:.2f} | {r['server_total_ms']:.3f} |"
        )
        for other in others:
            out[-1] += f" {r[other + '_ms']:.3f} | {r[other + '_ratio']:.2f} |"
        if busy:
            out[-1] += (
                f" {_fmt(r, 'floor_busy_ms', '.3f')} | {_fmt(r, 'floor_busy_ratio', '.2f')} |"
            )
            out[-1] += "".join(
                f" {r[o + '_ms'] / r['floor_busy_ms']:.2f} |" if "floor_busy_ms" in r else " - |"
                for o in others
            )
    out += [
        "",
        f"Worst ratio {worst:.2f}: {_mark(worst <= targets['decode_step_ratio_max'])} the "
        "target on this machine.",
        "",
        *_decomposition(results["decode"]),
        "## Small stateless requests",
        "",
        "32 clients in a closed loop (mha_client.loadgen, requests serialized before the "
        "clock starts, in the benchmark's process on the same cores) against mha-serve and "
        "against the bare echo server (Attend answering its request bytes). Ceiling = 1 / "
        "(1 / in-process best-batch seq/s + 1 / echo req/s): the forward and the wire's CPU, "
        "added. Floor: the floor server's Attend (above), inline and batched; floor/ceiling "
        "and served/floor with the better.",
        "",
        "| tokens | served seq/s | in-process seq/s (best batch, threads) | echo req/s "
        "| ceiling | **ratio** | target | floor seq/s (inline, batched) | floor/ceiling "
        "| served/floor |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for other in others:
        out[-2] += f" {label.get(other, other)}: seq/s | {label.get(other, other)}: ratio |"
        out[-1] += " ---: | ---: |"
    for r in results["small"]:
        target = targets["small_16_min"] if r["seq_len"] == 16 else targets["small_128_min"]
        out.append(
            f"| {r['seq_len']} | {r['served_seq_per_s']:.0f} | {r['inprocess_seq_per_s']:.0f} "
            f"({r['inprocess_best_batch']}, {r['inprocess_torch_threads']}) | "
            f"{r['echo_req_per_s']:.0f} | {r['ceiling_seq_per_s']:.0f} | **{r['ratio']:.2f}** "
            f"| >= {target} ({_mark(r['ratio'] >= target)}) "
            f"| {_small_floor(r)} | {_fmt(r, 'floor_ratio', '.2f')} "
            f"| {_fmt(r, 'served_over_floor', '.2f')} |"
        )
        for other in others:
            out[-1] += f" {r[other + '_seq_per_s']:.0f} | {r[other + '_ratio']:.2f} |"
    w = results["wire"]
    out += [
        "",
        "## Wire: payload copies of a 16 MiB tensor",
        "",
        f"Counted, not timed (`python bench/copies.py`): {w['method']}. A copy is one "
        "payload-sized buffer written; for float16 and bfloat16 the payload is the wire's "
        "(8 MiB), and a dtype conversion writes buffers too (bfloat16 on the client: numpy "
        "has no bfloat16, it is converted from and to float32). gRPC's own copy (into its "
        "slices to send, out of them into the bytes Python gets) is not in these rows: add 1 "
        f"each way. Target: <= {targets['copies']} each way, gRPC's included.",
        "",
        "| dtype | side | direction | copies | path |",
        "| --- | --- | --- | ---: | --- |",
    ]
    for r in w["paths"]:
        out.append(
            f"| {r['dtype']} | {r['side']} | {r['direction']} | {r['copies']:.2f} | {r['path']} |"
        )
    g = w["grpc_loopback"]
    out += [
        "",
        f"gRPC alone, one 16 MiB message over loopback with both ends in one process: "
        f"{g['request']:.2f} (request) and {g['reply']:.2f} (reply) buffers written: its send "
        "copy, the kernel's receive into its slices and their copy into the bytes handed to "
        "Python, about 3, plus slack in its buffers.",
        "",
    ]
    if notes and NOTES.exists():
        out += [NOTES.read_text().rstrip(), ""]
    return "\n".join(out)


def write_report(results: dict[str, Any], docs: Path, targets: dict[str, Any]) -> None:
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "benchmarks-overhead.md").write_text(render(results, targets))
