"""mha_serve/transfer.py: a step's small host data on its device, pinned and non_blocking on
CUDA, plain tensors on the CPU."""

import pytest
import torch

from mha_serve.transfer import PINNED_MAX_BYTES, host_buffer, list_tensor, to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_list_tensor_holds_the_values_on_the_device(device):
    device = torch.device(device)
    rows = list_tensor([[3, 1, 4], [1, 5, 9]], device)
    assert rows.dtype == torch.int64 and rows.device.type == device.type
    assert rows.tolist() == [[3, 1, 4], [1, 5, 9]]
    gate = list_tensor([0.5, 1.0, 0.0], device, torch.bfloat16)
    assert gate.dtype == torch.bfloat16 and gate.tolist() == [0.5, 1.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_to_device_converts_and_keeps_the_values(device):
    device = torch.device(device)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    y = to_device(x, device, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.device.type == device.type
    assert torch.equal(y.cpu(), x.to(torch.bfloat16))


def test_on_the_cpu_nothing_is_copied_or_pinned():
    x = torch.randn(2, 3)
    assert to_device(x, torch.device("cpu"), torch.float32) is x
    assert not host_buffer((4, 4), torch.float32, torch.device("cpu")).is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_cuda_staging_is_pinned_up_to_its_cap():
    cuda = torch.device("cuda")
    assert host_buffer((16, 512), torch.float32, cuda).is_pinned()
    over = PINNED_MAX_BYTES // 4 + 1
    assert not host_buffer((over,), torch.float32, cuda).is_pinned()


def test_a_device_that_is_neither_cpu_nor_cuda_gets_its_tensor_there():
    """(mps, say: torch's meta device stands in for it here) a plain tensor on that device,
    never a CPU tensor beside its model's."""
    meta = torch.device("meta")
    assert list_tensor([1, 2, 3], meta).device.type == "meta"
    assert to_device(torch.zeros(2), meta, torch.float32).device.type == "meta"
