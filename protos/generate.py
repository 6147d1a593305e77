"""Generates the Python gRPC stubs for protos/ into client/mha_client/api/.

The one way stubs are made (never edit them by hand): run with the pinned
grpcio-tools from the `dev` extra. `--check` regenerates into a temporary folder
and fails if the committed stubs differ (tests/test_protos.py runs it).

Two proto packages, each into its own Python package:
  protos/mha/v1/*.proto    -> mha_client.api            (mha.v1, our API)
  protos/inference/*.proto -> mha_client.api.inference  (the Open Inference Protocol)

protoc names modules after the proto path (`mha.v1.attention_pb2`); the stubs
live in the packages above instead, so a generated module's absolute import of its
sibling is rewritten to a relative one (grpc/grpc#29390), and the message classes
are given the module they live in: pickle (Ray Serve's gRPC proxy pickles every
request) finds a class by its `__module__`.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "client" / "mha_client" / "api"


@dataclass(frozen=True)
class ProtoPackage:
    folder: str  # under protos/, as the proto files import each other ("mha/v1")
    python_package: str  # where its stubs live
    protos: tuple[str, ...]  # file names in folder

    @property
    def out(self) -> Path:
        """The stubs' folder under OUT (mha_client.api.X -> OUT/X)."""
        rest = self.python_package.removeprefix("mha_client.api").lstrip(".")
        return OUT.joinpath(*rest.split(".")) if rest else OUT

    def rewrite(self, name: str, text: str) -> str:
        proto_module = re.escape(self.folder.replace("/", "."))
        text = re.sub(
            rf"^from {proto_module} import (\w+) as (\w+)$",
            r"from . import \1 as \2",
            text,
            flags=re.MULTILINE,
        )
        if name.endswith("_pb2.py"):
            text = re.sub(rf"'{proto_module}\.(\w+)'", rf"'{self.python_package}.\1'", text)
        return text


PACKAGES = (
    ProtoPackage("mha/v1", "mha_client.api", ("attention.proto",)),
    ProtoPackage(
        "inference", "mha_client.api.inference", ("grpc_service.proto", "model_config.proto")
    ),
)


def generate(out: Path) -> list[Path]:
    """Writes every package's stubs under `out` (laid out as under OUT); returns their paths."""
    from grpc_tools import protoc  # dev extra: grpcio-tools (pinned)

    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(PROTO_ROOT / pkg.folder / p) for pkg in PACKAGES for p in pkg.protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed: see the message above")
        for pkg in PACKAGES:
            folder = out / pkg.out.relative_to(OUT)
            folder.mkdir(parents=True, exist_ok=True)
            for src in sorted(Path(tmp, pkg.folder).glob("*_pb2*.py*")):
                dst = folder / src.name
                dst.write_text(pkg.rewrite(src.name, src.read_text()))
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
        stale = []
        for path in fresh:
            relative = path.relative_to(tmp)
            if not (OUT / relative).exists() or not filecmp.cmp(
                path, OUT / relative, shallow=False
            ):
                stale.append(str(relative))
    if stale:
        print(
            f"stale stubs in client/mha_client/api: {', '.join(stale)}; run: python protos/generate.py"
        )
        return 1
    print("stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
