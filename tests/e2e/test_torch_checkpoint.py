"""A server started from a config file serving nn.MultiheadAttention's own weights matches it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from tests.helpers import ServerProcess

ATOL = 1e-5  # float32 over the wire vs torch's module in-process


@pytest.fixture(scope="module")
def torch_mha():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_bias.uniform_(-0.1, 0.1)  # torch initialises biases to 0; exercise them
        mha.out_proj.bias.uniform_(-0.1, 0.1)
    return mha


@pytest.fixture(scope="module")
def checkpoint_server(tmp_path_factory, torch_mha):
    root = tmp_path_factory.mktemp("ckpt")
    save_file(torch_mha.state_dict(), root / "torch_mha.safetensors")
    (root / "serve.toml").write_text(
        '[server]\ngrace_period_s = 5\n\n[[models]]\nname = "torch-mha"\nembed_dim = 64\n'
        'num_heads = 4\ncheckpoint = "torch_mha.safetensors"\n'
    )
    proc = ServerProcess("--config", str(root / "serve.toml"), log_path=root / "server.log")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


def test_outputs_and_per_head_weights_match_torch(checkpoint_server, torch_mha):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 10, 64), dtype=np.float32)
    lengths = [10, 7, 1]
    request = pb.AttendRequest(
        model="torch-mha",
        input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes()),
        lengths=lengths,
        causal=True,
        weights=pb.WeightsRequest(enabled=True),
    )
    with grpc.insecure_channel(checkpoint_server.target) as channel:
        reply = pb_grpc.AttentionServiceStub(channel).Attend(request, timeout=30)
    out = np.frombuffer(reply.output.data, np.float32).reshape(3, 10, 64)
    weights = np.frombuffer(reply.attention_weights.data, np.float32).reshape(3, 4, 10, 10)

    xt = torch.from_numpy(x)
    padding = torch.arange(10)[None, :] >= torch.tensor(lengths)[:, None]  # True = ignore
    causal = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)
    with torch.no_grad():
        ref_out, ref_w = torch_mha(
            xt,
            xt,
            xt,
            key_padding_mask=padding,
            attn_mask=causal,
            need_weights=True,
            average_attn_weights=False,
        )
    for b, n in enumerate(lengths):
        err_out = np.abs(out[b, :n] - ref_out[b, :n].numpy()).max()
        err_w = np.abs(weights[b, :, :n] - ref_w[b, :, :n].numpy()).max()
        print(f"sequence {b}: max abs error output {err_out:.2e}, weights {err_w:.2e}")
        assert err_out < ATOL and err_w < ATOL
        assert np.all(out[b, n:] == 0)  # padded rows are zero


def test_model_info_reports_the_checkpoint_shape(checkpoint_server):
    with grpc.insecure_channel(checkpoint_server.target) as channel:
        info = pb_grpc.AttentionServiceStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(name="torch-mha"), timeout=10
        )
    assert (info.variant, info.num_heads, info.num_kv_heads, info.head_dim) == (
        pb.VARIANT_MHA,
        4,
        4,
        16,
    )
    assert info.num_parameters == 4 * 64 * 64 + 4 * 64


def test_sigterm_stops_gracefully(checkpoint_server):
    assert checkpoint_server.stop() == 0
    log = checkpoint_server.log()
    assert "draining" in log and "stopped" in log, log
