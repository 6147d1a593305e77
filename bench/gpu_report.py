"""docs/benchmarks-gpu.md from bench/gpu.py's results (figures only from the run; without a
run the page says that no GPU figures have been measured)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PAGE = "benchmarks-gpu.md"
HOW = (
    "Produced by `make gpu` on a machine with a CUDA GPU (bench/gpu_target.sh: a venv of its "
    "own with torch's CUDA build; `python bench/gpu.py`, which writes this page and "
    "`bench/results/gpu.json`; then the test suite's device directories with "
    "`MHA_SERVE_TEST_DEVICE=cuda`, "
    "whose summary joins the page). Without a GPU `make gpu` says so and exits 0; it never "
    "writes this page."
)
DECIDE_GRAPHS = (
    "Engine wiring of CUDA graphs is not done: graphs need static shapes (a graph per batch "
    "size and context bucket, or attention that reads the lengths from device memory), which "
    "the engine's per-session steps do not have today. The rule: wire them in where a graph "
    "saves at least a tenth of a served step, or speeds the 64-session step at least 1.2x."
)


def us(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{seconds * 1e6:.1f}"


def pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def render(results: dict[str, Any], targets: dict[str, Any]) -> str:
    d = results["device"]
    out = [
        "# GPU benchmarks (issue 25)",
        "",
        HOW,
        "",
        f"This run: `{results['command']}` on {results['date']}, {d['name']} (compute "
        f"capability {d['capability']}, {d['multiprocessors']} SMs, {d['memory_gib']:.0f} GiB), "
        f"torch {d['torch']}, CUDA {d['cuda']}, Python {d['python']}; "
        f"{results['elapsed_s']:.0f} s in all. Every ratio is measured in this run, beside what "
        "it is held against; compare within one run only.",
        "",
        *errors_section(results.get("errors")),
        *suite_section(results.get("suite")),
        *roofline_section(results),
        *kv_section(results, targets),
        *graphs_section(results),
        *stateless_section(results),
        *sessions_section(results),
        *lone_section(results),
        *new_lengths_section(results),
        *switches_section(results),
        *notes_section(),
    ]
    return "\n".join(out).rstrip() + "\n"


def errors_section(errors: dict[str, str] | None) -> list[str]:
    if not errors:
        return []
    out = ["## What failed in this run", ""]
    out += [f"- {key}: `{error[:300]}`" for key, error in errors.items()]
    return [*out, ""]


def roofline_section(results: dict[str, Any]) -> list[str]:
    if "copy_gbs" not in results:
        return []
    copy, sheet = results["copy_gbs"], results.get("datasheet_gbs")
    return [
        "## Roofline",
        "",
        f"A device-to-device copy moved {copy:.0f} GB/s (bytes read plus bytes written): the "
        "roofline of every share below. Datasheet: "
        + (
            f"{sheet} GB/s (the copy reached {copy / sheet:.0%} of it)."
            if sheet
            else "not in bench/gpu_kernels.py's table for this device."
        ),
        "",
    ]


def placeholder() -> str:
    return "\n".join(
        [
            "# GPU benchmarks (issue 25)",
            "",
            HOW,
            "",
            "**No GPU figures have been measured yet**: no run of `make gpu` on a machine with a "
            "GPU has landed. This page is replaced by the first one.",
            "",
            "What a run measures (bench/gpu.py's docstring has the details): the roofline (a "
            "device-to-device copy); the decode K/V-read bandwidth at context 4096 in bfloat16 "
            "as a share of it (target >= 50%); CUDA graphs for the decode step against eager; "
            "stateless throughput by batch and length, served against in-process; 64 sessions "
            "decoding together against one at a time; one session's streamed step against its "
            "limit; and the whole test suite run on CUDA.",
            "",
        ]
    )


def suite_section(suite: dict[str, Any] | None) -> list[str]:
    out = ["## The test suite on CUDA", ""]
    if not suite:
        return out + ["Not run with these figures (its summary joins by `--suite-json`).", ""]
    c = suite.get("counts")
    head = f"`MHA_SERVE_TEST_DEVICE={suite['device']} {suite['command']}`: "
    if c is None:
        head += f"pytest exited {suite['exit_code']} and wrote no report (see gpu-suite.log)."
    else:
        head += (
            f"**{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
            f"{c['skipped']} skipped** in {suite['duration_s']:.0f} s (exit {suite['exit_code']})."
        )
    if suite.get("timed_out"):
        head += f" Interrupted at its {suite['timeout_s']:.0f} s limit: the rest did not run."
    out += [head, ""]
    if suite.get("left_out"):
        out += ["Left out, their packages not installed on this machine:", ""]
        out += [f"- `{x['path']}` (needs `{x['needs']}`)" for x in suite["left_out"]]
        out.append("")
    if suite.get("failures"):
        out += ["Failures and errors (first 30):", ""]
        for f in suite["failures"][:30]:
            message = f["message"][0] if f["message"] else ""
            out.append(f"- `{f['test']}` ({f['outcome']}): {message[:200]}")
        out.append("")
    if suite.get("skip_reasons"):
        out += ["Skipped, by reason:", ""]
        # a reason's first line (a skip may carry a tool's whole output)
        out += [
            f"- {n} x {(reason.splitlines() or [''])[0][:200]}"
            for reason, n in suite["skip_reasons"]
        ]
        out.append("")
    return out


def kv_section(results: dict[str, Any], targets: dict[str, Any]) -> list[str]:
    rows = results.get("kv") or []
    if not rows:
        return []
    goal = targets["kv_read_share_min"]
    out = [
        f"## Decode K/V-read bandwidth at context {rows[0]['context']}, bfloat16",
        "",
        "One decode token per session over its cached K/V (random, in the paged cache, each "
        "session's blocks consecutive). *Engine*: the attention of a batch of session steps "
        "as the engine runs it (engine/attend.py): every session's K/V copied by one "
        "index_select each of K and V from the block storage into padded (B, KVH, S, D) "
        "tensors, one masked `scaled_dot_product_attention` for the batch (GQA's query heads "
        "folded into rows), then wo. *Per session*: `attend_cached`, the engine's path before "
        "(and still for steps that ask for weights), one attention kernel per session over "
        "in-place views, then wo; *graph*: the same replayed from a CUDA graph; *one kernel*: "
        "the same queries and K/V copied once, outside the timing, into contiguous tensors, "
        "one `scaled_dot_product_attention` for the batch (what the engine's gather pays "
        "for: its copy reads and writes the K/V once more before the kernel reads them). Time "
        "per step from device events over back-to-back steps (each step reads another set of "
        "sessions, so the L2 cache does not serve them); share = K/V bytes / time / roofline. "
        f"Target: >= {goal:.0%}. Errors: the engine's output and the per-session step's "
        "against a float64 recompute, max |diff| / max |ref|.",
        "",
        "| model | sessions | K/V per step | **engine (us)** | share | per session (us) | share "
        "| graph (us) | share | one kernel (us) | share | error, engine | error, per session |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for r in rows:
        size = f"{r['kv_bytes'] / 2**20:.1f} MiB" if r.get("kv_bytes") else "-"
        out.append(
            f"| {r['model']} | {r['batch']} | {size} | {measured(r, 'engine_s')} "
            f"| **{pct(r.get('engine_share'))}** | {us(r.get('eager_s'))} "
            f"| {pct(r.get('eager_share'))} | {us(r.get('graph_s'))} "
            f"| {pct(r.get('graph_share'))} | {us(r.get('batched_s'))} "
            f"| {pct(r.get('batched_share'))} | {sci(r.get('engine_rel_error'))} "
            f"| {sci(r.get('step_rel_error'))} |"
        )
    out.append("")
    if not any("engine_s" in r for r in rows):
        out += [
            "This run predates the engine's batched attention (engine/attend.py): its column "
            "stays empty until the next `make gpu`; per session is what the engine ran then.",
            "",
        ]
    labels = (
        ("engine", "engine"),
        ("eager", "per session"),
        ("graph", "graph"),
        ("batched", "one kernel"),
    )
    out += verdicts(rows, goal, labels)
    return [*out, "", *paged_section(rows, goal), *ragged_section(results)]


def verdicts(
    rows: list[dict[str, Any]], goal: float, labels: tuple[tuple[str, str], ...]
) -> list[str]:
    """At the widest batch, each (column, label)'s share against the goal, per model (a
    column a run predates is left out)."""
    widest = max(r["batch"] for r in rows)
    out = [f"At {widest} sessions, against the target of {goal:.0%}:", ""]
    for r in (r for r in rows if r["batch"] == widest):
        marks = []
        for k, label in labels:
            if f"{k}_s" not in r:  # a run from before this column
                continue
            share = r.get(f"{k}_share")
            verdict = "failed" if share is None else "meets" if share >= goal else "misses"
            marks.append(f"{label} {pct(share)} ({verdict})")
        out.append(f"- {r['model']}: {', '.join(marks)}")
    return out


def paged_section(rows: list[dict[str, Any]], goal: float) -> list[str]:
    """Section 2's read-in-place columns: flash decode (since the seventh session of issue
    25) and torch's paged kernel (since the sixth)."""
    rows = [r for r in rows if "paged_s" in r or "in_place_s" in r]
    if not rows:
        return []
    out = [
        "Read in place, no gather. *Flash decode*: the engine's batch with `--flash-decode` "
        "(engine/attend.py): FlashAttention's varlen forward (torch's own, in torch 2.11 and "
        "2.13) over the cache viewed token-major, each session's first slot and length given "
        "(`cu_seqlens_k`, `seqused_k`), then wo. *Paged*: torch's paged attention kernel "
        "(`torch.nn.attention.varlen.varlen_attn` with each session's page table and length, "
        "torch >= 2.13 only; pages of 256 tokens, which it requires), over the cache's K/V "
        "viewed as (pages, 256, KVH, D) (*cache's layout*; its storage is (KVH, blocks, "
        "block_size, D)) and over a copy laid out so, made once outside the timing (*pool*). "
        "A failed cell's reason is under the table.",
        "",
        "| model | sessions | **flash decode (us)** | share | paged, cache's layout (us) | share "
        "| paged, pool (us) | share | error, flash decode | error, paged |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['batch']} | {measured(r, 'in_place_s')} "
            f"| **{pct(r.get('in_place_share'))}** | {measured(r, 'paged_s')} "
            f"| {pct(r.get('paged_share'))} | {measured(r, 'paged_pool_s')} "
            f"| {pct(r.get('paged_pool_share'))} | {sci(r.get('in_place_rel_error'))} "
            f"| {sci(r.get('paged_rel_error'))} |"
        )
    failed = [
        f"- {r['model']}, {r['batch']} sessions, {key}: `{why[:200]}`"
        for r in rows
        for key, why in (r.get("errors") or {}).items()
        if key.startswith(("in_place", "paged"))
    ]
    if failed:
        out += ["", "Why a cell is empty:", "", *failed]
    labels = (("in_place", "flash decode"), ("paged", "paged"), ("paged_pool", "pool"))
    return [*out, "", *verdicts(rows, goal, labels), ""]


def ragged_section(results: dict[str, Any]) -> list[str]:
    rows = results.get("ragged") or []
    if not rows:
        return []
    out = [
        "Ragged contexts: the same step for sessions of unequal lengths. *Engine's groups*: "
        "the engine's rule (engine/attend.py): longest first, a session joins a padded group "
        "while it reads at least half of the group's longest, so padding at most doubles a "
        "session's cost and a group of one reads in place; *one group*: every session padded "
        "to the longest; *flash decode*: every session read in place, no padding "
        "(`--flash-decode`, above). Share counts only the real K/V bytes.",
        "",
        "| model | sessions | contexts | K/V per step | per session (us) | share "
        "| **engine's groups (us)** | share | one group (us) | share | flash decode (us) "
        "| share | error, groups | error, one group | error, flash decode |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for r in rows:
        size = f"{r['kv_bytes'] / 2**20:.1f} MiB" if r.get("kv_bytes") else "-"
        contexts = ", ".join(str(c) for c in r.get("contexts", []))
        out.append(
            f"| {r['model']} | {r['batch']} | {contexts} | {size} | {us(r.get('eager_s'))} "
            f"| {pct(r.get('eager_share'))} | {us(r.get('engine_s'))} "
            f"| **{pct(r.get('engine_share'))}** | {us(r.get('one_group_s'))} "
            f"| {pct(r.get('one_group_share'))} | {measured(r, 'in_place_s')} "
            f"| {pct(r.get('in_place_share'))} | {sci(r.get('engine_rel_error'))} "
            f"| {sci(r.get('one_group_rel_error'))} | {sci(r.get('in_place_rel_error'))} |"
        )
    return [*out, ""]


def measured(row: dict[str, Any], key: str) -> str:
    """us(row[key]); "-" for a run from before the key was measured."""
    return us(row.get(key)) if key in row else "-"


def graphs_section(results: dict[str, Any]) -> list[str]:
    rows = results.get("graphs") or []
    if not rows:
        return []
    out = [
        "## CUDA graphs for the decode step",
        "",
        "The whole model-level step (project, K/V write into the cache, `attend_cached`, wo) "
        "with static buffers, eager against replayed from a CUDA graph, the same shapes on "
        "both sides. Back to back: device events over a loop of steps. *Alone*: one session's "
        "step as a server takes it, the token copied in from host memory and the output back, "
        "wall clock, median.",
        "",
        "| model | sessions | context | eager (us) | graph (us) | **speedup** | alone, eager "
        "(us) | alone, graph (us) | graph vs eager (max diff) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        alone = r["batch"] == 1
        speedup = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        out.append(
            f"| {r['model']} | {r['batch']} | {r['context']} | {us(r.get('eager_s'))} "
            f"| {us(r.get('graph_s'))} | **{speedup}** "
            f"| {us(r.get('lone_eager_s')) if alone else ''} "
            f"| {us(r.get('lone_graph_s')) if alone else ''} | {sci(r.get('graph_max_diff'))} |"
        )
    out.append("")
    out += [DECIDE_GRAPHS, ""]
    widest = max(r["batch"] for r in rows)
    savings = [
        r["graph_saving_share"] for r in results.get("lone") or [] if "graph_saving_share" in r
    ]
    wide = [r["speedup"] for r in rows if r["batch"] == widest and r.get("speedup") is not None]
    if savings and wide:
        pays = max(savings) >= 0.1 or max(wide) >= 1.2
        out += [
            f"This run: a graph would save at most {max(savings):.0%} of a lone served step "
            f"(below) and speeds the {widest}-session step {min(wide):.2f}x to {max(wide):.2f}x: "
            "by the rule they "
            + (
                "**pay**: wiring them into the engine is worth its design."
                if pays
                else "**do not pay** yet."
            ),
            "",
        ]
    return out


def stateless_section(results: dict[str, Any]) -> list[str]:
    rows = results.get("stateless", [])
    if not rows:
        return []
    models = ", ".join(
        f"{m['name']} on {m['device']} {m['dtype']}" for m in results["served_models"]
    )
    out = [
        "## Stateless throughput by batch and length",
        "",
        f"mha-serve with its defaults ({models}), `mha_client.loadgen` closed loop of "
        f"{rows[0]['concurrency']} clients, each request (batch, length) float32 sequences. "
        "*In-process*: the same module called on one request's batch, its float32 input copied "
        "from host memory and the output back (what a server must do besides serving); "
        "*forward alone*: on device-resident input. *Echo*: a bare grpc.aio server answering "
        "the request bytes (the wire and the load generator alone). Served, echo and in-process "
        "alternate in rounds; medians. Sequences per second.",
        "",
        "| batch | length | served | in-process | forward alone | echo | **served / in-process** "
        "| served / echo |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['batch']} | {r['length']} | {r['served_seq_per_s']:.0f} "
            f"| {r['inprocess_seq_per_s']:.0f} | {r['forward_seq_per_s']:.0f} "
            f"| {r['echo_seq_per_s']:.0f} | **{r['vs_inprocess']:.2f}** | {r['vs_echo']:.2f} |"
        )
    return [*out, ""]


def sessions_section(results: dict[str, Any]) -> list[str]:
    b = results.get("sessions")
    if not b:
        return []
    each = ", ".join(f"{r['ratio']:.1f}x" for r in b["rounds"])
    return [
        "## 64 sessions decoding together vs one at a time",
        "",
        f"bench/sessions.py's pair on this server: {b['sessions']} gqa sessions prefilled to "
        f"{b['context']} tokens, one stream each; every round forks them twice and steps "
        f"{b['steps_per_phase']} tokens on one set one session at a time, on the other all at "
        f"once. Median round: {b['concurrent_tokens_per_s']:.0f} tokens/s together against "
        f"{b['sequential_tokens_per_s']:.0f} one at a time: **{b['ratio']:.1f}x** (each round: "
        f"{each}; mean batch {b['mean_batch_size']:.1f}).",
        "",
    ]


def lone_section(results: dict[str, Any]) -> list[str]:
    rows = [r for r in results.get("lone") or [] if "ratio" in r]
    if not rows:
        return []
    out = [
        "## One session's decode step against its limit",
        "",
        "A streamed step (`AsyncSession.stream().step`) through the server, against its limit: "
        "the same step in-process taken alone (above: host to host, eager) plus one round trip "
        "of the same request bytes through the echo server. The graphed in-process step and "
        "the share of the served step a graph would save beside it. Medians, us.",
        "",
        "| model | context | served | in-process | echo | limit | **ratio** | in-process, "
        "graph | graph would save |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['context']} | {us(r['served_s'])} | {us(r['inprocess_s'])} "
            f"| {us(r['echo_s'])} | {us(r['limit_s'])} | **{r['ratio']:.2f}** "
            f"| {us(r.get('inprocess_graph_s'))} | {pct(r.get('graph_saving_share'))} |"
        )
    return [*out, ""]


def new_lengths_section(results: dict[str, Any]) -> list[str]:
    rows = results.get("new_lengths") or []
    if not rows:
        return []
    out = [
        "## Attention at a new key length each call",
        "",
        "A growing session's decode step attends over one key more than its last: one query "
        "row per session (8 heads of 64, bfloat16) over 3000 keys, then 3001, and so on, 40 "
        "calls, each timed on the wall clock between device synchronisations (host work "
        "included). *Kernel*: the one forced with `torch.nn.attention.sdpa_kernel`; *engine*: "
        "none forced, under the engine's switch (`engine.choose_attention_kernels`: cuDNN off "
        "unless `--cudnn-attention`). *Bucket*: keys padded up to a multiple of it, the "
        "padding masked, so calls share shapes. Median and worst of the calls after the "
        "first five, and the first call, us.",
        "",
        "| kernel | sessions | mask | bucket | **median** | worst | first |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r.get("errors"):
            why = "; ".join(r["errors"].values())[:120]
            out.append(
                f"| {r['kernel']} | {r['batch']} | {'yes' if r['mask'] else 'no'} "
                f"| {r['bucket']} | not run: `{why}` | | |"
            )
            continue
        out.append(
            f"| {r['kernel']} | {r['batch']} | {'yes' if r['mask'] else 'no'} | {r['bucket']} "
            f"| **{us(r['median_s'])}** | {us(r['worst_s'])} | {us(r['first_s'])} |"
        )
    return [*out, ""]


def switches_section(results: dict[str, Any]) -> list[str]:
    s = results.get("switches")
    if not s:
        return []
    names = list(s["stateless_seq_per_s"])
    seq, tok, lone = s["stateless_seq_per_s"], s["sessions_tokens_per_s"], s["lone_step_s"]
    out = [
        "## The server's GPU switches against its defaults",
        "",
        f"The same mha-serve, once with its defaults and once per switch turned, in "
        f"{s['rounds']} alternating rounds; medians. Stateless: {s['batch']} x {s['length']} "
        "tokens a request from 16 clients (the batcher coalesces them into batches of changing "
        f"size). Together: {s['sessions']} gqa sessions decoding {s['steps']} steps at once "
        f"from a context new every round (from {s['context']}). Alone: one gqa session's "
        f"streamed decode step, from a context new every round (from {s['lone_context']}).",
        "",
        f"| server | stateless (seq/s) | {s['sessions']} together (tokens/s) | alone (us) "
        "| **vs defaults** (stateless, together, alone) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    base = names[0]
    for n in names:
        flags = " ".join(s["flags"].get(n) or []) or "defaults"
        vs = f"{seq[n] / seq[base]:.2f}x, {tok[n] / tok[base]:.2f}x, {lone[base] / lone[n]:.2f}x"
        out.append(
            f"| `{flags}` | {seq[n]:.0f} | {tok[n]:.0f} | {us(lone[n])} | "
            + ("-" if n == base else f"**{vs}**")
            + " |"
        )
    out += ["", "Above 1x: the switch turned does better than the defaults.", ""]
    return out


def notes_section() -> list[str]:
    """bench/gpu_notes.md: what was measured on a GPU outside this script's sections (a
    profile, a one-off check), each note with its date, command and machine."""
    notes = Path(__file__).with_name("gpu_notes.md")
    if not notes.exists():
        return []
    return ["## Notes from other GPU runs", "", notes.read_text().strip(), ""]


def write_report(results: dict[str, Any], docs: Path, targets: dict[str, Any]) -> Path:
    docs.mkdir(parents=True, exist_ok=True)
    page = docs / PAGE
    page.write_text(render(results, targets))
    return page
