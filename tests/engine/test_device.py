"""Device and dtype choice: CPU here; the CUDA checks run where a GPU is present."""

from __future__ import annotations

import pytest
import torch

from mha_serve.config import default_models
from mha_serve.engine import Engine, resolve_device, resolve_dtype
from tests.engine_calls import req, run_batch, torched

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
