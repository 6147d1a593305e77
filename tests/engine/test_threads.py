"""ComputeThreads: one multi-threaded torch thread, one single-threaded one for weights."""

from __future__ import annotations

import pytest
import torch

from mha_serve.engine.threads import ComputeThreads


def test_the_main_thread_keeps_its_count_and_the_weights_thread_runs_torch_single_threaded():
    before = torch.get_num_threads()
    compute = ComputeThreads(torch_threads=3)
    try:
        assert compute.main.submit(torch.get_num_threads).result() == 3
        assert compute.weights.submit(torch.get_num_threads).result() == 1
        # Setting the weights thread to 1 must not leak into the thread already running.
        assert compute.main.submit(torch.get_num_threads).result() == 3
        x = torch.randn(64, 64)
        assert torch.equal(compute.main.submit(torch.mm, x, x).result(), x @ x)
    finally:
        compute.shutdown()
    assert torch.get_num_threads() == before  # the caller's thread is left alone


def test_zero_keeps_torchs_default():
    default = torch.get_num_threads()
    compute = ComputeThreads(torch_threads=0)
    try:
        assert compute.main.submit(torch.get_num_threads).result() == default
    finally:
        compute.shutdown()


def test_the_weights_thread_count_can_be_raised_and_is_checked():
    compute = ComputeThreads(torch_threads=2, weights_torch_threads=2)
    try:
        assert compute.weights.submit(torch.get_num_threads).result() == 2
    finally:
        compute.shutdown()
    with pytest.raises(ValueError, match="weights_torch_threads must be >= 1, got 0"):
        ComputeThreads(weights_torch_threads=0)
