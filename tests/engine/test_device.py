"""Device and dtype choice: CPU here; the CUDA checks run where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from mha_serve.config import default_models
from mha_serve.engine import (
    AttendRequest,
    Engine,
    array_of,
    choose_attention_kernels,
    resolve_device,
    resolve_dtype,
)
from mha_serve.transport.server import load_engine
from tests.engine_calls import req, run_batch, torched
from tests.helpers import config_of

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_auto_is_cpu_float32_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32


def test_asking_for_cuda_without_one_says_what_to_use():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="CUDA is not available; use 'auto' or 'cpu'"):
        resolve_device("cuda")


def test_unknown_dtype_lists_the_choices():
    with pytest.raises(ValueError, match="auto, float32, float16, bfloat16"):
        resolve_dtype("fp8", torch.device("cpu"))


@pytest.fixture
def cudnn_switch():
    """torch's process-wide cuDNN attention switch, put back as it was after the test."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cuda_attention_runs_without_cudnn_unless_asked(cudnn_switch):
    """cuDNN's attention builds a plan for every new shape (35-50 ms each on an H200): an
    engine on CUDA switches it off unless asked; on the CPU the switch is left alone."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    choose_attention_kernels(torch.device("cpu"), cudnn=False)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    choose_attention_kernels(torch.device("cuda"), cudnn=False)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    choose_attention_kernels(torch.device("cuda:0"), cudnn=True)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_servers_setting_reaches_the_engine(cudnn_switch, monkeypatch):
    """--cudnn-attention travels from the command line to the engine's choice, for the
    engine's device (here the CPU, where the switch itself is left as it was)."""
    import mha_serve.engine.engine as engine_module

    assert config_of([]).cudnn_attention is False  # the default: off
    cfg = config_of(["--cudnn-attention", "true", "--device", "cpu"])
    assert cfg.cudnn_attention is True
    seen = []
    real = engine_module.choose_attention_kernels

    def spy(device, *, cudnn):
        seen.append((device.type, cudnn))
        real(device, cudnn=cudnn)

    monkeypatch.setattr(engine_module, "choose_attention_kernels", spy)
    torch.backends.cuda.enable_cudnn_sdp(False)
    load_engine(cfg)
    assert seen == [("cpu", True)]
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@cuda
@pytest.mark.parametrize("cudnn", [False, True])
def test_cuda_decode_steps_at_new_lengths_run_no_cudnn_plan(cudnn_switch, cudnn):
    """Each step of a growing session attends over a key length not seen before: with the
    default, no step runs cuDNN's attention (whose plan each new length would rebuild);
    asked for, it does (so the check can fail)."""
    device = resolve_device("cuda")
    engine = Engine(
        default_models(),
        device=device,
        dtype=resolve_dtype("auto", device),
        max_response_bytes=2**28,
        cudnn_attention=cudnn,
    )
    g = torch.Generator().manual_seed(0)
    sid = engine.create_session("gqa").session_id
    engine.attend(
        AttendRequest("gqa", array_of(torch.randn(1, 37, 512, generator=g)), session_id=sid)
    )
    steps = [array_of(torch.randn(1, 1, 512, generator=g)) for _ in range(4)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x in steps:
            engine.attend(AttendRequest("gqa", x, session_id=sid))
    names = {e.name for e in prof.events()}
    assert ("aten::_cudnn_attention_forward" in names) is cudnn, sorted(
        n for n in names if "attention" in n
    )


@cuda
def test_cuda_low_precision_matches_cpu_float32():
    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    assert device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    gpu = Engine(default_models(), device=device, dtype=dtype, max_response_bytes=2**28)
    cpu = Engine(
        default_models(), device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**28
    )
    x = torch.randn(3, 64, 512, generator=torch.Generator().manual_seed(0))
    for name in ("mha", "gqa", "mqa"):
        call = req(name, x, lengths=[64, 40, 1], causal=True, need_weights=True)
        raw = gpu.attend(call)  # host arrays in the dtype asked (float32), whatever the device
        assert raw.output.dtype == "float32" and raw.output.data.dtype.name == "float32"
        got, ref = torched(raw), torched(cpu.attend(call))
        torch.testing.assert_close(got.output, ref.output, atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(got.weights, ref.weights, atol=2e-2, rtol=0)
        pair = [req(name, x[:1], causal=True), req(name, x[1:2, :40], causal=True)]
        batched = run_batch(gpu, gpu.get(name), pair)  # prepared, as the engine runs a batch
        torch.testing.assert_close(batched[0].output, ref.output[:1], atol=5e-2, rtol=5e-2)
