"""What bench/run_all.py writes: the targets, docs/benchmarks.md, the two plots, a profile summary."""

from __future__ import annotations

import collections
import os
import platform
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

SYSTEM_LABELS = {
    "naive": "naive gRPC server",
    "echo": "gRPC echo, no compute",
    "ray": "Ray Serve @serve.batch",
    "mha-serve": "mha-serve",
}
SERVED = ("naive", "ray", "mha-serve")  # the systems of the sweep and the plots
# Cores taken by other processes or the hypervisor beyond which a point is marked disturbed.
DISTURBED_CORES = 0.25
COLORS = {
    "naive": "tab:gray",
    "ray": "tab:blue",
    "mha-serve": "tab:orange",
    "inprocess": "black",
    "echo": "tab:green",
}


@dataclass(frozen=True)
class Target:
    name: str
    numerator: tuple[str, int]  # (system, seq_len) whose throughput is compared ...
    denominator: tuple[str, int] | None  # ... with this one; None: mha-serve's p99/p50
    threshold: float
    at_least: bool  # ratio >= threshold (throughput) or <= threshold (tail latency)


# The issue's targets (issue 4), all at 32 concurrent clients on this machine.
TARGETS = (
    Target("16 tokens: mha-serve / naive throughput", ("mha-serve", 16), ("naive", 16), 3.0, True),
    Target(
        "16 tokens: mha-serve / Ray Serve throughput", ("mha-serve", 16), ("ray", 16), 1.5, True
    ),
    Target(
        "128 tokens: mha-serve / in-process limit",
        ("mha-serve", 128),
        ("inprocess", 128),
        0.8,
        True,
    ),
    Target("16 tokens: mha-serve p99 / p50", ("mha-serve", 16), None, 3.0, False),
    Target("128 tokens: mha-serve p99 / p50", ("mha-serve", 128), None, 3.0, False),
)


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"^model name\s*:\s*(.+)$", text, re.M).group(1).strip()
    except (OSError, AttributeError):
        pass
    versions = {}
    for pkg in ("torch", "grpcio", "protobuf", "ray", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def point(results: dict[str, Any], system: str, seq_len: int, concurrency: int) -> dict | None:
    for p in results["load"]:
        if (p["system"], p["seq_len"], p["concurrency"]) == (system, seq_len, concurrency):
            return p
    return None


def inprocess_best(results: dict[str, Any], seq_len: int) -> dict[str, Any]:
    return results["inprocess"]["seq_lens"][str(seq_len)]["best"]


def throughput(results: dict[str, Any], system: str, seq_len: int, concurrency: int) -> float:
    if system == "inprocess":
        return inprocess_best(results, seq_len)["sequences_per_s"]
    p = point(results, system, seq_len, concurrency)
    return p["sequences_per_s"] if p else float("nan")


def targets(results: dict[str, Any], concurrency: int) -> list[dict[str, Any]]:
    rows = []
    for t in TARGETS:
        if t.denominator is None:
            p = point(results, *t.numerator, concurrency)
            value = p["latency"]["p99_ms"] / p["latency"]["p50_ms"] if p else float("nan")
        else:
            num = throughput(results, *t.numerator, concurrency)
            value = num / throughput(results, *t.denominator, concurrency)
        met = value >= t.threshold if t.at_least else value <= t.threshold
        rows.append(
            {
                "target": t.name,
                "value": value,
                "threshold": t.threshold,
                "at_least": t.at_least,
                "met": bool(met),
            }
        )
    return rows


def _f(x: float, digits: int = 1) -> str:
    return "—" if x != x else f"{x:,.{digits}f}"


def headline_rows(results: dict[str, Any], concurrency: int) -> list[list[str]]:
    rows = []
    for seq_len in sorted({p["seq_len"] for p in results["load"]}):
        best = inprocess_best(results, seq_len)
        cpu = results["inprocess"].get("cpu_cores", {"other": 0.0, "steal": 0.0})
        mark = " †" if cpu["other"] + cpu["steal"] > DISTURBED_CORES else ""
        rows.append(
            [
                str(seq_len),
                f"in-process limit (batch {best['batch']}){mark}",
                _f(best["sequences_per_s"]),
                _f(best["tokens_per_s"], 0),
                f"{best['ms_per_forward']:.1f} per forward",
                "—",
                "—",
                "—",
                "—",
                " / ".join(
                    f"{cpu.get(k, 0.0):.2f}" for k in ("server", "client", "other", "steal")
                ),
            ]
        )
        for system in ("echo", *SERVED):
            p = point(results, system, seq_len, concurrency)
            if p is None:
                continue
            lat, cpu = p["latency"], p["cpu_cores"]
            errors = sum(p["errors"].values())
            disturbed = cpu["other"] + cpu["steal"] > DISTURBED_CORES
            rows.append(
                [
                    str(seq_len),
                    SYSTEM_LABELS[system] + (" †" if disturbed else ""),
                    _f(p["sequences_per_s"]),
                    _f(p["tokens_per_s"], 0),
                    _f(lat["p50_ms"]),
                    _f(lat["p95_ms"]),
                    _f(lat["p99_ms"]),
                    _f(lat["p99_ms"] / lat["p50_ms"], 2),
                    str(errors),
                    " / ".join(f"{cpu[k]:.2f}" for k in ("server", "client", "other", "steal")),
                ]
            )
    return rows


def ceiling_rows(results: dict[str, Any], concurrency: int) -> list[list[str]]:
    """CPU per request adds up: compute (the in-process limit) plus the wire (the echo server,
    load generator included), so no server of this module on these cores can pass
    1 / (1 / in-process + 1 / echo) requests per second."""
    rows = []
    for seq_len in sorted({p["seq_len"] for p in results["load"]}):
        echo = point(results, "echo", seq_len, concurrency)
        ours = point(results, "mha-serve", seq_len, concurrency)
        if echo is None or ours is None:
            continue
        limit = inprocess_best(results, seq_len)["sequences_per_s"]
        ceiling = 1 / (1 / limit + 1 / echo["sequences_per_s"])
        rows.append(
            [
                str(seq_len),
                _f(limit),
                _f(echo["sequences_per_s"]),
                _f(ceiling),
                f"{ceiling / limit:.2f}",
                _f(ours["sequences_per_s"]),
                f"{ours['sequences_per_s'] / ceiling:.0%}",
            ]
        )
    return rows


CEILING_HEADERS = [
    "tokens",
    "in-process seq/s",
    "echo req/s",
    "ceiling seq/s",
    "ceiling / in-process",
    "mha-serve seq/s",
    "mha-serve / ceiling",
]


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


HEADLINE_HEADERS = [
    "tokens",
    "system",
    "seq/s (= req/s)",
    "tokens/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "p99/p50",
    "errors",
    "cores: server / client / other / steal",
]


def targets_table(results: dict[str, Any]) -> str:
    rows = []
    for t in results["targets"]:
        measured = f"{t['value']:.2f}" + ("x" if t["at_least"] else "")
        goal = (
            ("≥ " if t["at_least"] else "≤ ")
            + f"{t['threshold']:g}"
            + ("x" if t["at_least"] else "")
        )
        rows.append([t["target"], measured, goal, "**met**" if t["met"] else "**not met**"])
    return md_table(["target (32 clients)", "measured", "goal", ""], rows)


def sweep_table(results: dict[str, Any]) -> str:
    concurrencies = sorted({p["concurrency"] for p in results["load"]})
    rows = []
    for seq_len in sorted({p["seq_len"] for p in results["load"]}):
        for system in SERVED:
            cells = []
            for c in concurrencies:
                p = point(results, system, seq_len, c)
                cells.append(
                    "—"
                    if p is None
                    else f"{p['sequences_per_s']:,.0f} ({p['latency']['p99_ms']:,.0f})"
                )
            rows.append([str(seq_len), SYSTEM_LABELS[system], *cells])
    return md_table(["tokens", "system", *[f"c={c}" for c in concurrencies]], rows)


def inprocess_table(results: dict[str, Any]) -> str:
    seq_lens = list(results["inprocess"]["seq_lens"])
    batches = [p["batch"] for p in results["inprocess"]["seq_lens"][seq_lens[0]]["points"]]
    rows = []
    for i, b in enumerate(batches):
        cells = []
        for s in seq_lens:
            p = results["inprocess"]["seq_lens"][s]["points"][i]
            cells.append(f"{p['sequences_per_s']:,.0f} ({p['ms_per_forward']:.1f} ms)")
        rows.append([str(b), *cells])
    return md_table(["batch", *[f"{s} tokens: seq/s (ms per forward)" for s in seq_lens]], rows)


def wire_table(results: dict[str, Any]) -> str:
    payloads = results["wire"]["payloads"]
    labels = list(payloads)
    rows = []
    for i, step in enumerate(payloads[labels[0]]["steps"]):
        cells = []
        for label in labels:
            steps = payloads[label]["steps"]
            cells.append(
                "—"
                if i >= len(steps)
                else f"{steps[i]['mb_per_s']:,.0f} MB/s ({steps[i]['copies']:.1f})"
            )
        rows.append([step["step"], *cells])
    return md_table(["step", *[f"{label}: MB/s (copies)" for label in labels]], rows)


def profile_section(results: dict[str, Any]) -> str:
    prof = results.get("profile")
    if not prof:
        return (
            "Not sampled in this run (`--quick` or `--no-profile`); the full run adds a "
            "py-spy profile of mha-serve under the 16-token load."
        )
    if "error" in prof:
        return f"The profile failed: {prof['error']}"
    threads = [
        [t["thread"], "—" if t["busy"] is None else f"{t['busy']:.2f}", f"{t['cpu_cores']:.2f}"]
        for t in prof["threads"]
    ]
    where = [[thread, name, f"{busy:.2f}"] for thread, name, busy in prof["categories"]]
    return (
        f"py-spy ({prof['samples']} samples at {prof['rate_hz']} Hz over {prof['duration_s']} s) "
        f"of mha-serve serving 16-token sequences to 32 clients ({prof['sequences_per_s']:,.0f} "
        "seq/s while sampled). *Busy* is the share of samples in which the thread was not "
        "idle: running, or waiting for a core or for the GIL; *CPU* is what it really got "
        "(/proc).\n\n"
        + md_table(["thread", "busy", "CPU cores"], threads)
        + "\n\n"
        + md_table(["thread", "where (first match, leaf to root)", "busy"], where)
        + "\n\nRaw stacks: `bench/results/profile_mha_serve_16.txt` (flame graph: "
        "`py-spy record --format flamegraph`)."
    )


def write_docs(results: dict[str, Any], docs: Path) -> None:
    images = docs / "images"
    images.mkdir(parents=True, exist_ok=True)
    plot_throughput(results, images / "bench_throughput.png")
    plot_latency(results, images / "bench_latency.png")
    (docs / "benchmarks.md").write_text(markdown(results))


def markdown(results: dict[str, Any]) -> str:
    m, s = results["machine"], results["settings"]
    v = m["versions"]
    c = 32
    return f"""# Benchmarks

Measured by `{results["command"]}` on {results["date"]} ({results["elapsed_s"] / 60:.1f} min);
regenerate with the same command. Machine: {m["nproc"]} CPUs ({m["cpu"]}), Python {m["python"]},
torch {v["torch"]}, grpcio {v["grpcio"]}, protobuf {v["protobuf"]}, ray {v["ray"]}.
Model `mha` (embed_dim 512, 8 heads, float32), one sequence per request, {c} concurrent clients
(closed loop) unless said otherwise; {s["headline_duration_s"]:g} s measured per point at c={c},
{s["duration_s"]:g} s elsewhere, after warm-up. The load generator runs on the same cores.

## Targets

{targets_table(results)}

## Side by side, {c} concurrent clients

{md_table(HEADLINE_HEADERS, headline_rows(results, c))}

Cores are averages over each measurement from /proc: the server's process tree, the load
generator, other processes, and *steal* (time the hypervisor gave this VM's CPUs to others);
† marks points where other processes and steal took more than {DISTURBED_CORES} cores: those
figures were taken on less of the machine than the others (rerun to compare cleanly).

## What bounds any server here

CPU time per request adds up: the forward (the in-process limit) plus the wire (the echo
server and load generator, with no compute), so on these cores no server of this module can
pass about `1 / (1 / in-process + 1 / echo)` sequences per second (an estimate: it takes both
runs to have used the whole machine). Batching cannot lift it: it only brings the forward
towards the in-process limit, and at 128 tokens the forward gains little from batching at all
(see the in-process table).

{md_table(CEILING_HEADERS, ceiling_rows(results, c))}

![throughput vs concurrency](images/bench_throughput.png)

![latency percentiles at {c} clients](images/bench_latency.png)

## Concurrency sweep: seq/s (p99 ms)

{sweep_table(results)}

## In-process limit: the module on batched tensors, no serving

{inprocess_table(results)}

## Wire codec: MB/s and cost in memcpys of the payload

{wire_table(results)}

## Where mha-serve's time goes

{profile_section(results)}

## The systems

- **in-process**: `bench/inprocess.py`, `MultiHeadAttention` called on (batch, L, 512) tensors
  under `torch.inference_mode()`, {results["inprocess"]["threads"]} torch threads; median time
  per forward at the best batch size.
- **naive gRPC server**: `bench/naive_server.py`, grpc's tutorial thread pool (10 workers), one
  forward per request, no batching; **gRPC echo** is the same server with `--echo` (it returns
  the input and computes nothing).
- **Ray Serve**: `bench/ray_baseline.py`, one replica with 2 CPUs, `@serve.batch(max_batch_size=64,
  batch_wait_timeout_s=0.002)` (mha-serve's defaults), `max_ongoing_requests=256`, access log
  off; called through Ray Serve's HTTP proxy with the same serialized AttendRequest bytes
  (its gRPC proxy cannot be bound to loopback only).
- **mha-serve**: `python -m mha_serve.transport.main --host 127.0.0.1 --port P --metrics-port 0`
  with its defaults.

Every server listens on 127.0.0.1 and runs alone while measured. Raw figures:
`bench/results/latest.json`. How to run, profile and read these: `bench/README.md`.
"""


def summary_text(results: dict[str, Any]) -> str:
    lines = ["side by side, 32 concurrent clients:"]
    widths = [6, 34, 15, 10, 17, 8, 8, 8, 6, 24]
    for row in [HEADLINE_HEADERS, *headline_rows(results, 32)]:
        lines.append("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)))
    lines.append("")
    for t in results["targets"]:
        goal = ("≥ " if t["at_least"] else "≤ ") + f"{t['threshold']:g}"
        lines.append(
            f"{t['target']:<46} {t['value']:7.2f}  goal {goal:<6} "
            f"{'met' if t['met'] else 'NOT MET'}"
        )
    return "\n".join(lines)


def plot_throughput(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    seq_lens = sorted({p["seq_len"] for p in results["load"]})
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(6 * len(seq_lens), 4.2))
    for ax, seq_len in zip(axes, seq_lens, strict=True):
        for system in SERVED:
            pts = sorted(
                (p["concurrency"], p["sequences_per_s"])
                for p in results["load"]
                if p["system"] == system and p["seq_len"] == seq_len
            )
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=SYSTEM_LABELS[system],
                color=COLORS[system],
            )
        best = inprocess_best(results, seq_len)
        ax.axhline(
            best["sequences_per_s"],
            ls="--",
            color=COLORS["inprocess"],
            label=f"in-process limit (batch {best['batch']})",
        )
        echo = point(results, "echo", seq_len, results["headline_concurrency"])
        if echo is not None:
            ax.axhline(
                echo["sequences_per_s"],
                ls=":",
                color=COLORS["echo"],
                label=f"gRPC echo, no compute (c={echo['concurrency']})",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        concurrencies = sorted({p["concurrency"] for p in results["load"]})
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("sequences / s")
        ax.set_title(f"{seq_len}-token sequences, embed_dim 512, 8 heads")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(
        f"Throughput vs concurrency ({results['machine']['nproc']} CPUs, "
        f"load generator on the same machine)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(results: dict[str, Any], path: Path, concurrency: int = 32) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    seq_lens = sorted({p["seq_len"] for p in results["load"]})
    fig, axes = plt.subplots(1, len(seq_lens), figsize=(6 * len(seq_lens), 4.2))
    width = 0.25
    for ax, seq_len in zip(axes, seq_lens, strict=True):
        systems = [
            s for s in ("naive", "ray", "mha-serve") if point(results, s, seq_len, concurrency)
        ]
        for i, pct in enumerate(("p50_ms", "p95_ms", "p99_ms")):
            values = [point(results, s, seq_len, concurrency)["latency"][pct] for s in systems]
            xs = [j + (i - 1) * width for j in range(len(systems))]
            bars = ax.bar(
                xs,
                values,
                width,
                label=pct.removesuffix("_ms"),
                alpha=0.4 + 0.3 * i,
                color="tab:purple",
            )
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(systems)), [SYSTEM_LABELS[s] for s in systems], fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{seq_len}-token sequences, {concurrency} clients")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency percentiles (client side, round trip)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Where a sample's time goes: the category of the frame nearest the leaf that matches one.
PROFILE_CATEGORIES = (
    (
        "torch forward",
        ("torch/nn/", "model/attention.py", "model/steps.py", "model/norm.py", "torch/functional"),
    ),
    ("output checks (require_finite)", ("require_finite",)),
    ("batch assembly and split (Engine.run_batch)", ("Engine.run_batch", "Engine.run ")),
    ("request validation (Engine.validate)", ("Engine.validate", "validate")),
    ("tensor codec (transport/tensors.py, convert.py)", ("transport/tensors.py", "convert.py")),
    ("servicer and metrics", ("servicer.py", "prometheus_client", "metrics/")),
    (
        "batcher: queue, futures, thread handoff",
        ("batching/", "concurrent/futures"),
    ),
    ("gRPC aio core (Cython) and the asyncio loop", ("asyncio/", "grpc", "selectors.py")),
)


def _category(frames: list[str]) -> str:
    for frame in reversed(frames):  # leaf first
        for name, needles in PROFILE_CATEGORIES:
            if any(needle in frame for needle in needles):
                return name
    return "other"


def summarize_profile(
    raw: Path, duration_s: float, rate_hz: int, thread_cores: dict[int, float]
) -> dict[str, Any]:
    """Busy cores per thread and per (thread, category) from py-spy's raw collapsed stacks;
    thread_cores: real CPU cores per thread id over the same run (/proc)."""
    by_category: collections.Counter[tuple[str, str]] = collections.Counter()
    by_thread: collections.Counter[tuple[int, str]] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        samples += n
        head = re.match(r"thread \((\d+)\): (.*)", frames[0])
        tid, thread = (int(head.group(1)), head.group(2)) if head else (0, frames[0])
        thread = re.sub(r"_\d+$", "", thread)  # batch-mha_0 -> batch-mha
        by_thread[(tid, thread)] += n
        # grpc's poller thread runs C only: its Python stack is just threading's frames.
        where = (
            _category(frames[1:]) if "_poll_wrapper" not in thread else PROFILE_CATEGORIES[-1][0]
        )
        by_category[(thread, where)] += n
    per_s = rate_hz * duration_s
    threads = [
        {"thread": t, "tid": tid, "busy": n / per_s, "cpu_cores": thread_cores.get(tid, 0.0)}
        for (tid, t), n in by_thread.most_common()
    ]
    seen = {tid for tid, _ in by_thread}
    native = sum(c for tid, c in thread_cores.items() if tid not in seen)
    threads.append(
        {
            "thread": "threads without Python frames (torch OpenMP, gRPC core)",
            "tid": None,
            "busy": None,
            "cpu_cores": native,
        }
    )
    return {
        "samples": samples,
        "rate_hz": rate_hz,
        "duration_s": duration_s,
        "threads": threads,
        "categories": [(t, c, n / per_s) for (t, c), n in by_category.most_common()],
    }
