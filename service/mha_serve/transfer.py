"""A step's small host data (index and length lists, its input tokens) on the compute device
without making the host wait: on CUDA a copy from pageable host memory synchronises the
stream before it starts (CUDA's documented behaviour), so such data goes through pinned
memory, non_blocking (torch's host allocator keeps the pinned block until the copy is done);
on the CPU it is a plain tensor, as before."""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Inputs up to this size are staged in pinned memory on CUDA (a decode batch of 64 tokens of
# 512 float32 values is 128 KiB); a larger prefill is copied as it is: its forward dwarfs a
# wait, and pinned memory is held by torch's cache once allocated.
PINNED_MAX_BYTES = 4 << 20


def pinned(device: torch.device) -> bool:
    """Whether host data bound for `device` is staged in pinned memory."""
    return device.type == "cuda"


def list_tensor(
    values: Sequence[float] | Sequence[Sequence[float]],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """values (a list of numbers, or equal lists of them: a matrix) as one tensor of dtype
    on device: one copy, which never waits for the device."""
    if not pinned(device):  # the CPU (or another device, e.g. mps: a plain copy there)
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def host_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to fill and then send to device with to_device: pinned where
    that saves a wait (CUDA, at most PINNED_MAX_BYTES)."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    pin = pinned(device) and n <= PINNED_MAX_BYTES
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Host tensor t on device in dtype (t itself when it is already): on CUDA converted into
    pinned memory first (host_buffer) and copied without a wait."""
    if t.dtype == dtype and t.device == device:  # (a CPU model's step: no torch op at all)
        return t
    if not pinned(device) or t.nbytes > PINNED_MAX_BYTES:
        return t.to(device, dtype, non_blocking=True)
    staging = host_buffer(t.shape, dtype, device)
    staging.copy_(t)
    return staging.to(device, non_blocking=True)
