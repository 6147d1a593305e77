"""The Ray tests and benchmarks start a Ray of their own whatever the machine has seen: a
`ray start` head that died leaves its address in ray_current_cluster, which a bare
ray.init() would try to join ("When connecting to an existing cluster, num_cpus and
num_gpus must not be provided"); start_ray does not. In a process of its own, with Ray's
temporary directory (RAY_TMPDIR) holding such a file, so that nothing else sees it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
START = """
import ray
from tests.ray_app.cluster import start_ray
start_ray(ray, 1)
print("address", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


def test_a_dead_heads_address_is_not_joined():
    pytest.importorskip("ray")
    # Short: Ray's socket paths live under it (a Unix socket path has ~107 characters).
    with tempfile.TemporaryDirectory(prefix="rt", dir="/tmp") as tmp:
        (Path(tmp) / "ray").mkdir()
        dead = f"127.0.0.1:{free_port()}"  # what a head that died leaves behind
        (Path(tmp) / "ray" / "ray_current_cluster").write_text(dead)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = tmp
        bare = subprocess.run(
            [sys.executable, "-c", "import ray; ray.init(num_cpus=1)"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert bare.returncode != 0  # the trap is real: a bare ray.init() joins it
        done = subprocess.run(
            [sys.executable, "-c", START],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("address ")]
    assert line.split()[1] != dead
