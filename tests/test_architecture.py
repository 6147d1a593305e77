"""The layers of ../shared/ARCHITECTURE.md hold in the code, and the command line reads no torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "service" / "mha_serve"


def test_import_contracts_hold():
    """lint-imports checks [tool.importlinter] in pyproject.toml: layers, no circles, and a
    client that never imports the server."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (the dev extra has it)")
    done = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "broken" not in done.stdout.lower().replace("0 broken", "")


def test_front_doors_never_reach_into_the_session_table():
    """Only engine/ and cache/ touch the session table, the caches and the block pool."""
    pattern = re.compile(r"\.table\b|\.caches\b|\.pool\(")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("transport", "metrics", "serving", "ray_app")
        for path in sorted((SERVICE / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter where `import torch` fails, as without the server extra."""
    prelude = "import sys\nsys.modules['torch'] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_and_config_import_no_torch():
    done = run_without_torch(
        """
        from mha_serve.config import build_config
        from mha_serve.transport.main import main
        assert len(build_config(None, {}).models) == 3
        main(["--help"])
        """
    )
    assert done.returncode == 0, done.stderr
    assert "usage: mha-serve" in done.stdout


def test_serving_without_torch_says_which_extra_to_install():
    done = run_without_torch(
        """
        import sys
        from mha_serve.transport.main import main
        sys.exit(main(["--port", "0", "--metrics-port", "0"]))
        """
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'mha-serve[server]'" in done.stderr
