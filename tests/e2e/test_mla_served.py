"""A real mha-serve serving multi-head latent attention: one model from our safetensors file
(its config in the file's metadata), one from a TOML [models.mla] table (seeded weights),
each answering Attend (with weights) and a session's prefill and decode steps as the float64
decompressed reference of tests/model/test_mla.py computes them (short ones absorbed, long
prompts expanded: model/mla.py), and reporting the KV cache's
R + C values per token (K alone); the Open Inference Protocol's ModelConfig names its shape.
A third, from a file, with Ling 3.0's per-head output gate on its merged heads."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from mha_client.api.inference import grpc_service_pb2 as ip
from mha_client.api.inference import grpc_service_pb2_grpc as ip_grpc
from mha_client.sdk import Client
from mha_serve.model import MultiHeadAttention, init_weights, save_checkpoint
from tests.helpers import serving_process
from tests.model.test_mla import C, E, H, N, Q, R, V, config, make, reference

ATOL = 1e-5  # float32 over the wire against float64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, {model name: the same module in-process})."""
    root = tmp_path_factory.mktemp("mla")
    from_file = make(seed=7, interleaved=True)
    save_checkpoint(from_file, root / "mla.safetensors")
    gated = make(
        seed=9, q_lora=False, interleaved=True, output_gate=True, output_gate_per_head=True
    )
    save_checkpoint(gated, root / "mla_gated.safetensors")
    seeded = MultiHeadAttention(config(q_lora=False, bias=False))
    init_weights(seeded, 8)
    mla = seeded.config.mla
    (root / "serve.toml").write_text(
        '[[models]]\nname = "mla-file"\ncheckpoint = "mla.safetensors"\n'
        "kv_cache_bytes = 1048576\nkv_block_size = 4\n\n"
        '[[models]]\nname = "mla-gated"\ncheckpoint = "mla_gated.safetensors"\n'
        "kv_cache_bytes = 1048576\nkv_block_size = 4\n\n"
        f'[[models]]\nname = "mla-toml"\nembed_dim = {E}\nnum_heads = {H}\nbias = false\n'
        "causal = true\nseed = 8\nkv_cache_bytes = 1048576\n"
        f"rope = {{ theta = {seeded.config.rope.theta} }}\n"
        f"[models.mla]\nkv_lora_rank = {mla.kv_lora_rank}\nrope_dim = {mla.rope_dim}\n"
        f"nope_dim = {mla.nope_dim}\nv_head_dim = {mla.v_head_dim}\neps = {mla.eps}\n"
    )
    args = ("--config", str(root / "serve.toml"), "--dtype", "float32", "--device", "cpu")
    with serving_process(root, *args) as proc, Client(proc.target) as client:
        yield client, {"mla-file": from_file, "mla-toml": seeded.eval(), "mla-gated": gated}


def close(got: np.ndarray, want: torch.Tensor, what: str) -> None:
    err = float(np.abs(got - want.numpy()).max())
    print(f"{what}: max abs error {err:.2e}")
    assert err < ATOL, f"{what}: max abs error {err:.2e}"


@pytest.mark.parametrize("name", ["mla-file", "mla-toml", "mla-gated"])
def test_attend_and_a_session_equal_the_decompressed_reference(served, name):
    client, modules = served
    module = modules[name]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 9, E), dtype=np.float32)
    want, want_w = reference(module, torch.from_numpy(x), lengths=torch.tensor([9, 4]))
    got = client.attend(name, x, lengths=[9, 4], causal=True, weights=True, heads=[2, 0])
    close(got.output, want, f"{name} Attend")
    close(got.weights, want_w[:, [2, 0]], f"{name} Attend weights")

    seq = x[:1]
    want = reference(module, torch.from_numpy(seq))[0][0]  # (9, E)
    with client.create_session(name, ttl_s=30) as session:
        close(session.step(seq[0, :5]).output, want[:5], f"{name} prefill")
        for t in range(5, 9):
            close(session.step(seq[0, t : t + 1]).output, want[t : t + 1], f"{name} step {t}")

    info = client.model_info(name)
    assert (info.num_kv_heads, info.head_dim, info.variant) == (1, R + C, "mqa")
    assert info.kv_cache.bytes_per_token == (R + C) * 4  # K alone: its values are its keys


@pytest.mark.parametrize("name", ["mla-file", "mla-toml"])
def test_long_prompts_expanded_and_their_decode_steps_equal_the_reference(served, name):
    """A padded Attend batch and a session's prompt of 70 tokens (>= mla.EXPAND_MIN_ROWS:
    expanded), then decode steps over the latents it cached (absorbed)."""
    client, modules = served
    module = modules[name]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 72, E), dtype=np.float32)
    want = reference(module, torch.from_numpy(x), lengths=torch.tensor([72, 50]))[0]
    close(client.attend(name, x, lengths=[72, 50], causal=True).output, want, f"{name} Attend")
    want = reference(module, torch.from_numpy(x[:1]))[0][0]  # (72, E)
    with client.create_session(name, ttl_s=30) as session:
        close(session.step(x[0, :70]).output, want[:70], f"{name} prompt")
        for t in (70, 71):
            close(session.step(x[0, t : t + 1]).output, want[t : t + 1], f"{name} step {t}")


def test_the_oip_model_config_names_the_latent_shape(served):
    client, _ = served
    with grpc.insecure_channel(client.target) as channel:
        stub = ip_grpc.GRPCInferenceServiceStub(channel)
        for name, q_lora_rank in (("mla-file", Q), ("mla-toml", None)):
            config = stub.ModelConfig(ip.ModelConfigRequest(name=name)).config
            params = {k: v.string_value for k, v in config.parameters.items()}
            assert params["mla"] == (
                f"kv_lora_rank {C}, rope_dim {R}, nope_dim {N}, v_head_dim {V}, "
                f"q_lora_rank {q_lora_rank}"
            ), params
            assert (params["num_kv_heads"], params["head_dim"]) == ("1", str(R + C))
