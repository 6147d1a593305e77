"""The real SDK (sync and async) and the real mha-client CLI against the real server."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from mha_client.cli import main as cli_main
from mha_client.errors import MhaServeError
from mha_client.sdk import AsyncClient, Client
from mha_serve.config import default_models
from mha_serve.model import MultiHeadAttention, init_weights
from tests.helpers import suite_device

ATOL = 1e-5  # float32 over the wire vs the same module in-process
SPECS = {spec.name: spec for spec in default_models()}


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as c:
        yield c


def reference(name: str, x: np.ndarray, lengths: list[int], causal: bool):
    spec = SPECS[name]
    module = MultiHeadAttention(spec.attention)
    init_weights(module, spec.seed)
    with torch.inference_mode():
        out = module(
            torch.from_numpy(x), lengths=torch.tensor(lengths), causal=causal, need_weights=True
        )
    return out.output.numpy(), out.weights.numpy()


def test_list_models(client):
    models = {m.name: m for m in client.list_models()}
    assert {(m.variant, m.num_heads, m.num_kv_heads, m.embed_dim) for m in models.values()} == {
        ("mha", 8, 8, 512),
        ("gqa", 8, 2, 512),
        ("mqa", 8, 1, 512),
    }
    assert models["gqa"].device == suite_device() and models["gqa"].max_seq_len == 4096


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_embeddings_and_per_head_weights_for_every_variant(client, name, causal):
    x = np.random.default_rng(7).standard_normal((3, 12, 512), dtype=np.float32)
    lengths = [12, 5, 9]
    result = client.attend(name, x, lengths=lengths, causal=causal, weights=True)
    assert result.output.shape == (3, 12, 512) and result.weights.shape == (3, 8, 12, 12)
    assert result.weight_heads == list(range(8)) and result.timing.batch_size == 3
    ref_out, ref_w = reference(name, x, lengths, causal)
    np.testing.assert_allclose(result.output, ref_out, atol=ATOL, rtol=0)
    np.testing.assert_allclose(result.weights, ref_w, atol=ATOL, rtol=0)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(result.weights[b, :, :n, :n].sum(-1), 1.0, atol=1e-5)
        assert np.all(result.weights[b, :, :, n:] == 0)


def test_single_sequence_keeps_its_rank(client):
    x = np.random.default_rng(8).standard_normal((6, 512), dtype=np.float32)
    result = client.attend("mqa", x, weights=True, heads=[2], query_range=(1, 4))
    assert result.output.shape == (6, 512) and result.weights.shape == (1, 3, 6)


def test_low_precision_on_the_wire(client):
    x = np.random.default_rng(9).standard_normal((2, 8, 512), dtype=np.float32)
    full = client.attend("gqa", x)
    bf16 = client.attend("gqa", x, input_dtype="bfloat16", output_dtype="float32")
    half = client.attend("gqa", x.astype(np.float16))
    assert half.output.dtype == np.float16
    np.testing.assert_allclose(bf16.output, full.output, atol=5e-2)
    np.testing.assert_allclose(half.output.astype(np.float32), full.output, atol=5e-3)


def test_head_mask_prunes_heads(client):
    x = np.random.default_rng(10).standard_normal((1, 8, 512), dtype=np.float32)
    keep = client.attend("mha", x, head_mask=[1.0] * 8).output
    pruned = client.attend("mha", x, head_mask=[1, 1, 0, 1, 1, 1, 1, 0]).output
    assert np.abs(keep - pruned).max() > 1e-3
    np.testing.assert_array_equal(client.attend("mha", x).output, keep)


def test_sdk_errors_carry_code_and_message(client):
    with pytest.raises(MhaServeError) as err:
        client.attend("gqa", np.zeros((1, 3, 100), np.float32))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "expects embed_dim 512, got 100" in str(err.value)


async def test_async_client_concurrent_calls(server):
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((1, 4 + i, 512), dtype=np.float32) for i in range(8)]
    async with AsyncClient(server.target) as c:
        assert await c.health() == "SERVING"
        results = await asyncio.gather(*(c.attend("mqa", x) for x in inputs))
    # Concurrent calls may share a padded batch: equal to each call alone within ATOL.
    with Client(server.target) as sync:
        for x, r in zip(inputs, results, strict=True):
            np.testing.assert_allclose(r.output, sync.attend("mqa", x).output, atol=ATOL, rtol=0)


def cli(*args: str, target: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "mha-client"  # the console script beside this python
    assert exe.exists(), f"the mha-client console script is not installed at {exe}"
    return subprocess.run(
        [str(exe), "--target", target, *args], capture_output=True, text=True, timeout=120
    )


def test_cli_models_health_and_attend(server, tmp_path):
    models = cli("models", "--json", target=server.target)
    assert models.returncode == 0, models.stderr
    assert [m["name"] for m in json.loads(models.stdout)] == ["mha", "gqa", "mqa"]
    assert cli("health", target=server.target).stdout.strip() == "SERVING"

    png, npz = tmp_path / "heads.png", tmp_path / "out.npz"
    run = cli(
        "attend",
        "gqa",
        "--random-shape",
        "2,16",
        "--lengths",
        "16,9",
        "--causal",
        "--heatmap",
        str(png),
        "--save",
        str(npz),
        target=server.target,
    )
    assert run.returncode == 0, run.stderr
    assert "entropy" in run.stdout and "(2, 16, 512)" in run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = np.load(npz)
    assert saved["output"].shape == (2, 16, 512) and saved["weights"].shape == (2, 8, 16, 16)

    bad = cli("attend", "nope", "--random-shape", "4", target=server.target)
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr


def test_cli_sessions_and_decode(server, tmp_path):
    created = cli("session", "create", "gqa", "--max-len", "64", "--json", target=server.target)
    assert created.returncode == 0, created.stderr
    sid = json.loads(created.stdout)["session_id"]
    step = cli(
        "session",
        "step",
        sid,
        "--random-tokens",
        "5",
        "--weights",
        "--json",
        "--save",
        str(tmp_path / "step.npz"),
        target=server.target,
    )
    assert step.returncode == 0, step.stderr
    summary = json.loads(step.stdout)
    assert summary["session"]["num_tokens"] == 5 and summary["weights_shape"] == [8, 5, 5]
    assert summary["session"]["max_len"] == 64
    np.save(tmp_path / "batch.npy", np.ones((1, 3, 512), np.float32))  # (1, T, E) counts T
    step = cli("session", "step", sid, "--input", str(tmp_path / "batch.npy"), target=server.target)
    assert step.returncode == 0, step.stderr
    assert "appended   3 tokens -> session holds 8" in step.stdout
    assert np.load(tmp_path / "step.npz")["output"].shape == (5, 512)
    fork = cli("session", "fork", sid, "--json", target=server.target)
    assert json.loads(fork.stdout)["num_tokens"] == 8
    cut = cli("session", "truncate", sid, "6", "--json", target=server.target)
    assert cut.returncode == 0, cut.stderr
    assert json.loads(cut.stdout)["num_tokens"] == 6
    assert cli("session", "close", sid, target=server.target).returncode == 0
    gone = cli("session", "info", sid, target=server.target)
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr and "closed" in gone.stderr
    decode = cli("decode", "mqa", "--prompt-len", "16", "--steps", "4", target=server.target)
    assert decode.returncode == 0, decode.stderr
    assert "tokens/s" in decode.stdout and "20 tokens in 2 blocks" in decode.stdout
    zero = cli("decode", "mqa", "--steps", "0", target=server.target)
    assert zero.returncode == 2 and "'0' is not a positive integer" in zero.stderr
    kept = cli("decode", "mqa", "--prompt-len", "5000", "--keep", target=server.target)
    assert kept.returncode == 1 and "INVALID_ARGUMENT" in kept.stderr
    left = re.search(r"session +([0-9a-f]+) \(left open\)", kept.stderr)  # past max_seq_len
    assert left, kept.stderr
    assert cli("session", "close", left.group(1), target=server.target).returncode == 0


def test_cli_session_step_saves_as_attend_does(server, tmp_path, capsys):
    """session step --save OUT.npy wrote OUT.npy.npz (np.savez) and printed nothing; now
    it writes what attend --save writes, and says so."""
    assert cli_main(["--target", server.target, "session", "create", "gqa", "--json"]) == 0
    sid = json.loads(capsys.readouterr().out)["session_id"]
    step = ["--target", server.target, "session", "step", sid]
    np.save(tmp_path / "x2d.npy", np.ones((4, 512), np.float32))
    npy, npz = tmp_path / "sx.npy", tmp_path / "sx.npz"
    try:
        assert cli_main([*step, "--input", str(tmp_path / "x2d.npy"), "--save", str(npy)]) == 0
        assert f"saved      {npy}" in capsys.readouterr().out.splitlines()
        assert np.load(npy).shape == (4, 512) and not Path(f"{npy}.npz").exists()
        argv = [*step, "--random-tokens", "2", "--weights", "--save", str(npz), "--json"]
        assert cli_main(argv) == 0
        assert json.loads(capsys.readouterr().out)["files"] == {"saved": str(npz)}
        with np.load(npz) as saved:
            assert saved["output"].shape == (2, 512) and saved["lengths"].tolist() == [2]
            assert saved["weights"].shape == (8, 2, 6)  # heads, new rows, all keys
            assert saved["weight_heads"].tolist() == list(range(8))
    finally:
        assert cli_main(["--target", server.target, "session", "close", sid]) == 0
