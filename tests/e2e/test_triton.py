"""An unchanged tritonclient (Triton's Python gRPC client) against a real mha-serve: health,
metadata, config, inference in FP32 and BF16 with and without weights, raw and typed inputs,
sequences over ModelInfer and the stream, Triton-style errors; its numbers equal mha.v1's.

tritonclient[grpc] 2.73 needs protobuf < 7 and would downgrade ours, so it gets its own virtual
environment (.venv-triton, made here once and reused) and runs tests/e2e/triton_client.py there.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api.inference import grpc_service_pb2, model_config_pb2

ROOT = Path(__file__).resolve().parents[2]
TRITON_VENV = ROOT / ".venv-triton"
REQUIREMENTS = ("tritonclient[grpc]==2.73.0", "ml_dtypes", "numpy")
SCRIPT = Path(__file__).with_name("triton_client.py")
ATOL_FP32 = 1e-6

pytestmark = pytest.mark.slow  # the first run installs tritonclient (about a minute)


@pytest.fixture(scope="session")
def triton_python() -> Path:
    """tritonclient's interpreter; the environment is made once (a stamp names what it holds)
    under a lock, so that concurrent test runs share one."""
    python = TRITON_VENV / "bin" / "python"
    stamp = TRITON_VENV / ".installed"
    wanted = "\n".join(REQUIREMENTS)
    lock_path = ROOT / ".venv-triton.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text() == wanted:
            return python
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(TRITON_VENV)], check=True, timeout=300
        )
        install = subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                *REQUIREMENTS,
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        if install.returncode != 0:
            last = (install.stderr.strip().splitlines() or ["no output"])[-1]  # pip's error
            pytest.skip(
                f"could not install {', '.join(REQUIREMENTS)} into {TRITON_VENV} (is PyPI "
                f"reachable?): {last[:300]}"
            )
        stamp.write_text(wanted)
    return python


def tensor(x: np.ndarray, dtype: int = pb.DTYPE_FLOAT32) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=x.shape, data=x.tobytes())


def array(t: pb.Tensor) -> np.ndarray:
    if t.dtype == pb.DTYPE_BFLOAT16:  # bf16 bits -> the float32 they are the high half of
        bits = np.frombuffer(t.data, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(t.shape)
    return np.frombuffer(t.data, np.float32).reshape(t.shape)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounding to nearest even as ml_dtypes does."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_tritonclient_gets_what_mha_v1_gets(server, stub, triton_python, tmp_path):
    check_tritonclient(
        server.target, stub, triton_python, tmp_path, lambda: num_sessions(stub), server.log
    )


def check_tritonclient(
    target: str,
    stub,
    triton_python: Path,
    work: Path,
    num_sessions_now: Callable[[], int],
    log: Callable[[], str] = lambda: "",
) -> None:
    """Runs triton_client.py against `target` and checks its numbers against the same calls
    through mha.v1 (`stub`); num_sessions_now(): the sessions the server holds (the
    sequences' sessions must be closed at the end). Shared with tests/ray_app."""
    rng = np.random.default_rng(19)
    x = rng.standard_normal((2, 5, 512), dtype=np.float32)
    steps = [rng.standard_normal((1, n, 512), dtype=np.float32) for n in (4, 1, 2)]
    sessions_before = num_sessions_now()
    np.savez(work / "inputs.npz", x=x, **{f"step{i}": s for i, s in enumerate(steps)})
    descriptors = work / "descriptors"
    descriptors.mkdir()
    for module in (grpc_service_pb2, model_config_pb2):
        (descriptors / f"{module.__name__.rsplit('.', 1)[1]}.pb").write_bytes(
            module.DESCRIPTOR.serialized_pb
        )
    run = subprocess.run(
        [str(triton_python), str(SCRIPT), target, str(work)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\nserver log:\n{log()[-3000:]}"
    got = np.load(work / "outputs.npz")

    def close(name: str, expected: np.ndarray, atol: float = ATOL_FP32) -> None:
        diff = np.abs(got[name] - expected)
        assert got[name].shape == expected.shape, name
        assert diff.max() <= atol, f"{name}: max diff {diff.max():.3g}, mean {diff.mean():.3g}"

    ref = stub.Attend(pb.AttendRequest(model="mha", input=tensor(x)), timeout=60)
    close("fp32", array(ref.output))
    close("typed", array(ref.output))
    weights = pb.WeightsRequest(enabled=True, heads=[0, 3], query_start=1)
    ref = stub.Attend(
        pb.AttendRequest(model="mha", input=tensor(x), causal=True, weights=weights), timeout=60
    )
    close("fp32_weights_output", array(ref.output))
    close("fp32_weights", array(ref.attention_weights))

    xb = tensor(bf16_bits(x), pb.DTYPE_BFLOAT16)
    ref = stub.Attend(pb.AttendRequest(model="gqa", input=xb), timeout=60)
    close("bf16", array(ref.output), atol=0)  # the same bits: the same computation
    weights = pb.WeightsRequest(enabled=True, dtype=pb.DTYPE_BFLOAT16)
    ref = stub.Attend(pb.AttendRequest(model="gqa", input=xb, weights=weights), timeout=60)
    close("bf16_weights_output", array(ref.output), atol=0)
    close("bf16_weights", array(ref.attention_weights), atol=0)

    sid = stub.CreateSession(pb.CreateSessionRequest(model="mqa"), timeout=10).session_id
    for i, step in enumerate(steps):
        out = array(
            stub.Attend(pb.AttendRequest(session_id=sid, input=tensor(step)), timeout=60).output
        )
        close(f"infer_step{i}", out)
        close(f"stream_step{i}", out)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    assert num_sessions_now() == sessions_before  # sequence_end closed both sequences' sessions


def num_sessions(stub) -> int:
    return stub.GetModelInfo(pb.GetModelInfoRequest(name="mqa"), timeout=10).kv_cache.num_sessions
