"""Generates the Python gRPC stubs for protos/mha/v1/*.proto into client/mha_client/api/.

The one way stubs are made (never edit them by hand): run with the pinned
grpcio-tools from the `dev` extra. `--check` regenerates into a temporary folder
and fails if the committed stubs differ (tests/test_protos.py runs it).

protoc names modules after the proto path (`mha.v1.attention_pb2`); the stubs
live in the `mha_client.api` package instead, so the generated grpc module's
absolute import of its sibling is rewritten to a relative one (grpc/grpc#29390),
and the message classes are given the module they live in: pickle (Ray Serve's
gRPC proxy pickles every request) finds a class by its `__module__`.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "client" / "mha_client" / "api"
PROTOS = ["mha/v1/attention.proto"]
_SIBLING_IMPORT = re.compile(r"^from mha\.v1 import (\w+) as (\w+)$", re.MULTILINE)
_MODULE_NAME = re.compile(r"'mha\.v1\.(\w+)'")
PACKAGE = "mha_client.api"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev extra: grpcio-tools (pinned)

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_ROOT / p) for p in PROTOS],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed: see the message above")
        written = []
        for src in sorted(Path(tmp, "mha", "v1").glob("*_pb2*.py*")):
            text = _SIBLING_IMPORT.sub(r"from . import \1 as \2", src.read_text())
            if src.name.endswith("_pb2.py"):
                text = _MODULE_NAME.sub(rf"'{PACKAGE}.\1'", text)
            dst = out / src.name
            dst.write_text(text)
            written.append(dst)
        return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (OUT / p.name).exists() or not filecmp.cmp(p, OUT / p.name, shallow=False)
        ]
    if stale:
        print(
            f"stale stubs in client/mha_client/api: {', '.join(stale)}; run: python protos/generate.py"
        )
        return 1
    print("stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
