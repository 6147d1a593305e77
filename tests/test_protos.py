"""The committed stubs in client/mha_client/api are exactly what protos/generate.py makes from the .proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh():
    # No skip: grpcio-tools is in the dev extra that `make test` installs.
    result = subprocess.run(
        [sys.executable, "protos/generate.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_as_a_package_without_a_top_level_mha_module():
    # grpc/grpc#29390: the grpc stub must import its sibling relatively, not as `mha.v1`.
    text = (ROOT / "client/mha_client/api/attention_pb2_grpc.py").read_text()
    assert "from . import attention_pb2" in text and "from mha.v1" not in text


def test_every_message_pickles_under_its_own_module():
    """Ray Serve's gRPC proxy pickles each request on its way to a replica: a class must be
    importable under its __module__ (protoc would name it mha.v1.attention_pb2)."""
    import pickle

    from mha_client.api import attention_pb2 as pb

    for name in pb.DESCRIPTOR.message_types_by_name:
        cls = getattr(pb, name)
        assert cls.__module__ == "mha_client.api.attention_pb2", name
        assert pickle.loads(pickle.dumps(cls())) == cls(), name
