"""The suite's device (MHA_SERVE_TEST_DEVICE, tests/helpers.py): checked once at start-up and
named in pytest's header, so a run's log says where its servers and engines ran."""

from __future__ import annotations

import pytest

from tests.helpers import SUITE_DEVICE_ENV, suite_device_name


def pytest_configure(config: pytest.Config) -> None:
    try:
        suite_device_name()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_report_header(config: pytest.Config) -> str:
    name = suite_device_name()
    if name == "cpu":
        return f"{SUITE_DEVICE_ENV}=cpu: servers and engines on the CPU, float32"
    import torch

    seen = torch.cuda.get_device_name(name) if torch.cuda.is_available() else "no CUDA device"
    return f"{SUITE_DEVICE_ENV}={name}: servers and engines on {seen}, float32 (torch {torch.__version__})"
