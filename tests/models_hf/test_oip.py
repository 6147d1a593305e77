"""The Open Inference Protocol serves the new families as mha.v1 does: a Gemma 2 local
layer (soft-capping, window 6), a Gemma 3 one (q/k norm), a GPT-OSS sliding layer
(attention sinks, window 6), a Cohere 2 local one (RoPE by interleaved pairs, window 6) and
a Qwen3-Next full-attention one (an output gate) equal transformers' attention
in a stateless ModelInfer and in a Triton sequence stepped past the window; ModelConfig
names the options."""

from __future__ import annotations

import grpc
import pytest
import torch

from mha_client.api.inference import grpc_service_pb2 as ip
from mha_client.api.inference import grpc_service_pb2_grpc as ip_grpc
from tests.models_hf.reference import layer_window, reference_attention
from tests.models_hf.test_parity_grpc import assert_close, reference
from tests.transport.test_inference import infer_request, output


@pytest.fixture(scope="module")
def oip(served):
    client, _ = served
    with grpc.insecure_channel(client.target) as channel:
        yield ip_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "cohere2_local"])
def test_infer_and_a_sequence_past_the_window(served, oip, name):
    _, models = served
    family, base, layer = reference(models, name)
    x = torch.randn(1, 20, base.config.hidden_size, generator=torch.Generator().manual_seed(7))
    want, _ = reference_attention(family, base, layer, x)
    got = output(oip.ModelInfer(infer_request(x.numpy(), model=name)), "OUTPUT")
    assert_close(got[0], want[0], what=f"{name} ModelInfer")
    cuts = [0, 8, 9, 10, 16, 20]  # a prefill, then steps past the window of 6
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        request = infer_request(
            x[:, a:b].numpy(), model=name, sequence_id=900 + len(name), sequence_start=i == 0
        )
        request.parameters["sequence_end"].bool_param = b == cuts[-1]
        got = output(oip.ModelInfer(request), "OUTPUT")
        assert_close(got[0], want[0, a:b], what=f"{name} sequence step [{a}, {b})")
    config = oip.ModelConfig(ip.ModelConfigRequest(name=name)).config
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["sliding_window"] == str(layer_window(base, layer))
    assert ("softcap" in params) == (name == "gemma2")
    assert ("sinks" in params) == (name == "gpt_oss")
    assert ("qk_norm" in params) == (name == "gemma3")
    assert params["rope"].endswith(", interleaved pairs") == (name == "cohere2_local")


def test_bloom_infer_and_a_sequence_and_its_config_names_alibi(served, oip):
    """BLOOM (ALiBi over 12 heads, no RoPE): ModelInfer and a Triton sequence equal
    BloomAttention; ModelConfig says alibi with its bias_max, and no rope."""
    _, models = served
    family, base, layer = reference(models, "bloom")
    x = torch.randn(1, 14, base.config.hidden_size, generator=torch.Generator().manual_seed(8))
    want, _ = reference_attention(family, base, layer, x)
    got = output(oip.ModelInfer(infer_request(x.numpy(), model="bloom")), "OUTPUT")
    assert_close(got[0], want[0], what="bloom ModelInfer")
    cuts = [0, 6, 7, 14]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        request = infer_request(
            x[:, a:b].numpy(), model="bloom", sequence_id=950, sequence_start=i == 0
        )
        request.parameters["sequence_end"].bool_param = b == cuts[-1]
        got = output(oip.ModelInfer(request), "OUTPUT")
        assert_close(got[0], want[0, a:b], what=f"bloom sequence step [{a}, {b})")
    config = oip.ModelConfig(ip.ModelConfigRequest(name="bloom")).config
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["alibi"] == "bias_max 8" and "rope" not in params, params


def test_falcon_rw_config_names_its_alibi_form(served, oip):
    """Falcon-RW's ModelConfig: ALiBi with its scale (1 / sqrt(head_dim 8)) and bfloat16
    terms, no rope; BLOOM's names neither (above)."""
    config = oip.ModelConfig(ip.ModelConfigRequest(name="falcon_rw")).config
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["alibi"] == "bias_max 8, scale 0.353553, bfloat16" and "rope" not in params


def test_qwen3_next_infer_and_a_sequence_and_its_config_names_the_output_gate(served, oip):
    """Qwen3-Next's full-attention layer (an output gate, q/k norm, a quarter rotated):
    ModelInfer and a Triton sequence equal Qwen3NextAttention; ModelConfig says
    output_gate, and only for the gated model."""
    _, models = served
    family, base, layer = reference(models, "qwen3_next")
    x = torch.randn(1, 12, base.config.hidden_size, generator=torch.Generator().manual_seed(9))
    want, _ = reference_attention(family, base, layer, x)
    got = output(oip.ModelInfer(infer_request(x.numpy(), model="qwen3_next")), "OUTPUT")
    assert_close(got[0], want[0], what="qwen3_next ModelInfer")
    cuts = [0, 5, 6, 12]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        request = infer_request(
            x[:, a:b].numpy(), model="qwen3_next", sequence_id=970, sequence_start=i == 0
        )
        request.parameters["sequence_end"].bool_param = b == cuts[-1]
        got = output(oip.ModelInfer(request), "OUTPUT")
        assert_close(got[0], want[0, a:b], what=f"qwen3_next sequence step [{a}, {b})")
    for name, gated in (("qwen3_next", True), ("qwen3", False)):
        config = oip.ModelConfig(ip.ModelConfigRequest(name=name)).config
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert (params.get("output_gate") == "true") == gated, (name, params)
        assert params["rope"].endswith(", partial 0.25") == gated, (name, params)


def test_gemma4_config_names_the_value_norm(served, oip):
    """ModelConfig says v_norm (with its q/k norm's eps), and only for a model that has it."""
    for name, normed in (("gemma4_global", True), ("gemma3n", True), ("qwen3", False)):
        config = oip.ModelConfig(ip.ModelConfigRequest(name=name)).config
        params = {k: v.string_value for k, v in config.parameters.items()}
        assert (params.get("v_norm") == "true") == normed, (name, params)
        assert "qk_norm" in params, (name, params)
